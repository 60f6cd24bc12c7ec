"""NumPy's statistics and NaN-ignoring reductions on traced values and sf.Arrays, as compositions of
ops shardfuse has: np.count_nonzero, np.average, np.ptp, np.nan_to_num, np.nansum / nanmean /
nanmax / nanmin / nanargmax / nanargmin / nanprod / nancumsum / nancumprod / nanvar / nanstd,
np.diagonal / trace; their entries of the NUMPY table (the quantiles: shardfuse/numpy_quantiles.py).

A NaN is masked by `where` before the reduction it would poison, so the reductions shard as
theirs do (a sum over a sharded axis is an Allreduce); an all-NaN slice gives NaN for nanmax /
nanmin / nanmean, as NumPy's (which also warns).  np.diagonal is advanced indexing (rows, cols);
its gradient a scatter into zeros.
"""
from __future__ import annotations

import math

import numpy as np

from shardfuse import dtypes
from shardfuse.numpy_broadcast import broadcast_to
from shardfuse.numpy_compose import axes_key, cumprod, dtype_name, mean_dtypes, prod
from shardfuse.numpy_math import cumsum, isnan
from shardfuse.ops import Op
from shardfuse.spec import normalize_axis, reduced_axes
from shardfuse.traced import NUMPY, describe
from shardfuse.traced_numpy import apply_op, where



# ---- counts, averages, ranges, NaN handling ----
def count_nonzero(a, axis=None, *, keepdims=False):
    """np.count_nonzero: the number of nonzero elements over `axis` (int64)."""
    return apply_op(_count_nonzero, "count_nonzero", a, axes_key(axis), keepdims)


def _count_nonzero(v, axis, keepdims):
    return (v != 0).sum(axis, keepdims=keepdims)


def average(a, axis=None, weights=None, returned=False, *, keepdims=False):
    """np.average: the mean, or with weights= sum(a * w) / sum(w) over `axis` (weights of a's shape,
    or 1-D along the one `axis`, as NumPy's); returned=True: (average, sum of weights)."""
    if isinstance(weights, (list, tuple)):
        weights = np.asarray(weights)
    avg = apply_op(_average, "average", a, axes_key(axis), weights, keepdims)
    # (a second plan outside jit, where a one-op plan makes one result)
    return (avg, apply_op(_weight_sum, "average", a, axes_key(axis), weights, keepdims)) if returned else avg


def _average(v, axis, w, keepdims):
    return _average_and_weight_sum(v, axis, w, keepdims)[0]


def _weight_sum(v, axis, w, keepdims):
    return _average_and_weight_sum(v, axis, w, keepdims)[1]


def _average_and_weight_sum(v, axis, w, keepdims):
    if w is None:
        m = v.astype("float64").mean(axis, keepdims=keepdims) if not dtypes.is_float(v.dtype_name) else v.mean(
            axis, keepdims=keepdims)
        axes = reduced_axes(axis, v.ndim, v.shape)
        return m, m.unary_op(Op.FULL_LIKE, value=math.prod(v.shape[k] for k in axes))  # (not m * 0 + n: inf * 0)
    one = axis[0] if isinstance(axis, tuple) and len(axis) == 1 else axis  # (NumPy 2 takes axis=(k,) too)
    if w.shape != v.shape:
        if one is None or isinstance(one, tuple) or w.ndim != 1 or w.shape[0] != v.shape[
                normalize_axis(one, v.ndim, v.shape)]:
            raise ValueError(f"np.average: weights of shape {w.shape} differ from {describe(v)}: they must be of its "
                             "shape, or 1-D along the one axis= given, as NumPy's")
        ax = normalize_axis(one, v.ndim, v.shape)
        w = w.reshape(tuple(n if k == ax else 1 for k, n in enumerate(v.shape)))
    # (NumPy's result dtype: of a and w, float64 with it where a is integer or boolean; both cast first, so
    # the weights are summed in it, a fuzzer)
    dt = dtypes.promote_types(v.dtype_name, w.dtype_name)
    dt = dtypes.promote_types(dt, "float64") if not dtypes.is_float(v.dtype_name) else dt
    v, w = v.astype(dt), w.astype(dt)
    scale = broadcast_to(w, v.shape).sum(axis, keepdims=keepdims)
    return (v * w).sum(axis, keepdims=keepdims) / scale, scale


def ptp(a, axis=None, out=None, keepdims=False):
    """np.ptp: max - min over `axis` (integers wrap, as NumPy's)."""
    if out is not None:
        raise TypeError("np.ptp with out= is not supported on shardfuse values (inside sf.jit and on sf.Arrays): "
                        "write y = np.ptp(x, axis)")
    return apply_op(_ptp, "ptp", a, axes_key(axis), keepdims)


def _ptp(v, axis, keepdims):
    if v.dtype_name == "bool":
        raise TypeError(f"np.ptp of the boolean array {describe(v)}: NumPy refuses it (a subtraction of booleans)")
    return v.max(axis, keepdims=keepdims) - v.min(axis, keepdims=keepdims)


def nan_to_num(x, copy=True, nan=0.0, posinf=None, neginf=None):
    """np.nan_to_num: NaN to `nan`, +inf to `posinf` (the dtype's largest finite value by default),
    -inf to `neginf` (its most negative); integers and booleans unchanged."""
    if not isinstance(copy, (bool, np.bool_)):
        raise TypeError(f"np.nan_to_num: copy must be a bool, got {type(copy).__name__} (nan=, posinf=, neginf= are "
                        "keywords)")
    return apply_op(_nan_to_num, "nan_to_num", x, nan, posinf, neginf)


def _nan_to_num(v, nan, posinf, neginf):
    if not dtypes.is_float(v.dtype_name):
        return v
    big = _largest(v)
    hi = big if posinf is None else posinf
    lo = -big if neginf is None else neginf
    nan, hi, lo = (np.asarray(c).astype(dtypes.np_dtype(v.dtype_name)).item() for c in (nan, hi, lo))  # (x's dtype)
    return where(isnan(v), nan, where(v == np.inf, hi, where(v == -np.inf, lo, v)))


def _largest(v):
    """The dtype's largest finite value (NumPy's finfo; bfloat16's through ml_dtypes)."""
    if v.dtype_name == "bfloat16":
        return 3.3895313892515355e38  # ((2 - 2**-7) * 2**127)
    return float(np.finfo(dtypes.np_dtype(v.dtype_name)).max)


def _fill_nan(v, fill):
    """v with its NaN elements `fill` (integers and booleans as they are)."""
    return where(isnan(v), fill, v) if dtypes.is_float(v.dtype_name) else v


def _count(v, axis, keepdims):
    return (~isnan(v)).sum(axis, keepdims=keepdims)


def nansum(a, axis=None, dtype=None, out=None, keepdims=False):
    """np.nansum: the sum over `axis` with NaN counted as zero."""
    _no_out(out, "nansum")
    return apply_op(_nansum, "nansum", a, axes_key(axis), dtype_name(dtype), keepdims)


def _nansum(v, axis, dtype, keepdims):
    return _fill_nan(v, 0.0).sum(axis, dtype=dtype, keepdims=keepdims)


def nanmean(a, axis=None, dtype=None, out=None, keepdims=False):
    """np.nanmean: the mean of the elements that are not NaN (NaN for an all-NaN slice)."""
    _no_out(out, "nanmean")
    return apply_op(_nanmean, "nanmean", a, axes_key(axis), dtype_name(dtype), keepdims)


def _nanmean(v, axis, dtype, keepdims):
    if not dtypes.is_float(v.dtype_name):
        return v.mean(axis, dtype=dtype, keepdims=keepdims)
    dt, wide = mean_dtypes(v) if dtype is None else (dtypes.normalize_dtype(dtype),) * 2
    s = where(isnan(v), 0.0, v).astype(wide).sum(axis, keepdims=keepdims)
    return (s / _count(v, axis, keepdims).astype(wide)).astype(dt)


def _nan_extremum(largest):
    def traced(v, axis, keepdims):
        if not dtypes.is_float(v.dtype_name):
            return v.max(axis, keepdims=keepdims) if largest else v.min(axis, keepdims=keepdims)
        w = where(isnan(v), -np.inf if largest else np.inf, v)
        m = w.max(axis, keepdims=keepdims) if largest else w.min(axis, keepdims=keepdims)
        return where(isnan(v).all(axis, keepdims=keepdims), np.nan, m)
    return traced


_nanmax, _nanmin = _nan_extremum(True), _nan_extremum(False)


def nanmax(a, axis=None, out=None, keepdims=False):
    """np.nanmax: the largest element that is not NaN over `axis` (NaN for an all-NaN slice)."""
    _no_out(out, "nanmax")
    return apply_op(_nanmax, "nanmax", a, axes_key(axis), keepdims)


def nanmin(a, axis=None, out=None, keepdims=False):
    """np.nanmin: the smallest element that is not NaN over `axis` (NaN for an all-NaN slice)."""
    _no_out(out, "nanmin")
    return apply_op(_nanmin, "nanmin", a, axes_key(axis), keepdims)


def _nan_arg(largest):
    def traced(v, axis, keepdims):
        pick = NUMPY[np.argmax if largest else np.argmin]
        if not dtypes.is_float(v.dtype_name):
            return pick(v, axis, keepdims=keepdims)
        i = pick(where(isnan(v), -np.inf if largest else np.inf, v), axis, keepdims=keepdims)
        return where(isnan(v).all(axis, keepdims=keepdims), -1, i)
    return traced


_nanargmax, _nanargmin = _nan_arg(True), _nan_arg(False)


def nanargmax(a, axis=None, out=None, *, keepdims=False):
    """np.nanargmax: the index of the largest element that is not NaN (int64); an all-NaN slice gives -1, as
    jnp.nanargmax (NumPy raises, which a compiled plan cannot)."""
    _no_out(out, "nanargmax")
    return apply_op(_nanargmax, "nanargmax", a, axis, bool(keepdims))


def nanargmin(a, axis=None, out=None, *, keepdims=False):
    """np.nanargmin: as np.nanargmax, of the smallest."""
    _no_out(out, "nanargmin")
    return apply_op(_nanargmin, "nanargmin", a, axis, bool(keepdims))


def nanprod(a, axis=None, dtype=None, out=None, keepdims=False):
    """np.nanprod: the product over `axis` with NaN counted as one."""
    _no_out(out, "nanprod")
    return prod(apply_op(_fill_nan, "nanprod", a, 1.0), axis, dtype, None, keepdims)


def nancumsum(a, axis=None, dtype=None, out=None):
    """np.nancumsum: the running sum with NaN counted as zero."""
    _no_out(out, "nancumsum")
    return cumsum(apply_op(_fill_nan, "nancumsum", a, 0.0), axis, dtype)


def nancumprod(a, axis=None, dtype=None, out=None):
    """np.nancumprod: the running product with NaN counted as one."""
    _no_out(out, "nancumprod")
    return cumprod(apply_op(_fill_nan, "nancumprod", a, 1.0), axis, dtype)


def nanvar(a, axis=None, dtype=None, out=None, ddof=0, keepdims=False):
    """np.nanvar: the variance of the elements that are not NaN, divided by their count less ddof."""
    _no_out(out, "nanvar")
    return apply_op(_nanvar, "nanvar", a, axes_key(axis), dtype_name(dtype), ddof, keepdims)


def nanstd(a, axis=None, dtype=None, out=None, ddof=0, keepdims=False):
    """np.nanstd: the square root of np.nanvar."""
    _no_out(out, "nanstd")
    return apply_op(_nanstd, "nanstd", a, axes_key(axis), dtype_name(dtype), ddof, keepdims)


def _nanvar(v, axis, dtype, ddof, keepdims, root=False):
    dt, wide = mean_dtypes(v) if dtype is None else (dtypes.normalize_dtype(dtype),) * 2
    w = v.astype(wide)
    d = where(isnan(w), 0.0, w - _nanmean(w, axis, None, True))
    dof = _count(w, axis, keepdims).astype(wide) - ddof
    # (NumPy's NaN where dof <= 0; divided by 1 there, as JAX's, so no NaN reaches the gradient of the others)
    r = where(dof > 0, (d * d).sum(axis, keepdims=keepdims) / where(dof > 0, dof, 1.0), np.nan)
    return (NUMPY[np.sqrt](r) if root else r).astype(dt)


def _nanstd(v, axis, dtype, ddof, keepdims):
    return _nanvar(v, axis, dtype, ddof, keepdims, root=True)


def _no_out(out, what):
    if out is not None:
        raise TypeError(f"np.{what} with out= is not supported on shardfuse values (inside sf.jit and on sf.Arrays): "
                        "write y = np.{what}(x, ...)")


# ---- diagonals ----
def diagonal(a, offset=0, axis1=0, axis2=1):
    """np.diagonal: the elements (i, i + offset) of axes axis1 and axis2, along a new last axis."""
    if not isinstance(offset, (int, np.integer)):
        raise TypeError(f"np.diagonal: offset must be an int, got {type(offset).__name__} {offset!r}")
    return apply_op(_diagonal, "diagonal", a, int(offset), axis1, axis2)


def _diagonal(v, offset, axis1, axis2):
    a1, a2 = normalize_axis(axis1, v.ndim, v.shape), normalize_axis(axis2, v.ndim, v.shape)
    if a1 == a2:
        raise ValueError(f"np.diagonal of {describe(v)}: axis1 and axis2 cannot be the same")
    rest = [k for k in range(v.ndim) if k not in (a1, a2)]
    w = v.transpose([a1, a2] + rest)
    rows = np.arange(max(0, -offset), max(0, min(w.shape[0], w.shape[1] - offset)))
    d = w[rows, rows + offset]  # (k, *rest): NumPy puts the diagonal last
    return d.transpose(list(range(1, d.ndim)) + [0]) if d.ndim > 1 else d


def trace(a, offset=0, axis1=0, axis2=1, dtype=None, out=None):
    """np.trace: the sum of np.diagonal (integers in int64, as NumPy's sum)."""
    if out is not None:
        raise TypeError("np.trace with out= is not supported on shardfuse values (inside sf.jit and on sf.Arrays): "
                        "write y = np.trace(x)")
    return diagonal(a, offset, axis1, axis2).sum(-1, dtype=dtype)


NUMPY.update({
    np.count_nonzero: count_nonzero, np.average: average, np.ptp: ptp, np.nan_to_num: nan_to_num,
    np.nansum: nansum, np.nanmean: nanmean, np.nanmax: nanmax, np.nanmin: nanmin, np.nanprod: nanprod,
    np.nanargmax: nanargmax, np.nanargmin: nanargmin,
    np.nancumsum: nancumsum, np.nancumprod: nancumprod, np.nanvar: nanvar, np.nanstd: nanstd,
    np.diagonal: diagonal, np.trace: trace,
})
