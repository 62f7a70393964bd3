"""What this rank holds of the model's state: each local parameter or buffer piece with its placement.

Checkpoints, gradient clipping and per-rank data all need the same view of a compiled program: for
every placeholder of the captured graph this rank keeps a piece of, the local tensor, the storage
placements it has on the (sub)mesh, and whether this copy is the one that *counts*. The program
(``executor.RankProgram``) of a plan without a pipeline holds one piece of every parameter and buffer;
a pipeline's holds the pieces of its rank group's stages; a weight shared by
several stages (tied embeddings) has a copy in each, and only the first stage holding it (in pipeline
order) *owns* it: the owner's copy is what a checkpoint saves and what a gradient norm counts, the
others are kept equal to it (``tie_sources`` says where each copy's value comes from).

``device_mesh_of(env)`` is the ``DeviceMesh`` of a ``MeshEnv`` (built once from its existing groups for a
pipeline group's submesh), for wrapping local pieces as DTensors.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from autoshard.passes.graph import META
from autoshard.passes.layout.shapes import normalize
from autoshard.passes.sharding.storage_forms import form_of, optimizer_placements
from autoshard.passes.spec import Partial, Replicate

from .groups import MeshEnv
from .materialize import names_of

__all__ = ["Holding", "holdings", "device_mesh_of", "is_pipeline", "orphan_placeholders"]


@dataclass(eq=False)
class Holding:
    """One local piece. ``names``: the canonical FQN first, then tied aliases. ``placements``: storage
    placements normalized to ``env``'s mesh (size-1 axes ``R``). ``stage``: the pipeline stage holding it
    (None on the plain path). ``owner``: this copy is the one that counts (see the module docstring)."""
    placeholder: str
    names: list
    tensor: torch.Tensor
    placements: tuple
    env: MeshEnv
    is_param: bool
    global_shape: tuple
    stage: Optional[int] = None
    owner: bool = True
    #: what the optimizer steps for this piece and its placements: a ZeRO parameter's slice (a view of
    #: ``tensor``, ``runtime.zero``), else None (the piece itself, placed as its gradient)
    optimized_slice: Optional[torch.Tensor] = None
    slice_placements: Optional[tuple] = None

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def optimized(self) -> torch.Tensor:
        """The tensor the optimizer steps (and whose ``.grad`` it reads) for this piece."""
        return self.tensor if self.optimized_slice is None else self.optimized_slice

    @property
    def optimized_placements(self) -> tuple:
        """The placements of ``optimized``, of its gradient and optimizer state (``P`` read as ``R``: a
        gradient's layout)."""
        if self.slice_placements is not None:
            return self.slice_placements
        return tuple(Replicate() if isinstance(p, Partial) else p for p in self.placements)

    def counts_gradient(self) -> bool:
        """Whether this rank adds this piece's gradient (``optimized.grad``) to a global sum over the
        tensor's elements (a gradient norm): the owner copy, on the rank at coordinate 0 of every axis
        where the gradient is replicated (a parameter stored ``R`` or ``P`` has its full summed gradient
        on every rank there)."""
        if not self.owner:
            return False
        coord = self.env.coordinate
        return all(coord[a] == 0 for a, p in enumerate(self.optimized_placements) if isinstance(p, Replicate))


def is_pipeline(program: Any) -> bool:
    """Whether ``program`` (a ``RankProgram``) runs a plan of several stages."""
    return program.plan.pipelined


def holdings(program: Any) -> list[Holding]:
    """Every local piece of ``program`` (a ``RankProgram``), in placeholder order (parameters first,
    then buffers; by stage for a pipeline)."""
    if is_pipeline(program):
        return _pipeline_holdings(program)
    captured, mesh = program.captured, program.mesh
    out = []
    pieces = list(zip(captured.params, program.local_parameters(), [True] * len(captured.params)))
    pieces += list(zip(captured.buffers, program.buffers(), [False] * len(captured.buffers)))
    for ph, t, is_param in pieces:
        h = Holding(ph, names_of(captured, ph), t, normalize(program.strategies[ph].outputs[0], mesh.shape),
                    program.env, is_param, tuple(captured.node(ph).meta[META].shape))
        sliced = program.optimizer_parameter(t) if is_param else t
        if sliced is not t:
            meta = captured.node(ph).meta[META]
            h.optimized_slice = sliced
            h.slice_placements = normalize(optimizer_placements(h.placements, form_of(
                program.strategies[ph], meta.shape, mesh.shape)), mesh.shape)
        out.append(h)
    return out


def _pipeline_holdings(program: Any) -> list[Holding]:
    owners = _owner_stages(program)
    out = []
    for s in sorted(program.stages):
        st = program.stages[s]
        pieces = [(ph, t, True) for ph, t in zip(st.param_names, st.params)]
        pieces += [(ph, t, False) for ph, t in zip(st.buffer_names, st.buffers)]
        for ph, t, is_param in pieces:
            out.append(Holding(ph, names_of(program.captured, ph), t,
                               normalize(st.strategies[ph].outputs[0], st.env.mesh.shape), st.env, is_param,
                               tuple(program.captured.node(ph).meta[META].shape), stage=s, owner=owners[ph] == s))
    return out


def _owner_stages(program: Any) -> dict[str, int]:
    """placeholder -> the first stage (pipeline order) whose sub-graph holds it."""
    owners: dict[str, int] = {}
    for g in program.graphs:
        for ph in list(g.captured.params) + list(g.captured.buffers):
            owners.setdefault(ph, g.index)
    return owners


def orphan_placeholders(program: Any) -> list[str]:
    """Placeholders of a pipeline's program held by no stage (read by no op: never trained, but still
    part of ``model.state_dict()``). Empty for a plain program."""
    if not is_pipeline(program):
        return []
    owners = _owner_stages(program)
    return [ph for ph in list(program.captured.params) + list(program.captured.buffers) if ph not in owners]


_MESHES: "weakref.WeakKeyDictionary[MeshEnv, Any]" = weakref.WeakKeyDictionary()


def device_mesh_of(env: MeshEnv):
    """The ``DeviceMesh`` over ``env``'s ranks and axes, or None when the program runs alone (no process
    group). A plain program's env has one (``setup_distributed``); a pipeline group's is built from the
    group's existing per-axis process groups (a size-1 axis gets a one-rank group, created by this rank
    alone), so nothing here is a collective over other ranks."""
    dm = env.device_mesh
    if dm is not None and not isinstance(dm, str):
        return dm
    if not dist.is_available() or not dist.is_initialized():
        return None
    if env in _MESHES:
        return _MESHES[env]
    from torch.distributed.device_mesh import DeviceMesh
    ranks = list(getattr(env, "ranks", None) or range(env.mesh.size))
    groups = []
    for a in range(env.mesh.ndim):
        comm = env.comm(a)
        groups.append(comm.group if comm.group is not None and comm.size > 1 else
                      dist.new_group([ranks[env.rank]], use_local_synchronization=True))
    layout = torch.tensor(ranks, dtype=torch.int).reshape(env.mesh.shape)
    dm = DeviceMesh.from_group(groups if len(groups) > 1 else groups[0], env.device.type, mesh=layout,
                               mesh_dim_names=tuple(env.mesh.axis_names))
    _MESHES[env] = dm
    return dm
