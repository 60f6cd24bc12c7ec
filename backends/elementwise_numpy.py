"""The elementwise kernels of issue 31 (sqrt, log, powers, maximum / minimum, comparisons, where's
halves, casts, max / min of the last axis), as fn(xp, x, y or scalar, out) for any array module
xp: merged into numpy_local.ELEMENTWISE, which CuPy's kernels share (backends/cuda/kernels.py runs
bfloat16 through float32 scratch and has its own sigmoid, silu and rsqrt).

Scalars arrive already in the operand's dtype's values where NumPy 2 would round them (the
tracer rounds a comparison's or maximum's scalar), so `x.dtype.type(s)` is exact here.  16-bit
floats with a scalar exponent, and the compositions (sigmoid, silu, rsqrt), run in float32 and
round once, as the existing scalar ops do."""
from __future__ import annotations

import numpy as np

from shardfuse.ops import Op


def _zero(o):
    """The exact filler of where's halves: x + (-0.0) is x for every float x (-0.0 and NaN too)."""
    return o.dtype.type(-0.0) if o.dtype.kind not in "biu" else o.dtype.type(0)


def _in32(fn):
    """fn(xp, x, s) computed in float32 for 16-bit x and rounded once into out; in x's type otherwise."""
    def run(xp, x, s, o):
        if x.dtype.itemsize == 2:
            o[...] = fn(xp, x.astype(np.float32), s)
        else:
            o[...] = fn(xp, x, s)
    return run


def _sigmoid(xp, x, _):
    """1 / (1 + e^-x); for x < 0 written e^x / (1 + e^x), so neither side overflows to NaN."""
    e = xp.exp(-xp.abs(x))
    return xp.where(x >= 0, 1 / (1 + e), e / (1 + e))


def _scalar(fn, reflected=False):
    def run(xp, x, s, o):
        if x.dtype.itemsize == 2 and x.dtype.kind != "b":  # 16-bit floats: in float32, rounded once
            s = np.float32(s)
            return fn(s, x, out=o, dtype=np.float32) if reflected else fn(x, s, out=o, dtype=np.float32)
        s = x.dtype.type(s)
        return fn(s, x, out=o) if reflected else fn(x, s, out=o)
    return run


def _then(xp, c, x, o):  # where(c, x, 0)
    xp.copyto(o, _zero(o))
    xp.copyto(o, x, where=c)


def _else(xp, c, x, o):  # where(c, 0, x)
    xp.copyto(o, x)
    xp.copyto(o, _zero(o), where=c)


def _fill_then(xp, c, s, o):  # where(c, s, 0)
    xp.copyto(o, _zero(o))
    xp.copyto(o, o.dtype.type(s), where=c)


def _fill_else(xp, c, s, o):  # where(c, 0, s)
    xp.copyto(o, o.dtype.type(s))
    xp.copyto(o, _zero(o), where=c)


def _astype(xp, x, _, o):
    o[...] = x  # (NumPy's unsafe cast, as astype: floats to integers truncate toward zero)



def _compare(op):  # (a comparison Op's value is its ufunc's name: Op.LT is "less")
    return lambda xp, x, y, o: getattr(xp, op)(x, y, out=o)


def _compare_scalar(op):
    return lambda xp, x, s, o: getattr(xp, op)(x, x.dtype.type(s), out=o)


_TO_SCALAR = {Op.LT: Op.LT_SCALAR, Op.LE: Op.LE_SCALAR, Op.GT: Op.GT_SCALAR, Op.GE: Op.GE_SCALAR,
              Op.EQ: Op.EQ_SCALAR, Op.NE: Op.NE_SCALAR}

ELEMENTWISE = {
    Op.SQRT: lambda xp, x, _, o: xp.sqrt(x, out=o),
    Op.LOG: lambda xp, x, _, o: xp.log(x, out=o),
    Op.RSQRT: _in32(lambda xp, x, _: 1 / xp.sqrt(x)),
    Op.SIGMOID: _in32(_sigmoid),
    Op.SILU: _in32(lambda xp, x, _: x * _sigmoid(xp, x, _)),
    Op.POW: lambda xp, x, s, o: _scalar(xp.power)(xp, x, s, o),
    Op.RPOW: lambda xp, x, s, o: _scalar(xp.power, reflected=True)(xp, x, s, o),
    Op.MAXIMUM: lambda xp, x, y, o: xp.maximum(x, y, out=o),
    Op.MINIMUM: lambda xp, x, y, o: xp.minimum(x, y, out=o),
    Op.MAXIMUM_SCALAR: lambda xp, x, s, o: xp.maximum(x, x.dtype.type(s), out=o),
    Op.MINIMUM_SCALAR: lambda xp, x, s, o: xp.minimum(x, x.dtype.type(s), out=o),
    **{op: _compare(op) for op in _TO_SCALAR},
    **{scalar: _compare_scalar(op) for op, scalar in _TO_SCALAR.items()},
    Op.LOGICAL_NOT: lambda xp, x, _, o: xp.logical_not(x, out=o),
    Op.WHERE_THEN: _then,
    Op.WHERE_ELSE: _else,
    Op.FILL_THEN: _fill_then,
    Op.FILL_ELSE: _fill_else,
    Op.ASTYPE: _astype,
    Op.REDUCE_MAX: lambda xp, x, _, o: xp.max(x, axis=-1, out=o),
    Op.REDUCE_MIN: lambda xp, x, _, o: xp.min(x, axis=-1, out=o),
}
