"""DeviceMesh: the devices a program runs on, and which of them this process owns.

Under `mpiexec -n P` each process owns a contiguous block of size/P devices (rank p owns
[p*L, (p+1)*L)); in one process it owns all of them.  The mesh also picks the backend:
CuPy+NCCL when CuPy sees GPUs, NumPy otherwise.
"""
from __future__ import annotations

import math
import os
from functools import cached_property

# The field's words for per-axis parallel types (nvFuser's ParallelType).
STREAM = "Stream"
DEFAULT_AXIS_NAMES = {1: ("DIDx",), 2: ("DIDy", "DIDx"), 3: ("DIDz", "DIDy", "DIDx")}

_MPI_ENV = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MPI_LOCALRANKID")


def launched_by_mpi() -> bool:
    """True when this process was started by mpiexec (so mpi4py is worth importing)."""
    return any(k in os.environ for k in _MPI_ENV)


def world():
    """(comm, rank, size) of MPI.COMM_WORLD, or (None, 0, 1) when not under mpiexec."""
    if not launched_by_mpi():
        return None, 0, 1
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    return comm, comm.Get_rank(), comm.Get_size()


def _gpu_count() -> int:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no CuPy, no driver, no GPU: all mean "no GPU backend"
        return 0


class DeviceMesh:
    """A logical grid of devices, e.g. ``DeviceMesh(4)`` or ``DeviceMesh((2, 4), ("dp", "tp"))``.

    backend: "numpy", "cupy" or None (CuPy when it sees GPUs, else NumPy).
    """

    def __init__(self, shape, axis_names=None, backend=None):
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        if not shape or any(not isinstance(s, int) or s < 1 for s in shape):
            raise ValueError(f"DeviceMesh shape must be positive ints, got {shape!r}")
        if axis_names is None:
            if len(shape) not in DEFAULT_AXIS_NAMES:
                raise ValueError(f"give axis_names for a {len(shape)}-D mesh")
            axis_names = DEFAULT_AXIS_NAMES[len(shape)]
        axis_names = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names)
        if len(axis_names) != len(shape) or len(set(axis_names)) != len(axis_names):
            raise ValueError(f"need {len(shape)} distinct axis names for mesh shape {shape}, got {axis_names!r}")
        if backend not in (None, "numpy", "cupy"):
            raise ValueError(f"backend must be 'numpy', 'cupy' or None, got {backend!r}")
        self.shape = shape
        self.axis_names = axis_names
        self.size = math.prod(shape)
        comm, rank, nprocs = world()
        if self.size % nprocs:
            raise ValueError(f"a mesh of {self.size} devices cannot be split over {nprocs} MPI processes")
        self.nprocs, self.rank = nprocs, rank
        per = self.size // nprocs
        self.local_devices = tuple(range(rank * per, (rank + 1) * per))
        if backend is None:
            backend = "cupy" if _gpu_count() > 0 else "numpy"
        self.backend_name = backend
        self.devices = tuple(range(self.size))  # global device ids, in mesh order
        self.root = self  # the mesh a program runs on; a sub-mesh points at it

    def submesh(self, devices, axis_names=None) -> "DeviceMesh":
        """A 1-D mesh over some of this mesh's devices, e.g. a pipeline stage: ``mesh.submesh([2, 3])``.

        Values placed on it live on those devices only; moving a value between sub-meshes
        lowers to SendRecv, Broadcast, Scatter or Gather.
        """
        devices = tuple(int(d) for d in devices)
        if not devices or len(set(devices)) != len(devices) or not set(devices) <= set(self.devices):
            raise ValueError(f"a sub-mesh needs distinct devices of {self} (ids {self.devices}), got {devices}")
        sub = object.__new__(DeviceMesh)
        sub.__dict__.update({k: v for k, v in self.__dict__.items() if k != "backend"})
        sub.shape, sub.size, sub.devices, sub.root = (len(devices),), len(devices), devices, self.root
        sub.axis_names = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names or self.axis_names[-1:])
        sub.local_devices = tuple(d for d in devices if d in self.local_devices)
        return sub

    @property
    def is_root(self) -> bool:
        return self.root is self

    # -- geometry -----------------------------------------------------------------------
    def axis_index(self, name: str) -> int:
        if name not in self.axis_names:
            raise ValueError(f"unknown mesh axis {name!r}: this mesh has axes {self.axis_names}")
        return self.axis_names.index(name)

    def axis_size(self, name: str) -> int:
        return self.shape[self.axis_index(name)]

    def coords(self, device: int) -> tuple[int, ...]:
        """Mesh coordinates of a global device id (row-major, last axis fastest)."""
        device = self.devices.index(device)
        out = []
        for s in reversed(self.shape):
            out.append(device % s)
            device //= s
        return tuple(reversed(out))

    def teams(self, name: str) -> list[tuple[int, ...]]:
        """Groups of devices that differ only in mesh axis `name`, each in that axis' order."""
        ax = self.axis_index(name)
        groups: dict[tuple, list[int]] = {}
        for d in self.devices:
            c = self.coords(d)
            groups.setdefault(c[:ax] + c[ax + 1:], []).append(d)
        return [tuple(g) for g in groups.values()]

    # -- identity and runtime -----------------------------------------------------------
    def _key(self):
        return (self.shape, self.axis_names, self.backend_name, self.devices)

    def __eq__(self, other):
        return isinstance(other, DeviceMesh) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __repr__(self):
        dims = ", ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.shape))
        where = "" if self.is_root else f", devices={self.devices}"
        return f"DeviceMesh({dims}{where}, backend={self.backend_name})"

    @cached_property
    def backend(self):
        """The backend instance for this process' devices (created once per mesh)."""
        if not self.is_root:
            return self.root.backend
        from shardfuse.backends import make_backend

        return make_backend(self)
