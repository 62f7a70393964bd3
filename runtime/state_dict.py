"""The model's state of a compiled program under the original ``model.state_dict()`` names.

``ModelState(program, model)`` serves a ``RankProgram``, with or without a pipeline:

- ``state_dict()``: this rank's pieces as DTensors (the plan's storage placements on the program's
  ``DeviceMesh``; a pipeline rank's on its rank group's submesh), views of the live parameters, ready
  for ``torch.distributed.checkpoint.save`` / ``load``. Alone (no process group) the values are the
  plain full tensors.
- ``full_state_dict()``: full CPU tensors on every rank (a collective).
- ``load_state_dict(sd)``: copies ``sd`` into this rank's pieces; values may be DTensors on the
  program's mesh in any placements (DTensor reshards) or plain full tensors.

Names and values are exactly what ``model.state_dict()`` gives: the model's own ``state_dict`` runs,
with this rank's values swapped in for its parameters and buffers, so state-dict hooks (a fused QKV
weight saved as separate q/k/v tensors, say) apply; ``load_state_dict`` runs the model's own
``load_state_dict`` the same way, so load pre-hooks fuse them back. The user's model is only borrowed:
its tensors are put back afterwards. Nothing is dropped silently: a name ``model.state_dict()`` has that
no rank can give a value for is an error naming it.

A pipeline rank gives the names its stages own (``holdings``: a weight shared by several stages is
saved from the first); tensors of other stages stand in as meta tensors while the model's hooks run,
and their outputs are left out. A tensor no stage reads (an unused parameter) is kept, unchanged, on
the first rank group. After a load, copies of shared weights are set from their owner.
"""
from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from torch.distributed.tensor import DTensor

from autoshard.passes.errors import CheckpointError
from autoshard.passes.graph import META
from autoshard.passes.spec import Partial, Replicate

from .holdings import Holding, device_mesh_of, holdings, is_pipeline, orphan_placeholders
from .layout import shard_tensor
from .materialize import full_tensors_by_replay, names_of
from .redistribute import redistribute

__all__ = ["ModelState", "swapped_tensors", "as_dtensor"]


@contextlib.contextmanager
def swapped_tensors(model: nn.Module, values: dict):
    """Put ``values`` (FQN -> tensor) in place of the model's parameters and buffers of those names
    for the duration of the block, then put the originals back."""
    saved = []
    try:
        for fqn, value in values.items():
            owner, _, leaf = fqn.rpartition(".")
            module = model.get_submodule(owner)
            store = (module._parameters if leaf in module._parameters else
                     module._buffers if leaf in module._buffers else None)
            if store is None:
                raise CheckpointError(f"the model has no parameter or buffer {fqn!r}; was it compiled from this model?")
            saved.append((store, leaf, store[leaf]))
            store[leaf] = value
        yield
    finally:
        for store, leaf, old in reversed(saved):
            store[leaf] = old


def as_dtensor(local: torch.Tensor, mesh, placements, shape) -> torch.Tensor:
    """``local`` as a DTensor on ``mesh`` (a view of it, sharing storage) or, without a mesh, as is."""
    if mesh is None:
        return local
    shape = torch.Size(shape)
    return DTensor.from_local(local, mesh, tuple(placements), run_check=False, shape=shape,
                              stride=torch.empty(shape, device="meta").stride())


def _is_meta(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and v.is_meta


class ModelState:
    """See the module docstring. ``program``: a ``RankProgram``; ``model``: the
    module it was compiled from (None: names come from the captured graph and no hooks run); ``seed``:
    the initialization seed of a meta-device model (for tensors no pipeline stage holds); ``ties``: a
    pipeline's ``TieGroups`` joining the rank groups that hold copies of a shared parameter."""

    def __init__(self, program: Any, model: Optional[nn.Module] = None, *, seed: int = 0, ties: Any = None):
        self.program, self.model = program, model
        self.captured = program.captured
        self.pipeline = is_pipeline(program)
        self.held = holdings(program)
        self.env = program.env
        self.mesh = device_mesh_of(self.env)
        self._first_group_ranks = program.layout[0][1] if self.pipeline else None
        self._orphans = self._orphan_values(seed)
        self._ours: Optional[list] = None
        self._checked = False
        self._ties = ties

    # ---- what this rank has --------------------------------------------------------------------
    def _orphan_values(self, seed: int) -> dict[str, torch.Tensor]:
        """placeholder -> full value of tensors no stage holds, on the first rank group's ranks."""
        phs = orphan_placeholders(self.program)
        if phs and self.model is None:  # every rank knows the plan: every rank raises
            raise CheckpointError(f"{[names_of(self.captured, p)[0] for p in phs]} are read by no pipeline stage; "
                                  "their values come from the model: build the pipeline with model=")
        if not phs or self.program.group != 0:
            return {}
        own = dict(self.model.named_parameters(remove_duplicate=False))
        own.update(self.model.named_buffers(remove_duplicate=False))
        tensors = {ph: own[names_of(self.captured, ph)[0]] for ph in phs}
        replayed = full_tensors_by_replay(self.model, {id(t) for t in tensors.values() if t.is_meta}, seed)
        return {ph: (replayed[id(t)] if t.is_meta else t.detach()).to(self.env.device).clone()
                for ph, t in tensors.items()}

    def _owned(self) -> list[Holding]:
        return [h for h in self.held if h.owner]

    def _shape(self, ph: str) -> tuple:
        return tuple(self.captured.node(ph).meta[META].shape)

    def _local_values(self) -> dict[str, torch.Tensor]:
        """FQN -> this rank's value for every name it owns: DTensor views of its pieces (a ``P`` piece is
        summed first, into a new tensor) and the orphans, replicated over the first group."""
        out = {}
        for h in self._owned():
            local = h.tensor.detach()
            placements = h.placements
            if any(isinstance(p, Partial) for p in placements):
                plain = tuple(Replicate() if isinstance(p, Partial) else p for p in placements)
                local, placements = redistribute(local, placements, plain, h.env), plain
            value = as_dtensor(local, self.mesh, placements, h.global_shape)
            for name in h.names:
                out[name] = value
        replicated = (Replicate(),) * self.env.mesh.ndim
        for ph, t in self._orphans.items():
            value = as_dtensor(t, self.mesh, replicated, t.shape)
            for name in names_of(self.captured, ph):
                out[name] = value
        return out

    def _stand_ins(self, skip: dict) -> dict[str, torch.Tensor]:
        """Meta tensors for every model tensor of the captured graph not in ``skip``."""
        out = {}
        for ph in list(self.captured.params) + list(self.captured.buffers):
            meta = self.captured.node(ph).meta[META]
            stand_in = torch.empty(meta.shape, dtype=meta.dtype, device="meta")
            for name in names_of(self.captured, ph):
                if name not in skip:
                    out[name] = stand_in
        return out

    def _run_state_dict(self, values: dict) -> dict:
        """``model.state_dict()`` with ``values`` swapped in (or, without a model, ``values`` by name)."""
        if self.model is None:
            order = [n for ph in list(self.captured.params) + list(self.captured.buffers)
                     for n in names_of(self.captured, ph)]
            return {n: values[n].detach() for n in order if n in values}
        with swapped_tensors(self.model, values):
            return self.model.state_dict()

    # ---- the three operations ------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's state as DTensors under ``model.state_dict()``'s names (see the module docstring)."""
        values = self._local_values()
        raw = self._run_state_dict({**self._stand_ins(values), **values})
        out = {k: v for k, v in raw.items() if not _is_meta(v)}
        self._ours = list(out)
        self._check_complete(list(raw), out)
        return out

    def _check_complete(self, every: list, out: dict) -> None:
        """Every name of ``model.state_dict()`` has a value on some rank (once: a collective on a pipeline)."""
        if self._checked:
            return
        have = set(out)
        if self.pipeline and dist.is_initialized():
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, sorted(have))
            have = set().union(*map(set, gathered))
        lost = [k for k in every if k not in have]
        if lost:
            raise CheckpointError(f"model.state_dict() names {lost[:5]}{' ...' if len(lost) > 5 else ''} but no rank "
                                  "holds a value for them (a state-dict hook that builds a tensor from nothing the "
                                  "program holds?); they would be lost from the checkpoint")
        self._checked = True

    def full_state_dict(self) -> dict:
        """Full CPU tensors under ``model.state_dict()``'s names, on every rank (a collective)."""
        full = self._full_by_placeholder()
        values = {name: t for ph, t in full.items() for name in names_of(self.captured, ph)}
        raw = self._run_state_dict(values)
        lost = [k for k, v in raw.items() if _is_meta(v)]
        if lost:
            raise CheckpointError(f"no value for {lost[:5]}: the compiled program does not hold these tensors of "
                                  "model.state_dict()")
        return raw

    def _full_by_placeholder(self) -> dict[str, torch.Tensor]:
        everything = (Replicate(),) * self.env.mesh.ndim
        out = {}
        with torch.no_grad():
            if not self.pipeline:
                for h in self.held:
                    out[h.placeholder] = redistribute(h.tensor.detach(), h.placements, everything, h.env).cpu().clone()
                return out
            owned = {h.placeholder: h for h in self._owned()}
            first = self._first_group_ranks[0]
            for ph in list(self.captured.params) + list(self.captured.buffers):
                meta = self.captured.node(ph).meta[META]
                if ph in owned:
                    h = owned[ph]
                    full = redistribute(h.tensor.detach(), h.placements, everything, h.env).contiguous()
                    src = self.program.layout[self.program.plan.stages[h.stage].group][1][0]
                elif ph in self._orphans:
                    full, src = self._orphans[ph].clone(), first
                else:
                    full, src = torch.empty(meta.shape, dtype=meta.dtype, device=self.program.device), None
                if src is None:
                    src = self._source_rank(ph)
                dist.broadcast(full, src=src)
                out[ph] = full.cpu().clone()
        return out

    def _source_rank(self, ph: str) -> int:
        for g in self.program.graphs:
            if ph in g.captured.params or ph in g.captured.buffers:
                return self.program.layout[self.program.plan.stages[g.index].group][1][0]
        return self._first_group_ranks[0]

    def load_state_dict(self, state_dict: dict, strict: bool = True) -> None:
        """Copy ``state_dict`` (names as ``state_dict()`` gives them; DTensors on this program's mesh or
        plain full tensors) into this rank's pieces. ``strict``: every name this rank owns must be given
        and no name the model does not have (``CheckpointError`` lists them)."""
        ours = self._ours if self._ours is not None else list(self.state_dict())
        targets, after = self._load_targets()
        template = self._run_state_dict({**self._stand_ins(targets), **targets})
        problem = None
        if strict:
            missing = [k for k in ours if k not in state_dict]
            unexpected = [k for k in state_dict if k not in template]
            if missing or unexpected:
                problem = (f"the state dict does not match the compiled model: missing {missing[:5]}"
                           f"{' ...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                           f"{' ...' if len(unexpected) > 5 else ''}; pass strict=False to load a part")
        given = {}
        for k in ours:
            if k in state_dict and problem is None:
                given[k], problem = self._as_target(k, state_dict[k])
        self.agree(problem)
        completed = {k: given.get(k, v) for k, v in template.items() if k in given or k not in ours}
        if self.model is None:
            with torch.no_grad():
                for k, v in given.items():
                    targets[k].copy_(v)
        else:
            with swapped_tensors(self.model, {**self._stand_ins(targets), **targets}):
                result = self.model.load_state_dict(completed, strict=False)
            missing = [k for k in result.missing_keys if k in targets]
            unused = [k for k in result.unexpected_keys if k in given]
            if strict and (missing or unused):
                raise CheckpointError(f"after the model's load hooks, {missing[:5]} got no value and {unused[:5]} "
                                      "were not taken; the state dict does not match the compiled model")
        after()

    def _load_targets(self) -> tuple[dict, Any]:
        """(FQN -> DTensor to load into, a function finishing the load): views of the owned pieces; a
        ``P`` piece loads into a full temporary that is then cut with the summand rule; then the
        pipeline's copies of shared weights are set from their owners."""
        targets, pending = {}, []
        for h in self._owned():
            if any(isinstance(p, Partial) for p in h.placements):
                temp = torch.empty(h.global_shape, dtype=h.tensor.dtype, device=h.tensor.device)
                value = as_dtensor(temp, self.mesh, (Replicate(),) * len(h.placements), h.global_shape)
                pending.append((h, temp))
            else:
                value = as_dtensor(h.tensor.detach(), self.mesh, h.placements, h.global_shape)
            for name in h.names:
                targets[name] = value
        replicated = (Replicate(),) * self.env.mesh.ndim
        for ph, t in self._orphans.items():
            value = as_dtensor(t, self.mesh, replicated, t.shape)
            for name in names_of(self.captured, ph):
                targets[name] = value

        def after():
            with torch.no_grad():
                for h, temp in pending:
                    h.tensor.detach().copy_(shard_tensor(temp, h.placements, h.env.mesh.shape, h.env.coordinate,
                                                         partial="first"))
            self.sync_copies(lambda h: h.tensor)
        return targets, after

    def _as_target(self, key: str, value: Any) -> tuple[Any, Optional[str]]:
        """(the value as a DTensor on this program's mesh, or None and what is wrong with it)."""
        if not isinstance(value, torch.Tensor) or self.mesh is None:
            return value, None
        if isinstance(value, DTensor):
            if value.device_mesh != self.mesh:
                return None, (f"{key!r} is a DTensor on {value.device_mesh}, not on this program's mesh {self.mesh}; "
                              "load it with torch.distributed.checkpoint into this model's state_dict() (that "
                              "reshards), or pass full tensors")
            return value, None
        return as_dtensor(value.to(self.env.device), self.mesh, (Replicate(),) * self.env.mesh.ndim, value.shape), None

    def agree(self, problem: Optional[str]) -> None:
        """Raise ``CheckpointError`` on every rank when any rank found ``problem`` (a collective when
        distributed): a load that fails on one rank must not leave the others waiting in its collectives."""
        failed = problem is not None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([1.0 if failed else 0.0], device=self.env.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            failed = bool(flag.item())
        if failed:
            raise CheckpointError(problem or "another rank's state dict does not match the compiled model (its error "
                                  "names the keys); every rank stops loading")

    # ---- copies of shared weights (pipelines) ----------------------------------------------------
    def sync_copies(self, tensor_of, *, gradient_layout: bool = False) -> None:
        """Set every non-owner copy of a shared pipeline parameter from its owner's: ``tensor_of(holding)``
        is the local tensor to read or write (the piece itself, or optimizer state of it: pass
        ``gradient_layout`` to read ``P`` placements as ``R``, as a gradient is laid out; a scalar is copied
        whole). A collective over the ranks holding copies (through ``ties``); nothing on a plain program."""
        if not self.pipeline:
            return
        everything = (Replicate(),) * self.env.mesh.ndim

        def layout(h: Holding) -> tuple:
            return tuple(Replicate() if gradient_layout and isinstance(p, Partial) else p for p in h.placements)

        with torch.no_grad():
            for ph, holders in self._shared().items():
                mine = [h for h in self.held if h.placeholder == ph]
                if not mine:
                    continue
                owner = next((h for h in mine if h.owner), None)
                scalar = tensor_of(mine[0]).dim() == 0
                if owner is not None:
                    value = tensor_of(owner).detach()
                    full = value.clone() if scalar else redistribute(value, layout(owner), everything,
                                                                      owner.env).contiguous()
                else:
                    shape = () if scalar else self.captured.node(ph).meta[META].shape
                    full = torch.empty(shape, dtype=tensor_of(mine[0]).dtype, device=tensor_of(mine[0]).device)
                groups = sorted({self.program.plan.stages[s].group for s in holders})
                if len(groups) > 1:
                    owner_group = self.program.plan.stages[holders[0]].group
                    dist.broadcast(full, src=self.program.layout[owner_group][1][self.env.rank],
                                   group=self._ties.get(tuple(groups)))
                for h in mine:
                    if not h.owner:
                        piece = full if scalar else shard_tensor(full, layout(h), h.env.mesh.shape, h.env.coordinate,
                                                                 partial="first")
                        tensor_of(h).detach().copy_(piece)

    def _shared(self) -> dict[str, list[int]]:
        """parameter placeholder -> the stages holding it, for parameters held by more than one stage."""
        out: dict[str, list[int]] = {}
        for g in self.program.graphs:
            for ph in g.captured.params:
                out.setdefault(ph, []).append(g.index)
        return {ph: s for ph, s in out.items() if len(s) > 1}
