"""Sharding: where a value lives, and nothing else (JAX's NamedSharding, DTensor's DTensorSpec).

`Sharding(mesh, dims, partial)`: the mesh is required, so every question about the pieces
(their shape, which device holds which block, DTensor's placements) is answered from the
sharding alone.  `dims[i]` names the mesh axes that shard tensor axis i, outermost first (()
replicated, ("tp",), ("dp", "tp")); `partial` the mesh axes over which the local values are
sums still to be reduced.  When a value is produced (a stream schedule) is no part of it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from shardfuse.placements import Partial, Replicate, Shard, StridedShard


@dataclass(frozen=True)
class Sharding:
    mesh: object
    dims: tuple  # per tensor axis: a tuple of mesh axis names, outermost first
    partial: tuple = ()  # mesh axes with a pending sum

    def __post_init__(self):
        if self.mesh is None:
            raise TypeError(f"Sharding needs a mesh (dims {self.dims})")
        used = [n for d in self.dims for n in d]
        if len(used) != len(set(used)):
            raise ValueError(f"Sharding{self.dims}: a mesh axis shards two tensor axes")

    @staticmethod
    def replicated(mesh, ndim: int) -> "Sharding":
        return Sharding(mesh, ((),) * ndim)

    @property
    def ndim(self) -> int:
        return len(self.dims)

    def count(self, i: int) -> int:
        """How many pieces tensor axis i is cut into."""
        return math.prod(self.mesh.axis_size(n) for n in self.dims[i])

    def local_shape(self, shape) -> tuple:
        """The shape of each device's piece of a global array of this shape."""
        return tuple(n // self.count(i) for i, n in enumerate(shape))

    def axis_of(self, name: str):
        """The tensor axis mesh axis `name` shards (alone or with others), or None."""
        return next((i for i, d in enumerate(self.dims) if name in d), None)

    def with_dim(self, i: int, axes) -> "Sharding":
        dims = list(self.dims)
        dims[i] = tuple(axes)
        return Sharding(self.mesh, tuple(dims), self.partial)

    def block(self, i: int, device: int) -> int:
        """Which block of tensor axis i `device` holds (its coordinates along dims[i], the first outermost)."""
        coords, b = self.mesh.coords(device), 0
        for n in self.dims[i]:
            b = b * self.mesh.axis_size(n) + coords[self.mesh.axis_index(n)]
        return b

    def placements(self) -> tuple:
        """DTensor's placements, one per mesh axis in the mesh's order: Shard(i), Partial() or
        Replicate(); StridedShard(i, split_factor) where mesh axes later in the mesh's order shard
        axis i outside of this one (their sizes' product: see shardfuse/placements.py)."""
        out = []
        names = self.mesh.axis_names
        for k, name in enumerate(names):
            dim = self.axis_of(name)
            if dim is None:
                out.append(Partial() if name in self.partial else Replicate())
                continue
            order = self.dims[dim]
            split = math.prod(self.mesh.axis_size(n) for n in order[:order.index(name)] if n in names[k + 1:])
            out.append(Shard(dim) if split == 1 else StridedShard(dim, split))
        return tuple(out)
