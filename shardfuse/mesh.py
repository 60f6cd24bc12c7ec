"""DeviceMesh: the devices a program runs on, and which of them this process owns.

Under `mpiexec -n P` each process owns a contiguous block of size/P devices (rank p owns
[p*L, (p+1)*L)); in one process it owns all of them.  The mesh also picks the backend:
CuPy+NCCL when CuPy sees GPUs, NumPy otherwise.

A mesh is geometry, compared, hashed and pickled by it.  Beside it, each mesh object holds the
run-time state that must live exactly as long as that object, declared in `DeviceMesh.__init__`
and filled on first use by the modules named there (this module imports none of them): its
backend (streams, communicators, library handles) and its one-op plans (array_ops' PlanCache).
They are kept on the mesh and not in those modules' tables weakly keyed by the mesh because they
refer back to it (a backend holds its mesh, a plan's program and backend name it), and Python has
no ephemerons: a WeakKeyDictionary value that reaches its key keeps the key alive for ever, and a
bound plan cannot hold its mesh weakly while its program and backend hold it.  A weak table
would also give equal meshes one entry (under MPI making a backend is collective, so it must not
depend on which equal mesh the garbage collector took).  On the mesh, mesh and state form one
cycle the garbage collector frees together.
What depends on geometry alone is kept by geometry instead (pieces.py's placement memo).
"""
from __future__ import annotations

import math
import os
import weakref

import numpy as np

# The field's words for per-axis parallel types (nvFuser's ParallelType).
STREAM = "Stream"
DEFAULT_AXIS_NAMES = {1: ("DIDx",), 2: ("DIDy", "DIDx"), 3: ("DIDz", "DIDy", "DIDx")}

_MPI_ENV = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MPI_LOCALRANKID")


def as_int(value, what: str, minimum: int | None = None) -> int:
    """`value` as a Python int: ints and NumPy integers, never bools (True is not 1 here), floats
    or strings; TypeError / ValueError naming `what`, what was expected and what came."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what} must be an int, got {value!r} ({type(value).__name__}){static_advice(value)}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{what} must be an int >= {minimum}, got {value}")
    return value


def static_advice(value) -> str:
    """What an error about a number adds where the number came is traced (a jitted function's argument)."""
    if type(value).__module__ != "shardfuse.traced":
        return ""
    return ("; a Python int passed to a jitted function is traced (a weak int64 input, as in JAX): to use it as a "
            "shape, an axis or a count, make it static, sf.jit(f, static_argnums=...) or static_argnames=...")


def launched_by_mpi() -> bool:
    """True when this process was started by mpiexec (so mpi4py is worth importing)."""
    return any(k in os.environ for k in _MPI_ENV)


def world():
    """(comm, rank, size) of MPI.COMM_WORLD, or (None, 0, 1) when not under mpiexec.

    The first call with more than one process also installs shardfuse's fault handling
    (shardfuse/faults.py): an uncaught exception or an early exit on one rank ends the
    whole job instead of hanging it, without `python -m mpi4py`."""
    if not launched_by_mpi():
        return None, 0, 1
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise ImportError(f"this process was started by an MPI launcher, and running under one needs mpi4py ({e}): "
                          "pip install -e \".[mpi]\" (MPICH from PyPI), or pip install mpi4py built against your "
                          "cluster's MPI") from None

    from shardfuse import faults

    comm = MPI.COMM_WORLD
    faults.install(comm)
    return comm, comm.Get_rank(), comm.Get_size()


def gpu_count() -> int:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no CuPy, no driver, no GPU: all mean "no GPU backend"
        return 0


class Geometry(tuple):
    """(shape, axis names, devices, this process' devices) of a mesh, hashed once: the key of what
    is remembered per mesh geometry (pieces.py), looked up on every call, holding no mesh."""

    def __new__(cls, fields):
        self = super().__new__(cls, fields)
        self.hashed = tuple.__hash__(self)
        return self

    def __hash__(self):
        return self.hashed


class DeviceMesh:
    """A logical grid of devices, e.g. ``DeviceMesh(4)`` or ``DeviceMesh((2, 4), ("dp", "tp"))``.

    backend: "numpy", "cupy" or None (CuPy when it sees GPUs, else NumPy).
    """

    def __init__(self, shape, axis_names=None, backend=None):
        shape = _mesh_shape(shape)
        if axis_names is None:
            if len(shape) not in DEFAULT_AXIS_NAMES:
                raise ValueError(f"give axis_names for a {len(shape)}-D mesh")
            axis_names = DEFAULT_AXIS_NAMES[len(shape)]
        axis_names = _axis_names(axis_names, len(shape), f"mesh shape {shape}")
        if backend not in (None, "numpy", "cupy"):
            raise ValueError(f"backend must be 'numpy', 'cupy' or None, got {backend!r}")
        if backend == "cupy":
            try:
                import cupy  # noqa: F401
            except ImportError as e:
                raise ImportError(f"DeviceMesh(backend='cupy') needs CuPy ({e}): pip install -e \".[gpu]\"") from None
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
            backend = "cupy" if gpu_count() > 0 else "numpy"
        self.backend_name = backend
        self.devices = tuple(range(self.size))  # global device ids, in mesh order
        self.root = self  # the mesh a program runs on; a sub-mesh points at it
        self._hash = hash(self._key())
        self.geometry = Geometry((self.shape, self.axis_names, self.devices, self.local_devices))
        self._empty_run_time_state()
        _LIVE_MESHES[(self.shape, self.axis_names, self.backend_name, self.nprocs)] = self

    def submesh(self, devices, axis_names=None) -> "DeviceMesh":
        """A mesh over some of this mesh's devices, e.g. a pipeline stage: ``mesh.submesh([2, 3])``
        (1-D, named as this mesh's last axis), or a grid of device ids for a stage of several axes,
        ``mesh.submesh(ids[0], ("dp", "tp"))`` with ``ids = np.arange(8).reshape(2, 2, 2)`` on a
        ("pp", "dp", "tp") mesh (as JAX's ``Mesh(mesh.devices[0], ("dp", "tp"))``).

        Values placed on it live on those devices only; moving a value between sub-meshes
        lowers to SendRecv, Broadcast, Scatter or Gather.
        """
        try:
            grid = np.array(devices, dtype=object)
            if any(isinstance(d, (list, tuple, np.ndarray)) for d in grid.ravel()):
                raise ValueError
        except ValueError:  # (NumPy's "inhomogeneous shape", or lists left as elements of an object array)
            raise ValueError(f"a sub-mesh's grid of device ids must be rectangular, got {devices!r}") from None
        if grid.ndim == 0:  # (a number, a string, a 0-d array)
            raise TypeError(f"submesh() takes a sequence (or a grid) of device ids of {self} (ids {self.devices}), "
                            f"got {devices!r}")
        if 0 in grid.shape:
            raise ValueError(f"a sub-mesh needs distinct devices of {self} (ids {self.devices}), got {devices!r}")
        shape = grid.shape
        devices = tuple(as_int(d, "a sub-mesh device id") for d in grid.ravel())
        if len(set(devices)) != len(devices) or not set(devices) <= set(self.devices):
            raise ValueError(f"a sub-mesh needs distinct devices of {self} (ids {self.devices}), got {devices}")
        default = self.axis_names[-len(shape):] if len(shape) <= len(self.axis_names) else None
        if axis_names is None and default is None:
            raise ValueError(f"give axis_names for a {len(shape)}-D sub-mesh of {self}")
        axis_names = _axis_names(default if axis_names is None else axis_names, len(shape), f"a {len(shape)}-D sub-mesh")
        # Built field by field: the sub-mesh has run-time state of its own, none of this mesh's
        sub = object.__new__(DeviceMesh)
        sub.shape, sub.axis_names, sub.size = tuple(shape), axis_names, len(devices)
        sub.nprocs, sub.rank, sub.backend_name = self.nprocs, self.rank, self.backend_name
        sub.devices, sub.root = devices, self.root
        sub._hash = hash(sub._key())
        sub.local_devices = tuple(d for d in devices if d in self.root.local_devices)
        sub.geometry = Geometry((sub.shape, sub.axis_names, sub.devices, sub.local_devices))
        sub._empty_run_time_state()
        return sub

    def _empty_run_time_state(self):
        """Declares the run-time state a mesh object holds (see the module docstring), empty; each
        attribute is filled and read only by the module named beside it."""
        self.backend_cache = None  # runtime.backend_of: the backend of this mesh object
        self.submesh_backend_cache: dict = {}  # runtime.backend_of, on a root mesh: its sub-meshes' backends
        self.op_plan_cache = None  # array_ops: a PlanCache of the one-op plans of operations outside jit here

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
        return self is other or (isinstance(other, DeviceMesh) and self._key() == other._key())

    def __hash__(self):  # (made once, by the constructors: every call's dispatch key holds its arguments' meshes)
        return self._hash

    def __repr__(self):
        dims = ", ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.shape))
        where = "" if self.is_root else f", devices={self.devices}"
        procs = f", processes={self.nprocs}" if self.nprocs > 1 else ""  # (the NumPy backend over MPI)
        return f"DeviceMesh({dims}{where}, backend={self.backend_name}{procs})"

    # -- pickling: by constructor arguments, never the backend or caches ---------------------
    def __reduce__(self):
        root = self.root
        sub = None if self.is_root else (np.reshape(np.array(self.devices, dtype=object), self.shape).tolist(), self.axis_names)
        return _rebuild_mesh, (root.shape, root.axis_names, root.backend_name, sub)


def _mesh_shape(shape) -> tuple:
    what = "DeviceMesh shape must be positive ints (a device count, or a tuple of axis sizes)"
    if isinstance(shape, (bool, np.bool_)) or not isinstance(shape, (int, np.integer, tuple, list)):
        raise TypeError(f"{what}, got {shape!r} ({type(shape).__name__})")
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    for s in shape:
        if isinstance(s, (bool, np.bool_)) or not isinstance(s, (int, np.integer)):
            raise TypeError(f"{what}, got {shape!r}: {s!r} is a {type(s).__name__}")
    if not shape or any(s < 1 for s in shape):
        raise ValueError(f"{what}, got {shape!r}")
    return tuple(int(s) for s in shape)


def _axis_names(names, ndim: int, what: str) -> tuple:
    names = (names,) if isinstance(names, str) else names
    if not isinstance(names, (tuple, list)) or not all(isinstance(n, str) and n for n in names):
        raise TypeError(f"axis_names must be a name or a sequence of names (strings), got {names!r}")
    names = tuple(names)
    if len(names) != ndim or len(set(names)) != len(names):
        raise ValueError(f"need {ndim} distinct axis names for {what}, got {names!r}")
    return names


# Live root meshes by constructor arguments (the latest made of each): unpickling finds the mesh
# (and its backend) already there instead of making another; weak, so it keeps no mesh alive.
_LIVE_MESHES: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()


def _rebuild_mesh(shape, axis_names, backend_name, sub):
    """A pickled mesh, rebuilt by its constructor arguments in this process (see __reduce__)."""
    _, _, nprocs = world()
    key = (shape, axis_names, backend_name, nprocs)
    root = _LIVE_MESHES.get(key)
    if root is None:
        root = DeviceMesh(shape, axis_names, backend_name)
    return root if sub is None else root.submesh(*sub)


def meeting_mesh(meshes):
    """The mesh of `meshes` that lies within every other, where their values can meet (a value replicated
    on the larger ones is copied there, passes/propagate.py), else None; ties broken by the devices and
    the repr, never by set order (every rank must pick the same)."""
    for m in sorted(meshes, key=lambda m: (len(m.devices), tuple(m.devices), repr(m))):
        if all(set(m.devices) <= set(h.devices) for h in meshes):
            return m
    return None


def mixed_meshes(op, homes) -> str:
    """The error of an op whose operands ((name, sub-mesh or None) each) live on sub-meshes that are not
    nested (a stage's activation beside the next stage's weight, not moved), raised while tracing, where
    the user's line is in the traceback (propagation refused it at compile time with internal names)."""
    named = ", ".join(f"{n} on devices {m.devices}" for n, m in homes if m is not None)
    return (f"{op}: operands live on different sub-meshes ({named}); move one first with sf.to_mesh(x, mesh) or "
            "sf.shard(x, ..., mesh=)")
