"""cuBLAS and cuBLASLt through ctypes (CuPy's own wrappers refuse graph capture): loading, the
signatures of the few entry points used, the status check, the CUDA / cuBLAS / NCCL enums, and
a kernel launch with prebound arguments."""
from __future__ import annotations

import ctypes

from shardfuse.dtypes import TABLE

# Per dtype name: the NumPy type a CuPy buffer of it holds (bfloat16: its uint16 bits) and bytes
# per element, both from shardfuse.dtypes' table; CUDA's cudaDataType and NCCL's type enum
STORE = {name: t.bits for name, t in TABLE.items()}
ITEM = {name: t.itemsize for name, t in TABLE.items()}
CUDA_T = {"float16": 2, "bfloat16": 14, "float32": 0, "float64": 1}
NCCL_T = {"float16": 6, "bfloat16": 9, "float32": 7, "float64": 8, "int32": 2, "int64": 4, "bool": 1}  # (bool: uint8)
OP_N, OP_T = 0, 1
COMPUTE_32F, COMPUTE_32F_TF32, COMPUTE_64F = 68, 77, 70
COMPUTE_SCALE = {68: 0, 77: 0, 70: 1}  # compute type -> scale (alpha/beta) cudaDataType
GEMM_DEFAULT = -1
D2D = 3  # cudaMemcpyDeviceToDevice


def check(status, what):
    if status != 0:
        raise RuntimeError(f"cupy_nccl: {what} failed with cuBLAS status {status}")


class Prebound:
    """A kernel launch whose n arguments are all 64-bit, its argument array built once and its
    values set in place per call (CuPy's RawKernel launch converts every Python argument anew
    each call; cuLaunchKernel copies the values, so they may change after it).  `function`: the
    CuPy Function compiled for the GPU it launches on (kept: it holds the module); `launch`:
    cuLaunchKernel's binding, cupy.cuda.driver.launchKernel."""

    def __init__(self, function, n, launch):
        self.function, self.fn, self.launch = function, function.ptr, launch
        self.values = (ctypes.c_uint64 * n)()
        self.params = (ctypes.c_void_p * n)(*(ctypes.addressof(self.values) + 8 * i for i in range(n)))
        self.params_ptr = ctypes.addressof(self.params)

    def __call__(self, grid, block, values, stream_ptr):
        self.values[:] = values
        self.launch(self.fn, grid, 1, 1, block, 1, 1, 0, stream_ptr, self.params_ptr, 0)


def find_cublas():
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


class Cublas:
    """The few cuBLAS entry points, through ctypes (CuPy's wrappers refuse graph capture)."""

    def __init__(self):
        lib = find_cublas()
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
        # without argtypes, for the virtual devices' one batched call per step: called with ctypes
        # objects built at bind time (CublasLt.MatmulPrebound's reason: 23 ints converted per call)
        self.gemm_batched_prebound = lib["cublasGemmStridedBatchedEx"]
        self.gemm_batched_prebound.restype = I


class CublasLt:
    """cuBLASLt through ctypes: descriptors and the algorithm are chosen at bind time (lt_plans.lt_plan),
    so a GEMM step at run time is one cublasLtMatmul call (less host work than cublasGemmEx)."""

    TRANSA, TRANSB = 3, 4  # cublasLtMatmulDescAttributes_t
    BATCH_COUNT, BATCH_STRIDE = 5, 6  # cublasLtMatrixLayoutAttribute_t
    PREF_MAX_WORKSPACE = 1  # cublasLtMatmulPreferenceAttributes_t
    PREF_MIN_ALIGNMENT = (5, 6, 7, 8)  # of A, B, C, D in bytes (uint32; the default, 256, is assumed unless set)
    HEURISTIC_BYTES = 96  # sizeof(cublasLtMatmulHeuristicResult_t): algo (64), workspaceSize, state, waves, reserved
    HEURISTIC_STATE = 72  # offset of its state (0: success)

    def __init__(self):
        find_cublas()
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
        # The same entry point without argtypes, for the GEMM steps: called with ctypes objects
        # built once at bind time (only the three data pointers change, in place), ctypes passes
        # them as they are instead of converting 16 Python ints per call.
        self.MatmulPrebound = lib["cublasLtMatmul"]
        self.MatmulPrebound.restype = I
