"""Allreduce with max or min, with NumPy's NaN rule (a NaN anywhere gives NaN), for any array module xp.

MPI's MAX / MIN (Open MPI and MPICH: `a > b ? a : b`) and NCCL's ncclMax / ncclMin (fmax-like on
floats) do not propagate NaN as NumPy's max does: the result depends on which rank holds the NaN,
or the NaN is dropped.  So the plan moves floats (and bools) as order-preserving integer keys
(passes/lower.py: `OrderKeys`, then the Allreduce with op=max / min, then `FromOrderKeys`): the
IEEE-754 bits of the value in float32 (float64 for float64; 16-bit floats widen exactly), with
a negative's magnitude bits flipped, so that integer order is float order, and every NaN the
largest key for max and the smallest for min.  The integer max or min, which every library gets
right, decodes back (that key to a NaN).  Integers need no keys.
"""
from __future__ import annotations

import numpy as np

from shardfuse.ops import Reduce



def _wide(dtype):
    return (np.float64, np.int64) if np.dtype(dtype) == np.float64 else (np.float32, np.int32)


def to_keys(xp, x, op, out):
    """Order-preserving integer keys of x (floats or bools) into out (key_dtype's)."""
    if x.dtype.kind == "b":
        out[...] = x
        return
    f, i = _wide(x.dtype)
    v = x.astype(f) if x.dtype != f else x
    bits = v.view(i)
    flip = i(np.iinfo(i).max)
    nan = i(np.iinfo(i).max if op == Reduce.MAX else np.iinfo(i).min)
    out[...] = xp.where(xp.isnan(v), nan, xp.where(bits < 0, bits ^ flip, bits))


def from_keys(xp, keys, op, out):
    """The values (out's dtype) the keys of to_keys stand for; the NaN key gives NaN."""
    if out.dtype.kind == "b":
        out[...] = keys != 0
        return
    f, i = _wide(out.dtype)
    flip = i(np.iinfo(i).max)
    nan = i(np.iinfo(i).max if op == Reduce.MAX else np.iinfo(i).min)
    bits = xp.where(keys < 0, keys ^ flip, keys).astype(i)
    out[...] = xp.where(keys == nan, f(np.nan), bits.view(f))
