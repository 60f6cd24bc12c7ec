"""cuBLASLt plans made at bind time: a GEMM's descriptors and layouts, and its algorithm, the
fastest of the heuristic's first candidates timed on scratch operands."""
from __future__ import annotations

import ctypes

from cupy.cuda import runtime

from shardfuse.backends.cuda.libs import OP_N, check

_TUNED: dict = {}  # problem -> index of the fastest candidate (the heuristic's order is deterministic), per process


def _keeper(keep):
    """out(f, *args): f's created handle, and i32(v): an int32 attribute value, both kept in keep."""
    def out(f, *args):
        p = ctypes.c_void_p()
        check(f(ctypes.byref(p), *args), f"cublasLt {f.__name__}")
        keep.append(p)
        return p.value

    def i32(v):
        x = ctypes.c_int32(v)
        keep.append(x)
        return ctypes.cast(ctypes.byref(x), ctypes.c_void_p), 4
    return out, i32


def lt_layouts(lt, ctype, opa, opb, m, n, k, lda, ldb, ldc, keep, batch=None):
    """The layouts (la, lb, lc) of D = op(A) op(B); batch: (count, strideA, strideB, strideC) in
    elements, for a strided batch of such GEMMs.  What must outlive them goes into keep."""
    out, i32 = _keeper(keep)
    la = out(lt.MatrixLayoutCreate, ctype, *((m, k) if opa == OP_N else (k, m)), lda)
    lb = out(lt.MatrixLayoutCreate, ctype, *((k, n) if opb == OP_N else (n, k)), ldb)
    lc = out(lt.MatrixLayoutCreate, ctype, m, n, ldc)
    if batch is not None:
        for lay, stride in zip((la, lb, lc), batch[1:]):
            n64 = ctypes.c_int64(stride)
            keep.append(n64)
            check(lt.MatrixLayoutSetAttribute(lay, lt.BATCH_COUNT, *i32(batch[0])), "cublasLt set batch count")
            check(lt.MatrixLayoutSetAttribute(lay, lt.BATCH_STRIDE, ctypes.cast(ctypes.byref(n64), ctypes.c_void_p),
                                              8), "cublasLt set batch stride")
    return la, lb, lc


def lt_plan(lt, handle, ordinal, comp, scale, ctype, opa, opb, m, n, k, lda, ldb, ldc, workspace, tune=None,
            count=1, align=256):
    """(desc, layouts, algo buffer) for D = op(A) op(B), or None when no algorithm fits.
    tune(desc, la, lb, lc, algos) -> index of the fastest, when given (`count` candidates).
    align: the bytes every operand pointer is a multiple of (cuBLASLt's algorithms assume 256
    unless told less, and one given less faults with a misaligned address)."""
    keep = []
    out, i32 = _keeper(keep)
    desc = out(lt.MatmulDescCreate, comp, scale)
    check(lt.MatmulDescSetAttribute(desc, lt.TRANSA, *i32(opa)), "cublasLt set transa")
    check(lt.MatmulDescSetAttribute(desc, lt.TRANSB, *i32(opb)), "cublasLt set transb")
    la, lb, lc = lt_layouts(lt, ctype, opa, opb, m, n, k, lda, ldb, ldc, keep)
    pref = out(lt.MatmulPreferenceCreate)
    ws = ctypes.c_uint64(workspace)
    keep.append(ws)
    check(lt.MatmulPreferenceSetAttribute(pref, lt.PREF_MAX_WORKSPACE, ctypes.cast(ctypes.byref(ws),
                                          ctypes.c_void_p), 8), "cublasLt set workspace")
    if align < 256:
        al = ctypes.c_uint32(align)
        keep.append(al)
        for attr in lt.PREF_MIN_ALIGNMENT:
            check(lt.MatmulPreferenceSetAttribute(pref, attr, ctypes.cast(ctypes.byref(al), ctypes.c_void_p), 4),
                  "cublasLt set alignment")
    want = max(1, count) if tune is not None else 1
    result = ctypes.create_string_buffer(lt.HEURISTIC_BYTES * want)
    got = ctypes.c_int(0)
    st = lt.MatmulAlgoGetHeuristic(handle, desc, la, lb, lc, lc, pref, want, result, ctypes.byref(got))
    if st != 0 or got.value < 1:
        return None
    keep.append(result)
    base = ctypes.addressof(result)
    algos = [base + i * lt.HEURISTIC_BYTES for i in range(got.value)
             if ctypes.c_int.from_address(base + i * lt.HEURISTIC_BYTES + lt.HEURISTIC_STATE).value == 0]
    best = 0
    if tune is not None and len(algos) > 1:
        key = (ordinal, comp, ctype, opa, opb, m, n, k, lda, ldb, ldc, workspace, align)
        if key not in _TUNED:
            _TUNED[key] = tune(desc, la, lb, lc, algos)
        best = _TUNED[key]
    return desc, la, lb, lc, algos[best], keep


def alignment(*pointers) -> int:
    """The largest power of two up to 256 that divides every one of these byte offsets or pointers."""
    a = 256
    for p in pointers:
        while p % a:
            a //= 2
    return a


def fastest(run, algos, sizes, item, stream_ptr, reps=3):
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
