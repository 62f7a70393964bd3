"""Process groups for a pipeline: each rank group's submesh axes, and the groups tying shared weights.

The physical mesh's first axis is cut into ``pp`` rank groups; group g runs its stages on the
logical submesh ``Stage.mesh`` over the global ranks ``Stage.ranks``. ``build_pipeline_envs``
creates, with ``torch.distributed.new_group`` on EVERY rank in the same order (as new_group requires),
one group per (rank group, set of submesh axes, coordinates off those axes), and hands each rank a
``SubmeshEnv``: a ``MeshEnv`` whose communicators are those subgroups, so the core runtime's lowering
runs unchanged inside a stage. ``tie_group`` pairs the k-th ranks of several rank groups.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from autoshard.passes.errors import MeshError
from autoshard.passes.mesh import Mesh
from autoshard.passes.pipeline.plan import Plan

from ..collectives import AxisComm
from ..groups import MeshEnv

__all__ = ["SubmeshEnv", "group_layout", "build_pipeline_envs", "TieGroups"]


@dataclass(eq=False)
class SubmeshEnv(MeshEnv):
    """A ``MeshEnv`` over a rank group's submesh: ``rank`` is the index within the group, ``ranks``
    the group's global ranks; every axis set has its communicator built up front."""
    ranks: list = field(default_factory=list)

    def _new_flat_group(self, axes):
        raise MeshError(f"submesh {self.mesh.shape} of ranks {self.ranks} has no communicator for axes {axes}; "
                        "build_pipeline_envs creates them all up front")


def group_layout(plan: Plan) -> dict[int, tuple[Mesh, list[int]]]:
    """group -> (submesh, global ranks); every stage of a group must agree on both."""
    out: dict[int, tuple[Mesh, list[int]]] = {}
    for st in plan.stages:
        got = (st.mesh, list(st.ranks))
        if st.mesh.size != len(st.ranks):
            raise MeshError(f"stage {st.index}: submesh {st.mesh.shape} has {st.mesh.size} devices but "
                            f"{len(st.ranks)} ranks {st.ranks}")
        if out.setdefault(st.group, got) != got:
            raise MeshError(f"stages of rank group {st.group} disagree on its submesh/ranks: {out[st.group]} vs {got}")
    if sorted(out) != list(range(plan.pp)):
        raise MeshError(f"the plan uses rank groups {sorted(out)}; expected 0..{plan.pp - 1}")
    seen = [r for g in sorted(out) for r in out[g][1]]
    if len(set(seen)) != len(seen):
        raise MeshError(f"rank groups overlap: {[out[g][1] for g in sorted(out)]}")
    return out


def _axis_sets(ndim: int) -> list[tuple[int, ...]]:
    return [c for k in range(1, ndim + 1) for c in itertools.combinations(range(ndim), k)]


def build_pipeline_envs(plan: Plan, rank: int, device: torch.device, backend: str) -> tuple[int, SubmeshEnv]:
    """(this rank's group, its SubmeshEnv). A collective over the world: call on every rank."""
    layout = group_layout(plan)
    world = dist.get_world_size()
    total = sum(len(r) for _, r in layout.values())
    if total != world:
        raise MeshError(f"the pipeline uses {total} ranks ({plan.pp} groups x {total // plan.pp}) but the world "
                        f"size is {world}; launch {total} processes")
    mine_group = next(g for g, (_, ranks) in layout.items() if rank in ranks)
    comms: dict[tuple, AxisComm] = {}
    for g in sorted(layout):
        mesh, ranks = layout[g]
        local = ranks.index(rank) if g == mine_group else None
        for axes in _axis_sets(mesh.ndim):
            size = 1
            for a in axes:
                size *= mesh.shape[a]
            others = [a for a in range(mesh.ndim) if a not in axes]
            members: dict[tuple, list[int]] = {}
            for i, r in enumerate(ranks):
                c = mesh.coordinate(i)
                members.setdefault(tuple(c[a] for a in others), []).append(r)
            for key in sorted(members):
                pg = dist.new_group(members[key]) if size > 1 else None
                if local is not None and rank in members[key]:
                    c = mesh.coordinate(local)
                    index = 0
                    for a in axes:
                        index = index * mesh.shape[a] + c[a]
                    name = "_".join(mesh.axis_names[a] for a in axes)
                    comms[axes] = AxisComm(name, size, index, pg)
    mesh, ranks = layout[mine_group]
    local = ranks.index(rank)
    axis = tuple(comms[(a,)] for a in range(mesh.ndim))
    env = SubmeshEnv(mesh, local, device, backend, f"pipeline group {mine_group}", axis,
                     {k: v for k, v in comms.items() if len(k) > 1}, ranks=list(ranks))
    return mine_group, env


class TieGroups:
    """Groups joining the k-th ranks of a set of rank groups (for summing a shared weight's gradient
    across the groups holding copies). Created on every rank, in the order ``keys`` gives."""

    def __init__(self, layout: dict[int, tuple[Mesh, list[int]]], keys: list[tuple[int, ...]], rank: int):
        self.groups: dict[tuple[int, ...], object] = {}
        for key in keys:
            if key in self.groups or len(key) < 2:
                continue
            size = len(layout[key[0]][1])
            mine = None
            for k in range(size):
                members = sorted(layout[g][1][k] for g in key)
                pg = dist.new_group(members)
                if rank in members:
                    mine = pg
            self.groups[key] = mine

    def get(self, key: tuple[int, ...]):
        return self.groups.get(key)
