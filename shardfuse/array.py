"""sf.Array: a global array whose pieces live on the devices of a mesh.

Global-view semantics, as in JAX and DTensor: `.shape` is the global shape and `.sharding`
(a Layout) says how it is placed; `gather()` returns the global value on every process.
"""
from __future__ import annotations

import numpy as np

from shardfuse.layout import Layout
from shardfuse.trace import TensorSpec, check_divides, normalize_axis, normalize_dtype, np_dtype


def device_index(shape, layout: Layout, mesh, device: int):
    """The index (tuple of slices) of `device`'s piece of a global array (None: it holds none)."""
    mesh = layout.mesh or mesh
    if device not in mesh.devices:
        return None
    coords = mesh.coords(device)
    idx = []
    for n, a in zip(shape, layout.axes):
        if a is None or a == "Stream":
            idx.append(slice(None))
        else:
            size = n // mesh.axis_size(a)
            c = coords[mesh.axis_index(a)]
            idx.append(slice(c * size, (c + 1) * size))
    return tuple(idx)


def local_pieces(x: np.ndarray, layout: Layout, mesh):
    """This process' pieces of a global array (one per local device), contiguous."""
    out = []
    for d in mesh.local_devices:
        idx = device_index(x.shape, layout, mesh, d)
        # a device outside the value's sub-mesh holds a placeholder of the local shape, never read
        out.append(np.ascontiguousarray(x[idx]) if idx is not None else
                   np.full(layout.local_shape(x.shape, mesh), np.nan, x.dtype))
    return out


def _check_layout(shape, layout: Layout, mesh):
    for ax, name in layout.sharded_axes().items():
        check_divides(shape, ax, name, mesh)


class Array:
    def __init__(self, mesh, shape, dtype, layout: Layout, shards: list):
        self.mesh, self.shape, self.dtype = mesh, tuple(shape), np_dtype(normalize_dtype(dtype))
        self.sharding, self.shards = layout, shards

    ndim = property(lambda self: len(self.shape))

    @property
    def placements(self) -> tuple:
        """Per mesh axis: Shard(dim), Replicate() or Partial(), as in DTensor."""
        from shardfuse.placements import placements_of

        return placements_of(self.sharding, self.mesh)

    @property
    def spec(self) -> TensorSpec:
        return TensorSpec(self.shape, self.dtype.name, self.sharding)

    def __repr__(self):
        return f"sf.Array(shape={self.shape}, dtype={self.dtype.name}, sharding={self.sharding.placements(self.mesh)})"

    @classmethod
    def from_global(cls, x, mesh, axis: int, over: str = "DIDx"):
        if mesh is None:
            raise ValueError("sf.shard on a concrete array needs mesh=")
        x = np.asarray(x)
        normalize_dtype(x.dtype)
        ax = normalize_axis(axis, x.ndim, x.shape)
        mesh.axis_index(over)
        layout = Layout.replicated(x.ndim).with_axis(ax, over)
        _check_layout(x.shape, layout, mesh)
        return cls(mesh, x.shape, x.dtype, layout, mesh.backend.to_device(local_pieces(x, layout, mesh)))

    def gather(self) -> np.ndarray:
        """The global value, on every process (a host copy)."""
        pieces = list(zip(self.mesh.local_devices, self.mesh.backend.to_host(self.shards)))
        if self.mesh.nprocs > 1:
            from mpi4py import MPI

            pieces = [p for part in MPI.COMM_WORLD.allgather(pieces) for p in part]
        lay = self.sharding
        mesh = lay.mesh or self.mesh
        out = np.zeros(self.shape, self.dtype)
        replicas = [mesh.axis_index(m) for m in mesh.axis_names
                    if lay.mesh_axis_of(m) is None and m not in lay.partial]
        for d, piece in pieces:
            if d not in mesh.devices:
                continue  # outside the value's sub-mesh
            if any(mesh.coords(d)[r] for r in replicas):
                continue  # a replica: device 0 of that mesh axis holds the same data
            out[device_index(self.shape, lay, mesh, d)] += piece
        return out

    def __array__(self, dtype=None, copy=None):
        out = self.gather()
        return out if dtype is None else out.astype(dtype)


def from_local(local_piece, axis: int, over: str = "DIDx", mesh=None):
    """SPMD construction: each process passes its own piece (covering its local devices)."""
    if mesh is None:
        raise ValueError("sf.from_local needs mesh=")
    x = np.asarray(local_piece)
    normalize_dtype(x.dtype)
    ax = normalize_axis(axis, x.ndim, x.shape)
    if len(mesh.shape) != 1:
        raise NotImplementedError("sf.from_local supports 1-D meshes for now")
    mesh.axis_index(over)
    if mesh.nprocs > 1:
        from mpi4py import MPI

        seen = MPI.COMM_WORLD.allgather((x.shape, x.dtype.name))
        if len(set(seen)) != 1:
            raise ValueError(f"sf.from_local: processes passed pieces of different shapes/dtypes: {seen}")
    L = len(mesh.local_devices)
    if x.shape[ax] % L:
        raise ValueError(f"local piece axis {ax} of extent {x.shape[ax]} cannot be split over {L} local devices")
    shape = list(x.shape)
    shape[ax] *= mesh.nprocs
    layout = Layout.replicated(x.ndim).with_axis(ax, over)
    parts = [np.ascontiguousarray(p) for p in np.split(x, L, axis=ax)]
    return Array(mesh, shape, x.dtype, layout, mesh.backend.to_device(parts))


def spec_of(arg, mesh) -> TensorSpec:
    """The TensorSpec a call argument compiles for (plain arrays: replicated, layout from the function)."""
    if isinstance(arg, Array):
        if arg.mesh != mesh:
            raise ValueError(f"argument is an sf.Array on {arg.mesh}, but the function is compiled for {mesh}")
        return arg.spec
    if not hasattr(arg, "shape") or not hasattr(arg, "dtype"):
        arg = np.asarray(arg)
    return TensorSpec(tuple(arg.shape), normalize_dtype(arg.dtype))
