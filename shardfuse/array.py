"""sf.Array: a global array whose pieces live on the devices of a mesh.

Global-view semantics, as in JAX and DTensor: `.shape` is the global shape and `.sharding`
(a Layout) says how it is placed; `gather()` returns the global value on every process.
"""
from __future__ import annotations

import math
import threading

import numpy as np

from shardfuse import faults
from shardfuse.array_ops import ArrayOps, reshard
from shardfuse.stage_arrays import on_root
from shardfuse.interop import array_info, check_input, host_view, stream_ptr
from shardfuse.layout import Layout, layout_of
from shardfuse.mesh import DeviceMesh
from shardfuse.dtypes import dtype_pair
from shardfuse.pieces import Placed, device_index, global_placement, local_indices, local_pieces
from shardfuse.spec import TensorSpec, check_axis, check_divides
from shardfuse.runtime import backend_of


REPR_ELEMENTS = 10_000  # the largest sf.Array whose repr shows its values (gathered to the host for it)


class Donated:
    """The pieces of a donated sf.Array: any use raises, saying why."""

    def __init__(self, why: str):
        self.why = why

    def _refuse(self, *_):
        raise RuntimeError(self.why)

    __iter__ = __getitem__ = __len__ = _refuse


class Array(Placed, ArrayOps):  # operators, ufuncs, reductions, indexing: array_ops
    """A global array on a mesh: this process' pieces (`shards`, one per local device) and the
    layout that says where each lies.

    Pickling keeps the mesh by its constructor arguments (shape, axis names, backend; a sub-mesh
    by its devices) and this process' pieces as NumPy arrays: small, and unpickled onto the same
    mesh in this process (an equal live mesh is reused) or a new one like it.  Under MPI the pickle
    holds only the pickling process' pieces, so it unpickles only in the process of the same rank
    and world size (a per-rank checkpoint); to send a value elsewhere pickle ``.gather()`` (the
    global NumPy value; collective) or ``.to_local()`` (this process' piece) instead."""

    def __init__(self, mesh, shape, dtype, layout: Layout, shards: list, pieces_contiguous: bool = False,
                 owned: bool = False, fenced=None):
        self.dtype_name, self.dtype = dtype_pair(dtype)
        self.mesh, self.shape = mesh, tuple(shape)
        self.sharding, self.shards = layout, shards
        self.pieces_contiguous = pieces_contiguous  # placed by shardfuse, or whole plan buffers: taken as they are
        # a plan's result: a buffer per device that nothing else views, which a plan that it is donated
        # to may write (pieces placed from a caller's array may view it, or share one buffer per GPU)
        self.owned = owned
        self.fenced = fenced  # a plan's result: its call's interop.Fence (the stream that already waits for it)
        # a 0-d result weakly typed as JAX keeps it (a Python number's arithmetic): the next call takes it
        # as it took the Python number, so a step count in a state does not make float32 weights float64
        self.weak = False
        self.root_view = None  # (placed on a stage: stage_arrays.on_root's form of it on the whole mesh, made once)

    ndim = property(lambda self: len(self.shape))

    def donated(self, to: str) -> None:
        """Mark this array's buffers as given to a plan's result (sf.jit donate_argnums): any later
        use raises, as a donated JAX array does, instead of reading what the result wrote there."""
        self.shards = Donated(f"this sf.Array{self.shape} was donated to {to} (donate_argnums): its buffers now "
                              "hold that call's result; use the result instead")

    @property
    def placements(self) -> tuple:
        """Per mesh axis: Shard(dim), Replicate() or Partial(), as in DTensor."""
        from shardfuse.placements import placements_of

        return placements_of(self.sharding, self.mesh)

    @property
    def spec(self) -> TensorSpec:
        return TensorSpec(self.shape, self.dtype_name, self.sharding, weak=self.weak)

    def __repr__(self):
        """With its values, as JAX's and DTensor's reprs, where reading them is local and small: one
        process, or every process holding the whole value (under mpiexec a gather is otherwise collective:
        one rank printing would hang), up to REPR_ELEMENTS, not donated; else shape=."""
        what = f"shape={self.shape}"
        local = self.mesh.nprocs == 1 or self._whole_here() is not None  # (a replicated loss: as in one process)
        if local and self.size <= REPR_ELEMENTS and not isinstance(self.shards, Donated):
            what = np.array2string(np.asarray(self), separator=", ", prefix="sf.Array(")
        return (f"sf.Array({what}, dtype={self.dtype_name}, "
                f"placements={self.sharding.placements(self.mesh)}, mesh={self.sharding.home(self.mesh)!r})")

    def __format__(self, spec):
        """f"{loss:.4f}" and f"{loss}" as of a NumPy 0-d array (a probe's training-log line raised), read only where
        that is local (as repr: one process, or every process holding it); else a spec is refused, as NumPy's."""
        if self.ndim == 0 and (self.mesh.nprocs == 1 or self._whole_here() is not None):
            return format(np.asarray(self).item(), spec)
        if spec:  # (never a gather: under mpiexec one rank's would hang)
            raise TypeError(f"unsupported format string passed to sf.Array.__format__: a spec formats a 0-d value "
                            f"every process holds, got shape {self.shape}; format float(x) or np.asarray(x)")
        return repr(self)

    def _repr_html_(self):
        """Jupyter: shape, dtype, placements per mesh axis, mesh, and the sharding picture."""
        import html

        from shardfuse.visualize import visualize_sharding

        mesh = self.sharding.home(self.mesh)
        rows = "".join(f"<tr><td>{html.escape(n)}</td><td>{html.escape(str(p))}</td></tr>"
                       for n, p in zip(self.mesh.axis_names, self.sharding.placements(self.mesh)))
        head = (f"<b>sf.Array</b> shape {self.shape}, {self.dtype_name}, on {html.escape(repr(mesh))}"
                f"<table style='font-family:monospace'><tr><th>mesh axis</th><th>placement</th></tr>{rows}</table>")
        picture = visualize_sharding(self)._repr_html_() if self.ndim in (1, 2) else ""
        return f"<div>{head}{picture}</div>"

    @classmethod
    def from_global(cls, x, mesh, axis: int | None, over: str | None = None, what: str = "sf.shard"):
        """x placed on mesh: sharded on `axis` over mesh axis `over`, or replicated (axis None)."""
        if mesh is None:
            raise ValueError(f"{what} on a concrete array needs mesh=")
        check_mesh(mesh, what)
        if axis is not None:
            axis = check_axis(axis)  # before the memo, whose keys cannot tell True from 1
        info = array_info(x)
        check_input(info, backend_of(mesh), what)
        _same_on_every_rank(x, info, mesh, what)
        layout, where = global_placement(info.shape, mesh, axis, over)
        return cls(mesh, info.shape, info.dtype, layout, local_pieces(x, info.dtype, layout, mesh, info, where=where),
                   True)

    @classmethod
    def from_layout(cls, x, mesh, layout: Layout, what: str = "sf.distribute"):
        """x (a global array) placed on mesh with this layout (checked: each sharded extent divides)."""
        check_mesh(mesh, what)
        info = array_info(x)
        check_input(info, backend_of(mesh), what)
        _same_on_every_rank(x, info, mesh, what)  # (first: a shape that differs is then named alike on every rank)
        if layout.ndim != len(info.shape):
            raise ValueError(f"{what}: layout of {layout.ndim} axes for an array of shape {info.shape}")
        for a, over in layout.sharded_axes().items():
            check_divides(info.shape, a, over, mesh)
        return cls(mesh, info.shape, info.dtype, layout, local_pieces(x, info.dtype, layout, mesh, info), True)

    def redistribute(self, device_mesh=None, placements=None) -> "Array":
        """The same value with other placements (DTensor's redistribute(device_mesh, placements), the mesh
        this array's; JAX-style specs too: one entry per tensor axis), moved by the collectives a plan would
        use (a one-op plan, compiled once per layout pair)."""
        if placements is None and not hasattr(device_mesh, "axis_names"):  # (redistribute(placements))
            device_mesh, placements = None, device_mesh
        if device_mesh is not None and device_mesh != self.mesh:
            raise ValueError(f"sf.Array.redistribute: the array lives on {self.mesh}, not {device_mesh}; move "
                             "values between meshes inside sf.jit with sf.to_mesh")
        if placements is None:
            raise TypeError("sf.Array.redistribute: placements= is required")
        return reshard(self, layout_of(placements, self.ndim, self.mesh))

    device_mesh = property(lambda self: self.mesh)  # (DTensor's name)
    full_tensor = property(lambda self: self.full_array)  # (DTensor's name: x.full_tensor())

    def gather(self) -> np.ndarray:
        """The global value, on every process (a host copy).

        A value that every process holds whole (replicated over its mesh: a loss, a plan's
        replicated result) is read from this process' own piece, with no communication, as JAX
        reads a fully replicated array: ``if mesh.rank == 0: print(float(loss))`` is fine, and so
        are np.asarray, int() and bool() of one.  Otherwise collective: under mpiexec every
        process must call it (the pieces are all-gathered over MPI), in the same order as its
        other collectives; a process that skips it leaves the others waiting."""
        k = self._whole_here()
        if k is not None:  # (decided alike on every rank: from the layout and the mesh alone)
            return backend_of(self.mesh).to_host(self.shards[:k + 1])[k].astype(self.dtype, copy=False)
        pieces = list(zip(self.mesh.local_devices, backend_of(self.mesh).to_host(self.shards)))
        if self.mesh.nprocs > 1:  # (with the deadline; a rank at another step raises RankMismatchError)
            what = f"gather() of an sf.Array {self.dtype_name}{list(self.shape)} {self.placements}"
            pieces = [p for part in faults.allgather_object(pieces, what) for p in part]
        lay = self.sharding
        mesh = lay.home(self.mesh)
        out = np.zeros(self.shape, self.dtype)
        replicas = [mesh.axis_index(m) for m in mesh.axis_names
                    if lay.mesh_axis_of(m) is None and m not in lay.partial]
        for d, piece in pieces:
            if d not in mesh.devices:
                continue  # outside the value's sub-mesh
            if any(mesh.coords(d)[r] for r in replicas):
                continue  # a replica: device 0 of that mesh axis holds the same data
            if lay.partial:  # pending sums: the pieces add up
                out[device_index(self.shape, lay, mesh, d)] += piece
            else:  # disjoint pieces, placed as they are (a sum into zeros would turn -0.0 into +0.0)
                out[device_index(self.shape, lay, mesh, d)] = piece
        return out

    def _whole_here(self):
        """Where every process holds the whole value (no axis sharded, no partial sums, a device of
        every process in the mesh it lives on): the position among this process' devices of its
        first piece, which is the value; else None."""
        lay, mesh = self.sharding, self.sharding.home(self.mesh)
        if lay.sharded_axes() or lay.partial:
            return None
        per = mesh.root.size // mesh.nprocs  # (rank p owns devices [p * per, (p + 1) * per))
        if len({d // per for d in mesh.devices}) < mesh.nprocs:
            return None
        return next(k for k, d in enumerate(self.mesh.local_devices) if d in mesh.devices)

    def __reduce__(self):
        """Pickled small: the mesh by its constructor arguments, this process' pieces as NumPy
        (never the backend, its streams or communicators); see the class docstring."""
        # (replicas, devices holding the same block of a value with no pending sums, pickled once: a
        # replicated state was 4x its data on 4 devices; pickle keeps one object referenced four times)
        keys = list(range(len(self.shards))) if self.sharding.partial else \
            [repr(i) for i in local_indices(self.shape, self.sharding, self.mesh)]
        first: dict = {}
        for j, k in enumerate(keys):
            first.setdefault(k, j)
        held = sorted(set(first.values()))
        host = dict(zip(held, backend_of(self.mesh).to_host([self.shards[j] for j in held])))
        pieces = [host[first[k]] for k in keys]
        return _rebuild_array, (self.mesh, self.shape, self.dtype_name, self.sharding, pieces,
                                self.mesh.rank, self.mesh.nprocs, self.weak)

    def __array__(self, dtype=None, copy=None):
        out = self.gather()
        return out if dtype is None else out.astype(dtype)

    # ---- device-side access: the pieces as the backend holds them (no host copy) -------------
    @property
    def addressable_shards(self) -> list:
        """This process' pieces, as in JAX: (device, index, data) each, data a backend-native
        array (cupy.ndarray on the cupy backend, bfloat16 as its uint16 bits; numpy.ndarray on NumPy)."""
        indices = local_indices(self.shape, self.sharding, self.mesh)
        return [AddressableShard(d, idx, data)
                for d, idx, data in zip(self.mesh.local_devices, indices, self.shards) if idx is not None]

    def to_local(self):
        """This process' piece (DTensor's to_local), a backend-native array: no copy where the process
        holds one piece (or replicas of one).  Where its devices hold several pieces that tile a box
        (two tp blocks of a process under `mpiexec -n 2` on a 2x2 mesh), the box, assembled in a new
        array: what sf.from_local takes back from this process."""
        shards = self.addressable_shards
        if len(shards) == 1 or (shards and self._held_whole(shards)):  # replicas: any one is the value
            return shards[0].data
        pieces = {tuple((i.start, i.stop) for i in s.index): s.data for s in shards}  # (replicas hold the same)
        lo = [min(b[a][0] for b in pieces) for a in range(self.ndim)]
        hi = [max(b[a][1] for b in pieces) for a in range(self.ndim)]
        if self.sharding.partial or sum(math.prod(e - s for s, e in b) for b in pieces) != math.prod(
                e - s for s, e in zip(lo, hi)):
            raise ValueError(f"to_local(): this process holds {len(pieces)} different pieces of {self!r} on "
                             f"{len(shards)} devices {[s.device for s in shards]} that do not tile one box "
                             "(or pend sums); use addressable_shards")
        first = next(iter(pieces.values()))
        box = (_cupy_of(first) or np).empty(tuple(e - s for s, e in zip(lo, hi)), first.dtype)
        for b, data in pieces.items():
            box[tuple(slice(s - o, e - o) for (s, e), o in zip(b, lo))] = data
        return box

    def _held_whole(self, shards) -> bool:
        return not self.sharding.partial and all(tuple(s.data.shape) == self.shape for s in shards)

    def _whole_piece(self, what):
        """A local piece that is the whole value (replicated, or a mesh of one device)."""
        lay = self.sharding
        if lay.mesh is None and not lay.partial and self.shards[0].shape == self.shape:
            return self.shards[0]  # the hot path (a result exported every call): replicated pieces
        shards = self.addressable_shards
        if shards and self._held_whole(shards):
            return shards[0].data
        raise ValueError(f"{what}: {self!r} is not held whole by this process (it holds {len(shards)} "
                         "piece(s) of it); export .to_local() for the piece, or .full_array() for the whole value")

    def __dlpack__(self, *, stream=None, **kwargs):
        """DLPack export of the whole value (see _whole_piece).  The consumer's stream (DLPack's
        `stream`: None, 1 legacy default, 2 per-thread default, or a pointer) waits for the plan."""
        piece = self._whole_piece("__dlpack__")
        if stream is not None and stream != -1 and not (self.fenced and self.fenced.covers(stream)):  # (-1: no sync)
            backend_of(self.mesh).fence_out({1: 0}.get(stream, stream))
        if stream is not None and type(piece) is not np.ndarray:  # (NumPy's own takes stream=None only)
            # a plan's result is ordered above (its pieces are the plan's); a placed caller's array is the
            # caller's, written on CuPy's current stream: the consumer's stream waits for that one too
            kwargs["stream"] = -1 if self.fenced is not None else stream
        if self.dtype_name == "bfloat16":  # (CuPy holds its uint16 bits; NumPy's DLPack has no bfloat16)
            try:
                import torch
            except ImportError:
                raise TypeError("__dlpack__ of a bfloat16 sf.Array needs torch (neither CuPy's nor NumPy's DLPack "
                                "has bfloat16); use to_local() for the array itself") from None
            return torch.from_dlpack(piece.view(np.uint16)).view(torch.bfloat16).__dlpack__(**kwargs)
        return piece.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._whole_piece("__dlpack_device__").__dlpack_device__()

    @property
    def __cuda_array_interface__(self):
        if backend_of(self.mesh).ordinals is None:  # (the protocol: devices in host memory)
            raise AttributeError("__cuda_array_interface__: this sf.Array lives in host memory (NumPy backend)")
        if self.dtype_name == "bfloat16":
            raise AttributeError("__cuda_array_interface__ has no bfloat16 type; use __dlpack__ (torch) or to_local()")
        piece = self._whole_piece("__cuda_array_interface__")
        consumer = stream_ptr()  # the consumer reads on the current stream
        if not (self.fenced and self.fenced.covers(consumer)):
            backend_of(self.mesh).fence_out(consumer)
        return piece.__cuda_array_interface__

    def full_array(self) -> "Array":
        """The whole value replicated on every device of the mesh, gathered device-side (the
        plan's collectives: NCCL, device copies or MPI), like DTensor's full_tensor()."""
        if not self.sharding.sharded_axes() and not self.sharding.partial and self.sharding.mesh is None:
            return self
        return reshard(self, Layout.replicated(self.ndim))


def _cupy_of(x):
    """CuPy where x is a CuPy array (its box is made on the current device; assignment copies
    between GPUs), else None."""
    if isinstance(x, np.ndarray):
        return None
    import cupy

    return cupy


def check_mesh(mesh, what):
    """mesh is an sf.DeviceMesh, else a TypeError naming `what` took it."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{what}: mesh= must be an sf.DeviceMesh, got {type(mesh).__name__}")


def _same_on_every_rank(x, info, mesh, what) -> None:
    """Under mpiexec, every rank placing a global host array passes the same one, compared on a
    sample of its elements as a call compares its arguments (faults.agree; SHARDFUSE_CHECK_INPUTS):
    ranks passing their own arrays (each seeded by its rank) would each take its pieces of its own,
    a blend no rank sees (a probe: sf.distribute of each rank's own initial weights).  Only NumPy
    arrays and numbers, placed from the main thread (a prefetch thread placing batches beside the
    calls is not checked: the checks come from one thread, as calls do; CPU torch tensors too), and not at all with
    SHARDFUSE_CHECK_INPUTS=0: then no communication either."""
    host = isinstance(x, (np.ndarray, np.generic, int, float)) or getattr(info, "device", 0) is None
    if mesh.nprocs > 1 and faults.checking_inputs() and host and \
            threading.current_thread() is threading.main_thread():
        faults.agree("", what, faults.input_prints(["x"], [x], [info], host_view))


def _rebuild_array(mesh, shape, dtype, layout, pieces, rank, nprocs, weak=False):
    """An unpickled sf.Array (see Array.__reduce__): its pieces placed on the mesh again."""
    if (mesh.rank, mesh.nprocs) != (rank, nprocs):
        raise ValueError(f"this sf.Array was pickled by MPI process {rank} of {nprocs} and holds that process' "
                         f"pieces only; here is process {mesh.rank} of {mesh.nprocs}. Pickle .gather() (the global "
                         "value) or .to_local() (a process' piece) to move a value between processes")
    out = Array(mesh, shape, dtype, layout, backend_of(mesh).to_device(pieces))
    out.weak = weak  # (a step count stays weakly typed: a resumed float32 run stays float32, as JAX's)
    return out


class AddressableShard(tuple):
    """One piece this process holds, as JAX's Shard: (device, index, data)."""

    __slots__ = ()

    def __new__(cls, device, index, data):
        return super().__new__(cls, (device, index, data))

    device = property(lambda self: self[0])
    index = property(lambda self: self[1])
    data = property(lambda self: self[2])

    def __repr__(self):
        return f"AddressableShard(device={self.device}, index={self.index}, shape={tuple(self.data.shape)})"


def replicated(x, mesh) -> Array:
    """sf.replicate(x, mesh=) on a concrete array: every device of mesh holds the whole of x
    (place a weight once, then pass it to every call)."""
    return Array.from_global(x, mesh, None, what="sf.replicate")


def spec_of(arg, mesh) -> TensorSpec:
    """The TensorSpec a call argument compiles for (plain arrays: replicated, layout from the function)."""
    arg = on_root(arg, mesh)
    if isinstance(arg, Array):
        if arg.mesh != mesh:
            raise ValueError(f"argument is an sf.Array on {arg.mesh}, but the function is compiled for {mesh}")
        return arg.spec
    info = array_info(arg)
    return TensorSpec(info.shape, info.dtype, weak=type(arg) in WEAK_TYPES)


WEAK_TYPES = frozenset({bool, int, float})  # Python's scalars (not NumPy's, a subclass or not): weakly typed, as JAX's
