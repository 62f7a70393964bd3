"""The logical device mesh the planner shards over.

A ``Mesh`` is a validated, immutable description: its shape (one size per axis) and axis names.
It holds no process group; the runtime builds a ``torch.distributed.DeviceMesh`` of the same
shape when it runs. Axis 0 is the outermost (slowest, e.g. across nodes); the last axis is the
innermost (fastest, e.g. NVLink inside a node).

>>> Mesh.of((2, 2))
Mesh(shape=(2, 2), axis_names=('dp', 'tp'))
>>> Mesh.of(4).size, Mesh.of(4).axis_names
(4, ('axis0',))
"""
from __future__ import annotations

import math
from dataclasses import dataclass

# A 1-D mesh's one axis is whatever the plan makes it (data, tensor or sequence parallel): its
# default name says nothing about its use. Two and three axes keep the conventional names.
_DEFAULT_NAMES = {1: ("axis0",), 2: ("dp", "tp"), 3: ("pp", "dp", "tp")}


@dataclass(frozen=True)
class Mesh:
    shape: tuple[int, ...]
    axis_names: tuple[str, ...] = ()

    def __post_init__(self):
        shape = tuple(int(s) for s in self.shape)
        if not shape or any(s < 1 for s in shape):
            raise ValueError(f"mesh shape must be a non-empty tuple of positive ints, got {self.shape!r}")
        names = tuple(self.axis_names) or _DEFAULT_NAMES.get(len(shape), tuple(f"axis{i}" for i in range(len(shape))))
        if len(names) != len(shape):
            raise ValueError(f"mesh has {len(shape)} axes {shape} but {len(names)} axis names {names}")
        if len(set(names)) != len(names):
            raise ValueError(f"mesh axis names must be distinct, got {names}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "axis_names", names)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @classmethod
    def of(cls, mesh) -> "Mesh":
        """Accept an int, a tuple of ints, a ``Mesh`` or a ``torch.distributed.DeviceMesh``."""
        if isinstance(mesh, Mesh):
            return mesh
        if isinstance(mesh, int):
            return cls((mesh,))
        if isinstance(mesh, (tuple, list)):
            return cls(tuple(mesh))
        shape = getattr(mesh, "shape", None)
        names = getattr(mesh, "mesh_dim_names", None)
        if shape is not None and hasattr(mesh, "get_group"):
            return cls(tuple(shape), tuple(names) if names else ())
        raise TypeError(
            f"mesh must be an int, a tuple of ints, an autoshard.Mesh or a DeviceMesh; got {type(mesh).__name__}"
        )

    @classmethod
    def for_world(cls, world: int, devices_per_node: int | None = None) -> "Mesh":
        """The mesh for ``world`` devices: ``(nodes, devices_per_node)`` (axes "dp", "tp": the slow axis
        across nodes, the fast one inside a node) when the world spans more than one whole node, else
        ``(world,)``. ``devices_per_node`` None means one node holds the whole world. The same world
        always gives the same mesh, so an elastic run that shrinks and grows back plans the same shapes.

        >>> Mesh.for_world(4, 2).shape, Mesh.for_world(2, 2).shape, Mesh.for_world(8).shape
        ((2, 2), (2,), (8,))
        """
        if not isinstance(world, int) or world < 1:
            raise ValueError(f"world must be a positive int, got {world!r}")
        per_node = world if devices_per_node is None else devices_per_node
        if not isinstance(per_node, int) or per_node < 1:
            raise ValueError(f"devices_per_node must be a positive int, got {devices_per_node!r}")
        if world % per_node:
            raise ValueError(f"a world of {world} devices is not a whole number of nodes of {per_node} devices "
                             f"({world} % {per_node} = {world % per_node}): pass the devices per node the "
                             "launcher runs (torchrun's --nproc-per-node)")
        nodes = world // per_node
        return cls((nodes, per_node)) if nodes > 1 and per_node > 1 else cls((world,))

    def coordinate(self, rank: int) -> tuple[int, ...]:
        """Row-major coordinate of ``rank`` (the layout torch's init_device_mesh uses)."""
        coord = []
        for size in reversed(self.shape):
            coord.append(rank % size)
            rank //= size
        return tuple(reversed(coord))

    def to_json(self) -> dict:
        return {"shape": list(self.shape), "axis_names": list(self.axis_names)}

    @classmethod
    def from_json(cls, data: dict) -> "Mesh":
        return cls(tuple(data["shape"]), tuple(data["axis_names"]))
