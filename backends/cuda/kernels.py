"""CuPy kernels and the elementwise and sum steps.  bfloat16 is stored as uint16 (CuPy has no
bfloat16 arithmetic): an elementwise op of INLINE with a bfloat16 operand or result is one generated
kernel (fused.bind_fused's, as a Fused step of that one op: several elements a thread), others
(comparisons, casts, where's halves and max / min of the last axis too) run in float32 scratch and
round back once, sums reduce in float32, with the conversions of the preamble (round to nearest
even, NaN kept quiet)."""
from __future__ import annotations

import math

import cupy
import numpy as np
from cupy._core import _accelerator  # (whether CUB is off: see _reduce_min)

# fn(xp, x, y or scalar, out) keyed by Op, for any array module xp: the same ufunc calls on both backends
from shardfuse.backends.elementwise_numpy import ELEMENTWISE
# the C forms of the ops and dtypes (no CuPy there: the generated sources are tested without a GPU)
from shardfuse.backends.cuda.csource import BF16_PREAMBLE, C_TYPES, INLINE, PARAM_TYPES  # noqa: F401 (fused.py's too)
from shardfuse.backends.cuda.fused import bind_fused
from shardfuse.backends.cuda.rows_source import PTR
from shardfuse.ops import Expr, Op, Reduce


class Kernels:
    """The CuPy kernels of one backend, each compiled at its first use."""

    def __init__(self):
        self.cache = {}

    def cached(self, key, make):
        """The kernel under `key`, made by make() at its first use."""
        kern = self.cache.get(key)
        if kern is None:
            kern = self.cache[key] = make()
        return kern

    def bf16_sum(self, to_float32=False):
        """The sum of bfloat16 (uint16 bits) in float32, rounded to bfloat16 once, or left in float32."""
        out, post = ("float32 y", "y = a") if to_float32 else ("uint16 y", "y = f2bf(a)")
        return self.cached((Op.SUM, to_float32), lambda: cupy.ReductionKernel(
            "uint16 x", out, "bf2f(x)", "a + b", post, "0", f"sf_bf16_sum{'_f32' if to_float32 else ''}",
            reduce_type="float", preamble=BF16_PREAMBLE))

    def fused(self, op, f):
        """The one-kernel form of op (_FUSED), computed in C type f (float or double)."""
        return self.cached((op, f), lambda: cupy.ElementwiseKernel("T x", "T y", _FUSED[op].replace("F", f),
                                                                   f"sf_{op}_{f}"))

    def to_f32(self):
        return self.cached("to_f32", lambda: cupy.ElementwiseKernel(
            "uint16 x", "float32 y", "y = bf2f(x)", "sf_bf16_to_f32", preamble=BF16_PREAMBLE))

    def to_bf16(self):
        return self.cached("to_bf16", lambda: cupy.ElementwiseKernel(
            "float32 y", "uint16 x", "x = f2bf(y)", "sf_f32_to_bf16", preamble=BF16_PREAMBLE))

    def sum_of(self, dtype, n):
        """y = x0 + ... + x{n-1} elementwise, summed in float32 (float64 for float64) and rounded
        once, like NCCL's reductions; n inputs in one kernel, so no scratch buffer is needed."""
        def make():
            t = {"bfloat16": "uint16"}.get(dtype, dtype)
            load = {"bfloat16": "bf2f(x{})", "float16": "(float)x{}"}.get(dtype, "x{}")
            acc = {"float64": "double", "int32": "long long", "int64": "long long", "bool": "bool"}.get(dtype, "float")
            body = f"{acc} s = {load.format(0)};" + "".join(f" s += {load.format(i)};" for i in range(1, n))
            body += " y = f2bf(s);" if dtype == "bfloat16" else " y = s;"
            return cupy.ElementwiseKernel(", ".join(f"{t} x{i}" for i in range(n)), f"{t} y", body,
                                          f"sf_sum{n}_{dtype}", preamble=BF16_PREAMBLE)
        return self.cached(("sum_of", dtype, n), make)

    def extremum_of(self, dtype, n, op):
        """y = max (op="max") or min of x0 ... x{n-1} elementwise, integers (order keys), one kernel."""
        def make():
            f = "max" if op == Reduce.MAX else "min"
            body = "y = x0;" + "".join(f" y = {f}(y, x{i});" for i in range(1, n))
            return cupy.ElementwiseKernel(", ".join(f"{dtype} x{i}" for i in range(n)), f"{dtype} y", body,
                                          f"sf_{op}{n}_{dtype}")
        return self.cached(("extremum_of", dtype, n, op), make)

    def order_keys(self, op, x_dtype, keys_dtype, decode=False):
        """Floats (or bools) to the order keys of backends/extrema.py, or (decode) back, in one kernel
        with no temporaries (a graph capture refuses allocations); bfloat16 comes through float32."""
        def make():
            wide = keys_dtype == "int64"
            k, f, m = ("long long", "double", "0x7fffffffffffffffLL") if wide else ("int", "float", "0x7fffffff")
            nan_key = m if op == Reduce.MAX else f"(-{m} - 1)"
            bits, from_bits = ("__double_as_longlong", "__longlong_as_double") if wide else \
                ("__float_as_int", "__int_as_float")
            if decode:
                body = "y = k != 0;" if x_dtype == "bool" else \
                    f"{k} b = k < 0 ? (k ^ {m}) : k; {f} v = {from_bits}(k == {nan_key} ? {m} : b); y = v;"
                return cupy.ElementwiseKernel(f"{keys_dtype} k", f"{x_dtype} y", body, f"sf_from_keys_{op}_{x_dtype}")
            body = "y = x;" if x_dtype == "bool" else \
                f"{f} v = ({f})x; {k} b = {bits}(v); y = v != v ? {nan_key} : (b < 0 ? (b ^ {m}) : b);"
            return cupy.ElementwiseKernel(f"{x_dtype} x", f"{keys_dtype} y", body, f"sf_keys_{op}_{x_dtype}")
        return self.cached((Op.ORDER_KEYS, op, x_dtype, keys_dtype, decode), make)

    def cumsum(self, dtype):
        """y = the running sum of x's last axis (n elements a row), one thread per row, in order: float16
        and float32 summed in float (double for float64, long long for integers), each prefix rounded
        once, as elementwise_numpy's cumsum; no temporaries (a graph capture refuses allocations).  x
        may be a strided view: a raw array's x[k] is its k-th element in C order, strides honoured."""
        acc = {"float64": "double", "int32": "long long", "int64": "long long"}.get(dtype, "float")
        return self.cached((Op.CUMSUM, dtype), lambda: cupy.ElementwiseKernel(
            "raw T x, int64 n", "raw T y",
            f"{acc} s = 0; for (long long k = i * n; k < i * n + n; ++k) {{ s += ({acc})x[k]; y[k] = (T)s; }}",
            f"sf_cumsum_{dtype}"))

    def take(self):
        """out = table[ids] for the rows this device holds, `zero` elsewhere (elementwise_numpy.take_rows's
        semantics: -0.0 for floats, its bits for bfloat16), one kernel over the output (no temporaries:
        graph capture refuses allocations)."""
        return self.cached(Op.TAKE, lambda: cupy.ElementwiseKernel(
            "raw T table, raw I ids, raw int64 rows, int64 nloc, int64 vocab, int64 width, T zero", "T out",
            "long long r = i / width, c = i % width; long long g = (long long)ids[r]; if (g < 0) g += vocab;"
            " g = g < 0 ? 0 : (g >= vocab ? vocab - 1 : g); long long loc = g - rows[0];"
            " out = (loc >= 0 && loc < nloc) ? table[loc * width + c] : zero;", "sf_take"))

    def scatter_add(self, values_dtype, acc_dtype):
        """acc[loc * width + c] += values[r * width + c] for each position r whose id (as take reads
        it) is a row this device holds (loc: its place among them), by atomicAdd on a float32
        accumulator (float64 for float64; atomicAdd of float and double, no 16-bit atomics); values
        read in their dtype (bfloat16 as its uint16 bits).  The adds land in the order the hardware
        takes them, as PyTorch's index_put_ with accumulate: sums are not bitwise reproducible."""
        def make():
            t = {"bfloat16": "uint16"}.get(values_dtype, values_dtype)
            acc = "double" if acc_dtype == "float64" else "float"
            load = "bf2f(v)" if values_dtype == "bfloat16" else f"({acc})v"
            return cupy.ElementwiseKernel(
                f"{t} v, raw I ids, raw int64 rows, int64 nloc, int64 vocab, int64 width", f"raw {acc_dtype} acc",
                "long long r = i / width, c = i % width; long long g = (long long)ids[r]; if (g < 0) g += vocab;"
                " g = g < 0 ? 0 : (g >= vocab ? vocab - 1 : g); long long loc = g - rows[0];"
                f" if (loc >= 0 && loc < nloc) atomicAdd(&acc[loc * width + c], {load});",
                f"sf_scatter_add_{values_dtype}", preamble=BF16_PREAMBLE)
        return self.cached((Op.SCATTER_ADD, values_dtype, acc_dtype), make)

    def gather(self, n, vector):
        """One launch instead of 2n - 1 copies: block r (`units` elements) of each of n send
        buffers into place r of each of n receive buffers, all on one GPU (an all-gather over
        virtual devices).  Pointers come as kernel arguments, so nothing is uploaded per call;
        `vector`: 16-byte units (every offset and the block size aligned), else bytes."""
        def make():
            t = "uint4" if vector else "unsigned char"
            ptrs = ", ".join([f"unsigned long long s{i}" for i in range(n)] + [f"unsigned long long r{i}" for i in range(n)])
            src = f"""
extern "C" __global__ void sf_gather{n}_{int(vector)}({ptrs}, unsigned long long units) {{
    const {t}* S[{n}] = {{{", ".join(f"(const {t}*)s{i}" for i in range(n))}}};
    {t}* R[{n}] = {{{", ".join(f"({t}*)r{i}" for i in range(n))}}};
    unsigned long long total = units * {n * n};
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < total;
         i += (unsigned long long)gridDim.x * blockDim.x) {{
        unsigned long long u = i % units, rest = i / units;
        unsigned int r = rest % {n}, j = rest / {n};
        R[j][r * units + u] = S[r][u];
    }}
}}"""
            return cupy.RawKernel(src, f"sf_gather{n}_{int(vector)}")
        return self.cached(("gather", n, vector), make)


    def strided_blocks(self, vector):
        """x [a, c, units] into a contiguous buffer, x's element (i, k, u) at i * sa + k * sc + u:
        a view two strides deep over contiguous blocks (a device's piece of the seed layout
        moved outermost, [D, S, m, K] of [S, D, m, K]), which no 2-D DMA copy can move.  One
        launch with every argument a 64-bit value (libs.Prebound) instead of CuPy's copy kernel
        (~15 us of host time, issue 29 item 2); `vector`: 16-byte units, else bytes."""
        def make():
            t = "uint4" if vector else "unsigned char"
            src = f"""
extern "C" __global__ void sf_strided_blocks_{int(vector)}(unsigned long long x, unsigned long long y,
        unsigned long long c, unsigned long long units, unsigned long long sa, unsigned long long sc,
        unsigned long long total) {{
    const {t}* X = (const {t}*)x;
    {t}* Y = ({t}*)y;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < total;
         i += (unsigned long long)gridDim.x * blockDim.x) {{
        unsigned long long u = i % units, rest = i / units;
        Y[i] = X[(rest / c) * sa + (rest % c) * sc + u];
    }}
}}"""
            return cupy.RawKernel(src, f"sf_strided_blocks_{int(vector)}")
        return self.cached(("strided_blocks", vector), make)

# One kernel each where NumPy's form is a composition (F: the type computed in, float for 16- and
# 32-bit values, double for float64); sigmoid as e^x / (1 + e^x) below 0, so nothing overflows to NaN
_FUSED = {
    Op.SIGMOID: "F v = (F)x; F e = exp(-fabs(v)); y = (T)(v >= 0 ? 1 / (1 + e) : e / (1 + e))",
    Op.SILU: "F v = (F)x; F e = exp(-fabs(v)); y = (T)(v * (v >= 0 ? 1 / (1 + e) : e / (1 + e)))",
    Op.RSQRT: "y = (T)((F)1 / sqrt((F)x))",
    # (NumPy's form makes temporaries: an allocation inside a CUDA graph capture is refused)
    Op.GELU: "F v = (F)x; y = (T)((F)0.5 * v * ((F)1 + tanh((F)0.7978845608028654 * (v + (F)0.044715 * v * v * v))))",
    # (CuPy has no erf outside cupyx.scipy.special; CUDA's erf / erfc, in F, rounded once as NumPy's are)
    Op.ERF: "y = (T)erf((F)x)",
    Op.GELU_ERF: "F v = (F)x; y = (T)((F)0.5 * v * erfc(-v * (F)0.7071067811865476))",
    # NumPy's sign: 0 for -0.0 and NaN for NaN (integers too: T is their type, the result -1, 0 or 1)
    Op.SIGN: "F v = (F)x; y = (T)(v > (F)0 ? (F)1 : (v < (F)0 ? (F)-1 : (v == (F)0 ? (F)0 : v)))",
}




def inline_source(op, in_dtypes, out_dtype, scalar):
    """(parameters, outputs, body) of op's one-kernel form for these dtypes (see INLINE)."""
    f = "double" if "float64" in (*in_dtypes, out_dtype) else "float"
    params, body = [], []
    for name, dt in zip("ab", in_dtypes):
        params.append(f"{PARAM_TYPES[dt]} {name}_")
        load = f"bf2f({name}_)" if dt == "bfloat16" else f"{name}_" if dt == "bool" else f"(F){name}_"
        body.append(f"{'bool' if dt == 'bool' else 'F'} {name} = {load};")
    if scalar is not None:
        params.append("float64 s_")
        body.append("F s = (F)s_;")
    expr = INLINE[op]
    if out_dtype == "bfloat16":
        body.append(f"y = f2bf((float)({expr}));")
    elif out_dtype == "bool":
        body.append(f"y = ({expr}) != 0;" if op == Op.ASTYPE else f"y = {expr};")
    else:
        body.append(f"y = ({C_TYPES[out_dtype]})({expr});")
    return ", ".join(params), f"{PARAM_TYPES[out_dtype]} y", " ".join(body).replace("F", f)


def _inline(kernels, op, refs, scalar):
    """op's one-kernel form for the dtypes of refs (operands, then the result)."""
    dtypes = tuple(r.dtype for r in refs)
    key = ("inline", op, dtypes, scalar is not None)

    def make():
        params, out, body = inline_source(op, dtypes[:-1], dtypes[-1], scalar)
        return cupy.ElementwiseKernel(params, out, body, f"sf_{op}_inline", preamble=BF16_PREAMBLE)
    kern = kernels.cached(key, make)
    if scalar is None:
        return kern
    return lambda *views: kern(*views[:-1], np.float64(scalar), views[-1])


def _reduce_min(xp, x, _, o):
    """min of the last axis as -max(-x) (exact, NaN kept), ~max(~x) for integers and booleans:
    CuPy 14's min with out= over a contiguous input fails inside its CUB path (TypeError comparing
    an array with a dtype, seen on an H100 2026-12-05, for floats and int32 alike), while max runs."""
    if not _accelerator.get_reduction_accelerators() and not _accelerator.get_routine_accelerators():
        return xp.min(x, axis=-1, out=o)  # (CUB off, as while a graph is captured: CuPy's own kernel, no temporary)
    flip = xp.negative if o.dtype.kind == "f" else xp.invert  # (~x = -x - 1 for integers: no overflow at the
    xp.max(flip(x), axis=-1, out=o)                             # minimum; logical not for booleans)
    flip(o, out=o)


_CUPY = {Op.REDUCE_MIN: _reduce_min}  # CuPy's own form of an op, where NumPy's does not run there


def _fused(kernels, op, dtype):
    kern = kernels.fused(op, "double" if dtype == "float64" else "float")
    return lambda xp, x, _, o: kern(x, o)


_KEYS = (Op.ORDER_KEYS, Op.FROM_ORDER_KEYS)


def _keys(kernels, op, a, out, reduce_op):
    """The order-key kernels (bfloat16 arrives and leaves as float32 scratch, as for every op)."""
    if op == Op.ORDER_KEYS:
        kern = kernels.order_keys(reduce_op, "float32" if a.dtype == "bfloat16" else a.dtype, out.dtype)
    else:
        kern = kernels.order_keys(reduce_op, "float32" if out.dtype == "bfloat16" else out.dtype, a.dtype, decode=True)
    return lambda xp, x, _, o: kern(x, o)


def _cumsum(kernels, dtype):
    """The cumsum step's fn: Kernels.cumsum over the rows of the last axis (bfloat16 in float32 scratch)."""
    kern = kernels.cumsum("float32" if dtype == "bfloat16" else dtype)

    def run(xp, x, _, o):
        if x.size:
            kern(x, x.shape[-1], o, size=x.size // x.shape[-1])
    return run


def bind_elementwise(dev, kernels, op, a, b, out, stream, scalar=None):
    """Step: out = op(a[, b]) (op an Op of ops.ELEMENTWISE).  bfloat16 operands are read through
    float32 scratch and a bfloat16 result written through it (made now: no allocation when the
    step runs), so comparisons, casts and max of bfloat16 see numbers, not their bits."""
    fn = _fused(kernels, op, out.dtype) if op in _FUSED else _keys(kernels, op, a, out, scalar) if op in _KEYS \
        else _cumsum(kernels, out.dtype) if op == Op.CUMSUM else _CUPY.get(op, ELEMENTWISE[op])
    refs = (a, out) if b is None else (a, b, out)
    if any(r.dtype == "bfloat16" for r in refs) and op in INLINE:
        if out.shape and all(r.dtype in PTR for r in refs):  # (fused.py's flat kernel of this one op: VEC
            leaves = tuple(Expr(None, r.dtype, arg=k) for k, r in enumerate(refs[:-1]))  # elements a thread)
            return bind_fused(dev, kernels, Expr(op, out.dtype, leaves, scalar), refs[:-1], out, stream)
        kern = _inline(kernels, op, refs, scalar)
        return dev.per_device(refs, stream, lambda j, *views: kern(*views))
    if all(r.dtype != "bfloat16" for r in refs):
        if b is None:
            return dev.per_device(refs, stream, lambda j, x, o: fn(cupy, x, scalar, o))
        return dev.per_device(refs, stream, lambda j, x, y, o: fn(cupy, x, y, o))
    to32, to16 = kernels.to_f32(), kernels.to_bf16()
    scratch = [dev.f32_scratch(r) if r.dtype == "bfloat16" else None for r in refs]

    def body(j, *views):
        args = []
        for v, t in zip(views[:-1], scratch):
            if t is not None:
                to32(v, t[j])
            args.append(v if t is None else t[j])
        o, t = views[-1], scratch[-1]
        fn(cupy, args[0], scalar if b is None else args[1], o if t is None else t[j])
        if t is not None:
            to16(t[j], o)
    return dev.per_device(refs, stream, body)


def bind_sum(dev, kernels, a, axis, out, stream, scale=1.0):
    """Step: out = a.sum(axis) * scale; 16-bit reduced in float32 and scaled there, rounded once (a
    float16 mean whose sum would overflow float16 does not), or kept in float32 (traced._reduce's
    16-bit sums: float32 until the end; bfloat16 read through its bits, never summed as uint16)."""
    if a.dtype in ("bfloat16", "float16") and out.dtype == "float32":
        if a.dtype == "bfloat16":
            bf16 = kernels.bf16_sum(to_float32=True)
            total = lambda x, o: bf16(x, o, axis=axis)  # noqa: E731
        else:
            total = lambda x, o: cupy.sum(x, axis=axis, dtype=cupy.float32, out=o)  # noqa: E731

        def wide(j, x, o):
            total(x, o)
            if scale != 1.0:
                cupy.multiply(o, scale, out=o)
        return dev.per_device((a, out), stream, wide)
    if out.dtype == "bfloat16":
        if scale == 1.0:
            kern = kernels.bf16_sum()
            return dev.per_device((a, out), stream, lambda j, x, o: kern(x, o, axis=axis))
        kern, to16, t = kernels.bf16_sum(to_float32=True), kernels.to_bf16(), dev.f32_scratch(out)

        def scaled_bf16(j, x, o):
            kern(x, t[j], axis=axis)
            cupy.multiply(t[j], scale, out=t[j])
            to16(t[j], o)
        return dev.per_device((a, out), stream, scaled_bf16)
    if out.dtype == "float16":
        t = dev.f32_scratch(out)

        def half(j, x, o):
            cupy.sum(x, axis=axis, dtype=cupy.float32, out=t[j])
            cupy.multiply(t[j], scale, out=o)
        return dev.per_device((a, out), stream, half)
    if scale == 1.0:
        return dev.per_device((a, out), stream, lambda j, x, o: cupy.sum(x, axis=axis, out=o))

    def scaled(j, x, o):
        cupy.sum(x, axis=axis, out=o)
        cupy.multiply(o, scale, out=o)
    return dev.per_device((a, out), stream, scaled)


def bind_scatter_add(dev, kernels, values, ids, rows, out, stream, vocab):
    """Step: out = zeros, then each position's values added into its id's row (Kernels.scatter_add;
    elementwise_numpy.scatter_add_rows's semantics).  float32 and float64 accumulate in out itself;
    float16 and bfloat16 in float32 scratch (made now: no allocation when the step runs, as a graph
    capture needs), rounded into out once (as PyTorch's embedding backward accumulates)."""
    nloc = math.prod(rows.shape)
    width = math.prod(out.shape) // nloc
    kern = kernels.scatter_add(values.dtype, "float64" if out.dtype == "float64" else "float32")
    scratch = dev.f32_scratch(out) if out.dtype in ("float16", "bfloat16") else None
    to16 = kernels.to_bf16() if out.dtype == "bfloat16" else None

    def step(j, v, i, r, o):
        acc = o if scratch is None else scratch[j]
        acc.fill(0)  # (a memset on the step's stream: every element written, poisoned or not)
        kern(v, i, r, nloc, vocab, width, acc)
        if to16 is not None:
            to16(acc, o)
        elif scratch is not None:
            cupy.copyto(o, acc)  # (float32 -> float16, rounded once)
    return dev.per_device((values, ids, rows, out), stream, step)
