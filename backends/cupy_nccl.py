"""CuPy + NCCL + cuBLAS: the executor's steps on NVIDIA GPUs.

Same protocol as numpy_local.NumpyLocalBackend.  What is GPU-specific:

* Devices and GPUs.  In one process local device j runs on GPU j when there are enough GPUs,
  else on GPU `j * ngpu // L` (L local devices: contiguous blocks of *virtual devices* sharing
  a GPU, so every plan at D = 2, 4, 8 runs on one GPU).  Under mpiexec each local device needs
  a GPU of its own (local rank from COMM_TYPE_SHARED picks them): NCCL refuses two ranks on
  one GPU.
* Streams.  The executor's "main" stream is this backend's own non-blocking stream per GPU
  (`backend.main[j]` / `backend.stream(j)` for local device j; virtual devices of one GPU
  share it), and worker index i is the i-th stream of that GPU's pool of
  `Stream(non_blocking=True)`; the legacy null stream is never used.  A plan starts by
  recording an event on main that the workers wait for and ends by main waiting for every
  worker, so all of a call's work is fenced by main.  The executor fences main against the
  caller's stream at every call (`fence_in` before, `fence_out` after: device-side event
  waits, no host sync).  Events are one per GPU: the virtual devices of a GPU issue each
  step in turn on the same stream, so one record after the step covers all of them.
* Buffers.  Every buffer is allocated from CuPy's pool while main is the current stream,
  so a block freed after a call (a dropped input or output) is only handed again to work
  ordered after that call's final join on main: a buffer still read by a worker stream is
  never reused early.  bfloat16 is stored as uint16 (CuPy has no bfloat16 arithmetic);
  `to_host` returns ml_dtypes.bfloat16.  The caller's arrays come in through `adopt` and
  `piece` (zero copy where they already are contiguous on the right GPU).
* GEMMs call cuBLAS through ctypes (CuPy's own wrappers refuse graph capture): a plain GEMM
  is one cublasLtMatmul with descriptors and algorithm chosen at bind time (the fastest of up to
  SHARDFUSE_GEMM_TUNE heuristic candidates, timed on scratch operands; SHARDFUSE_GEMM=ex:
  cublasGemmEx); batched ones are cublasGemmStridedBatchedEx.  One handle and one workspace per
  (GPU, stream), so GEMMs on concurrent streams never share a workspace (virtual devices on one
  stream run in turn, so they may).  Batch dims that nest into the rows are folded into one
  GEMM, one more is a strided batch, further outer ones are looped at bind time; views cuBLAS
  cannot read are staged through scratch.  Everything but the per-call base pointers is
  resolved at bind time.  float32 runs without TF32 unless SHARDFUSE_TF32=1 (or CUPY_TF32=1).
* Collectives, per team of the mesh axis (or of a sub-mesh's axis: `submesh_teams`).  A team
  whose devices are all in this process and on one GPU runs as device copies and CuPy
  reductions on the step's stream (allgather: D copies into the first member's buffer, then
  D - 1 whole copies; reductions sum all D inputs in one kernel, in float32 for float16 /
  bfloat16 and float64 for float64, rounded once; no scratch).  A team of distinct GPUs is
  NCCL, one communicator per team (keyed by its devices, made by its members only): one
  process owning several GPUs uses NcclCommunicator.initAll and groupStart/groupEnd; under
  mpiexec the team's unique id is shared over MPI.  A team mixing both is refused at bind
  time.  On an NCCL error the team's communicators are aborted and the error names the
  failed step.  Collectives are issued on the step's stream, so their wait steps are None.
* Moves between meshes (`bind_transfers`): copies on one GPU, cudaMemcpyPeerAsync between GPUs
  of this process (ordered both ways by events); devices of another process are refused.
* Graph mode (`sf.jit(..., graph=True)`): see GraphPlan.  Graphs read the caller's own input
  buffers (no copy-in) and write the plan's own outputs: the next call overwrites them.
"""
from __future__ import annotations

import ctypes
import os
from collections import OrderedDict

import numpy as np

import cupy
from cupy.cuda import nccl, runtime

from shardfuse.interop import _torch_view, array_info, to_cupy, to_numpy
from shardfuse.trace import np_dtype

POISON = os.environ.get("SHARDFUSE_POISON") == "1"  # fill new buffers with NaN (tests)
TF32 = os.environ.get("SHARDFUSE_TF32", os.environ.get("CUPY_TF32", "0")) == "1"
WORKSPACE = int(os.environ.get("SHARDFUSE_CUBLAS_WORKSPACE", str(32 << 20)))  # bytes per handle
GEMM_API = os.environ.get("SHARDFUSE_GEMM", "lt")  # "lt": cublasLtMatmul with a bind-time algorithm; "ex": cublasGemmEx
# cuBLASLt: time the heuristic's first candidates on scratch buffers at bind time and keep the
# fastest (its first choice was seen 8% slower than PyTorch's GEMM for bf16 8192^3); 0: take the first
GEMM_TUNE = int(os.environ.get("SHARDFUSE_GEMM_TUNE", "8"))

# storage dtype on the GPU, cudaDataType, NCCL type, NaN bit pattern (for poisoning)
_STORE = {"float16": np.float16, "bfloat16": np.uint16, "float32": np.float32, "float64": np.float64}
_CUDA_T = {"float16": 2, "bfloat16": 14, "float32": 0, "float64": 1}
_NCCL_T = {"float16": 6, "bfloat16": 9, "float32": 7, "float64": 8}
_ITEM = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
_OP_N, _OP_T = 0, 1
_COMPUTE_32F, _COMPUTE_32F_TF32, _COMPUTE_64F = 68, 77, 70
_COMPUTE_SCALE = {68: 0, 77: 0, 70: 1}  # compute type -> scale (alpha/beta) cudaDataType
_GEMM_DEFAULT = -1
_D2D = 3

_BF16_PREAMBLE = r"""
__device__ inline float bf2f(unsigned short h) { return __uint_as_float(((unsigned int)h) << 16); }
__device__ inline unsigned short f2bf(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}
"""


def _find_cublas():
    """The libcublas CuPy loaded (dlopen by soname returns the loaded copy)."""
    from cupy_backends.cuda.libs import cublas as _cb  # noqa: F401  (loads libcublas)

    for name in ("libcublas.so.13", "libcublas.so.12", "libcublas.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            pass
    with open("/proc/self/maps") as f:
        for line in f:
            if "libcublas.so" in line and "Lt" not in line:
                return ctypes.CDLL(line.split()[-1])
    raise RuntimeError("cupy_nccl: cannot find the libcublas that CuPy uses")


class _Cublas:
    """The few cuBLAS entry points, through ctypes (CuPy's wrappers refuse graph capture)."""

    def __init__(self):
        lib = _find_cublas()
        P, I, LL = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
        self.create = lib.cublasCreate_v2
        self.create.argtypes = [ctypes.POINTER(P)]
        self.set_stream = lib.cublasSetStream_v2
        self.set_stream.argtypes = [P, P]
        self.set_workspace = lib.cublasSetWorkspace_v2
        self.set_workspace.argtypes = [P, P, ctypes.c_size_t]
        self.gemm = lib.cublasGemmEx
        self.gemm.argtypes = [P, I, I, I, I, I, P, P, I, I, P, I, I, P, P, I, I, I, I]
        self.gemm_batched = lib.cublasGemmStridedBatchedEx
        self.gemm_batched.argtypes = [P, I, I, I, I, I, P, P, I, I, LL, P, I, I, LL, P, P, I, I, LL, I, I, I]
        for f in (self.create, self.set_stream, self.set_workspace, self.gemm, self.gemm_batched):
            f.restype = I


class _CublasLt:
    """cuBLASLt through ctypes: descriptors and the algorithm are chosen at bind time, so a GEMM
    step at run time is one cublasLtMatmul call (less host work than cublasGemmEx)."""

    TRANSA, TRANSB = 3, 4  # cublasLtMatmulDescAttributes_t
    BATCH_COUNT, BATCH_STRIDE = 5, 6  # cublasLtMatrixLayoutAttribute_t
    PREF_MAX_WORKSPACE = 1  # cublasLtMatmulPreferenceAttributes_t

    def __init__(self):
        _find_cublas()
        lib = None
        for name in ("libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"):
            try:
                lib = ctypes.CDLL(name)
                break
            except OSError:
                pass
        if lib is None:
            raise RuntimeError("cupy_nccl: cannot load libcublasLt")
        P, I, U64, I64, SZ = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
        PP = ctypes.POINTER(P)
        sig = {
            "cublasLtCreate": [PP],
            "cublasLtMatmulDescCreate": [PP, I, I],
            "cublasLtMatmulDescSetAttribute": [P, I, P, SZ],
            "cublasLtMatrixLayoutCreate": [PP, I, U64, U64, I64],
            "cublasLtMatrixLayoutSetAttribute": [P, I, P, SZ],
            "cublasLtMatmulPreferenceCreate": [PP],
            "cublasLtMatmulPreferenceSetAttribute": [P, I, P, SZ],
            "cublasLtMatmulAlgoGetHeuristic": [P, P, P, P, P, P, P, I, P, ctypes.POINTER(I)],
            "cublasLtMatmul": [P, P, P, P, P, P, P, P, P, P, P, P, P, P, SZ, P],
        }
        for name, args in sig.items():
            f = getattr(lib, name)
            f.argtypes, f.restype = args, I
            setattr(self, name[len("cublasLt"):], f)
        self.handles = {}

    def handle(self, ordinal):
        h = self.handles.get(ordinal)
        if h is None:
            hp = ctypes.c_void_p()
            with cupy.cuda.Device(ordinal):
                _check(self.Create(ctypes.byref(hp)), "cublasLtCreate")
            h = self.handles[ordinal] = hp.value
        return h

    HEURISTIC_BYTES = 96  # sizeof(cublasLtMatmulHeuristicResult_t): algo (64), workspaceSize, state, waves, reserved
    _tuned: dict = {}  # problem -> index of the fastest candidate (the heuristic's order is deterministic)

    def plan(self, ordinal, comp, scale, ctype, opa, opb, m, n, k, lda, ldb, ldc, workspace, tune=None):
        """(desc, layouts, algo buffer) for D = op(A) op(B), or None when no algorithm fits.
        tune(desc, la, lb, lc, algos) -> index of the fastest, when given (GEMM_TUNE candidates)."""
        keep = []

        def out(f, *args):
            p = ctypes.c_void_p()
            _check(f(ctypes.byref(p), *args), f"cublasLt {f.__name__}")
            keep.append(p)
            return p.value

        def i32(v):
            x = ctypes.c_int32(v)
            keep.append(x)
            return ctypes.cast(ctypes.byref(x), ctypes.c_void_p), 4

        desc = out(self.MatmulDescCreate, comp, scale)
        _check(self.MatmulDescSetAttribute(desc, self.TRANSA, *i32(opa)), "cublasLt set transa")
        _check(self.MatmulDescSetAttribute(desc, self.TRANSB, *i32(opb)), "cublasLt set transb")
        la = out(self.MatrixLayoutCreate, ctype, *((m, k) if opa == _OP_N else (k, m)), lda)
        lb = out(self.MatrixLayoutCreate, ctype, *((k, n) if opb == _OP_N else (n, k)), ldb)
        lc = out(self.MatrixLayoutCreate, ctype, m, n, ldc)
        pref = out(self.MatmulPreferenceCreate)
        ws = ctypes.c_uint64(workspace)
        keep.append(ws)
        _check(self.MatmulPreferenceSetAttribute(pref, self.PREF_MAX_WORKSPACE, ctypes.cast(ctypes.byref(ws),
                                                 ctypes.c_void_p), 8), "cublasLt set workspace")
        want = max(1, GEMM_TUNE) if tune is not None else 1
        result = ctypes.create_string_buffer(self.HEURISTIC_BYTES * want)
        count = ctypes.c_int(0)
        st = self.MatmulAlgoGetHeuristic(self.handle(ordinal), desc, la, lb, lc, lc, pref, want, result,
                                         ctypes.byref(count))
        if st != 0 or count.value < 1:
            return None
        keep.append(result)
        base = ctypes.addressof(result)
        algos = [base + i * self.HEURISTIC_BYTES for i in range(count.value)
                 if ctypes.c_int.from_address(base + i * self.HEURISTIC_BYTES + 72).value == 0]  # state: success
        best = 0
        if tune is not None and len(algos) > 1:
            key = (ordinal, comp, ctype, opa, opb, m, n, k, lda, ldb, ldc, workspace)
            if key not in self._tuned:
                self._tuned[key] = tune(desc, la, lb, lc, algos)
            best = self._tuned[key]
        return desc, la, lb, lc, algos[best], keep


def _fastest(run, algos, sizes, item, stream_ptr, reps=3):
    """Index of the fastest cuBLASLt algorithm on scratch operands of the problem's sizes (raw
    cudaMalloc, outside CuPy's pool, freed at once; filled with a non-zero constant pattern)."""
    ptrs = [runtime.malloc(n * item) for n in sizes]
    try:
        for p, n in zip(ptrs, sizes):
            runtime.memsetAsync(p, 0x3C, n * item, stream_ptr)  # 1.06 in float16, 0.011 in bfloat16/float32
        start, stop = runtime.eventCreate(), runtime.eventCreate()
        times = []
        for algo in algos:
            if run(algo, ptrs):
                times.append(float("inf"))  # this candidate refuses the problem: never pick it
                continue
            ts = []
            for _ in range(reps):
                runtime.eventRecord(start, stream_ptr)
                run(algo, ptrs)
                runtime.eventRecord(stop, stream_ptr)
                runtime.eventSynchronize(stop)
                ts.append(runtime.eventElapsedTime(start, stop))
            times.append(sorted(ts)[reps // 2])
        runtime.eventDestroy(start)
        runtime.eventDestroy(stop)
        return times.index(min(times))
    finally:
        runtime.streamSynchronize(stream_ptr)
        for p in ptrs:
            runtime.free(p)


def _check(status, what):
    if status != 0:
        raise RuntimeError(f"cupy_nccl: {what} failed with cuBLAS status {status}")


def _operand(p, r, s0, s1):
    """(op, ld) to read a (p x r) matrix with element strides (s0, s1) as cuBLAS (column-major) wants."""
    if s0 == 1 or p == 1:
        ld = s1 if r > 1 else max(p, 1)
        if ld >= max(1, p):
            return _OP_N, ld
    if s1 == 1 or r == 1:
        ld = s0 if p > 1 else max(r, 1)
        if ld >= max(1, r):
            return _OP_T, ld
    return None


def gemm_layout(a, b, out):
    """Plan a matmul of Refs as cuBLAS calls.

    Returns (m, n, k, opA, lda, opB, ldb, ldc, swap, inner, outer) where swap says the first
    cuBLAS operand is b (row-major output), inner is (count, strideA, strideB, strideC) or
    None, and outer is a list of (offA, offB, offC) element offsets (one cuBLAS call each).
    """
    ob = tuple(out.shape[:-2])
    nb = len(ob)

    def batch(ref):
        pad = nb - (len(ref.shape) - 2)
        return [0] * pad + [0 if n == 1 else s for n, s in zip(ref.shape[:-2], ref.strides[:-2])]

    ba, bb, bo = batch(a), batch(b), batch(out)
    M, K = a.shape[-2:]
    N = out.shape[-1]
    if b.shape[-2] != K or b.shape[-1] != N or out.shape[-2] != M:
        raise ValueError(f"matmul shapes {a.shape} @ {b.shape} -> {out.shape}")
    ars, acs = a.strides[-2:]
    brs, bcs = b.strides[-2:]
    ors, ocs = out.strides[-2:]
    dims = [(n, x, y, z) for n, x, y, z in zip(ob, ba, bb, bo) if n != 1]
    # fold batch dims into the rows when b is shared and a, out nest them above their rows
    while dims:
        n, x, y, z = dims[-1]
        rs_a, rs_o = (x, z) if M == 1 else (ars, ors)
        if y == 0 and x == M * rs_a and z == M * rs_o and (acs == 1 or K == 1) and (ocs == 1 or N == 1):
            M *= n
            ars, ors = rs_a, rs_o
            dims.pop()
        else:
            break
    if ocs == 1 or N == 1:  # row-major C: compute C^T = B^T A^T, column-major (N x M), ldc = row stride
        ldc = ors if M > 1 else max(N, 1)
        if ldc < max(1, N):
            return None
        pa, pb = _operand(N, K, bcs, brs), _operand(K, M, acs, ars)
        swap, m, n = True, N, M
    elif ors == 1 or M == 1:
        ldc = ocs if N > 1 else max(M, 1)
        pa, pb = _operand(M, K, ars, acs), _operand(K, N, brs, bcs)
        swap, m, n = False, M, N
    else:
        return None
    if pa is None or pb is None:
        return None
    inner = None
    if dims:
        cnt, x, y, z = dims[-1]
        inner = (cnt, y, x, z) if swap else (cnt, x, y, z)
        dims = dims[:-1]
    outer = [(0, 0, 0)]
    for cnt, x, y, z in dims:
        outer = [(oa + t * x, obb + t * y, oc + t * z) for (oa, obb, oc) in outer for t in range(cnt)]
    return m, n, K, pa[0], pa[1], pb[0], pb[1], ldc, swap, inner, outer


class GraphPlan:
    """A plan captured as CUDA graphs, one per GPU of this process, and replayed.

    No copy-in: a graph reads the call's own input buffers, so graphs are cached per tuple of
    input pointers (every input on every local device).  The first call with a new tuple
    captures one (host work of about a plan's eager issue, nothing runs twice); at most
    MAX_GRAPHS are kept, the least recently used dropped.  Outputs, per-call buffers and
    scratch are the plan's own and shared by every graph: the next call overwrites them.
    The eager warm-up (kernel compilation, cuBLAS and NCCL set-up) runs once per plan, on the
    plan's own input buffers (`inputs`) filled with random finite values.  Nothing is
    allocated during replay.
    """

    MAX_GRAPHS = 8  # graphs kept per plan: one per set of input buffers a caller alternates between

    def __init__(self, backend, exe):
        be = self.backend = backend
        self.steps, self.n_inputs = exe.steps, len(exe.prog.inputs)
        self.static = list(exe.slot_templates)
        self.inputs = []  # the plan's own input buffers: the warm-up's, and usable as inputs too
        for k, v in enumerate(exe.prog.inputs):
            ref = exe.refs[v]
            self.static[k] = be.empty(ref.shape, ref.dtype)
            self.inputs.append(self.static[k])
        for slot, shape, dtype in exe.per_call:
            self.static[slot] = be.empty(shape, dtype)
        for bufs in self.inputs:
            for x in bufs:
                be._fill_random(x)
        for step in self.steps:
            step(self.static)
        be.synchronize()
        self._mains = [(o, be._main_of[o]) for o in be.gpus]
        self.graphs = OrderedDict()  # input pointers -> (one graph per GPU, memory they hold)
        self.captures = 0

    def __call__(self, bufs):
        n = self.n_inputs
        key = tuple(x.data.ptr for k in range(n) for x in bufs[k])
        entry = self.graphs.get(key)
        if entry is None:
            entry = self._capture(bufs, key)
        else:
            self.graphs.move_to_end(key)
        for g, (_, m) in zip(entry[0], self._mains):
            g.launch(m)
        return self.static

    def _capture(self, bufs, key):
        be = self.backend
        if len(self.graphs) >= self.MAX_GRAPHS:
            # the dropped graph may still be running: its held memory goes back to the pool only
            # after it has finished
            be.synchronize()
            self.graphs.popitem(last=False)
        table = list(self.static)
        table[:self.n_inputs] = bufs[:self.n_inputs]
        # Anything CuPy allocates while capturing comes from blocks this graph keeps for its
        # lifetime: the replayed graph keeps using them, so the pool must never hand them out.
        held = []
        pool = cupy.get_default_memory_pool()

        def keep(size):
            mem = pool.malloc(size)
            held.append(mem)
            return mem

        # thread-local capture: each GPU's main stream records its own graph, all in this thread
        mode = runtime.streamCaptureModeThreadLocal
        started = []
        with cupy.cuda.using_allocator(keep):
            try:
                for o, m in self._mains:
                    with cupy.cuda.Device(o):
                        m.begin_capture(mode)
                    started.append((o, m))
                for step in self.steps:
                    step(table)
            except BaseException:
                for o, m in started:
                    try:
                        with cupy.cuda.Device(o):
                            m.end_capture()
                    except Exception:
                        pass  # the capture is already invalid; the step's error is the one to see
                raise
            graphs = []
            for o, m in self._mains:
                with cupy.cuda.Device(o):
                    graphs.append(m.end_capture())
        for g, (o, m) in zip(graphs, self._mains):
            with cupy.cuda.Device(o):
                g.upload(m)
        self.captures += 1
        entry = self.graphs[key] = (graphs, held)
        return entry


_MAX_PITCH = 2**31 - 1


def _blocks(x):
    """(height, width, pitch) in bytes when x is `height` equal C-contiguous blocks of `width`
    bytes, `pitch` bytes apart, else None."""
    width, k = x.itemsize, x.ndim
    while k > 0 and (x.shape[k - 1] == 1 or x.strides[k - 1] == width):  # the contiguous inner axes
        width *= x.shape[k - 1]
        k -= 1
    outer = [(n, st) for n, st in zip(x.shape[:k], x.strides[:k]) if n != 1]
    # memcpy2D takes pitches up to the device's memPitch (2^31 - 1 bytes on current GPUs)
    if len(outer) != 1 or not width <= outer[0][1] < _MAX_PITCH:
        return None
    return outer[0][0], width, outer[0][1]


class CupyNcclBackend:
    name = "cupy"

    def __init__(self, mesh):
        self.mesh = mesh
        self.local_devices = mesh.local_devices
        self.local_index = {d: j for j, d in enumerate(self.local_devices)}
        L = len(self.local_devices)
        ngpu = runtime.getDeviceCount()
        if ngpu < 1:
            raise RuntimeError("cupy_nccl: CuPy sees no GPU")
        if mesh.nprocs > 1:
            from mpi4py import MPI

            from shardfuse import faults

            # Split_type blocks with no deadline: first check every rank is here, for the same mesh
            faults.agree(f"mesh {mesh!r} shape={mesh.shape} axes={mesh.axis_names} devices={mesh.devices}",
                         f"the CuPy backend of {mesh!r}")
            node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
            local_rank = node.Get_rank()
            node.Free()
            self.ordinals = [local_rank * L + j for j in range(L)]
            if self.ordinals[-1] >= ngpu:
                raise RuntimeError(f"cupy_nccl: under mpiexec every device needs a GPU of its own (NCCL refuses two "
                                   f"ranks on one GPU): process {mesh.rank} (local rank {local_rank}) owns {L} "
                                   f"device(s) and needs GPUs {self.ordinals}, but CuPy sees {ngpu}; run fewer "
                                   "processes per node, or one process (its devices then share the GPUs)")
        elif L <= ngpu:
            self.ordinals = list(range(L))
        else:  # virtual devices: contiguous blocks of local devices share a GPU
            self.ordinals = [j * ngpu // L for j in range(L)]
        self.gpus = sorted(set(self.ordinals))  # the distinct GPUs, each with its own streams and events
        cupy.cuda.Device(self.ordinals[0]).use()  # before anything else touches CUDA
        self._main_of, self._workers_of = {}, {}
        self._fence = {}  # GPU -> (event the caller's stream records, event main records), made once
        for o in self.gpus:
            with cupy.cuda.Device(o):
                self._main_of[o] = cupy.cuda.Stream(non_blocking=True)
                self._fence[o] = (cupy.cuda.Event(disable_timing=True), cupy.cuda.Event(disable_timing=True))
            self._workers_of[o] = []
        self.main = [self._main_of[o] for o in self.ordinals]  # per local device (repeats on a shared GPU)
        # the fences' raw pointers, resolved once (they run twice per call)
        self._main_ptrs = [self._main_of[o].ptr for o in self.gpus]
        self._fence_in_ev = {o: self._fence[o][0].ptr for o in self.gpus}
        self._fence_out = [(self._fence[o][1].ptr, self._main_of[o].ptr) for o in self.gpus]
        self._one_gpu = len(self.gpus) == 1
        self._ctx_gpu = None  # CUDA context -> GPU, to find the GPU of a caller's stream (several GPUs)
        self._handles = {}  # (GPU, stream key) -> cuBLAS handle
        self._ws_ptr = {}  # (GPU, stream key) -> that handle's workspace (cuBLASLt calls use it too)
        self._lt = None
        self.gemm_api = GEMM_API
        self._workspaces = []
        self._comms = {}  # team (tuple of devices) -> {local device j: communicator}
        # A team of one device is a copy; SHARDFUSE_COLLECTIVES=nccl makes it a one-rank NCCL
        # communicator instead, so that a machine with one GPU still runs the NCCL path.
        self.one_device_nccl = os.environ.get("SHARDFUSE_COLLECTIVES") == "nccl"
        self._cublas = None
        self._kernels = {}
        self._events = []
        self.workspace_bytes = 0

    # ---- streams ----------------------------------------------------------------------
    def _gpu_stream(self, o, stream):
        if stream == "main":
            return self._main_of[o]
        pool = self._workers_of[o]
        while len(pool) <= stream:
            with cupy.cuda.Device(o):
                pool.append(cupy.cuda.Stream(non_blocking=True))
        return pool[stream]

    def _stream(self, j, stream):
        return self._gpu_stream(self.ordinals[j], stream)

    def stream(self, j=0):
        """The main stream of local device j (the one plans issue on and fence with)."""
        return self.main[j]

    def _handle(self, j, stream):
        o = self.ordinals[j]
        key = (o, stream)
        h = self._handles.get(key)
        if h is None:
            if self._cublas is None:
                self._cublas = _Cublas()
            cb = self._cublas
            with cupy.cuda.Device(o):
                hp = ctypes.c_void_p()
                _check(cb.create(ctypes.byref(hp)), "cublasCreate")
                _check(cb.set_stream(hp, ctypes.c_void_p(self._gpu_stream(o, stream).ptr)), "cublasSetStream")
                ws = cupy.empty(WORKSPACE, np.uint8)
                self._workspaces.append(ws)
                self.workspace_bytes += WORKSPACE
                _check(cb.set_workspace(hp, ctypes.c_void_p(ws.data.ptr), WORKSPACE), "cublasSetWorkspace")
            self._ws_ptr[key] = ws.data.ptr
            h = self._handles[key] = hp.value
        return h

    # ---- buffers ----------------------------------------------------------------------
    def empty(self, shape, dtype):
        if not POISON and len(self.ordinals) == 1:  # the per-call hot path
            with self.main[0]:
                return [cupy.empty(shape, _STORE[dtype])]
        out = []
        for j, o in enumerate(self.ordinals):
            with cupy.cuda.Device(o), self.main[j]:
                if POISON:
                    if dtype == "bfloat16":
                        out.append(cupy.full(shape, 0x7FC0, np.uint16))
                    else:
                        out.append(cupy.full(shape, np.nan, _STORE[dtype]))
                else:
                    out.append(cupy.empty(shape, _STORE[dtype]))
        return out

    def host(self, x):
        if isinstance(x, cupy.ndarray):
            return self._host_dtype(cupy.asnumpy(x))
        return np.asarray(x)

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
                out.append(self._host_dtype(cupy.asnumpy(b, stream=self.main[j])))  # waits for main
        return out

    @staticmethod
    def _host_dtype(x):
        return x.view(np_dtype("bfloat16")) if x.dtype == np.uint16 else x

    def ascontiguous(self, x):
        if isinstance(x, cupy.ndarray):
            if x.flags.c_contiguous:
                return x
            with cupy.cuda.Device(x.device.id), self._main_of[x.device.id]:
                return cupy.ascontiguousarray(x)
        return self.to_device([x])[0]

    def view(self, bufs, ref, j):
        base = bufs[ref.slot][j]
        item = base.itemsize
        mem = base.data + ref.offsets[j] * item
        return cupy.ndarray(ref.shape, base.dtype, mem, strides=tuple(s * item for s in ref.strides))

    def _fill_random(self, x):
        """Finite random values into a buffer (graph warm-up), on main."""
        with cupy.cuda.Device(x.device.id), self._main_of[x.device.id]:
            r = cupy.random.standard_normal(x.shape, dtype=np.float32)
            if x.dtype == np.uint16:  # bfloat16: the top half of the float32 bits
                x[...] = (r.view(np.uint32) >> 16).astype(np.uint16)
            else:
                x[...] = r.astype(x.dtype)

    # ---- the caller's arrays and streams ------------------------------------------------
    def adopt(self, x, info=None, fenced=None):
        """A CuPy array holding the whole of the caller's array x (bfloat16 as uint16): a
        zero-copy view of a device array (main of its GPU waits for the producer's stream, as
        DLPack does, unless that is `fenced`: the caller's stream, which mains already wait
        for), or a copy of a host array on main of the first GPU."""
        info = info or array_info(x)  # given by callers that checked x already
        if info.device is None:
            h = np.ascontiguousarray(to_numpy(x))
            if h.dtype == np_dtype("bfloat16"):
                h = h.view(np.uint16)
            o = self.gpus[0]
            with cupy.cuda.Device(o), self._main_of[o]:
                return cupy.asarray(h)
        # callers have checked x with interop.check_input: it is on one of this process' GPUs
        if info.kind == "cupy":  # already a view of itself: no device or stream context to enter
            return x
        if info.kind == "torch":
            return _torch_view(x, self._main_of[info.device].ptr, fenced)
        with cupy.cuda.Device(info.device), self._main_of[info.device]:
            return to_cupy(x)

    def piece(self, x, j):
        """x (a CuPy array of this process, e.g. a slice of adopt's result) as a C-contiguous
        buffer on local device j: x itself when it already is one there (zero copy), else a
        device-side copy on main of j's GPU (a peer copy from another GPU)."""
        o, src = self.ordinals[j], x.device.id
        if src == o:
            if x.flags.c_contiguous:
                return x
            main = self._main_of[o]
            with cupy.cuda.Device(o), main:
                rows = _blocks(x)
                if rows is None:
                    return cupy.ascontiguousarray(x)
                # equal contiguous blocks a pitch apart (a device's piece of the seed layout
                # [S, D, M/(S*D), K]: S blocks): one 2-D copy on the copy engine, not a kernel
                height, width, pitch = rows
                out = cupy.empty(x.shape, x.dtype)
                runtime.memcpy2DAsync(out.data.ptr, width, x.data.ptr, pitch, width, height,
                                      runtime.memcpyDeviceToDevice, main.ptr)
                return out
        if src not in self._main_of:
            raise ValueError(f"cupy_nccl: a piece on GPU {src}, this process' devices are on GPUs {self.gpus}")
        src_main, dst_main = self._main_of[src], self._main_of[o]
        with cupy.cuda.Device(src), src_main:
            c = cupy.ascontiguousarray(x)
        with cupy.cuda.Device(o), dst_main:
            out = cupy.empty(x.shape, x.dtype)
        ready, done = self._fence[src][1], self._fence[o][1]
        runtime.eventRecord(ready.ptr, src_main.ptr)  # the copy reads what main of the source wrote
        runtime.streamWaitEvent(dst_main.ptr, ready.ptr, 0)
        runtime.memcpyPeerAsync(out.data.ptr, o, c.data.ptr, src, c.nbytes, dst_main.ptr)
        # c may be a temporary that goes back to the source GPU's pool on return: main there
        # must not reuse it before the copy has read it
        runtime.eventRecord(done.ptr, dst_main.ptr)
        runtime.streamWaitEvent(src_main.ptr, done.ptr, 0)
        return out

    def _gpu_of_stream(self, ptr):
        if self._one_gpu:
            return self.gpus[0]
        if ptr in (0, 1, 2):  # the legacy or per-thread default stream: that of the current device
            o = runtime.getDevice()
        else:  # a stream belongs to its GPU's context
            from cupy_backends.cuda.api import driver

            if self._ctx_gpu is None:
                self._ctx_gpu = {driver.streamGetCtx(self._main_of[g].ptr): g for g in self.gpus}
            o = self._ctx_gpu.get(driver.streamGetCtx(ptr))
        if o not in self._main_of:
            raise ValueError(f"cupy_nccl: stream {ptr:#x} is on a GPU this process' devices do not use "
                             f"(GPUs {self.gpus})")
        return o

    def fence_in(self, stream_ptr):
        """Main of every GPU here waits, on the device, for the work queued so far on the caller's
        stream (a raw pointer): one event record there, one wait per main; no host sync."""
        o = self._gpu_of_stream(stream_ptr)
        ev = self._fence_in_ev[o]
        try:
            runtime.eventRecord(ev, stream_ptr)
        except runtime.CUDARuntimeError as e:
            raise ValueError(f"cupy_nccl: cannot record an event of GPU {o} on the caller's stream "
                             f"{stream_ptr:#x} (a stream of another GPU?): {e}") from e
        for m in self._main_ptrs:
            runtime.streamWaitEvent(m, ev, 0)

    def fence_out(self, stream_ptr):
        """The caller's stream waits, on the device, for everything queued so far on every main."""
        for ev, m in self._fence_out:
            runtime.eventRecord(ev, m)
            runtime.streamWaitEvent(stream_ptr, ev, 0)

    # ---- pointer helpers --------------------------------------------------------------
    @staticmethod
    def _offsets_bytes(ref):
        item = _ITEM[ref.dtype]
        return [o * item for o in ref.offsets]

    # ---- compute ----------------------------------------------------------------------
    def bind_matmul(self, a, b, out, stream):
        lay = gemm_layout(a, b, out)
        pre, post = [], []
        if lay is None:  # stage operands cuBLAS cannot read in place through contiguous scratch
            from shardfuse.backends.protocol import contiguous_strides

            def staged(ref):
                buf = self.empty(ref.shape, ref.dtype)
                return ref.__class__(-1, (0,) * len(self.ordinals), ref.shape, contiguous_strides(ref.shape),
                                     ref.dtype), buf

            x, y, o = a, b, out
            if gemm_layout(a, b, out) is None:
                x, xa = staged(a)
                pre.append((a, xa))
                y, yb = staged(b)
                pre.append((b, yb))
                if gemm_layout(x, y, out) is None:
                    o, ob = staged(out)
                    post.append((out, ob))
            lay = gemm_layout(x, y, o)
            if lay is None:
                raise NotImplementedError(f"cupy_nccl: matmul {a.shape} @ {b.shape} -> {out.shape}: no cuBLAS layout")
            gemm = self._bind_gemm(x, y, o, stream, lay, {id(x): pre and pre[0][1], id(y): pre and pre[1][1],
                                                         id(o): post and post[0][1]})
            copies_in = [self._stage_copy(src, buf, stream, True) for src, buf in pre]
            copies_out = [self._stage_copy(dst, buf, stream, False) for dst, buf in post]

            def step(bufs):
                for c in copies_in:
                    c(bufs)
                gemm(bufs)
                for c in copies_out:
                    c(bufs)
            return step
        return self._bind_gemm(a, b, out, stream, lay, {})

    def _stage_copy(self, ref, buf, stream, into):
        streams = [self._stream(j, stream) for j in range(len(self.ordinals))]

        def step(bufs):
            for j, s in enumerate(streams):
                with cupy.cuda.Device(self.ordinals[j]), s:
                    v = self.view(bufs, ref, j)
                    if into:
                        buf[j][...] = v
                    else:
                        v[...] = buf[j]
        return step

    def _bind_gemm(self, a, b, out, stream, lay, fixed):
        m, n, k, opa, lda, opb, ldb, ldc, swap, inner, outer = lay
        dt = out.dtype
        if not (a.dtype == b.dtype == dt):
            raise TypeError(f"cupy_nccl: matmul dtypes {a.dtype} @ {b.dtype} -> {dt}")
        ctype = _CUDA_T[dt]
        if dt == "float64":
            comp, one, zero = _COMPUTE_64F, ctypes.c_double(1.0), ctypes.c_double(0.0)
        else:
            comp = _COMPUTE_32F_TF32 if (dt == "float32" and TF32) else _COMPUTE_32F
            one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        alpha, beta = ctypes.addressof(one), ctypes.addressof(zero)
        item = _ITEM[dt]
        first, second = (b, a) if swap else (a, b)
        if swap:
            outer = [(ob * item, oa * item, oc * item) for (oa, ob, oc) in outer]
        else:
            outer = [(oa * item, ob * item, oc * item) for (oa, ob, oc) in outer]
        if self._cublas is None:
            self._cublas = _Cublas()
        cb = self._cublas
        nd = len(self.ordinals)
        handles = [self._handle(j, stream) for j in range(nd)]
        ords = self.ordinals
        multi = not self._one_gpu  # devices on several GPUs: each call needs its device current
        keep = (one, zero)  # alpha/beta must outlive the step

        def source(ref):  # (slot, byte offsets) or (None, fixed pointers) of a staged operand
            buf = fixed.get(id(ref))
            if buf:
                return None, [x.data.ptr for x in buf]
            return ref.slot, self._offsets_bytes(ref)

        (s1, o1), (s2, o2), (so, oo) = source(first), source(second), source(out)
        if s1 is None or s2 is None or so is None:
            def ptrs(bufs, j):
                return ((o1[j] if s1 is None else bufs[s1][j].data.ptr + o1[j]),
                        (o2[j] if s2 is None else bufs[s2][j].data.ptr + o2[j]),
                        (oo[j] if so is None else bufs[so][j].data.ptr + oo[j]))
        else:
            def ptrs(bufs, j):
                return bufs[s1][j].data.ptr + o1[j], bufs[s2][j].data.ptr + o2[j], bufs[so][j].data.ptr + oo[j]

        if inner is None and self.gemm_api == "lt" and not multi and len(outer) == 1 and None not in (s1, s2, so):
            if self._lt is None:
                self._lt = _CublasLt()
            lt = self._lt
            lh, ws, sp = lt.handle(ords[0]), self._ws_ptr[(ords[0], stream)], self._stream(0, stream).ptr
            sizes = (lda * (k if opa == _OP_N else m), ldb * (n if opb == _OP_N else k), ldc * n)

            def tune(desc, la, lb, lc, algos):
                return _fastest(lambda algo, p: lt.Matmul(lh, desc, alpha, p[0], la, p[1], lb, beta, p[2], lc, p[2], lc,
                                                           algo, ws, WORKSPACE, sp), algos, sizes, item, sp)

            plan = lt.plan(ords[0], comp, _COMPUTE_SCALE[comp], ctype, opa, opb, m, n, k, lda, ldb, ldc, WORKSPACE,
                           tune=tune if GEMM_TUNE > 1 else None)
            if plan is not None:
                desc, la, lb, lc, algo, lt_keep = plan
                mm = lt.Matmul
                d1, d2, d3 = outer[0]
                if nd == 1:  # the hot path, kept short: one device, one GEMM
                    o1_, o2_, oo_ = o1[0] + d1, o2[0] + d2, oo[0] + d3

                    def step(bufs, _keep=(keep, lt_keep)):
                        pc = bufs[so][0].data.ptr + oo_
                        st = mm(lh, desc, alpha, bufs[s1][0].data.ptr + o1_, la, bufs[s2][0].data.ptr + o2_, lb,
                                beta, pc, lc, pc, lc, algo, ws, WORKSPACE, sp)
                        if st:
                            _check(st, f"cublasLtMatmul (m={m} n={n} k={k} {dt})")
                    return step
                # virtual devices of one GPU: the same GEMM for each, in turn on the same stream
                # (so they may share the workspace)
                offs = [(o1[j] + d1, o2[j] + d2, oo[j] + d3) for j in range(nd)]

                def step(bufs, _keep=(keep, lt_keep)):
                    A, B, C = bufs[s1], bufs[s2], bufs[so]
                    for j, (x1, x2, x3) in enumerate(offs):
                        pc = C[j].data.ptr + x3
                        st = mm(lh, desc, alpha, A[j].data.ptr + x1, la, B[j].data.ptr + x2, lb,
                                beta, pc, lc, pc, lc, algo, ws, WORKSPACE, sp)
                        if st:
                            _check(st, f"cublasLtMatmul (m={m} n={n} k={k} {dt}, device {j})")
                return step
        if inner is None:
            fn = cb.gemm
            if nd == 1 and len(outer) == 1 and s1 is not None and s2 is not None and so is not None:
                # the common case, kept short: one device, one GEMM
                h0, (d1, d2, d3) = handles[0], outer[0]
                o1_, o2_, oo_ = o1[0] + d1, o2[0] + d2, oo[0] + d3

                def step(bufs, _keep=keep):
                    st = fn(h0, opa, opb, m, n, k, alpha, bufs[s1][0].data.ptr + o1_, ctype, lda,
                            bufs[s2][0].data.ptr + o2_, ctype, ldb, beta, bufs[so][0].data.ptr + oo_, ctype, ldc,
                            comp, _GEMM_DEFAULT)
                    if st:
                        _check(st, f"cublasGemmEx (m={m} n={n} k={k} {dt})")
                return step

            def step(bufs, _keep=keep):
                for j, h in enumerate(handles):
                    if multi:
                        runtime.setDevice(ords[j])
                    p1, p2, p3 = ptrs(bufs, j)
                    for d1, d2, d3 in outer:
                        st = fn(h, opa, opb, m, n, k, alpha, p1 + d1, ctype, lda, p2 + d2, ctype, ldb,
                                beta, p3 + d3, ctype, ldc, comp, _GEMM_DEFAULT)
                        if st:
                            _check(st, f"cublasGemmEx (m={m} n={n} k={k} {dt})")
            return step

        cnt, sa, sb, sc = inner
        fn = cb.gemm_batched

        def step(bufs, _keep=keep):
            for j, h in enumerate(handles):
                if multi:
                    runtime.setDevice(ords[j])
                p1, p2, p3 = ptrs(bufs, j)
                for d1, d2, d3 in outer:
                    st = fn(h, opa, opb, m, n, k, alpha, p1 + d1, ctype, lda, sa, p2 + d2, ctype, ldb, sb,
                            beta, p3 + d3, ctype, ldc, sc, cnt, comp, _GEMM_DEFAULT)
                    if st:
                        _check(st, f"cublasGemmStridedBatchedEx (m={m} n={n} k={k} batch={cnt} {dt})")
        return step

    def _kernel(self, op):
        kern = self._kernels.get(op)
        if kern is None:
            if op == "sum":
                kern = cupy.ReductionKernel("uint16 x", "uint16 y", "bf2f(x)", "a + b", "y = f2bf(a)", "0",
                                            "sf_bf16_sum", reduce_type="float", preamble=_BF16_PREAMBLE)
            elif op == "to_f32":
                kern = cupy.ElementwiseKernel("uint16 x", "float32 y", "y = bf2f(x)", "sf_bf16_to_f32",
                                              preamble=_BF16_PREAMBLE)
            else:
                kern = cupy.ElementwiseKernel("float32 y", "uint16 x", "x = f2bf(y)", "sf_f32_to_bf16",
                                              preamble=_BF16_PREAMBLE)
            self._kernels[op] = kern
        return kern

    def _per_device(self, refs, stream, body):
        """A step that builds CuPy views of refs on each device and runs body(j, *views) on stream."""
        streams = [self._stream(j, stream) for j in range(len(self.ordinals))]
        ords = self.ordinals
        view = self.view

        def step(bufs):
            for j, s in enumerate(streams):
                with cupy.cuda.Device(ords[j]), s:
                    body(j, *[view(bufs, r, j) for r in refs])
        return step

    def _f32_scratch(self, ref):
        out = []
        for o in self.ordinals:
            with cupy.cuda.Device(o):
                out.append(cupy.empty(ref.shape, np.float32))
        return out

    def bind_elementwise(self, op, a, b, out, stream, scalar=None):
        from shardfuse.backends.numpy_local import ELEMENTWISE

        fn = ELEMENTWISE[op]
        refs = (a, out) if b is None else (a, b, out)
        if out.dtype != "bfloat16":
            if b is None:
                return self._per_device(refs, stream, lambda j, x, o: fn(cupy, x, scalar, o))
            return self._per_device(refs, stream, lambda j, x, y, o: fn(cupy, x, y, o))
        # bfloat16: in float32 scratch made now (no allocation when the step runs), rounded back
        to32, to16 = self._kernel("to_f32"), self._kernel("to_bf16")
        ta, to = self._f32_scratch(a), self._f32_scratch(out)
        if b is None:
            def body(j, x, o):
                to32(x, ta[j])
                fn(cupy, ta[j], scalar, to[j])
                to16(to[j], o)
        else:
            tb = self._f32_scratch(b)

            def body(j, x, y, o):
                to32(x, ta[j])
                to32(y, tb[j])
                fn(cupy, ta[j], tb[j], to[j])
                to16(to[j], o)
        return self._per_device(refs, stream, body)

    def bind_sum(self, a, axis, out, stream):
        if out.dtype == "bfloat16":
            kern = self._kernel("sum")
            return self._per_device((a, out), stream, lambda j, x, o: kern(x, o, axis=axis))
        return self._per_device((a, out), stream, lambda j, x, o: cupy.sum(x, axis=axis, out=o))

    @staticmethod
    def _dma_copy(src, dst):
        """copy(dst_ptr, src_ptr, stream_ptr) for Refs of one shape that a DMA copy can move: both
        one block, or both rows of contiguous elements at fixed pitches (a 2-D copy); else None."""
        item = _ITEM[src.dtype]
        if src.is_contiguous() and dst.is_contiguous():
            nbytes = src.size * item
            return lambda d, s, st: runtime.memcpyAsync(d, s, nbytes, _D2D, st)
        rows = _as_rows(src), _as_rows(dst)
        if None not in rows and rows[0][:2] == rows[1][:2]:
            (h, w, sp), (_, _, dp) = rows
            return lambda d, s, st: runtime.memcpy2DAsync(d, dp * item, s, sp * item, w * item, h, _D2D, st)
        return None

    def bind_copy(self, src, dst, stream):
        if src.shape != dst.shape:
            raise ValueError(f"copy {src.shape} -> {dst.shape}")
        copy = self._dma_copy(src, dst)
        if copy is None:
            def body(j, x, o):
                o[...] = x
            return self._per_device((src, dst), stream, body)
        streams = [self._stream(j, stream).ptr for j in range(len(self.ordinals))]
        so, do = self._offsets_bytes(src), self._offsets_bytes(dst)
        ss, ds = src.slot, dst.slot

        def step(bufs):
            S, D = bufs[ss], bufs[ds]
            for j, sp in enumerate(streams):
                copy(D[j].data.ptr + do[j], S[j].data.ptr + so[j], sp)
        return step

    # ---- streams and events: device-side waits, never host blocks -------------------------
    def new_event(self):
        """One event per GPU (not per device): a GPU's virtual devices share its streams."""
        evs = []
        for o in self.gpus:
            with cupy.cuda.Device(o):
                evs.append(cupy.cuda.Event(disable_timing=True))
        self._events.append(evs)
        return evs

    def bind_record(self, event, stream):
        pairs = [(e.ptr, self._gpu_stream(o, stream).ptr) for o, e in zip(self.gpus, event)]

        def step(bufs):
            for e, s in pairs:
                runtime.eventRecord(e, s)
        return step

    def bind_wait_event(self, event, stream):
        pairs = [(self._gpu_stream(o, stream).ptr, e.ptr) for o, e in zip(self.gpus, event)]
        if len(pairs) == 1:
            (s0, e0), wait = pairs[0], runtime.streamWaitEvent
            return lambda bufs: wait(s0, e0, 0)

        def step(bufs):
            for s, e in pairs:
                runtime.streamWaitEvent(s, e, 0)
        return step

    def bind_join(self, waiter, waitee):
        ev = self.new_event()
        trip = [(e.ptr, self._gpu_stream(o, waitee).ptr, self._gpu_stream(o, waiter).ptr)
                for o, e in zip(self.gpus, ev)]
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

    def synchronize(self):
        for o in self.gpus:
            with cupy.cuda.Device(o):
                self._main_of[o].synchronize()
                for s in self._workers_of[o]:
                    s.synchronize()

    def capture(self, exe):
        return GraphPlan(self, exe)

    # ---- collectives: per team, device copies on one GPU or NCCL across GPUs ----------------
    submesh_teams = True  # team may be (sub-mesh, axis name): devices outside the sub-mesh skip it

    def _team_axis(self, team):
        return team if isinstance(team, tuple) else (self.mesh, team)

    def _team_size(self, team):
        mesh, name = self._team_axis(team)
        return mesh.axis_size(name)

    def _describe(self, team):
        mesh, name = self._team_axis(team)
        return repr(name) if mesh is self.mesh else f"{name!r} of {mesh}"

    def _team_kind(self, g, team):
        """'copy' for a team all in this process and on one GPU, 'nccl' for one of distinct GPUs."""
        if len(g) == 1:
            return "nccl" if self.one_device_nccl else "copy"
        if not all(d in self.local_index for d in g):
            return "nccl"  # spans processes, whose devices all have GPUs of their own
        gpus = [self.ordinals[self.local_index[d]] for d in g]
        if len(set(gpus)) == 1:
            return "copy"
        if len(set(gpus)) == len(g):
            return "nccl"
        raise NotImplementedError(f"cupy_nccl: team {g} of mesh axis {self._describe(team)} has devices on GPUs "
                                  f"{gpus}: some share a GPU and some do not, and a team runs either as copies on "
                                  "one GPU or as NCCL across distinct GPUs; use a mesh (or device count) whose "
                                  "teams are all on one GPU or all on different GPUs")

    def _make_comms(self, groups):
        """NCCL communicators of teams `groups` (the same list on every process): {j: comm} each."""
        made = {}
        try:
            if self.mesh.nprocs == 1:
                for g in groups:
                    js = [self.local_index[d] for d in g]
                    made[g] = dict(zip(js, nccl.NcclCommunicator.initAll([self.ordinals[j] for j in js])))
            else:
                from mpi4py import MPI

                from shardfuse import faults

                uids = {g: nccl.get_unique_id() for g in groups if g[0] in self.local_index}
                merged = {}
                # every process, members or not; with SHARDFUSE_TIMEOUT (NCCL's own init has none)
                for part in faults.allgather_object(MPI.COMM_WORLD, uids, f"sharing the NCCL ids of teams {groups}"):
                    merged.update(part)
                nccl.groupStart()
                try:
                    for g in groups:
                        made[g] = {}
                        for rank, d in enumerate(g):
                            if d in self.local_index:
                                j = self.local_index[d]
                                with cupy.cuda.Device(self.ordinals[j]):
                                    made[g][j] = nccl.NcclCommunicator(len(g), merged[g], rank)
                finally:
                    nccl.groupEnd()
        except Exception as e:
            for cs in made.values():
                for c in cs.values():
                    c.abort()
            raise RuntimeError(f"cupy_nccl: creating the NCCL communicators of teams {groups} failed: {e}") from e
        self._comms.update(made)

    def _collective(self, kind, send, recv, team, stream, call, copy):
        """A collective over every team of `team` that has a device here.  Teams on one GPU:
        copy(S, R, stream) with S, R the members' (buffer, byte offset) of send and recv in rank
        order, issued with that GPU and stream current.  Teams of distinct GPUs: one NCCL call
        per local member, call(comm, sendptr, recvptr, streamptr), grouped when there are several."""
        if not (send.is_contiguous() and recv.is_contiguous()):
            raise ValueError(f"cupy_nccl: {kind} needs contiguous send and recv buffers, got send {send.shape} "
                             f"strides {send.strides}, recv {recv.shape} strides {recv.strides}")
        mesh, name = self._team_axis(team)
        groups = [tuple(g) for g in mesh.teams(name)]
        kinds = {g: self._team_kind(g, team) for g in groups}
        copies = [([self.local_index[d] for d in g], self.ordinals[self.local_index[g[0]]]) for g in groups
                  if kinds[g] == "copy" and g[0] in self.local_index]
        copies = [(t, o, self._gpu_stream(o, stream)) for t, o in copies]
        nccl_groups = [g for g in groups if kinds[g] == "nccl"]
        missing = [g for g in nccl_groups if g not in self._comms]
        if missing:
            self._make_comms(missing)
        comms = [(j, c) for g in nccl_groups for j, c in self._comms[g].items()]
        so, ro = self._offsets_bytes(send), self._offsets_bytes(recv)
        ss, rs = send.slot, recv.slot

        def run_copies(bufs):
            S, R = bufs[ss], bufs[rs]
            for t, o, st in copies:
                with cupy.cuda.Device(o), st:
                    copy([(S[j], so[j]) for j in t], [(R[j], ro[j]) for j in t], st)

        if not comms:
            return (run_copies if copies else None), None

        def fail(e):
            for g in nccl_groups:
                for c in self._comms.pop(g, {}).values():
                    try:
                        c.abort()
                    except Exception:
                        pass
            raise RuntimeError(f"cupy_nccl: NCCL {kind} on team {self._describe(team)} ({send.shape} -> {recv.shape}, "
                               f"{send.dtype}) failed; communicators aborted: {e}") from e

        streams = [self._stream(j, stream).ptr for j, _ in comms]
        if len(comms) == 1:
            (j0, c0), st0 = comms[0], streams[0]

            def run_nccl(bufs):
                try:
                    call(c0, bufs[ss][j0].data.ptr + so[j0], bufs[rs][j0].data.ptr + ro[j0], st0)
                except Exception as e:
                    fail(e)
        else:
            def run_nccl(bufs):
                S, R = bufs[ss], bufs[rs]
                try:
                    nccl.groupStart()
                    try:
                        for (j, c), st in zip(comms, streams):
                            call(c, S[j].data.ptr + so[j], R[j].data.ptr + ro[j], st)
                    finally:
                        nccl.groupEnd()
                except Exception as e:
                    fail(e)
        if not copies:
            return run_nccl, None

        def start(bufs):
            run_copies(bufs)
            run_nccl(bufs)
        return start, None

    def _sum_kernel(self, dtype, n):
        """y = x0 + ... + x{n-1} elementwise, summed in float32 (float64 for float64) and rounded
        once, like NCCL's reductions; n inputs in one kernel, so no scratch buffer is needed."""
        key = ("sum_of", dtype, n)
        kern = self._kernels.get(key)
        if kern is None:
            t = {"bfloat16": "uint16"}.get(dtype, dtype)
            load = {"bfloat16": "bf2f(x{})", "float16": "(float)x{}"}.get(dtype, "x{}")
            acc = "double" if dtype == "float64" else "float"
            body = f"{acc} s = {load.format(0)};" + "".join(f" s += {load.format(i)};" for i in range(1, n))
            body += " y = f2bf(s);" if dtype == "bfloat16" else " y = s;"
            kern = cupy.ElementwiseKernel(", ".join(f"{t} x{i}" for i in range(n)), f"{t} y", body,
                                          f"sf_sum{n}_{dtype}", preamble=_BF16_PREAMBLE)
            self._kernels[key] = kern
        return kern

    def bind_allgather(self, send, recv, team, stream):
        d = self._team_size(team)
        count, t = send.size, _NCCL_T[send.dtype]
        if recv.size != count * d:
            raise ValueError(f"allgather sizes {send.shape} -> {recv.shape} over a team of {d}")
        nb = count * _ITEM[send.dtype]

        def copy(S, R, st):  # every block into the first member's buffer, then that whole buffer to the rest
            r0 = R[0][0].data.ptr + R[0][1]
            for rank, (x, off) in enumerate(S):
                runtime.memcpyAsync(r0 + rank * nb, x.data.ptr + off, nb, _D2D, st.ptr)
            for x, off in R[1:]:
                runtime.memcpyAsync(x.data.ptr + off, r0, d * nb, _D2D, st.ptr)
        return self._collective("allgather", send, recv, team, stream,
                                lambda c, s, r, st: c.allGather(s, r, count, t, st), copy)

    def bind_allreduce(self, send, recv, team, stream):
        d = self._team_size(team)
        count, t = send.size, _NCCL_T[send.dtype]
        kern, nb = self._sum_kernel(send.dtype, d), count * _ITEM[send.dtype]

        def copy(S, R, st):  # the sum into the first member's buffer, then copied to the rest
            (r0, o0) = R[0]
            out = cupy.ndarray((count,), r0.dtype, r0.data + o0)
            kern(*[cupy.ndarray((count,), x.dtype, x.data + off) for x, off in S], out)
            for x, off in R[1:]:
                runtime.memcpyAsync(x.data.ptr + off, out.data.ptr, nb, _D2D, st.ptr)
        return self._collective("allreduce", send, recv, team, stream,
                                lambda c, s, r, st: c.allReduce(s, r, count, t, 0, st), copy)

    def bind_reduce_scatter(self, send, recv, team, stream):
        """send: [D, *recv] contiguous; rank r gets the sum of every member's block r."""
        d = self._team_size(team)
        count, t = recv.size, _NCCL_T[recv.dtype]
        if send.size != count * d:
            raise ValueError(f"reduce_scatter sizes {send.shape} -> {recv.shape} over a team of {d}")
        kern, nb = self._sum_kernel(recv.dtype, d), count * _ITEM[recv.dtype]

        def copy(S, R, st):
            for rank, (r, off) in enumerate(R):
                kern(*[cupy.ndarray((count,), x.dtype, x.data + (xo + rank * nb)) for x, xo in S],
                     cupy.ndarray((count,), r.dtype, r.data + off))
        return self._collective("reduce_scatter", send, recv, team, stream,
                                lambda c, s, r, st: c.reduceScatter(s, r, count, t, 0, st), copy)

    def bind_alltoall(self, send, recv, team, stream):
        """send, recv: [D, ...] contiguous; block p of send goes to rank p, rank p's block lands at p.
        NCCL: grouped send/recv pairs (CuPy wraps no ncclAlltoAll)."""
        d = self._team_size(team)
        count, t = send.size // d, _NCCL_T[send.dtype]
        nb = count * _ITEM[send.dtype]

        def call(c, s, r, st):
            nccl.groupStart()
            try:
                for peer in range(d):
                    c.send(s + peer * nb, count, t, peer, st)
                    c.recv(r + peer * nb, count, t, peer, st)
            finally:
                nccl.groupEnd()

        def copy(S, R, st):
            for rank, (r, off) in enumerate(R):
                base = r.data.ptr + off
                for peer, (x, xo) in enumerate(S):
                    runtime.memcpyAsync(base + peer * nb, x.data.ptr + xo + rank * nb, nb, _D2D, st.ptr)
        return self._collective("alltoall", send, recv, team, stream, call, copy)

    def bind_sendrecv(self, send, recv, team, shift, stream):
        """Ring shift within the team: send to rank + shift, receive from rank - shift (the ring
        variant's step; NCCL: grouped send/recv)."""
        d = self._team_size(team)
        count, t = send.size, _NCCL_T[send.dtype]
        nb = count * _ITEM[send.dtype]

        def call(c, s, r, st):
            me = c.rank_id()
            nccl.groupStart()
            try:
                c.send(s, count, t, (me + shift) % d, st)
                c.recv(r, count, t, (me - shift) % d, st)
            finally:
                nccl.groupEnd()

        def copy(S, R, st):  # send and recv never overlap (the ring double-buffers), so no staging
            for rank, (r, off) in enumerate(R):
                x, xo = S[(rank - shift) % d]
                runtime.memcpyAsync(r.data.ptr + off, x.data.ptr + xo, nb, _D2D, st.ptr)
        return self._collective("sendrecv", send, recv, team, stream, call, copy)

    # ---- moves between meshes: point-to-point copies within this process ------------------
    def bind_transfers(self, pairs, stream):
        """Copies (src device, send Ref, dst device, recv Ref): on one GPU on its stream; between
        GPUs a peer copy on the source GPU's stream, after the destination's stream (whose
        earlier work may still read the buffer) and before it (which reads the result)."""
        idx = self.local_index
        same, views, cross = [], [], []
        for s, sref, d, rref in pairs:
            if s not in idx and d not in idx:
                continue
            if s not in idx or d not in idx:
                other = s if s not in idx else d
                raise NotImplementedError(f"cupy_nccl: moving a value from device {s} to device {d}: device {other} "
                                          "belongs to another process, and the cupy backend moves values between "
                                          "meshes only within one process (the NumPy backends also do it over MPI)")
            if sref.shape != rref.shape or sref.dtype != rref.dtype:
                raise ValueError(f"cupy_nccl: transfer {sref.dtype}{list(sref.shape)} -> "
                                 f"{rref.dtype}{list(rref.shape)}")
            js, jd = idx[s], idx[d]
            os_, od = self.ordinals[js], self.ordinals[jd]
            src = (sref.slot, sref.offsets[js] * _ITEM[sref.dtype])
            dst = (rref.slot, rref.offsets[jd] * _ITEM[rref.dtype])
            if os_ == od:
                st = self._gpu_stream(os_, stream)
                copy = self._dma_copy(sref, rref)
                if copy is None:  # neither one block nor rows: an elementwise copy on that GPU
                    views.append((js, sref, jd, rref, os_, st))
                else:
                    same.append((copy, js, src, jd, dst, st.ptr))
            else:
                if not (sref.is_contiguous() and rref.is_contiguous()):
                    raise NotImplementedError(f"cupy_nccl: moving {sref.shape} from GPU {os_} to GPU {od} needs "
                                              f"contiguous buffers, got strides {sref.strides} -> {rref.strides}")
                cross.append((js, os_, src, jd, od, dst, sref.size * _ITEM[sref.dtype]))
        if not same and not views and not cross:
            return None, None
        src_gpus = sorted({c[1] for c in cross})
        dst_gpus = sorted({c[4] for c in cross})
        gs = {o: self._gpu_stream(o, stream).ptr for o in set(src_gpus) | set(dst_gpus)}
        events = {}
        for o in gs:
            with cupy.cuda.Device(o):
                events[o] = cupy.cuda.Event(disable_timing=True)
        self._events.append(list(events.values()))
        ready = [(events[o].ptr, gs[o]) for o in dst_gpus]
        done = [(events[o].ptr, gs[o]) for o in src_gpus]

        def start(bufs):
            for copy, js, (ss, so), jd, (ds, do), sp in same:
                copy(bufs[ds][jd].data.ptr + do, bufs[ss][js].data.ptr + so, sp)
            for js, sref, jd, rref, o, st in views:
                with cupy.cuda.Device(o), st:
                    self.view(bufs, rref, jd)[...] = self.view(bufs, sref, js)
            if not cross:
                return
            for e, sp in ready:
                runtime.eventRecord(e, sp)
            for _, sp in done:
                for e, _ in ready:
                    runtime.streamWaitEvent(sp, e, 0)
            for js, os_, (ss, so), jd, od, (ds, do), nbytes in cross:
                runtime.memcpyPeerAsync(bufs[ds][jd].data.ptr + do, od, bufs[ss][js].data.ptr + so, os_, nbytes,
                                        gs[os_])
            for e, sp in done:
                runtime.eventRecord(e, sp)
            for _, sp in ready:
                for e, _ in done:
                    runtime.streamWaitEvent(sp, e, 0)
        return start, None


def _as_rows(ref):
    """(rows, width, pitch) in elements when ref is rows of contiguous elements at a fixed pitch."""
    dims = [(n, s) for n, s in zip(ref.shape, ref.strides) if n != 1]
    if not dims:
        return (1, 1, 1)
    # merge trailing contiguous dims into the width
    width, k = 1, len(dims)
    while k and dims[k - 1][1] == width:
        width *= dims[k - 1][0]
        k -= 1
    if k == 0:
        return (1, width, width)
    if width == 1:
        return None
    # the remaining dims must nest into one pitch
    n, s = dims[k - 1]
    rows = n
    for i in range(k - 2, -1, -1):
        if dims[i][1] != rows * s:
            return None
        rows *= dims[i][0]
    return (rows, width, s)
