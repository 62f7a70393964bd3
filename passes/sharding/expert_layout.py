"""Expert-parallel layouts: Megatron-Core's "parallel folding" as mesh axes, and the MoE layers' pins.

A layout runs attention and dense layers over ``tp x cp x dp`` ranks (tp fastest, then cp, then dp)
and, on the same ranks, the experts of every MoE layer over ``etp x ep x edp`` (etp fastest, then
ep, then edp = tp*cp*dp / (etp*ep)): Megatron-Core's MoE parallel folding, where the expert groups
need not follow the attention's (EP may take ranks the attention uses for TP, DP or CP). With HSDP
replicas (``replicas > 1``) both orders end with the replica groups, slowest.

``fold_axes`` cuts those ranks into mesh axes: every place where either order starts a new group
(the prefix products of the group sizes, fastest first) is an axis boundary, so each axis carries
one attention role (``"tp" | "cp" | "dp" | "replica"``) and one expert role (``"etp" | "ep" |
"edp" | "replica"``):

>>> fold_axes(tp=2, cp=1, dp=32, ep=8, etp=1)
Fold(shape=(8, 4, 2), names=('dp_edp', 'dp_ep', 'tp_ep'), attention=('dp', 'dp', 'tp'), experts=('edp', 'ep', 'ep'))

That works when the two sets of boundaries nest (each divides the next) and neither tp nor cp is cut
(``LayoutError`` otherwise: tp's ranks are one axis of the planning mesh). With ``ep == 1`` and
``etp == tp`` (no folding) the axes and names are the attention's alone, as layouts had them before.

``expert_layout_pins`` then pins every ``autoshard::moe_experts`` op to the strategy that says, per
axis: experts split over ep (``S(0)``; the tokens dispatched by all-to-all where they are split,
``expert_dispatch``; where they are replicated, each rank computes its own experts' pairs and the
output is a partial sum), inside each expert over etp (the ``I`` dim, a partial-sum output), and
data parallel over edp; and pins the experts' stored weights (``gate_up_proj`` ``(E, 2I, H)``,
``down_proj`` ``(E, H, I)``): ``S(0)`` over ep, ``I`` over etp, sharded (FSDP, the distributed
optimizer) or replicated over edp. The router (the weight matmul whose output only feeds the MoE
op's routing) stays replicated over tp, as Megatron keeps it (``router_matmuls``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch.fx as fx

from autoshard.passes.capture.moe_experts import capacity_factor_of, moe_nodes
from autoshard.passes.graph import META, CapturedGraph
from autoshard.passes.mesh import Mesh
from autoshard.passes.sharding.rules.moe import EXPERT_DISPATCH, EXPERT_DISPATCH_CAPACITY
from autoshard.passes.spec import Partial, Replicate, Shard, Strategy

__all__ = ["Fold", "ExpertAxes", "fold_axes", "expert_axes", "expert_axes_like_attention", "router_matmuls", "expert_layout_pins", "expert_params"]

_R, _P, _S0 = Replicate(), Partial(), Shard(0)


def _error(msg: str) -> Exception:
    from autoshard.passes.errors import LayoutError  # the layouts' error type
    return LayoutError(msg)


@dataclass(frozen=True)
class Fold:
    """One pipeline stage's ranks as mesh axes (slowest first), each with its attention and expert role."""
    shape: tuple[int, ...]
    names: tuple[str, ...]
    attention: tuple[str, ...]
    experts: tuple[str, ...]

    def without_ones(self) -> "Fold":
        """The axes of size > 1, or one size-1 "dp" axis when there are none."""
        keep = [i for i, s in enumerate(self.shape) if s > 1]
        if not keep:
            return Fold((1,), ("dp",), ("dp",), ("edp",))
        return Fold(*(tuple(t[i] for i in keep) for t in (self.shape, self.names, self.attention, self.experts)))


@dataclass(frozen=True)
class ExpertAxes:
    """Axes of the planning mesh by expert role: ``ep`` (experts split, dim 0), ``etp`` (inside each
    expert, the ``I`` dim), ``shard`` / ``replicate`` (expert data parallel: weights sharded, as
    FSDP and the distributed optimizer store them, or replicated)."""
    ep: tuple[int, ...] = ()
    etp: tuple[int, ...] = ()
    shard: tuple[int, ...] = ()
    replicate: tuple[int, ...] = ()


def _blocks(sizes: list[tuple[str, int]]) -> list[tuple[str, int, int]]:
    """(role, first, end) prefix-product intervals of groups listed fastest first."""
    out, lo = [], 1
    for role, size in sizes:
        out.append((role, lo, lo * size))
        lo *= size
    return out


def _role_at(blocks: list[tuple[str, int, int]], lo: int, hi: int) -> str:
    for role, a, b in blocks:
        if a <= lo and hi <= b and a < b:
            return role
    raise AssertionError(f"no group holds [{lo}, {hi})")  # the boundaries include every block's


def fold_axes(tp: int, cp: int, dp: int, ep: int = 1, etp: Optional[int] = None, replicas: int = 1) -> Fold:
    """The axes of ``tp x cp x dp`` ranks (``replicas`` of the dp groups slowest) carrying the attention's
    groups and the experts' ``etp x ep x edp`` (module docstring). ``etp`` None: tp (Megatron's default).
    A group of one rank has no axis (one rank in all: no axis at all, which ``Fold.without_ones`` makes
    a size-1 "dp"). ``LayoutError`` shows the arithmetic when the experts' groups do not fit."""
    etp = tp if etp is None else etp
    world = tp * cp * dp
    inner = world // replicas
    if inner % (ep * etp):
        raise _error(f"ep x etp = {ep} x {etp} = {ep * etp} does not divide the {inner} ranks of a data-parallel "
                     f"replica (tp x cp x dp / replicas = {tp} x {cp} x {dp} / {replicas}): the experts' groups "
                     f"are carved from the same ranks as the attention's; change ep or etp")
    attention = _blocks([("tp", tp), ("cp", cp), ("dp", dp // replicas), ("replica", replicas)])
    experts = _blocks([("etp", etp), ("ep", ep), ("edp", inner // (ep * etp)), ("replica", replicas)])
    cuts = sorted({b for _, lo, hi in attention + experts for b in (lo, hi)})
    for a, b in zip(cuts, cuts[1:]):
        if b % a:
            raise _error(f"the attention's groups (tp={tp}, then cp={cp}, then dp={dp}) and the experts' (etp={etp}, "
                         f"then ep={ep}) do not nest: group boundaries at {a} and {b} ranks, and {a} does not divide "
                         f"{b}. Megatron's rank order puts tp and etp fastest: choose ep x etp a multiple or a "
                         f"divisor of tp x cp at each step")
    spans = list(zip(cuts, cuts[1:]))
    att = [_role_at(attention, lo, hi) for lo, hi in spans]
    exp = [_role_at(experts, lo, hi) for lo, hi in spans]
    for role, size in (("tp", tp), ("cp", cp)):
        if att.count(role) > 1:
            raise _error(f"the experts' groups (etp={etp}, ep={ep}) would cut the {size} {role} ranks into "
                         f"{att.count(role)} axes; a layout keeps {role} one axis: choose etp x ep a multiple of "
                         f"{role}'s ranks below it, or a divisor of the ranks before it")
    plain = ep == 1 and etp == tp
    names = [a if plain else f"{a}_{e}" for a, e in zip(att, exp)]
    sizes = [hi // lo for lo, hi in spans]
    return Fold(tuple(reversed(sizes)), tuple(reversed(names)), tuple(reversed(att)), tuple(reversed(exp)))


def expert_axes(fold: Fold, shard_data: bool) -> ExpertAxes:
    """``fold``'s axes by expert role. Expert data-parallel axes shard the weights when ``shard_data``,
    except those the attention uses for cp (its parameters are replicated there too); replica axes
    always replicate."""
    roles = list(zip(fold.attention, fold.experts))
    shard = tuple(i for i, (a, e) in enumerate(roles) if e == "edp" and a != "cp" and shard_data)
    return ExpertAxes(ep=tuple(i for i, (_, e) in enumerate(roles) if e == "ep"),
                      etp=tuple(i for i, (_, e) in enumerate(roles) if e == "etp"),
                      shard=shard,
                      replicate=tuple(i for i, (_, e) in enumerate(roles) if e in ("edp", "replica") and i not in shard))


def expert_axes_like_attention(axes, mesh: Mesh) -> ExpertAxes:
    """The experts' axes of a layout without its own: etp = tp, no ep, the data axes as the attention's
    (``axes``: a ``LayoutAxes``), cp replicated (Megatron's expert data parallel spans dp x cp)."""
    etp = (axes.tp,) if axes.tp is not None and mesh.shape[axes.tp] > 1 else ()
    rest = () if axes.tp is None or etp else (axes.tp,)
    return ExpertAxes(etp=etp, shard=tuple(axes.shard),
                      replicate=tuple(axes.replicate) + ((axes.cp,) if axes.cp is not None else ()) + rest)


# ---- the MoE layers of a captured program ----------------------------------------------------------

def _param_of(node) -> Optional[fx.Node]:
    """The parameter placeholder an expert weight operand reads (itself, or the one it slices)."""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.args:
        node = node.args[0]
    return node if isinstance(node, fx.Node) and node.op == "placeholder" else None


def expert_params(captured: CapturedGraph) -> dict[str, str]:
    """Parameter placeholder -> "gate_up" | "down" for the experts' stored weights of every MoE layer."""
    out = {}
    for node in moe_nodes(captured.gm):
        for i, kind in ((3, "gate_up"), (4, "gate_up"), (5, "down")):
            p = _param_of(node.args[i])
            if p is not None and p.name in captured.params:
                out[p.name] = kind
    return out


def router_matmuls(captured: CapturedGraph, is_weight_matmul) -> set[str]:
    """Weight matmuls whose value reaches a MoE layer only through its routing (``top_k_index``,
    ``top_k_weights``): found walking back from those operands, stopping at each weight matmul.
    ``is_weight_matmul(node)``: the caller's test (``layout_placements``)."""
    found: set[str] = set()
    seen: set[str] = set()
    stack = [a for n in moe_nodes(captured.gm) for a in n.args[1:3] if isinstance(a, fx.Node)]
    while stack:
        node = stack.pop()
        if node.name in seen:
            continue
        seen.add(node.name)
        if is_weight_matmul(node):
            found.add(node.name)
            continue
        stack.extend(node.all_input_nodes)
    return found


def _sharded_dim(shape, used: set[int], ways: int) -> Optional[int]:
    for d, size in enumerate(shape):
        if d not in used and size % ways == 0:
            return d
    return None


def _check(captured: CapturedGraph, node: fx.Node, mesh: Mesh, ex: ExpertAxes) -> None:
    gate = node.args[3].meta[META].shape
    ep = math.prod(mesh.shape[a] for a in ex.ep)
    etp = math.prod(mesh.shape[a] for a in ex.etp)
    if gate[0] % ep:
        raise _error(f"ep={ep} does not divide the {gate[0]} experts of the MoE layer {node.name}; choose ep among "
                     f"{[d for d in range(1, gate[0] + 1) if gate[0] % d == 0]}")
    if gate[1] % etp:
        raise _error(f"etp={etp} does not divide the experts' intermediate size {gate[1]} of the MoE layer "
                     f"{node.name}; choose another etp (etp=1 keeps each expert whole)")


def expert_layout_pins(captured: CapturedGraph, mesh: Mesh, *, ex: ExpertAxes, data: tuple[int, ...],
                       cp: Optional[int], tp: Optional[int], sequence_parallel: bool) -> dict:
    """``{"params": ..., "strategies": ...}`` pinning every MoE layer of ``captured`` and its experts'
    weights (module docstring). ``data`` / ``cp`` / ``tp``: the attention's axes (``LayoutAxes``): the
    tokens reaching a MoE layer are split (``S(0)``) over the data and cp axes, and over tp under
    sequence parallelism; replicated over tp otherwise."""
    params: dict[str, tuple] = {}
    strategies: dict[str, Strategy] = {}
    split_tokens = set(data) | ({cp} if cp is not None else set()) | ({tp} if tp is not None and sequence_parallel
                                                                           else set())
    shard_ways = math.prod(mesh.shape[a] for a in ex.shard)
    for node in moe_nodes(captured.gm):
        _check(captured, node, mesh, ex)
        tokens, gate_up, down, out, lowering = [], [], [], [], []
        dispatch = EXPERT_DISPATCH_CAPACITY if capacity_factor_of(node) > 0 else EXPERT_DISPATCH
        for a in range(mesh.ndim):
            split = a in split_tokens
            if mesh.shape[a] == 1:  # nothing to split: every operand whole
                tokens.append(_R)
                gate_up.append(_R)
                down.append(_R)
                out.append(_R)
                lowering.append(None)
            elif a in ex.ep:
                tokens.append(_S0 if split else _R)
                gate_up.append(_S0)
                down.append(_S0)
                out.append(_S0 if split else _P)
                lowering.append(dispatch)
            elif a in ex.etp:
                tokens.append(_R)
                gate_up.append(Shard(1))
                down.append(Shard(2))
                out.append(_P)
                lowering.append(None)
            else:
                tokens.append(_S0 if split else _R)
                gate_up.append(_R)
                down.append(_R)
                out.append(_S0 if split else _R)
                lowering.append(None)
        tok, gu, dn = tuple(tokens), tuple(gate_up), tuple(down)
        strategies[node.name] = Strategy((tok, tok, tok, gu, gu, dn), (tuple(out),), tuple(lowering))
        for operand, compute in ((node.args[3], gu), (node.args[5], dn)):
            p = _param_of(operand)
            if p is None or p.name not in captured.params:
                continue
            shape = tuple(p.meta[META].shape)
            used = {0} if ex.ep else set()
            used |= {1 if compute is gu else 2} if ex.etp else set()
            sdim = _sharded_dim(shape, used, shard_ways) if ex.shard else None
            stored = list(compute)
            for a in ex.shard:
                stored[a] = Shard(sdim) if sdim is not None and mesh.shape[a] > 1 else _R
            params[captured.params[p.name]] = tuple(stored)
    return {"params": params, "strategies": strategies}
