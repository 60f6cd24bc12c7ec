"""Bare library calls to hold the plans against (CUDA, one device): cupy.matmul, and the
backend's own cuBLAS GEMM step with no plan around it, bound on protocol Refs."""
from __future__ import annotations

from shardfuse.backends.protocol import MAIN, Ref, contiguous_strides
from shardfuse.bench.runner import Variant
from shardfuse.dtypes import np_dtype


def bare_variants(args, be, inputs, log):
    """For every S asked for: the S chunk GEMMs as cupy.matmul calls on the caller's stream, and
    as the backend's own cuBLAS step (bind_matmul, no plan) on the backend's main stream (S = 1:
    one GEMM)."""
    import cupy

    sets = inputs.raw
    c0 = cupy.empty((args.m, args.n), sets[0][0].dtype)
    # bfloat16 is held as uint16: CuPy's matmul reads it through an ml_dtypes.bfloat16 view
    as_cp = (lambda x: x.view(np_dtype("bfloat16"))) if inputs.dtype == "bfloat16" else (lambda x: x)
    out = []
    try:
        cupy.matmul(as_cp(sets[0][0][:8]), as_cp(sets[0][1]), out=as_cp(c0[:8]))
        cupy_ok = True
    except Exception as e:  # an old CuPy without bfloat16 matmul: say so, time the rest
        log(f"  (bare cupy.matmul skipped: {type(e).__name__}: {e})")
        cupy_ok = False
    for s in sorted(set(args.chunks)):
        st = {"r": 0}

        def before(r, st=st):
            st["r"] = r
        if cupy_ok:
            out.append(Variant("bare cupy.matmul chunks" if s > 1 else "bare cupy.matmul (one)",
                               _cupy_chunks(cupy, sets, c0, as_cp, s, st), before, s=s, kind="bare_cupy"))
        out.append(_cublas_chunks(args, be, inputs.dtype, sets, c0, s, st, before))
    return out


def _cupy_chunks(cupy, sets, c0, as_cp, s, st):
    rows = c0.shape[0] // s

    def run():
        a, b = (as_cp(x) for x in sets[st["r"] % len(sets)])
        c = as_cp(c0)
        for i in range(s):
            cupy.matmul(a[i * rows:(i + 1) * rows], b, out=c[i * rows:(i + 1) * rows])
    return run


def _ref(slot, offset, shape, dtype):
    return Ref(slot, (offset,), shape, contiguous_strides(shape), dtype)


def _cublas_chunks(args, be, dtype, sets, c0, s, st, before):
    """S GEMMs, the backend's own cuBLAS step each, on its main stream; `fenced_fn` issues them
    as a plan call is: main waits for the caller's stream, which waits for main after."""
    import cupy

    k, n = args.k, args.n
    rows = args.m // s
    steps = [be.bind_matmul(_ref(0, i * rows * k, (rows, k), dtype), _ref(1, 0, (k, n), dtype),
                            _ref(2, i * rows * n, (rows, n), dtype), MAIN) for i in range(s)]

    def run():
        a, b = sets[st["r"] % len(sets)]
        bufs = [[a], [b], [c0]]
        for step in steps:
            step(bufs)

    def fenced():
        caller = cupy.cuda.get_current_stream().ptr
        be.fence_in(caller)
        run()
        be.fence_out(caller)
    v = Variant("bare cuBLAS chunks" if s > 1 else "bare cuBLAS (one)", run, before, s=s, kind="bare_cublas")
    v.fenced_fn = fenced
    v.stream = be.stream(0)  # stamped on the stream it issues on (backend.stream is no protocol member yet)
    return v
