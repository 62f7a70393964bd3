"""Process groups for a mesh: one per axis, plus flattened groups for sets of axes.

``setup_distributed(mesh)`` joins (or starts) ``torch.distributed`` and returns a ``MeshEnv``:
this rank's coordinate, its device, and an ``AxisComm`` per axis (built with
``torch.distributed.device_mesh.init_device_mesh``). The device and backend come from the
environment: CUDA available (and NCCL built) -> ``cuda:LOCAL_RANK`` with NCCL, else CPU with gloo.

``broadcast_json`` ships a JSON-able object from one rank to all as a uint8 tensor (length first),
so a plan solved on rank 0 reaches every rank without pickle. ``run_and_broadcast`` runs the work
that makes such an object on one rank and broadcasts its result or its error: when planning fails
on rank 0, every rank raises (no rank waits in the broadcast for a plan that will never come).

>>> g = MeshEnv.offline(Mesh.of((2, 2)), rank=3)   # no processes: inspect rank 3's view
>>> g.coordinate, g.comm(1)
((1, 1), AxisComm('tp', size=2, rank=1))
"""
from __future__ import annotations

import builtins
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from autoshard.passes.errors import AutoshardError, MeshError
from autoshard.passes.mesh import Mesh

from .collectives import AxisComm

__all__ = ["MeshEnv", "choose_device_backend", "setup_distributed", "broadcast_json", "run_and_broadcast",
           "finish_distributed"]


def choose_device_backend(local_rank: Optional[int] = None) -> tuple[torch.device, str]:
    """(device, backend) for this process: CUDA+NCCL on ``LOCAL_RANK``'s GPU when available, else CPU+gloo."""
    if torch.cuda.is_available() and dist.is_available() and dist.is_nccl_available():
        if local_rank is None:
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device("cuda", local_rank % torch.cuda.device_count()), "nccl"
    return torch.device("cpu"), "gloo"


@dataclass(eq=False)
class MeshEnv:
    """One rank's handle on the mesh: coordinate, device and communicators.

    ``comm(a)`` is the ``AxisComm`` of mesh axis ``a``; ``comm_for(axes)`` flattens several axes
    into one group (created once, on every rank in the same order, as ``new_group`` requires).
    """
    mesh: Mesh
    rank: int
    device: torch.device
    backend: Optional[str] = None
    device_mesh: Any = None
    axis_comms: tuple[AxisComm, ...] = ()
    _flat: dict = field(default_factory=dict, repr=False)

    @property
    def coordinate(self) -> tuple[int, ...]:
        return self.mesh.coordinate(self.rank)

    @property
    def distributed(self) -> bool:
        return self.device_mesh is not None

    def comm(self, axis: int) -> AxisComm:
        return self.axis_comms[axis]

    def comm_for(self, axes: Sequence[int]) -> AxisComm:
        """A communicator over the given axes flattened (row-major over them)."""
        axes = tuple(sorted(set(int(a) for a in axes)))
        if len(axes) == 1:
            return self.axis_comms[axes[0]]
        if axes in self._flat:
            return self._flat[axes]
        shape, coord = self.mesh.shape, self.coordinate
        size, index = 1, 0
        for a in axes:
            size, index = size * shape[a], index * shape[a] + coord[a]
        name = "_".join(self.mesh.axis_names[a] for a in axes) if axes else "none"
        group = None
        if self.distributed and size > 1:
            if size == self.mesh.size:
                group = dist.group.WORLD
            else:
                group = self._new_flat_group(axes)
        comm = AxisComm(name, size, index, group)
        self._flat[axes] = comm
        return comm

    def _new_flat_group(self, axes: tuple[int, ...]):
        # Ranks sharing their coordinates off ``axes`` form one group. Every rank must call
        # new_group for every group, in the same order.
        others = [a for a in range(self.mesh.ndim) if a not in axes]
        members: dict[tuple, list[int]] = {}
        for r in range(self.mesh.size):
            c = self.mesh.coordinate(r)
            members.setdefault(tuple(c[a] for a in others), []).append(r)
        mine = None
        for key in sorted(members):
            g = dist.new_group(members[key])
            if self.rank in members[key]:
                mine = g
        return mine

    @classmethod
    def offline(cls, mesh: Mesh, rank: int = 0, device: Any = "cpu") -> "MeshEnv":
        """A rank's view without processes: programs can be built and printed, not run."""
        mesh = Mesh.of(mesh)
        if not 0 <= rank < mesh.size:
            raise MeshError(f"rank {rank} is outside the mesh {mesh.shape} of {mesh.size} devices")
        coord = mesh.coordinate(rank)
        comms = tuple(AxisComm(n, s, c) for n, s, c in zip(mesh.axis_names, mesh.shape, coord))
        return cls(mesh, rank, torch.device(device), None, None, comms)


def _check_world(mesh: Mesh, world: int) -> None:
    if mesh.size != world:
        arith = "*".join(str(s) for s in mesh.shape)
        raise MeshError(
            f"mesh {mesh.shape} has {arith} = {mesh.size} devices but the world size is {world}; "
            f"launch {mesh.size} processes (torchrun --nproc-per-node {mesh.size}) or pick a mesh of {world} devices"
        )


def setup_distributed(mesh: Any, *, device: Any = None) -> MeshEnv:
    """Join the process world for ``mesh`` and build one group per axis.

    Uses an initialized ``torch.distributed`` if there is one; else initializes it from the
    RANK/WORLD_SIZE environment (torchrun); else, for a 1-device mesh, runs alone.
    """
    mesh = Mesh.of(mesh)
    if not dist.is_available() or (not dist.is_initialized() and "WORLD_SIZE" not in os.environ):
        _check_world(mesh, 1)
        dev = torch.device(device) if device is not None else choose_device_backend()[0]
        return MeshEnv.offline(mesh, 0, dev)
    if not dist.is_initialized():
        dev, backend = choose_device_backend()
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        _check_world(mesh, int(os.environ["WORLD_SIZE"]))
        dist.init_process_group(backend)
    backend = dist.get_backend()
    _check_world(mesh, dist.get_world_size())
    if device is not None:
        dev = torch.device(device)
    elif "nccl" in str(backend):
        dev = choose_device_backend()[0]
    else:
        dev = torch.device("cpu")
    from torch.distributed.device_mesh import init_device_mesh
    dm = init_device_mesh(dev.type, mesh.shape, mesh_dim_names=mesh.axis_names)
    rank = dist.get_rank()
    coord = mesh.coordinate(rank)
    comms = tuple(
        AxisComm(name, size, c, dm.get_group(name))
        for name, size, c in zip(mesh.axis_names, mesh.shape, coord)
    )
    return MeshEnv(mesh, rank, dev, str(backend), dm, comms)


def finish_distributed(exit_process: bool = False) -> None:
    """End of a training script, on every rank: wait until every rank got here (a non-blocking
    collective waited on), then destroy the process groups, or with ``exit_process`` flush stdout and
    stderr and end the process with status 0 without the interpreter's teardown. With gloo (torch
    2.13) a rank can abort while tearing down ("terminate called without an active exception", exit
    -6) after its work is done; once every rank has arrived no peer waits on this one, so skipping
    the teardown loses nothing. A no-op without an initialized process group (``exit_process`` still
    exits)."""
    if dist.is_available() and dist.is_initialized():
        flag = torch.zeros(1, device=choose_device_backend()[0])
        dist.all_reduce(flag, async_op=True).wait()
        if not exit_process:
            dist.destroy_process_group()
    if exit_process:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def broadcast_json(obj: Any = None, src: int = 0, *, env: Optional[MeshEnv] = None, group: Any = None,
                   device: Any = None) -> Any:
    """Send ``obj`` (JSON-able, given on rank ``src``; ignored elsewhere) to every rank; returns it everywhere.

    Two broadcasts over ``group`` (default: the world): the byte length as an int64, then the UTF-8
    JSON text as uint8, on ``env``'s device. Alone (no torch.distributed), returns ``obj`` unchanged.
    """
    if not dist.is_available() or not dist.is_initialized():
        return obj
    if device is None and env is not None:
        device = env.device
    if device is None:
        device = choose_device_backend()[0] if "nccl" in str(dist.get_backend(group)) else torch.device("cpu")
    is_src = dist.get_rank() == src
    payload = json.dumps(obj).encode("utf-8") if is_src else b""
    length = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    dist.broadcast(length, src=src, group=group)
    if is_src:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    else:
        data = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    dist.broadcast(data, src=src, group=group)
    return obj if is_src else json.loads(data.cpu().numpy().tobytes().decode("utf-8"))


def run_and_broadcast(work: Callable[[], Any], src: int = 0, *, env: Optional[MeshEnv] = None,
                      group: Any = None) -> Any:
    """Run ``work()`` on rank ``src`` only and return its JSON-able result on every rank.

    If ``work`` raises on ``src``, that rank re-raises the exception and every other rank raises one of
    the same class with the same message: an ``AutoshardError`` subclass this process has loaded or
    a built-in exception; anything else becomes ``RuntimeError`` naming the original class. Alone (no
    torch.distributed), it is ``work()``. Same transport as ``broadcast_json`` (``env``, ``group``).
    """
    payload, failure = None, None
    if not dist.is_available() or not dist.is_initialized() or dist.get_rank() == src:
        try:
            payload = {"ok": work()}
        except Exception as e:  # noqa: BLE001 - every rank must hear of it
            failure = e
            payload = {"error": _qualified_name(type(e)), "message": str(e)}
    payload = broadcast_json(payload, src=src, env=env, group=group)
    if failure is not None:
        raise failure
    if "error" in payload:
        raise _rebuilt_error(payload["error"], payload["message"], src)
    return payload["ok"]


def _qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _rebuilt_error(name: str, message: str, src: int) -> Exception:
    """The exception rank ``src`` raised, as this rank can build it (see ``run_and_broadcast``)."""
    known, pending = {}, [AutoshardError]
    while pending:
        cls = pending.pop()
        known[_qualified_name(cls)] = cls
        pending.extend(cls.__subclasses__())
    module, _, short = name.rpartition(".")
    cls = known.get(name)
    if cls is None and module == "builtins":
        cls = getattr(builtins, short, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(message)
        except TypeError:  # a built-in exception that needs more than a message
            pass
    return RuntimeError(f"rank {src} failed: {name}: {message}")
