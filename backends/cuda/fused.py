"""The generated kernels of passes/fuse.py's steps: a Fused step (an ops.Expr over its operands)
as one RawKernel of flat_source (a 0-d one as an ElementwiseKernel), a FusedSum (the sum of such
an Expr) as one ReductionKernel, so the chain's result is never written; a FusedRows step
(passes/fuse_rows.py) as one RawKernel of rows_source.  Each Expr node is a C variable rounded to its own dtype as the
unfused step's result was (bfloat16 through its uint16 bits, kernels.BF16_PREAMBLE); a sum
accumulates in float (double for float64) and is scaled there, as kernels.bind_sum sums."""
from __future__ import annotations

import cupy
import numpy

from shardfuse.backends.cuda import flat_source, rows_source
from shardfuse.backends.cuda.csource import BF16_PREAMBLE, C_TYPES, INLINE, PARAM_TYPES, literal
from shardfuse.ops import Op

_HELD = {"float64": "double", "int32": "int", "int64": "long long", "bool": "bool"}  # (16/32-bit floats: float)
_ROUND = {"bfloat16": "bf2f(f2bf((float)({})))", "float16": "(float)(float16)((float)({}))", "float32": "(float)({})",
          "float64": "(double)({})", "int32": "(int)({})", "int64": "(long long)({})"}


def expr_code(expr):
    """(statements, name of the result) computing an ops.Expr over operands x0, x1, ...: each node
    a C variable held as float (double for float64, its own type for integers and booleans),
    rounded to its dtype as the unfused step's result was; the INLINE expressions of the ops."""
    lines, count, memo = [], [0], {}  # (each equal node once)

    def node(e):
        if e.op is None:
            return f"bf2f(x{e.arg})" if e.dtype == "bfloat16" else f"x{e.arg}"
        if e in memo:
            return memo[e]
        args = [(node(a), a.dtype) for a in e.args]
        dts = (e.dtype, *(d for _, d in args))
        f = "double" if {"float64", "int32", "int64"} & set(dts) else "float"  # (integers exact in double)
        name = f"t{count[0]}"
        count[0] += 1
        scope = [f"bool {n} = {c};" if d == "bool" else f"{f} {n} = ({f})({c});" for n, (c, d) in zip("ab", args)]
        if e.value is not None:
            scope.append(f"{f} s = ({f}){literal(e.value)};")
        value = INLINE[e.op].replace("F", f)
        if e.dtype == "bool":
            value = f"(({value}) != 0)" if e.op == Op.ASTYPE else f"({value})"
        else:
            value = _ROUND[e.dtype].format(value)
        lines.append(f"{_HELD.get(e.dtype, 'float')} {name}; {{ {' '.join(scope)} {name} = {value}; }}")
        memo[e] = name
        return name
    last = node(expr)
    return " ".join(lines), last


def fused_source(expr, in_dtypes, out_dtype):
    """(parameters, output, body) of one ElementwiseKernel computing an ops.Expr (expr_code)."""
    body, last = expr_code(expr)
    store = f"f2bf((float){last})" if out_dtype == "bfloat16" else \
        last if out_dtype == "bool" else f"({C_TYPES[out_dtype]}){last}"
    params = ", ".join(f"{PARAM_TYPES[d]} x{k}" for k, d in enumerate(in_dtypes))
    return params, f"{PARAM_TYPES[out_dtype]} y", body + f" y = {store};"


def bind_fused(dev, kernels, expr, ins, out, stream):
    """Step: out = expr(ins), one generated kernel: a result of one axis or more by flat_source (its
    shapes and strides baked in, but for a layout of one run: compiled once per expression, dtypes
    and layout), a 0-d one by an ElementwiseKernel (compiled once per expression and dtypes)."""
    dtypes = tuple(r.dtype for r in ins)
    if out.shape:
        layouts = tuple((tuple(r.shape), tuple(r.strides)) for r in ins)
        src, name, threads, blocks, count = flat_source.source(expr, dtypes, layouts,
                                                               (out.dtype, tuple(out.shape), tuple(out.strides)))
        if blocks == 0:  # (nothing to compute: no launch)
            return dev.per_device((*ins, out), stream, lambda j, *views: None)
        flat, n = kernels.cached((Op.FUSED, src), lambda: cupy.RawKernel(src, name)), numpy.int64(count)
        return dev.per_device((*ins, out), stream, lambda j, *views: flat((blocks,), (threads,), (*views, n)))

    def make():
        params, outp, body = fused_source(expr, dtypes, out.dtype)
        return cupy.ElementwiseKernel(params, outp, body, "sf_fused", preamble=BF16_PREAMBLE)
    kern = kernels.cached((Op.FUSED, expr, dtypes, out.dtype), make)
    return dev.per_device((*ins, out), stream, lambda j, *views: kern(*views))


def fused_sum_source(expr, in_dtypes, out_dtype, scale):
    """(in_params, out_params, map_expr, post_map_expr, reduce_type) of one ReductionKernel: expr of
    each element as expr_code computes it (its result rounded to its dtype, as the unfused chain
    stored it), summed in float (double for float64), scaled there and rounded once into
    out_dtype, as bind_sum does (bfloat16's sum: kernels.bf16_sum, then a float32 multiply)."""
    body, last = expr_code(expr)
    acc = "double" if out_dtype == "float64" else "float"
    # (operands x0, x1, ..., result y: for one operand over trailing contiguous axes CuPy runs its CUB
    # kernel, which renames x0 -> in0 in map_expr and y -> out0 in post_map_expr by text replacement;
    # neither name occurs there otherwise: no literal, op or variable name holds "x0", nor "y")
    params = ", ".join(f"{PARAM_TYPES[d]} x{k}" for k, d in enumerate(in_dtypes))
    # (statements where CuPy takes an expression: a lambda called in place, reading this element's operands)
    value = f"([&]() -> {acc} {{ {body} return ({acc}){last}; }})()"
    total = "a" if scale == 1.0 else f"(a * ({acc}){literal(scale)})"
    store = f"f2bf({total})" if out_dtype == "bfloat16" else f"({C_TYPES[out_dtype]})({total})"
    return params, f"{PARAM_TYPES[out_dtype]} y", value, f"y = {store}", acc


def bind_fused_sum(dev, kernels, expr, ins, axis, out, stream, scale=1.0):
    """Step: out = expr(ins).sum(axis) * scale, one generated reduction kernel (the operands broadcast
    as CuPy broadcasts a ReductionKernel's inputs; no buffer of expr's result, no scratch)."""
    dtypes = tuple(r.dtype for r in ins)

    def make():
        params, outp, value, post, acc = fused_sum_source(expr, dtypes, out.dtype, scale)
        return cupy.ReductionKernel(params, outp, value, "a + b", post, "0", "sf_fused_sum", reduce_type=acc,
                                    preamble=BF16_PREAMBLE)
    kern = kernels.cached((Op.FUSED_SUM, expr, dtypes, out.dtype, scale), make)
    return dev.per_device((*ins, out), stream, lambda j, *views: kern(*views, axis=axis))


def bind_fused_rows(dev, kernels, expr, ins, out, stream, more=(), more_outs=()):
    """Step: out = expr(ins) of a FusedRows step, and more_outs[k] = more[k](ins), one generated kernel
    (backends/cuda/rows_source.py): a warp or a block per row, made once per group, dtypes and layout (the Refs'
    shapes and strides, the same on every device; only their offsets differ, and the views carry
    them as pointers)."""
    layouts = tuple((tuple(r.shape), tuple(r.strides)) for r in ins)
    spec = lambda r: (r.dtype, tuple(r.shape), tuple(r.strides))  # noqa: E731
    src, name, threads, blocks = rows_source.source(expr, tuple(r.dtype for r in ins), layouts, spec(out),
                                                    tuple((e, spec(r)) for e, r in zip(more, more_outs)))
    refs = (*ins, out, *more_outs)
    if blocks == 0 or any(0 in shape for shape, _ in layouts):  # (nothing to compute: no launch)
        return dev.per_device(refs, stream, lambda j, *views: None)
    kern = kernels.cached((Op.FUSED_ROWS, src), lambda: cupy.RawKernel(src, name))
    return dev.per_device(refs, stream, lambda j, *views: kern((blocks,), (threads,), views))
