"""CuPy + NCCL + cuBLAS: the executor's steps on NVIDIA GPUs.

Same protocol as numpy_local.NumpyLocalBackend.  This class only assembles the CUDA parts of
`backends/cuda/` and exposes the protocol; each part's docstring says what is GPU-specific:

* devices.py: local device -> GPU (virtual devices share one), main and worker streams, events,
  buffers (bfloat16 stored as uint16; `to_host` returns ml_dtypes.bfloat16).  The executor's
  "main" stream is this backend's own non-blocking stream per GPU (`backend.main[j]` /
  `backend.stream(j)` for local device j).  A plan starts by recording an event on main that
  the workers wait for and ends by main waiting for every worker, so all of a call's work is
  fenced by main.  The executor fences main against the caller's stream at every call
  (`fence_in` before, `fence_out` after: device-side event waits, no host sync).
* gemm.py (and gemm_layout.py): cuBLASLt / cuBLAS GEMMs resolved at bind time, one handle and
  workspace per (GPU, stream).
* kernels.py: elementwise ops and sums (bfloat16 through float32), the sum-of-n kernel.
* boxes.py: dynamic_slice and dynamic_update_slice, a kernel reading its starts on the device.
* fused.py: the generated kernels of fused chains and of their sums (passes/fuse.py), and of
  row groups (passes/fuse_rows.py; their source: rows_source.py).
* copies.py: DMA and 2-D copies, and `piece`.
* collectives.py: copies on one GPU or NCCL across GPUs, per team; moves between meshes
  (`bind_transfers`: copies on one GPU, cudaMemcpyPeerAsync between GPUs of this process,
  ordered both ways by events; devices of another process are refused).
* graphs.py: graph mode (`sf.jit(..., graph=True)`).

The caller's arrays come in through `adopt` and `piece` (zero copy where they already are
contiguous on the right GPU).
"""
from __future__ import annotations

import os

import numpy as np

import cupy

from shardfuse.backends.cuda import boxes, collectives, copies, devices, fused, gemm, kernels
from shardfuse.backends.cuda.graphs import GraphPlan
from shardfuse.backends.elementwise_numpy import not_held
from shardfuse.interop import torch_view, array_info, to_cupy, to_numpy
from shardfuse.dtypes import np_dtype
from shardfuse.ops import Reduce

# how many cuBLASLt candidates a GEMM times at bind time; read at every bind, so it may be set
# here at run time (benchmarks/gemm_vs_torch.py does)
GEMM_TUNE = gemm.GEMM_TUNE


class CupyNcclBackend:
    name = "cupy"
    submesh_teams = True  # team may be (sub-mesh, axis name): devices outside the sub-mesh skip it

    def __init__(self, mesh):
        dev = self.dev = devices.Devices(mesh)
        self.mesh, self.local_devices = mesh, dev.local_devices
        self.ordinals, self.gpus, self.main = dev.ordinals, dev.gpus, dev.main
        self.gemms = gemm.Handles(dev)
        self.kernels = kernels.Kernels()
        # A team of one device is a copy; SHARDFUSE_COLLECTIVES=nccl makes it a one-rank NCCL
        # communicator instead, so that a machine with one GPU still runs the NCCL path.
        self.collectives = collectives.Collectives(dev, self.kernels,
                                                   os.environ.get("SHARDFUSE_COLLECTIVES") == "nccl")
        self._comms = self.collectives.comms  # the same dict (tests/test_gpu.py aborts its communicators)

    # ---- a setting of the collectives that tests/test_gpu.py sets on the backend --------------
    @property
    def one_device_nccl(self):
        return self.collectives.one_device_nccl

    @one_device_nccl.setter
    def one_device_nccl(self, value):
        self.collectives.one_device_nccl = value

    def stream(self, j=0):
        """The main stream of local device j (the one plans issue on and fence with)."""
        return self.main[j]

    # ---- buffers and host data ------------------------------------------------------------
    def empty(self, shape, dtype, devices=None):
        return self.dev.empty(shape, dtype, devices)

    def to_device(self, pieces):
        out = []
        for j, (o, p) in enumerate(zip(self.ordinals, pieces)):
            with cupy.cuda.Device(o), self.main[j]:
                if isinstance(p, cupy.ndarray):
                    out.append(cupy.ascontiguousarray(p).copy())
                    continue
                p = np.ascontiguousarray(p)
                if p.dtype == np_dtype("bfloat16"):
                    p = p.view(np.uint16)
                out.append(cupy.asarray(p))
        return out

    def to_host(self, bufs):
        out = []
        for j, b in enumerate(bufs):
            with cupy.cuda.Device(self.ordinals[j]), self.main[j]:
                out.append(devices.host_dtype(cupy.asnumpy(b, stream=self.main[j])))  # waits for main
        return out

    def ascontiguous(self, x):
        if isinstance(x, cupy.ndarray):
            if x.flags.c_contiguous:
                return x
            with cupy.cuda.Device(x.device.id), self.dev.main_of[x.device.id]:
                return cupy.ascontiguousarray(x).reshape(x.shape)  # (0-d stays 0-d: CuPy's, as NumPy's, is 1-d)
        return self.to_device([x])[0]

    def copy(self, x):
        with cupy.cuda.Device(x.device.id), self.dev.main_of[x.device.id]:
            return x.copy(order="C")

    def adopt(self, x, info=None, fenced=None):
        """A CuPy array holding the whole of the caller's array x (bfloat16 as uint16): a
        zero-copy view of a device array (main of its GPU waits for the producer's stream, as
        DLPack does, unless that is `fenced`: the caller's stream, which mains already wait
        for), or a copy of a host array on main of the first GPU."""
        info = info or array_info(x)  # given by callers that checked x already
        main_of = self.dev.main_of
        if info.device is None:
            h = np.ascontiguousarray(to_numpy(x))
            if h.dtype == np_dtype("bfloat16"):
                h = h.view(np.uint16)
            o = self.gpus[0]
            with cupy.cuda.Device(o), main_of[o]:
                return cupy.asarray(h)
        # callers have checked x with interop.check_input: it is on one of this process' GPUs
        if info.kind == "cupy":  # already a view of itself: no device or stream context to enter
            return x
        if info.kind == "torch":
            return torch_view(x, main_of[info.device].ptr, fenced)
        with cupy.cuda.Device(info.device), main_of[info.device]:
            return to_cupy(x)

    def piece(self, x, j):
        """x (a CuPy array of this process) as a C-contiguous buffer on local device j (copies.piece)."""
        return copies.piece(self.dev, self.kernels, x, j)

    def view(self, bufs, ref, j):
        return self.dev.view(bufs, ref, j)

    # ---- ordering with the caller -----------------------------------------------------------
    def fence_in(self, stream_ptr):
        """Main of every GPU here waits, on the device, for the work queued so far on the caller's
        stream (a raw pointer); no host sync."""
        self.dev.fence_in(stream_ptr)

    def fence_out(self, stream_ptr):
        """The caller's stream waits, on the device, for everything queued so far on every main."""
        self.dev.fence_out(stream_ptr)

    def synchronize(self):
        self.dev.synchronize()

    # ---- compute steps ------------------------------------------------------------------------
    # (each on the local devices `devices`, positions j, or all for None: a pipeline stage's own)
    def bind_matmul(self, a, b, out, stream, devices=None):
        return gemm.bind_matmul(self.dev, self.gemms, a, b, out, stream, GEMM_TUNE, devices)

    def bind_elementwise(self, op, a, b, out, stream, scalar=None, devices=None):
        return kernels.bind_elementwise(self.dev.on(devices), self.kernels, op, a, b, out, stream, scalar)

    def bind_fused(self, expr, ins, out, stream, devices=None):
        return fused.bind_fused(self.dev.on(devices), self.kernels, expr, ins, out, stream)

    def bind_fused_sum(self, expr, ins, axis, out, stream, scale=1.0, devices=None):
        return fused.bind_fused_sum(self.dev.on(devices), self.kernels, expr, ins, axis, out, stream, scale)

    def bind_fused_rows(self, expr, ins, out, stream, devices=None, more=(), more_outs=()):
        return fused.bind_fused_rows(self.dev.on(devices), self.kernels, expr, ins, out, stream, more, more_outs)

    def bind_sum(self, a, axis, out, stream, scale=1.0, devices=None):
        return kernels.bind_sum(self.dev.on(devices), self.kernels, a, axis, out, stream, scale)

    def bind_take(self, table, ids, rows, out, stream, vocab, devices=None):
        kern, width = self.kernels.take(), int(np.prod(table.shape[1:], dtype=np.int64))
        return self.dev.on(devices).per_device((table, ids, rows, out), stream, lambda j, t, i, r, o: kern(
            t, i, r, t.shape[0], vocab, width, not_held(t.dtype), o))

    def bind_scatter_add(self, values, ids, rows, out, stream, vocab, devices=None):
        return kernels.bind_scatter_add(self.dev.on(devices), self.kernels, values, ids, rows, out, stream, vocab)

    def bind_dynamic_slice(self, operand, starts, out, box, stream, devices=None):
        return boxes.bind_box(self.dev.on(devices), self.kernels, operand, starts, out, box, stream, update=False)

    def bind_update_slice(self, update, starts, out, box, stream, devices=None):
        return boxes.bind_box(self.dev.on(devices), self.kernels, update, starts, out, box, stream, update=True)

    def bind_copy(self, src, dst, stream, devices=None):
        return copies.bind_copy(self.dev, src, dst, stream, devices)

    # ---- streams and events: device-side waits, never host blocks -----------------------------
    def new_event(self, timing=False):
        """One event per GPU (not per device): a GPU's virtual devices share its streams."""
        return self.dev.new_event(timing)

    def event_ms(self, start, end):
        return [cupy.cuda.get_elapsed_time(a, b) for a, b in zip(start, end)]

    def bind_record(self, event, stream):
        return devices.record_step(self.dev, event, stream)

    def bind_wait_event(self, event, stream):
        return devices.wait_event_step(self.dev, event, stream)

    def bind_join(self, waiter, waitee):
        return devices.join_step(self.dev, waiter, waitee)

    # ---- communication: per team, device copies on one GPU or NCCL across GPUs ----------------
    def bind_allgather(self, send, recv, team, stream):
        return self.collectives.allgather(send, recv, team, stream)

    def bind_allreduce(self, send, recv, team, stream, op=Reduce.SUM):
        return self.collectives.allreduce(send, recv, team, stream, op)

    def bind_reduce_scatter(self, send, recv, team, stream):
        return self.collectives.reduce_scatter(send, recv, team, stream)

    def bind_alltoall(self, send, recv, team, stream):
        return self.collectives.alltoall(send, recv, team, stream)

    def bind_sendrecv(self, send, recv, team, shift, stream):
        return self.collectives.sendrecv(send, recv, team, shift, stream)

    def bind_transfers(self, pairs, stream):
        return collectives.bind_transfers(self.dev, pairs, stream)

    # ---- whole plans --------------------------------------------------------------------------
    def capture(self, plan):
        return GraphPlan(self.dev, plan)

    # ---- reports --------------------------------------------------------------------------------
    def describe(self) -> dict:
        """Name, devices, GPU and library versions (for reports and bench tables)."""
        rt = cupy.cuda.runtime
        o = self.gpus[0]
        name = rt.getDeviceProperties(o)["name"]
        out = {"backend": self.name, "devices": len(self.local_devices), "processes": self.mesh.nprocs,
               "gpus": list(self.ordinals), "gpu": name.decode() if isinstance(name, bytes) else name,
               "cupy": cupy.__version__, "cuda_runtime": rt.runtimeGetVersion(), "driver": rt.driverGetVersion()}
        try:
            from cupy.cuda import nccl

            out["nccl"] = nccl.get_version()
        except Exception:
            pass
        try:
            from cupy_backends.cuda.libs import cublas

            with cupy.cuda.Device(o):
                out["cublas"] = cublas.getVersion(cupy.cuda.device.get_cublas_handle())
        except Exception:
            pass
        return out

    def memory_stats(self) -> dict:
        """Bytes held beside the plans' buffers: the cuBLAS workspaces, one per handle."""
        return {"workspace_bytes": self.gemms.workspace_bytes, "handles": len(self.gemms.handles)}
