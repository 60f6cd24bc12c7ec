"""NumPy's quantiles on traced values and sf.Arrays: np.median / quantile / percentile and their NaN-ignoring
forms np.nanmedian / nanquantile / nanpercentile, with NumPy's methods linear (its default), lower, higher,
nearest and midpoint; their entries of the NUMPY table.

A quantile sorts the reduced axes, merged into one, on every device (an axis sharded is gathered first,
as np.sort's) and reads the ranks it needs: fixed ones (q is static), or for the NaN-ignoring forms ranks
of each slice's count of numbers (NaN sorts last), read by np.take_along_axis.  A slice holding NaN gives
NaN (np.quantile), an all-NaN slice NaN (np.nanquantile), as NumPy's; the gradient goes to the elements
read, through the sort's permutation.
"""
from __future__ import annotations

import math

import numpy as np

from shardfuse import dtypes
from shardfuse.numpy_compose import axes_key, axes_last, computed_in, mean_dtypes
from shardfuse.numpy_math import isnan, sort
from shardfuse.spec import reduced_axes
from shardfuse.traced import NUMPY, Traced, describe
from shardfuse.traced_numpy import apply_op, maximum, minimum, where



_METHODS = ("linear", "lower", "higher", "nearest", "midpoint")


def quantile(a, q, axis=None, out=None, overwrite_input=False, method="linear", keepdims=False, *, weights=None):
    """np.quantile: the q-th quantiles (q static, a number or a NumPy array in [0, 1]; the result's
    leading axes are q's) over `axis` with NumPy's methods linear (its default), lower, higher,
    nearest and midpoint; NaN where a slice holds one, as NumPy's.  NumPy's dtypes: lower, higher and
    nearest pick elements (x's dtype); linear and midpoint are floats (integers in float64, and so is
    any x beside a q given as an array or NumPy scalar: NumPy promotes with q's float64)."""
    return _quantile(a, q, axis, out, method, keepdims, weights, "quantile", 1.0)


def nanquantile(a, q, axis=None, out=None, overwrite_input=False, method="linear", keepdims=False, *, weights=None):
    """np.nanquantile: np.quantile of each slice's numbers, NaN left out (NaN for an all-NaN slice)."""
    return _quantile(a, q, axis, out, method, keepdims, weights, "nanquantile", 1.0)


def nanpercentile(a, q, axis=None, out=None, overwrite_input=False, method="linear", keepdims=False, *, weights=None):
    """np.nanpercentile: np.nanquantile of q / 100."""
    return _quantile(a, q, axis, out, method, keepdims, weights, "nanpercentile", 100.0)


def nanmedian(a, axis=None, out=None, overwrite_input=False, keepdims=False):
    """np.nanmedian: np.median of each slice's numbers, NaN left out (NaN for an all-NaN slice)."""
    return _quantile(a, 0.5, axis, out, "linear", keepdims, None, "nanmedian", 1.0)


def percentile(a, q, axis=None, out=None, overwrite_input=False, method="linear", keepdims=False, *, weights=None):
    """np.percentile: np.quantile of q / 100."""
    return _quantile(a, q, axis, out, method, keepdims, weights, "percentile", 100.0)


def median(a, axis=None, out=None, overwrite_input=False, keepdims=False):
    """np.median: the 0.5 quantile (the mean of the two middle elements of an even count)."""
    return _quantile(a, 0.5, axis, out, "linear", keepdims, None, "median", 1.0)


def _quantile(a, q, axis, out, method, keepdims, weights, what, full):
    if out is not None or weights is not None:
        raise TypeError(f"np.{what} with out= or weights= is not supported on shardfuse values (inside "
                        "sf.jit and on sf.Arrays)")
    if method not in _METHODS:
        raise ValueError(f"np.{what}(method={method!r}) is not supported on shardfuse values (inside sf.jit and "
                         f"on sf.Arrays): methods {_METHODS}")
    if isinstance(q, Traced) or hasattr(type(q), "one_op"):
        raise TypeError(f"np.{what}: q must be known when the plan is built (a number, a list or a NumPy array; "
                        "inside sf.jit a static argument, static_argnums=), got a traced value: the ranks it reads "
                        "are fixed by q")
    qs = np.asarray(q, np.float64) / full
    if not np.all((qs >= 0) & (qs <= 1)):
        raise ValueError(f"np.{what}: q must be numbers in [0, {full:g}] known when the plan is built, got {q!r}")
    # (a Python number is weak, as NumPy 2's; a NumPy scalar or array promotes with x's dtype, percentile's
    # q / 100 being a float, as NumPy divides it)
    strong = np.true_divide(q, full).dtype.name if isinstance(q, (np.generic, np.ndarray, list, tuple)) else None
    return apply_op(_quantiles, what, a, tuple(qs.ravel().tolist()), qs.shape, axes_key(axis), method, keepdims,
                    strong, what.endswith("median"), what.startswith("nan"))


def _quantiles(v, qs, q_shape, axis, method, keepdims, strong, median, nan):
    if method in ("lower", "higher", "nearest"):
        dt = wide = v.dtype_name  # (elements picked: x's dtype)
    elif v.dtype_name == "bool" and not median:
        raise TypeError(f"np.quantile(method={method!r}) of the boolean array {describe(v)}: NumPy refuses it (a "
                        "subtraction of booleans); cast first, x.astype('float32'), or use method='lower'")
    else:
        dt, wide = mean_dtypes(v)
        if strong in dtypes.DTYPES and dtypes.is_float(strong):
            dt = dtypes.promote_types(dt, strong)
            wide = computed_in(dt)
    axes = tuple(sorted(reduced_axes(axis, v.ndim, v.shape)))
    # (sorted and b - a taken in x's own computing dtype, the lerp in the result's: NumPy's float32 x with a
    # float64 q subtracts in float32, a review)
    s = sort(axes_last(v, axes).astype(mean_dtypes(v)[1] if dtypes.is_float(wide) else wide), -1)
    n, how = s.shape[-1], "median" if median else method
    if nan and dtypes.is_float(s.dtype_name):  # (each slice's own count of numbers: NaN sorts last)
        count = (~isnan(s)).sum(-1, keepdims=True)
        picked = [_nan_rank(s, q, count, how, wide) for q in qs]
        r = NUMPY[np.stack](picked, 0).reshape(q_shape + picked[0].shape)
        r = where(count[..., 0] == 0, np.nan, r)  # (an all-NaN slice)
    else:
        picked = [_rank(s, q * (n - 1), how, wide) for q in qs]
        r = NUMPY[np.stack](picked, 0).reshape(q_shape + picked[0].shape)
        if dtypes.is_float(wide):
            r = where(isnan(s[..., n - 1]), np.nan, r)  # (sorted NaN last: a slice holding one gives NaN)
    if keepdims:
        r = r.reshape(q_shape + tuple(1 if k in axes else m for k, m in enumerate(v.shape)))
    return r.astype(dt)


def _rank(s, pos, method, wide):
    """The value at fractional rank pos of the sorted last axis, by NumPy's method, in `wide`."""
    lo = math.floor(pos)
    hi = min(lo + 1, s.shape[-1] - 1)
    t = pos - lo
    a, b = s[..., lo], s[..., hi]
    if method == "lower" or t == 0 and method != "linear":  # (linear at t = 0 is NumPy's lerp too: NaN beside inf)
        return a.astype(wide)
    if method == "higher":
        return b.astype(wide)
    if method == "nearest":  # (halves to even, as NumPy's around)
        return (b if round(pos) == hi else a).astype(wide)
    if method == "median":  # (NumPy's median: the mean of the middle two; inf where both are)
        return (a + b).astype(wide) * 0.5
    if method == "midpoint":  # (NumPy's: its lerp at 0.5, which cannot overflow)
        t = 0.5
    d, a, b = (b - a).astype(wide), a.astype(wide), b.astype(wide)
    return b - d * (1 - t) if t >= 0.5 else a + d * t  # (NumPy's _lerp)


def _nan_rank(s, q, count, method, wide):
    """_rank's value at q of each slice's first `count` elements (its numbers): the ranks traced, read by
    np.take_along_axis."""
    last = maximum(count - 1, 0)
    pos = last.astype("float64") * q
    lo = NUMPY[np.floor](pos).astype("int64")
    hi, t = minimum(lo + 1, last), (pos - lo.astype("float64"))[..., 0]

    def at(i):
        return NUMPY[np.take_along_axis](s, i, -1)[..., 0]
    a, b = at(lo), at(hi)
    if method == "lower":
        return a.astype(wide)
    if method == "higher":
        return where(t > 0, b, a).astype(wide)
    if method == "nearest":  # (halves to even, as NumPy's around)
        return at(NUMPY[np.rint](pos).astype("int64")).astype(wide)
    if method == "median":
        return where(t > 0, (a + b).astype(wide) * 0.5, a.astype(wide))
    d, a, b, t = (b - a).astype(wide), a.astype(wide), b.astype(wide), t.astype(wide)
    if method == "midpoint":
        return where(t > 0, b - d * 0.5, a)
    return where(t >= 0.5, b - d * (1 - t), a + d * t)  # (NumPy's _lerp)


NUMPY.update({np.quantile: quantile, np.percentile: percentile, np.median: median, np.nanquantile: nanquantile,
              np.nanpercentile: nanpercentile, np.nanmedian: nanmedian})
