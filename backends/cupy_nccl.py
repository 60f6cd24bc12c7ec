"""CuPy + NCCL + cuBLAS: the executor's steps on NVIDIA GPUs.

Same protocol as numpy_local.NumpyLocalBackend.  What is GPU-specific:

* Streams.  The executor's "main" stream is this backend's own non-blocking stream per
  device (`backend.stream(j)`), and worker index i is the i-th stream of a pool of
  `Stream(non_blocking=True)`; the legacy null stream is never used.  A plan starts by
  recording an event on main that the workers wait for and ends by main waiting for every
  worker, so all of a call's work is fenced by main.  Inputs placed by `to_device` /
  `ascontiguous` are written on main; `to_host` and `synchronize` wait for main.  If you
  produce inputs with your own CuPy code on another stream, synchronize it (or issue on
  `backend.stream(j)`) before the call.
* Buffers.  Every buffer is allocated from CuPy's pool while main is the current stream,
  so a block freed after a call (a dropped input or output) is only handed again to work
  ordered after that call's final join on main: a buffer still read by a worker stream is
  never reused early.  bfloat16 is stored as uint16 (CuPy has no bfloat16 arithmetic);
  `to_host` returns ml_dtypes.bfloat16.
* GEMMs call cuBLAS through ctypes (CuPy's own wrappers refuse graph capture): a plain GEMM
  is one cublasLtMatmul with descriptors and algorithm chosen at bind time (the fastest of up to
  SHARDFUSE_GEMM_TUNE heuristic candidates, timed on scratch operands; SHARDFUSE_GEMM=ex:
  cublasGemmEx); batched ones are cublasGemmStridedBatchedEx.  One handle and one workspace per
  (device, stream), so GEMMs on concurrent streams never share a workspace.  Batch dims that
  nest into the rows are folded into one GEMM, one more is a strided batch, further outer
  ones are looped at bind time; views cuBLAS cannot read are staged through scratch.  Everything but the
  per-call base pointers is resolved at bind time.  float32 runs without TF32 unless
  SHARDFUSE_TF32=1 (or CUPY_TF32=1).
* Collectives are NCCL, one communicator per team of each mesh axis, issued on the step's
  stream (so their wait steps are None).  One process owning several GPUs uses
  NcclCommunicator.initAll and groupStart/groupEnd; under mpiexec each process owns its
  block of devices (local rank from COMM_TYPE_SHARED picks the GPUs) and the team's unique
  id is shared over MPI.  On an NCCL error the team's communicators are aborted and the
  error names the failed step.
* Graph mode (`sf.jit(..., graph=True)`): `capture` runs the plan once eagerly on
  plan-owned input and output buffers, then captures it into one CUDA graph on main; a
  call copies its inputs into the plan's input buffers (skipped when they already are
  those buffers: see `GraphPlan.inputs`) and replays the graph.  Graph-mode outputs are the
  plan's own buffers: the next call overwrites them.  No allocation happens during replay.
"""
from __future__ import annotations

import ctypes
import os

import numpy as np

import cupy
from cupy.cuda import nccl, runtime

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
    """A plan captured once as a CUDA graph; calling it copies inputs in and replays."""

    def __init__(self, backend, exe):
        self.backend = backend
        be = backend
        if len(be.local_devices) != 1:
            raise NotImplementedError("graph mode: one local device per process")
        self.static = list(exe.slot_templates)
        self.inputs = []
        for k, v in enumerate(exe.prog.inputs):
            ref = exe.refs[v]
            self.static[k] = be.empty(ref.shape, ref.dtype)
            self.inputs.append(self.static[k])
        for slot, shape, dtype in exe.per_call:
            self.static[slot] = be.empty(shape, dtype)
        self.n_inputs = len(exe.prog.inputs)
        self._ptrs = [s[0].data.ptr for s in self.inputs]
        self._nbytes = [s[0].nbytes for s in self.inputs]
        main = be.main[0]
        with cupy.cuda.Device(be.ordinals[0]):
            for s in self.inputs:  # random, finite inputs for the warm-up run
                be._fill_random(s[0])
            for step in exe.steps:  # warm-up: compiles kernels, sets up NCCL and cuBLAS
                step(self.static)
            be.synchronize()
            # Anything CuPy allocates while capturing (temporaries of elementwise steps) comes from
            # blocks this plan keeps for its lifetime: the replayed graph keeps using them, so the
            # pool must never hand them to anyone else.
            self._held = []
            pool = cupy.get_default_memory_pool()

            def keep(size):
                mem = pool.malloc(size)
                self._held.append(mem)
                return mem

            mode = getattr(runtime, "streamCaptureModeThreadLocal", None)
            with cupy.cuda.using_allocator(keep):
                main.begin_capture() if mode is None else main.begin_capture(mode)
                try:
                    for step in exe.steps:
                        step(self.static)
                finally:
                    self.graph = main.end_capture()
            self.graph.upload(main)
            be.synchronize()
        self._main = main

    def __call__(self, bufs):
        st = self.static
        for k in range(self.n_inputs):
            x = bufs[k][0]
            if x.data.ptr != self._ptrs[k]:
                runtime.memcpyAsync(self._ptrs[k], x.data.ptr, self._nbytes[k], _D2D, self._main.ptr)
        self.graph.launch(self._main)
        return st


class CupyNcclBackend:
    name = "cupy"

    def __init__(self, mesh):
        self.mesh = mesh
        self.local_devices = mesh.local_devices
        self.local_index = {d: j for j, d in enumerate(self.local_devices)}
        L = len(self.local_devices)
        local_rank = 0
        if mesh.nprocs > 1:
            from mpi4py import MPI

            node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
            local_rank = node.Get_rank()
            node.Free()
        self.ordinals = [local_rank * L + j for j in range(L)]
        ngpu = runtime.getDeviceCount()
        if self.ordinals[-1] >= ngpu:
            raise RuntimeError(f"cupy_nccl: this process needs GPUs {self.ordinals}, but CuPy sees {ngpu}")
        cupy.cuda.Device(self.ordinals[0]).use()  # before anything else touches CUDA
        self.main = []
        for o in self.ordinals:
            with cupy.cuda.Device(o):
                self.main.append(cupy.cuda.Stream(non_blocking=True))
        self.workers = [[] for _ in self.ordinals]  # per device: pool of worker streams
        self._handles = {}  # (j, stream key) -> cuBLAS handle
        self._ws_ptr = {}  # (j, stream key) -> that handle's workspace (cuBLASLt calls use it too)
        self._lt = None
        self.gemm_api = GEMM_API
        self._workspaces = []
        self._comms = {}  # team name -> list of communicators, one per local device
        self._cublas = None
        self._kernels = {}
        self._events = []
        self.workspace_bytes = 0

    # ---- streams ----------------------------------------------------------------------
    def _stream(self, j, stream):
        if stream == "main":
            return self.main[j]
        pool = self.workers[j]
        while len(pool) <= stream:
            with cupy.cuda.Device(self.ordinals[j]):
                pool.append(cupy.cuda.Stream(non_blocking=True))
        return pool[stream]

    def stream(self, j=0):
        """The main stream of local device j (the one plans issue on and fence with)."""
        return self.main[j]

    def _handle(self, j, stream):
        key = (j, stream)
        h = self._handles.get(key)
        if h is None:
            if self._cublas is None:
                self._cublas = _Cublas()
            cb = self._cublas
            with cupy.cuda.Device(self.ordinals[j]):
                hp = ctypes.c_void_p()
                _check(cb.create(ctypes.byref(hp)), "cublasCreate")
                _check(cb.set_stream(hp, ctypes.c_void_p(self._stream(j, stream).ptr)), "cublasSetStream")
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
            with cupy.cuda.Device(x.device.id):
                j = self.ordinals.index(x.device.id)
                with self.main[j]:
                    return cupy.ascontiguousarray(x)
        return self.to_device([x])[0]

    def view(self, bufs, ref, j):
        base = bufs[ref.slot][j]
        item = base.itemsize
        mem = base.data + ref.offsets[j] * item
        return cupy.ndarray(ref.shape, base.dtype, mem, strides=tuple(s * item for s in ref.strides))

    def _fill_random(self, x):
        """Finite random values into a buffer (graph warm-up), on main."""
        j = self.ordinals.index(x.device.id)
        with cupy.cuda.Device(x.device.id), self.main[j]:
            r = cupy.random.standard_normal(x.shape, dtype=np.float32)
            if x.dtype == np.uint16:  # bfloat16: the top half of the float32 bits
                x[...] = (r.view(np.uint32) >> 16).astype(np.uint16)
            else:
                x[...] = r.astype(x.dtype)

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
            from shardfuse.executor import contiguous_strides

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
        multi = nd > 1
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
            lh, ws, sp = lt.handle(ords[0]), self._ws_ptr[(0, stream)], self._stream(0, stream).ptr
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
                o1_, o2_, oo_ = o1[0] + d1, o2[0] + d2, oo[0] + d3

                def step(bufs, _keep=(keep, lt_keep)):
                    pc = bufs[so][0].data.ptr + oo_
                    st = mm(lh, desc, alpha, bufs[s1][0].data.ptr + o1_, la, bufs[s2][0].data.ptr + o2_, lb,
                            beta, pc, lc, pc, lc, algo, ws, WORKSPACE, sp)
                    if st:
                        _check(st, f"cublasLtMatmul (m={m} n={n} k={k} {dt})")
                return step
        if inner is None:
            fn = cb.gemm
            if not multi and len(outer) == 1 and s1 is not None and s2 is not None and so is not None:
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

    def bind_copy(self, src, dst, stream):
        if src.shape != dst.shape:
            raise ValueError(f"copy {src.shape} -> {dst.shape}")
        item = _ITEM[src.dtype]
        streams = [self._stream(j, stream).ptr for j in range(len(self.ordinals))]
        so, do = self._offsets_bytes(src), self._offsets_bytes(dst)
        ss, ds = src.slot, dst.slot
        if src.is_contiguous() and dst.is_contiguous():
            nbytes = src.size * item

            def step(bufs):
                for j, sp in enumerate(streams):
                    runtime.memcpyAsync(bufs[ds][j].data.ptr + do[j], bufs[ss][j].data.ptr + so[j], nbytes, _D2D, sp)
            return step
        # a 2-D pitched copy when both are rows of contiguous elements with fixed pitches
        rows = _as_rows(src), _as_rows(dst)
        if None not in rows and rows[0][0] == rows[1][0] and rows[0][1] == rows[1][1]:
            (h, w, sp_), (_, _, dp_) = rows
            width = w * item

            def step(bufs):
                for j, sp in enumerate(streams):
                    runtime.memcpy2DAsync(bufs[ds][j].data.ptr + do[j], dp_ * item, bufs[ss][j].data.ptr + so[j],
                                          sp_ * item, width, h, _D2D, sp)
            return step

        def body(j, x, o):
            o[...] = x
        return self._per_device((src, dst), stream, body)

    # ---- streams and events: device-side waits, never host blocks -------------------------
    def new_event(self):
        evs = []
        for o in self.ordinals:
            with cupy.cuda.Device(o):
                evs.append(cupy.cuda.Event(disable_timing=True))
        self._events.append(evs)
        return evs

    def bind_record(self, event, stream):
        pairs = [(e.ptr, self._stream(j, stream).ptr) for j, e in enumerate(event)]

        def step(bufs):
            for e, s in pairs:
                runtime.eventRecord(e, s)
        return step

    def bind_wait_event(self, event, stream):
        pairs = [(self._stream(j, stream).ptr, e.ptr) for j, e in enumerate(event)]
        if len(pairs) == 1:
            (s0, e0), wait = pairs[0], runtime.streamWaitEvent
            return lambda bufs: wait(s0, e0, 0)

        def step(bufs):
            for s, e in pairs:
                runtime.streamWaitEvent(s, e, 0)
        return step

    def bind_join(self, waiter, waitee):
        ev = self.new_event()
        trip = [(e.ptr, self._stream(j, waitee).ptr, self._stream(j, waiter).ptr) for j, e in enumerate(ev)]
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
        for j, o in enumerate(self.ordinals):
            with cupy.cuda.Device(o):
                self.main[j].synchronize()
                for s in self.workers[j]:
                    s.synchronize()

    def capture(self, exe):
        return GraphPlan(self, exe)

    # ---- NCCL ---------------------------------------------------------------------------
    def _team_comms(self, team):
        comms = self._comms.get(team)
        if comms is not None:
            return comms
        groups = self.mesh.teams(team)
        mine = [g for g in groups if any(d in self.local_index for d in g)]
        comms = [None] * len(self.ordinals)
        try:
            if self.mesh.nprocs == 1:
                for g in mine:
                    js = [self.local_index[d] for d in g]
                    cs = nccl.NcclCommunicator.initAll([self.ordinals[j] for j in js])
                    for j, c in zip(js, cs):
                        comms[j] = c
            else:
                from mpi4py import MPI

                world = MPI.COMM_WORLD
                per = len(self.local_devices)
                uids = {}
                for gi, g in enumerate(groups):
                    if g[0] in self.local_index:
                        uids[gi] = nccl.get_unique_id()
                merged = {}
                for part in world.allgather(uids):
                    merged.update(part)
                nccl.groupStart()
                try:
                    for gi, g in enumerate(groups):
                        for rank, d in enumerate(g):
                            if d in self.local_index:
                                j = self.local_index[d]
                                with cupy.cuda.Device(self.ordinals[j]):
                                    comms[j] = nccl.NcclCommunicator(len(g), merged[gi], rank)
                finally:
                    nccl.groupEnd()
                del per
        except Exception as e:
            for c in comms:
                if c is not None:
                    c.abort()
            raise RuntimeError(f"cupy_nccl: creating the NCCL communicators of team {team!r} failed: {e}") from e
        self._comms[team] = comms
        return comms

    def _collective(self, kind, send, recv, team, stream, call):
        """One NCCL call per local device on `stream`; call(comm, sendptr, recvptr, streamptr)."""
        comms = self._team_comms(team)
        streams = [self._stream(j, stream).ptr for j in range(len(self.ordinals))]
        so, ro = self._offsets_bytes(send), self._offsets_bytes(recv)
        ss, rs = send.slot, recv.slot
        group = len(comms) > 1

        def fail(e):
            for c in comms:
                try:
                    c.abort()
                except Exception:
                    pass
            self._comms.pop(team, None)
            raise RuntimeError(f"cupy_nccl: NCCL {kind} on team {team!r} ({send.shape} -> {recv.shape}, "
                               f"{send.dtype}) failed; communicators aborted: {e}") from e

        if not group:
            c0, st0 = comms[0], streams[0]

            def start(bufs):
                try:
                    call(c0, bufs[ss][0].data.ptr + so[0], bufs[rs][0].data.ptr + ro[0], st0)
                except Exception as e:
                    fail(e)
            return start, None

        def start(bufs):
            try:
                nccl.groupStart()
                try:
                    for j, c in enumerate(comms):
                        call(c, bufs[ss][j].data.ptr + so[j], bufs[rs][j].data.ptr + ro[j], streams[j])
                finally:
                    nccl.groupEnd()
            except Exception as e:
                fail(e)
        return start, None

    def bind_allgather(self, send, recv, team, stream):
        count, t = send.size, _NCCL_T[send.dtype]
        if recv.size != count * self.mesh.axis_size(team):
            raise ValueError(f"allgather sizes {send.shape} -> {recv.shape}")
        return self._collective("allgather", send, recv, team, stream,
                                lambda c, s, r, st: c.allGather(s, r, count, t, st))

    def bind_allreduce(self, send, recv, team, stream):
        count, t = send.size, _NCCL_T[send.dtype]
        return self._collective("allreduce", send, recv, team, stream,
                                lambda c, s, r, st: c.allReduce(s, r, count, t, 0, st))

    def bind_alltoall(self, send, recv, team, stream):
        """send, recv: [D, ...] contiguous; block p of send goes to rank p, rank p's block lands at p.
        Grouped NCCL send/recv pairs (CuPy wraps no ncclAlltoAll)."""
        d = self.mesh.axis_size(team)
        count, t = send.size // d, _NCCL_T[send.dtype]
        step = count * _ITEM[send.dtype]

        def call(c, s, r, st):
            nccl.groupStart()
            try:
                for peer in range(d):
                    c.send(s + peer * step, count, t, peer, st)
                    c.recv(r + peer * step, count, t, peer, st)
            finally:
                nccl.groupEnd()
        return self._collective("alltoall", send, recv, team, stream, call)

    def bind_sendrecv(self, send, recv, team, shift, stream):
        """Ring shift within the team: send to rank + shift, receive from rank - shift (grouped
        NCCL send/recv, the ring variant's step)."""
        d = self.mesh.axis_size(team)
        count, t = send.size, _NCCL_T[send.dtype]

        def call(c, s, r, st):
            me = c.rank_id()
            nccl.groupStart()
            try:
                c.send(s, count, t, (me + shift) % d, st)
                c.recv(r, count, t, (me - shift) % d, st)
            finally:
                nccl.groupEnd()
        return self._collective("sendrecv", send, recv, team, stream, call)

    def bind_transfers(self, pairs, stream):
        raise NotImplementedError("moving values between sub-meshes (SendRecv / Broadcast / Scatter / Gather) "
                                  "is not implemented on the cupy backend yet; the NumPy backends run it")

    def bind_reduce_scatter(self, send, recv, team, stream):
        count, t = recv.size, _NCCL_T[recv.dtype]
        return self._collective("reduce_scatter", send, recv, team, stream,
                                lambda c, s, r, st: c.reduceScatter(s, r, count, t, 0, st))


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
