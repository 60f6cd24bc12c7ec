"""The one shared state of the cupy backend: which GPU runs each local device, the streams and
events of every GPU, the fences with the caller's stream, and buffers.

* Devices and GPUs.  In one process local device j runs on GPU j when there are enough GPUs,
  else on GPU `j * ngpu // L` (L local devices: contiguous blocks of *virtual devices* sharing
  a GPU, so every plan at D = 2, 4, 8 runs on one GPU).  Under mpiexec each local device needs
  a GPU of its own (local rank from COMM_TYPE_SHARED picks them): NCCL refuses two ranks on
  one GPU.
* Streams.  MAIN is this backend's own non-blocking stream per GPU (virtual devices of one GPU
  share it); worker index i is the i-th stream of that GPU's pool of `Stream(non_blocking=True)`;
  the legacy null stream is never used.  Events are one per GPU: the virtual devices of a GPU
  issue each step in turn on the same stream, so one record after the step covers all of them.
* Buffers.  Every buffer is allocated from CuPy's pool while main is the current stream, so a
  block freed after a call is only handed again to work ordered after that call's final join
  on main: a buffer still read by a worker stream is never reused early.  bfloat16 is stored as
  uint16 (CuPy has no bfloat16 arithmetic).
"""
from __future__ import annotations

import itertools
import math
import os

import numpy as np

import cupy
from cupy.cuda import runtime

from shardfuse.backends.cuda.libs import ITEM, STORE
from shardfuse.backends.protocol import MAIN, is_placeholder
from shardfuse.dtypes import np_dtype, poison_value

POISON = os.environ.get("SHARDFUSE_POISON") == "1"  # fill new buffers with NaN (tests)
ALIGN = 256  # bytes: what cudaMalloc guarantees, and what cuBLASLt's algorithms assume by default


def _ordinals(mesh, ngpu):
    """The GPU of each local device of `mesh` (see the module's docstring)."""
    L = len(mesh.local_devices)
    if mesh.nprocs > 1:
        from mpi4py import MPI

        from shardfuse import faults

        # Split_type blocks with no deadline: first check every rank is here, for the same mesh
        faults.agree(f"mesh {mesh!r} shape={mesh.shape} axes={mesh.axis_names} devices={mesh.devices}",
                     f"the CuPy backend of {mesh!r}")
        node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
        local_rank = node.Get_rank()
        node.Free()
        ordinals = [local_rank * L + j for j in range(L)]
        if ordinals[-1] >= ngpu:
            raise RuntimeError(f"cupy_nccl: under mpiexec every device needs a GPU of its own (NCCL refuses two "
                               f"ranks on one GPU): process {mesh.rank} (local rank {local_rank}) owns {L} "
                               f"device(s) and needs GPUs {ordinals}, but CuPy sees {ngpu}; run fewer "
                               "processes per node, or one process (its devices then share the GPUs)")
        return ordinals
    if L <= ngpu:
        return list(range(L))
    return [j * ngpu // L for j in range(L)]  # virtual devices: contiguous blocks share a GPU


def offsets_bytes(ref):
    item = ITEM[ref.dtype]
    return [o * item for o in ref.offsets]


def host_dtype(x):
    """A host copy of a buffer with bfloat16 (stored as uint16) viewed as ml_dtypes.bfloat16."""
    return x.view(np_dtype("bfloat16")) if x.dtype == np.uint16 else x


class Devices:
    """Local devices -> GPUs, each GPU's main and worker streams, events and fences; buffers."""

    def __init__(self, mesh):
        self.mesh = mesh
        self.local_devices = mesh.local_devices
        self.local_index = {d: j for j, d in enumerate(self.local_devices)}
        ngpu = runtime.getDeviceCount()
        if ngpu < 1:
            raise RuntimeError("cupy_nccl: CuPy sees no GPU")
        self.ordinals = _ordinals(mesh, ngpu)
        self.gpus = sorted(set(self.ordinals))  # the distinct GPUs, each with its own streams and events
        cupy.cuda.Device(self.ordinals[0]).use()  # before anything else touches CUDA
        self.main_of, self.workers_of = {}, {}
        self.fence = {}  # GPU -> (event the caller's stream records, event main records), made once
        for o in self.gpus:
            with cupy.cuda.Device(o):
                self.main_of[o] = cupy.cuda.Stream(non_blocking=True)
                self.fence[o] = (cupy.cuda.Event(disable_timing=True), cupy.cuda.Event(disable_timing=True))
            self.workers_of[o] = []
        self.main = [self.main_of[o] for o in self.ordinals]  # per local device (repeats on a shared GPU)
        # the fences' raw pointers, resolved once (they run twice per call)
        self.main_ptrs = [self.main_of[o].ptr for o in self.gpus]
        self.fence_in_ev = {o: self.fence[o][0].ptr for o in self.gpus}
        self.fence_out_pairs = [(self.fence[o][1].ptr, self.main_of[o].ptr) for o in self.gpus]
        self.one_gpu = len(self.gpus) == 1
        # (GPU, how many consecutive local devices run on it): the blocks Devices.empty packs
        self.blocks = [(o, len(list(run))) for o, run in itertools.groupby(self.ordinals)]
        self.ctx_gpu = None  # CUDA context -> GPU, to find the GPU of a caller's stream (several GPUs)
        self.events = []  # every event made, kept alive with the backend

    # ---- streams ----------------------------------------------------------------------
    def gpu_stream(self, o, stream):
        if stream == MAIN:
            return self.main_of[o]
        pool, k = self.workers_of[o], stream.index  # (a streams.Stream: worker k)
        while len(pool) <= k:
            with cupy.cuda.Device(o):
                pool.append(cupy.cuda.Stream(non_blocking=True))
        return pool[k]

    def stream(self, j, stream):
        return self.gpu_stream(self.ordinals[j], stream)

    def synchronize(self):
        for o in self.gpus:
            with cupy.cuda.Device(o):
                self.main_of[o].synchronize()
                for s in self.workers_of[o]:
                    s.synchronize()

    # ---- buffers ----------------------------------------------------------------------
    def empty(self, shape, dtype, devices=None):
        """One buffer per local device (`devices`: positions j; None: all; elsewhere a placeholder,
        one element broadcast to `shape`, never read).  The devices of one GPU get views of one
        allocation at a constant distance, a multiple of ALIGN bytes (aligned as separate
        allocations would be, so cuBLASLt's algorithms for 256-byte pointers and the gather
        kernel's 16-byte loads apply): one allocation per call instead of one per device, and
        their GEMMs can run as one strided-batched call (gemm_shared.py)."""
        store = STORE[dtype]
        if not POISON and len(self.ordinals) == 1 and (devices is None or 0 in devices):  # the per-call hot path
            with self.main[0]:
                return [cupy.empty(shape, store)]
        shape, item = tuple(shape), ITEM[dtype]
        size = int(math.prod(shape))
        step = -(-size * item // ALIGN) * ALIGN  # bytes from one device's piece to the next
        out, first = [], 0
        for o, count in self.blocks:
            mine = [j for j in range(first, first + count) if devices is None or j in devices]
            first += count
            with cupy.cuda.Device(o), self.main_of[o]:
                flat = self._flat(len(mine) * step // item, dtype, store) if mine else None
                # (an element of its own: a placeholder never aliases a device's buffer)
                spare = None if len(mine) == count else cupy.broadcast_to(self._flat(1, dtype, store).reshape(()), shape)
            for j in range(first - count, first):
                out.append(cupy.ndarray(shape, store, flat.data + mine.index(j) * step) if j in mine else spare)
        return out

    @staticmethod
    def _flat(n, dtype, store):
        """n fresh elements on the current device (poisoned with SHARDFUSE_POISON=1: bfloat16's NaN bits)."""
        if not POISON:
            return cupy.empty(n, store)
        return cupy.full(n, 0x7FC0 if dtype == "bfloat16" else poison_value(dtype), store)

    def f32_scratch(self, ref, devices=None):
        """float32 scratch of ref's shape per local device (`devices`: as empty's)."""
        return self.empty(ref.shape, "float32", devices)

    def view(self, bufs, ref, j):
        base = bufs[ref.slot][j]
        item = base.itemsize
        if is_placeholder(base):  # (its one element, not past it)
            return cupy.ndarray(ref.shape, base.dtype, base.data, strides=(0,) * len(ref.shape))
        mem = base.data + ref.offsets[j] * item
        return cupy.ndarray(ref.shape, base.dtype, mem, strides=tuple(s * item for s in ref.strides))

    def fill_random(self, x):
        """Finite random values into a buffer (graph warm-up), on main."""
        with cupy.cuda.Device(x.device.id), self.main_of[x.device.id]:
            r = cupy.random.standard_normal(x.shape, dtype=np.float32)
            if x.dtype == np.uint16:  # bfloat16: the top half of the float32 bits
                x[...] = (r.view(np.uint32) >> 16).astype(np.uint16)
            else:
                x[...] = r.astype(x.dtype)

    def per_device(self, refs, stream, body, devices=None):
        """A step that builds CuPy views of refs on each local device of `devices` (positions j;
        None: all) and runs body(j, *views) on stream."""
        js = range(len(self.ordinals)) if devices is None else devices
        streams = [(j, self.stream(j, stream)) for j in js]
        ords = self.ordinals
        view = self.view
        # equal Refs as one CuPy array: a step written in place of its operand (passes/reuse.py) passes
        # the same object twice, and CuPy copies an input that overlaps an output unless it is that
        # output (`inp is not out and may_share_bounds`: an allocation per call, refused in a capture)
        distinct = list(dict.fromkeys(refs))
        if len(distinct) == len(refs):  # (the common case: no indirection per call)
            def step(bufs):
                for j, s in streams:
                    with cupy.cuda.Device(ords[j]), s:
                        body(j, *[view(bufs, r, j) for r in refs])
            return step
        pick = [distinct.index(r) for r in refs]

        def shared_step(bufs):
            for j, s in streams:
                with cupy.cuda.Device(ords[j]), s:
                    views = [view(bufs, r, j) for r in distinct]
                    body(j, *[views[k] for k in pick])
        return shared_step

    def on(self, devices):
        """These devices as a step on local devices `devices` (positions j) sees them: per_device
        runs there only (kernels.py binds through it as through Devices); None: all, self."""
        return self if devices is None or len(devices) == len(self.ordinals) else OnDevices(self, tuple(devices))

    # ---- the caller's streams: device-side waits, never host blocks ----------------------
    def gpu_of_stream(self, ptr):
        if self.one_gpu:
            return self.gpus[0]
        if ptr in (0, 1, 2):  # the legacy or per-thread default stream: that of the current device
            o = runtime.getDevice()
        else:  # a stream belongs to its GPU's context
            from cupy_backends.cuda.api import driver

            if self.ctx_gpu is None:
                self.ctx_gpu = {driver.streamGetCtx(self.main_of[g].ptr): g for g in self.gpus}
            o = self.ctx_gpu.get(driver.streamGetCtx(ptr))
        if o not in self.main_of:
            raise ValueError(f"cupy_nccl: stream {ptr:#x} is on a GPU this process' devices do not use "
                             f"(GPUs {self.gpus})")
        return o

    def fence_in(self, stream_ptr):
        """Main of every GPU here waits, on the device, for the work queued so far on the caller's
        stream (a raw pointer): one event record there, one wait per main; no host sync."""
        o = self.gpu_of_stream(stream_ptr)
        ev = self.fence_in_ev[o]
        try:
            runtime.eventRecord(ev, stream_ptr)
        except runtime.CUDARuntimeError as e:
            raise ValueError(f"cupy_nccl: cannot record an event of GPU {o} on the caller's stream "
                             f"{stream_ptr:#x} (a stream of another GPU?): {e}") from e
        for m in self.main_ptrs:
            runtime.streamWaitEvent(m, ev, 0)

    def fence_out(self, stream_ptr):
        """The caller's stream waits, on the device, for everything queued so far on every main."""
        for ev, m in self.fence_out_pairs:
            runtime.eventRecord(ev, m)
            runtime.streamWaitEvent(stream_ptr, ev, 0)

    # ---- events: one per GPU ------------------------------------------------------------
    def new_event(self, timing=False):
        """One event per GPU (not per device): a GPU's virtual devices share its streams."""
        evs = []
        for o in self.gpus:
            with cupy.cuda.Device(o):
                evs.append(cupy.cuda.Event(disable_timing=not timing))
        self.events.append(evs)
        return evs


def record_step(dev, event, stream):
    pairs = [(e.ptr, dev.gpu_stream(o, stream).ptr) for o, e in zip(dev.gpus, event)]

    def step(bufs):
        for e, s in pairs:
            runtime.eventRecord(e, s)
    return step


def wait_event_step(dev, event, stream):
    pairs = [(dev.gpu_stream(o, stream).ptr, e.ptr) for o, e in zip(dev.gpus, event)]
    if len(pairs) == 1:
        (s0, e0), wait = pairs[0], runtime.streamWaitEvent
        return lambda bufs: wait(s0, e0, 0)

    def step(bufs):
        for s, e in pairs:
            runtime.streamWaitEvent(s, e, 0)
    return step


def join_step(dev, waiter, waitee):
    ev = dev.new_event()
    trip = [(e.ptr, dev.gpu_stream(o, waitee).ptr, dev.gpu_stream(o, waiter).ptr)
            for o, e in zip(dev.gpus, ev)]
    if len(trip) == 1:
        (e0, src0, dst0), rec, wait = trip[0], runtime.eventRecord, runtime.streamWaitEvent

        def join1(bufs):
            rec(e0, src0)
            wait(dst0, e0, 0)
        return join1

    def step(bufs):
        for e, src, dst in trip:
            runtime.eventRecord(e, src)
            runtime.streamWaitEvent(dst, e, 0)
    return step


class OnDevices:
    """A Devices whose per_device runs on some local devices only (Devices.on); all else is the
    Devices' own."""

    def __init__(self, dev, devices):
        self.dev, self.devices = dev, devices

    def __getattr__(self, name):
        return getattr(self.dev, name)

    def per_device(self, refs, stream, body):
        return self.dev.per_device(refs, stream, body, self.devices)

    def f32_scratch(self, ref):  # (a step's scratch: on its devices only, a placeholder elsewhere)
        return self.dev.f32_scratch(ref, self.devices)
