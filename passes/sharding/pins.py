"""Manual pins: fix some decisions and let the solver make the rest.

>>> Pins(params={"blocks.*.fc1.weight": ("R", "S(0)")}, inputs={0: "S(0), R"})   # doctest: +SKIP

- ``params``: fnmatch pattern on parameter FQN (tied aliases match too) -> storage placements, each
  axis optionally with its storage form after a slash (``("R/zero1", "S(0)")``; a bare placement is
  the plain form: DDP for ``R``, FSDP for ``S(d)``; ``passes.sharding.storage_forms``); an exact FQN
  beats a pattern, two patterns that disagree on one parameter are an error.
- ``inputs``: user-input index (or placeholder name; "target" for the target) -> placements.
- ``ops``: fnmatch pattern on node name -> placements of the op's first output.
- ``strategies``: node name -> exact ``Strategy`` (a loaded or randomized plan); it need not be in the
  enumerated list, but must fit the node's operands, outputs and the mesh.

Placements: one per mesh axis, each a ``Placement`` or a string ("S(0)", "R", "P"); a single
string "S(0), R" is split at commas. ``resolve`` turns pins into the allowed strategy indices per
node and raises ``PinError`` naming the pin and why it cannot hold, e.g. "dim 1 of size 7 does not
divide over axis 'tp' of size 2".
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

from autoshard.passes.errors import AutoshardError
from autoshard.passes.graph import META, CapturedGraph, operand_meta, operands, outputs
from autoshard.passes.mesh import Mesh
from autoshard.passes.spec import Placement, Strategy, TensorMeta, fmt_placements, parse_placement
from autoshard.passes.sharding.storage_forms import fmt_storage, parse_storage
from autoshard.passes.sharding.strategies import StrategyTable, why_not_divisible

__all__ = ["Pins", "PinError", "parse_placements", "parse_param_pin", "PinsFor", "HintsFor", "pins_name_zero_forms"]


class PinError(AutoshardError, ValueError):
    """A pin matches nothing or allows no strategy."""


def parse_placements(value: Any, mesh: Mesh, what: str) -> tuple[Placement, ...]:
    """One placement per mesh axis from a tuple of Placement/str, or one comma-separated string."""
    return _parse(value, mesh, what, parse_placement)


def parse_param_pin(value: Any, mesh: Mesh, what: str) -> tuple[tuple[Placement, ...], tuple]:
    """A parameter pin: (placements, storage form per axis) from items such as ``"R/zero1"``,
    ``"S(0)/once"``, ``"R"`` (``passes.sharding.storage_forms``; a bare placement is the plain form)."""
    pairs = _parse(value, mesh, what, parse_storage)
    return tuple(p for p, _ in pairs), tuple(f for _, f in pairs)


def pins_name_zero_forms(pins) -> bool:
    """Whether ``pins`` (a ``Pins``, its keyword dict, or None) pin some parameter to a ZeRO form on
    some axis (``"R/zero1"``, ``"R/zero2"``): its solve must then offer the storage forms."""
    if pins is None:
        return False
    params = pins.get("params") if isinstance(pins, dict) else getattr(pins, "params", None)

    def texts(value):
        if isinstance(value, str):
            return [value]
        if isinstance(value, (tuple, list)):
            return [t for v in value for t in texts(v)]
        return []

    return any(t.strip().endswith(("/zero1", "/zero2")) for v in (params or {}).values() for t in texts(v))


def _parse(value: Any, mesh: Mesh, what: str, parse_one) -> tuple:
    if isinstance(value, Placement):
        items = [value]
    elif isinstance(value, str):
        text = value.strip()
        if text.startswith("(") and text.endswith(")"):
            text = text[1:-1]
        items = [t.strip() for t in text.split(",") if t.strip()]
    else:
        items = list(value)
    try:
        pls = tuple((p if parse_one is parse_placement else (p, None)) if isinstance(p, Placement)
                    else parse_one(str(p)) for p in items)
    except ValueError as e:
        raise PinError(f"{what}: {e}") from e
    if len(pls) != mesh.ndim:
        shown = [p if parse_one is parse_placement else p[0] for p in pls]
        raise PinError(f"{what} gives {len(pls)} placement(s) {fmt_placements(shown)} but the mesh {mesh.shape} "
                       f"has {mesh.ndim} axes {mesh.axis_names}: give one placement per axis")
    return pls


@dataclass
class Pins:
    params: dict[str, Any] = field(default_factory=dict)
    inputs: dict[Union[int, str], Any] = field(default_factory=dict)
    ops: dict[str, Any] = field(default_factory=dict)
    strategies: dict[str, Any] = field(default_factory=dict)

    def resolve(self, captured: CapturedGraph, table: StrategyTable, mesh: Mesh) -> dict[str, list[int]]:
        """Allowed strategy indices for every pinned node (strategies pins may append to ``table``)."""
        mesh = Mesh.of(mesh)
        allowed: dict[str, set[int]] = {}

        def restrict(node_name: str, idx: set[int], what: str) -> None:
            before = allowed.get(node_name)
            now = idx if before is None else before & idx
            if not now:
                raise PinError(f"{what} conflicts with another pin on node {node_name!r}: no strategy satisfies both")
            allowed[node_name] = now

        self._resolve_params(captured, table, mesh, restrict)
        self._resolve_inputs(captured, table, mesh, restrict)
        self._resolve_ops(captured, table, mesh, restrict)
        self._resolve_strategies(captured, table, mesh, restrict)
        return {k: sorted(v) for k, v in allowed.items()}

    # ---- one kind of pin each ------------------------------------------------------------------
    def _placeholder_pin(self, captured, table, mesh, node_name, label, storage, what, restrict) -> None:
        """Restrict ``node_name`` to ``storage``: (placements, storage forms per axis or None)."""
        pls, forms = storage
        meta = captured.node(node_name).meta.get(META)
        forms = tuple(f if size > 1 else None for f, size in zip(forms or (None,) * mesh.ndim, mesh.shape))
        idx = {i for i, s in enumerate(table[node_name]) if s.outputs and tuple(s.outputs[0]) == pls
               and (tuple(s.lowerings) or (None,) * mesh.ndim) == forms}
        if not idx and any(forms):
            raise PinError(f"{what}: {label} cannot take the storage {fmt_storage(pls, forms)} on mesh {mesh.shape}: "
                           "storage forms are for the parameters of a trained program (under a pipeline zero1/zero2 "
                           "only): zero1/zero2 on R axes with a dim they divide, once on S axes with every other "
                           "axis's form (see passes/sharding/storage_forms.py)")
        if not idx:
            shape = meta.shape if isinstance(meta, TensorMeta) else None
            why = why_not_divisible(shape, pls, mesh) if shape is not None else "it is not a tensor"
            if why is None:
                why = "the mesh has no such option"
            raise PinError(f"{what}: {label} of shape {tuple(shape) if shape is not None else '?'} cannot be placed "
                           f"{fmt_placements(pls)} on mesh {mesh.shape} {mesh.axis_names}: {why}")
        restrict(node_name, idx, what)

    def _resolve_params(self, captured, table, mesh, restrict) -> None:
        fqns = {fqn: node for node, fqn in captured.params.items()}
        fqns.update({alias: fqns[canon] for alias, canon in captured.aliases.items() if canon in fqns})
        chosen: dict[str, tuple] = {}  # node -> (exact?, pattern, placements)
        for pattern, value in self.params.items():
            pls = parse_param_pin(value, mesh, f"pin params[{pattern!r}]")
            hits = sorted({node for fqn, node in fqns.items() if fnmatch.fnmatchcase(fqn, pattern)}) \
                if _is_glob(pattern) else [fqns[pattern]] if pattern in fqns else []
            if not hits:
                raise PinError(f"pin params[{pattern!r}] matches no parameter; parameters are e.g. "
                               f"{sorted(fqns)[:8]}")
            for node in hits:
                exact = pattern in fqns and fqns[pattern] == node
                prev = chosen.get(node)
                if prev is None or (exact and not prev[0]):
                    chosen[node] = (exact, pattern, pls)
                elif prev[0] == exact and prev[2] != pls:
                    raise PinError(f"pins params[{prev[1]!r}] = {fmt_storage(*prev[2])} and params[{pattern!r}] = "
                                   f"{fmt_storage(*pls)} disagree on parameter {captured.params[node]!r}")
        for node, (_, pattern, (pls, forms)) in chosen.items():
            self._placeholder_pin(captured, table, mesh, node, f"parameter {captured.params[node]!r}", (pls, forms),
                                  f"pin params[{pattern!r}]", restrict)

    def _resolve_inputs(self, captured, table, mesh, restrict) -> None:
        names = list(captured.inputs) + ([captured.target] if captured.target else [])
        for key, value in self.inputs.items():
            what = f"pin inputs[{key!r}]"
            pls = parse_placements(value, mesh, what)
            if isinstance(key, int):
                if not 0 <= key < len(captured.inputs):
                    raise PinError(f"{what}: the program has {len(captured.inputs)} user input(s) "
                                   f"{captured.inputs}; use an index below that or a name")
                node = captured.inputs[key]
            elif key == "target" and captured.target:
                node = captured.target
            elif key in names:
                node = key
            else:
                raise PinError(f"{what} names no input; inputs are {names} (or indices 0..{len(captured.inputs) - 1})")
            self._placeholder_pin(captured, table, mesh, node, f"input {node!r}", (pls, None), what, restrict)

    def _resolve_ops(self, captured, table, mesh, restrict) -> None:
        ops = [n for n in captured.gm.graph.nodes if n.op == "call_function"]
        by_name = {n.name: n for n in ops}
        for pattern, value in self.ops.items():
            what = f"pin ops[{pattern!r}]"
            pls = parse_placements(value, mesh, what)
            hits = [n for n in ops if fnmatch.fnmatchcase(n.name, pattern)] if _is_glob(pattern) else \
                [by_name[pattern]] if pattern in by_name else []
            if not hits:
                raise PinError(f"{what} matches no op node; op nodes are e.g. {[n.name for n in ops[:10]]}")
            for n in hits:
                metas = [m for m in outputs(n) if m is not None]
                idx = {i for i, s in enumerate(table[n.name]) if s.outputs and tuple(s.outputs[0]) == pls}
                if not idx:
                    why = why_not_divisible(metas[0].shape, pls, mesh) if metas else "the op has no tensor output"
                    if why is None:
                        options = sorted({fmt_placements(s.outputs[0]) for s in table[n.name] if s.outputs})
                        why = f"no sharding strategy of {n.target} produces it (possible: {', '.join(options)})"
                    raise PinError(f"{what}: node {n.name!r} ({n.target}, output shape "
                                   f"{tuple(metas[0].shape) if metas else '-'}) cannot output {fmt_placements(pls)}: {why}")
                restrict(n.name, idx, what)

    def _resolve_strategies(self, captured, table, mesh, restrict) -> None:
        for name, strat in self.strategies.items():
            what = f"pin strategies[{name!r}]"
            if isinstance(strat, dict):
                strat = Strategy.from_json(strat)
            if name not in table:
                raise PinError(f"{what} names no placeholder or op node of the captured program")
            node = captured.node(name)
            lst = table[name]
            if strat in lst:
                restrict(name, {lst.index(strat)}, what)
                continue
            ins = [operand_meta(o) for o in operands(node)] if node.op == "call_function" else []
            outs = [m for m in outputs(node) if m is not None]
            if len(strat.inputs) != len(ins) or len(strat.outputs) != len(outs):
                raise PinError(f"{what}: {strat} has {len(strat.inputs)} operand and {len(strat.outputs)} output "
                               f"placements but node {name!r} has {len(ins)} tensor operand(s) and {len(outs)} output(s)")
            for kind, metas, plss in (("operand", ins, strat.inputs), ("output", outs, strat.outputs)):
                for k, (m, pls) in enumerate(zip(metas, plss)):
                    if len(pls) != mesh.ndim:
                        raise PinError(f"{what}: {kind} {k} has {len(pls)} placements, mesh {mesh.shape} has "
                                       f"{mesh.ndim} axes")
                    why = why_not_divisible(m.shape, pls, mesh)
                    if why:
                        raise PinError(f"{what}: {kind} {k} of shape {tuple(m.shape)}: {why}")
            lst.append(strat)
            restrict(name, {len(lst) - 1}, what)


#: Pins that depend on the program and mesh they apply to: the stage planner calls it on each
#: program it solves (the shallow copy of a deep model, a stage traced at the microbatch) with the
#: rank group's submesh, e.g. a hand-written layout's placements (``autoshard.layout_plans``).
#: None from it: nothing pinned there.
def _is_glob(pattern: str) -> bool:
    """Whether ``pattern`` has fnmatch wildcards (else it matches only the name equal to it: a layout's
    pins name every parameter exactly, and matching each against every name was quadratic)."""
    return any(c in pattern for c in "*?[")


PinsFor = Callable[[CapturedGraph, Mesh], Optional["Pins"]]
#: pins of known plans (e.g. published layouts) on a program and submesh, for a solver to start from
HintsFor = Callable[[CapturedGraph, Mesh], Sequence["Pins"]]
