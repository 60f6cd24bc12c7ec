"""NumPy's functions that are compositions of ops shardfuse has, on traced values and sf.Arrays:
np.clip (x.clip), np.prod / cumprod (x.prod, x.cumprod), np.pad, np.diff, np.fmax / fmin, np.heaviside, np.fabs,
np.positive, np.degrees / radians (rad2deg / deg2rad), np.logaddexp2, np.divmod; their entries of the
NUMPY table.  (The joins, np.hstack & co.: shardfuse/numpy_joins.py; the statistics, np.nanmean, np.median
& co.: shardfuse/numpy_stats.py; the searches: shardfuse/numpy_search.py.)

Each is built of slices, elementwise steps, reductions and concatenations, so it shards as those do (an
axis sliced is made whole first: the plan prints the Allgather) and its
gradient is theirs, exact where the composition is: a product is a tree of pairwise products of
slices (log2(n) elementwise steps; its gradient is the product of the other factors, zeros
included, which a division by x would lose), a cumprod the Hillis-Steele scan of such products.
Integer products wrap as NumPy's (multiplication modulo 2**64 is associative: the same values);
16-bit floats multiply in float32 and round once, as their sums do.  Float products are taken in
another order than NumPy's left to right, so they round differently, and where partial products
overflow to inf and underflow to 0 both (1e200 * 1e200 * 1e-200 * 1e-200) the order decides between
inf and NaN, as a sum's order decides its rounding.
"""
from __future__ import annotations

import math

import numpy as np

from shardfuse import dtypes
from shardfuse.numpy_broadcast import broadcast_to, logaddexp
from shardfuse.numpy_math import isnan
from shardfuse.ops import Op
from shardfuse.spec import normalize_axis, reduced_axes
from shardfuse.traced import NUMPY, Traced, describe
from shardfuse.traced_numpy import apply_op, defaults_only, maximum, minimum, scalar_operands, where


def _along(v, ax, index):
    """v[index] on axis `ax` alone (a slice or an int)."""
    return v[(slice(None),) * ax + (index,)]


def axes_last(v, axes):
    """v with `axes` moved last and merged into one (a view where they are whole; the reshape's rule)."""
    rest = [k for k in range(v.ndim) if k not in axes]
    w = v.transpose(rest + list(axes)) if rest + list(axes) != list(range(v.ndim)) else v
    return w.reshape(tuple(v.shape[k] for k in rest) + (math.prod(v.shape[k] for k in axes),))


def _product_dtype(v, dtype):
    """(the dtype NumPy's prod / cumprod gives, the dtype it is computed in here)."""
    dt = dtypes.normalize_dtype(dtype) if dtype is not None else (
        v.dtype_name if dtypes.is_float(v.dtype_name) else "int64")
    return dt, computed_in(dt)


def mean_dtypes(v):
    """(NumPy's float dtype of v's mean or quantile, the dtype computed in: 16-bit floats in float32, rounded once
    at the end, as sums; integers and booleans in float64, as np.mean's)."""
    dt = v.dtype_name if dtypes.is_float(v.dtype_name) else "float64"
    return dt, computed_in(dt)


def computed_in(dt):
    """The dtype a reduction of dt computes in: 16-bit floats in float32 (rounded once, as sums), else dt."""
    return "float32" if dt in ("float16", "bfloat16") else dt


def _pairwise_product(w):
    """The product of w's last axis: halves multiplied pairwise, an odd element kept aside."""
    left = []
    while w.shape[-1] > 1:
        if w.shape[-1] % 2:
            left.append(w[..., -1])
            w = w[..., :-1]
        w = w[..., 0::2] * w[..., 1::2]
    p = w[..., 0] if w.shape[-1] else w.sum(-1) * 0 + 1  # (the empty product is 1)
    for x in left:
        p = p * x
    return p


def prod(a, axis=None, dtype=None, out=None, keepdims=False, initial=None, where=None):
    """np.prod / x.prod: the product over `axis` (an int, a tuple, None: all) as NumPy's (integers and
    booleans in int64, wrapping as NumPy's; dtype=, keepdims=, initial=, where=); a pairwise tree of
    elementwise products (see the module's docstring)."""
    if out is not None:
        raise TypeError("np.prod with out= is not supported on shardfuse values (inside sf.jit and on sf.Arrays): "
                        "write y = np.prod(x, axis)")
    return apply_op(_prod, "prod", a, axes_key(axis), dtype_name(dtype), keepdims, initial, where)


def axes_key(axis):
    """axis= of a reduction as NumPy takes it: None, an int or a tuple of ints (a list is refused, as NumPy's)."""
    if isinstance(axis, list):
        raise TypeError(f"axis must be an int or a tuple of ints, got the list {axis!r} (as NumPy refuses it)")
    return axis


def dtype_name(dtype):
    """dtype= as shardfuse's name of it (np.float32, 'float32', np.dtype: one plan each), None kept."""
    return None if dtype is None else dtypes.normalize_dtype(dtype)


def _prod(v, axis, dtype, keepdims, initial, mask):
    dt, wide = _product_dtype(v, dtype)
    w = v.astype(wide)
    if mask is not None:
        w = where(mask, w, 1)
    axes = tuple(sorted(reduced_axes(axis, v.ndim, v.shape)))
    p = _pairwise_product(axes_last(w, axes))
    if initial is not None:  # (cast to the result's dtype first, as NumPy's: an int product's initial=1.5 is 1)
        p = p * np.array(initial, dtypes.np_dtype(dt)).astype(dtypes.np_dtype(wide)).item()
    if keepdims:
        p = p.reshape(tuple(1 if k in axes else n for k, n in enumerate(v.shape)))
    return p.astype(dt)


def cumprod(a, axis=None, dtype=None, out=None):
    """np.cumprod / x.cumprod: the running product along `axis` (None: of the flattened array), NumPy's
    dtypes; log2(n) elementwise steps (y[k] *= y[k - d] for d = 1, 2, 4, ...) along a whole axis."""
    if out is not None:
        raise TypeError("np.cumprod with out= is not supported on shardfuse values (inside sf.jit and on sf.Arrays): "
                        "write y = np.cumprod(x, axis)")
    return apply_op(_cumprod, "cumprod", a, axis, dtype_name(dtype))


def _cumprod(v, axis, dtype):
    dt, wide = _product_dtype(v, dtype)
    w = v.astype(wide)
    if axis is None:
        w, ax = w.reshape(-1), 0
    else:
        ax = normalize_axis(axis, v.ndim, v.shape)
    w = w if ax == w.ndim - 1 else w.swapaxes(ax, -1)
    d = 1
    while d < w.shape[-1]:
        w = NUMPY[np.concatenate]([w[..., :d], w[..., d:] * w[..., :-d]], axis=-1)
        d *= 2
    w = w if ax == w.ndim - 1 else w.swapaxes(ax, -1)
    return w.astype(dt)


def diff(a, n=1, axis=-1, prepend=None, append=None):
    """np.diff: the n-th differences along `axis` (of booleans: not_equal, as NumPy's), prepend= /
    append= joined first (a scalar broadcast to one slice); slices of a whole axis and a subtraction."""
    if not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"np.diff: order n must be a non-negative int, got {n!r}")
    prepend, append = (e if e is None or hasattr(type(e), "one_op") or isinstance(e, Traced) else np.asarray(e)
                       for e in (prepend, append))  # (NumPy's asanyarray: a scalar or a list an array)
    return apply_op(_diff, "diff", a, int(n), axis, prepend, append)


def _diff(v, n, axis, prepend, append):
    ax = normalize_axis(axis, v.ndim, v.shape)
    side = v.shape[:ax] + (1,) + v.shape[ax + 1:]  # (a scalar or 0-d prepend / append: one slice of it)
    parts = [e if e.ndim else broadcast_to(e, side) for e in (prepend, append) if e is not None]
    if parts:
        v = NUMPY[np.concatenate]([parts[0], v, parts[1]] if len(parts) == 2 else
                                  [parts[0], v] if prepend is not None else [v, parts[0]], axis=ax)
    for _ in range(n):
        hi, lo = _along(v, ax, slice(1, None)), _along(v, ax, slice(None, -1))
        v = hi != lo if v.dtype_name == "bool" else hi - lo
    return v


def pad(array, pad_width, mode="constant", **kwargs):
    """np.pad with mode "constant" (constant_values=, per axis and side as NumPy's), "edge", "wrap",
    "reflect" or "symmetric": each padded axis the concatenation of its pads and itself (constants
    broadcast from a slice, the others slices of the axis, reversed for reflect and symmetric), so a
    padded axis is made whole and the others keep their sharding.  Pads wider than the axis are
    refused for the modes that copy it (NumPy repeats them)."""
    if mode not in ("constant", "edge", "wrap", "reflect", "symmetric"):
        raise ValueError(f"np.pad(mode={mode!r}) is not supported on shardfuse values (inside sf.jit and on "
                         "sf.Arrays): modes constant, edge, wrap, reflect and symmetric are")
    unknown = set(kwargs) - ({"constant_values"} if mode == "constant" else set())
    if unknown:
        raise TypeError(f"np.pad(mode={mode!r}) got unsupported keyword(s) {sorted(unknown)}")
    ndim = np.ndim(array)
    widths = _pairs(pad_width, ndim, "pad_width", int)
    if any(b < 0 or a < 0 for b, a in widths):
        raise ValueError(f"np.pad: index can't contain negative values (pad_width={pad_width!r})")
    values = _pairs(kwargs.get("constant_values", 0), ndim, "constant_values", None)
    if mode == "constant":  # (NumPy's cast of them to the array's dtype, refusals included: NaN or 2**40 into int32)
        dt = dtypes.np_dtype(dtypes.normalize_dtype(array.dtype))
        values = tuple(tuple(np.array(c, dt).item() for c in pair) for pair in values)
    return apply_op(_pad, "pad", array, widths, mode, values)


def _pairs(spec, ndim, what, kind):
    """NumPy's per-axis (before, after) of an int, a pair or one pair per axis, as a tuple of tuples."""
    try:
        arr = np.broadcast_to(np.asarray(spec), (ndim, 2))
    except ValueError:
        raise ValueError(f"np.pad: {what}={spec!r} must broadcast to ({ndim}, 2): a value, a (before, after) pair, "
                         "or one pair per axis") from None
    if kind is int and arr.dtype.kind not in "iu":
        raise TypeError(f"np.pad: {what} must be integers, got {spec!r}")
    return tuple(tuple(x.item() for x in row) for row in arr)


def _pad(v, widths, mode, values):
    what = describe(v)
    for ax, ((b, a), (cb, ca)) in enumerate(zip(widths, values)):
        n = v.shape[ax]
        if not b and not a:
            continue
        if mode != "constant" and (n == 0 or max(b, a) > n - (mode == "reflect")):
            raise ValueError(f"np.pad(mode={mode!r}) of {what}: pads ({b}, {a}) on axis {ax} of extent {n} "
                             f"are wider than the axis{' less one' if mode == 'reflect' else ''}; shardfuse pads "
                             "once (NumPy repeats)")
        parts = [_pad_side(v, ax, b, mode, cb, before=True), v, _pad_side(v, ax, a, mode, ca, before=False)]
        v = NUMPY[np.concatenate]([p for p in parts if p is not None], axis=ax)
    return v


def _pad_side(v, ax, k, mode, value, before):
    if not k:
        return None
    n = v.shape[ax]
    shape = v.shape[:ax] + (k,) + v.shape[ax + 1:]
    if mode == "constant":  # (value: cast to v's dtype by pad)
        c = np.array(value, dtypes.np_dtype(v.dtype_name))
        return broadcast_to(v.builder.constant(c.reshape((1,) * v.ndim)), shape)
    if mode == "edge":
        return broadcast_to(_along(v, ax, slice(0, 1) if before else slice(n - 1, n)), shape)
    if mode == "wrap":
        return _along(v, ax, slice(n - k, n) if before else slice(0, k))
    # reflect leaves the edge out (k, ..., 1 before), symmetric repeats it (k - 1, ..., 0)
    start = k - (mode == "symmetric") if before else n - 1 - (mode == "reflect")
    stop = start - k
    return _along(v, ax, slice(start, stop if stop >= 0 else None, -1))


_UNSET = object()  # (a bound not given, as NumPy's _NoValue: np.clip(x, lo) lacks a_max; None is no bound)


def clip(a, a_min=_UNSET, a_max=_UNSET, out=None, *, min=_UNSET, max=_UNSET, **rest):  # noqa: A002 (NumPy's names)
    """np.clip / x.clip: minimum(maximum(x, lo), hi) (jnp.clip's form: NaN kept, hi where lo > hi,
    the gradient maximum's and minimum's); a bound None is no bound; bounds arrays or scalars."""
    defaults_only("np.clip", "np.clip(x, lo, hi)", out=out, **rest)
    given = [b is not _UNSET for b in (a_min, a_max, min, max)]  # (by identity: == of an array bound is elementwise)
    if not all(given[:2]) if not any(given[2:]) else any(given[:2]):  # (NumPy's refusals)
        raise TypeError("np.clip takes both bounds, np.clip(x, lo, hi) (None: no bound), or min= / max= alone")
    lo, hi = (a_min, a_max) if any(given[:2]) else (min, max)
    return apply_op(_clip, "clip", a, None if lo is _UNSET else lo, None if hi is _UNSET else hi)


def _clip(x, lo, hi):
    for b in (lo, hi):  # (NumPy's dtype is of all three at once: a bool x and an int32 bound is int32, a probe)
        x = x.promote_with(b, Op.MAXIMUM)[0] if isinstance(b, Traced) else x.with_scalar(b, Op.MAXIMUM)[0] \
            if isinstance(b, np.generic) else x
    if lo is not None:
        x = maximum(x, lo)
    return x if hi is None else minimum(x, hi)


def _elementwise(name, traced, doc):
    """The public function of a traced composition of elementwise steps (made once: outside jit it
    keys the one-op plan cache)."""
    def fn(*args):
        return apply_op(traced, name, *args)
    fn.__name__, fn.__doc__ = name, doc
    return fn


def _fmax(a, b):
    a, b = scalar_operands(a, b, Op.MAXIMUM)
    if not dtypes.is_float(a.dtype_name):
        return maximum(a, b)
    return where(isnan(b), a, where(isnan(a), b, maximum(a, b)))


def _fmin(a, b):
    a, b = scalar_operands(a, b, Op.MINIMUM)
    if not dtypes.is_float(a.dtype_name):
        return minimum(a, b)
    return where(isnan(b), a, where(isnan(a), b, minimum(a, b)))


def _floats(a, b):
    """(a, b) promoted, then in NumPy's float dtype of them (integers in float64, booleans in float16)."""
    a, b = scalar_operands(a, b, Op.MAXIMUM)
    dt = dtypes.float_result(a.dtype_name)
    return a.astype(dt), b.astype(dt)


def _heaviside(a, b):
    a, b = _floats(a, b)
    return where(isnan(a), a, where(a < 0, 0.0, where(a > 0, 1.0, b)))


def _fabs(v):
    return abs(v.astype(dtypes.float_result(v.dtype_name)))


def _scaled(v, double, single):
    """v * NumPy's constant of np.degrees / np.radians: the double one for float64, the float one
    (180f / pi_f, pi_f / 180f) for the others, 16-bit floats multiplied in float32 and rounded once."""
    dt = dtypes.float_result(v.dtype_name)
    if dt == "float64":
        return v.astype(dt) * double
    return (v.astype("float32") * float(single)).astype(dt)


def _degrees(v):
    return _scaled(v, 180 / math.pi, np.float32(180) / np.float32(math.pi))


def _radians(v):
    return _scaled(v, math.pi / 180, np.float32(math.pi) / np.float32(180))


def _logaddexp2(a, b):
    """log2(2**a + 2**b) = logaddexp(a ln 2, b ln 2) / ln 2."""
    a, b = _floats(a, b)
    return logaddexp(a * math.log(2), b * math.log(2)) * (1 / math.log(2))


def _positive(v):
    if v.dtype_name == "bool":
        raise TypeError(f"np.positive of the boolean array {describe(v)}: NumPy has no positive of booleans")
    return v * 1  # (a copy: -0.0 kept, where v + 0 is +0.0)


def divmod_(x1, x2):
    """np.divmod / divmod(x, y): (x // y, x % y), NumPy's floor division and remainder."""
    return NUMPY[np.floor_divide](x1, x2), NUMPY[np.mod](x1, x2)


fmax = _elementwise("fmax", _fmax, "np.fmax: the larger of two elements, NaN ignored (NaN only where both are).")
fmin = _elementwise("fmin", _fmin, "np.fmin: the smaller of two elements, NaN ignored (NaN only where both are).")
heaviside = _elementwise("heaviside", _heaviside, "np.heaviside(x, h0): 0 below 0, 1 above, h0 at 0, NaN for NaN.")
fabs = _elementwise("fabs", _fabs, "np.fabs: |x| as a float (integers in float64, as NumPy's).")
degrees = _elementwise("degrees", _degrees, "np.degrees / np.rad2deg: x * 180 / pi.")
radians = _elementwise("radians", _radians, "np.radians / np.deg2rad: x * pi / 180.")
logaddexp2 = _elementwise("logaddexp2", _logaddexp2, "np.logaddexp2: log2(2**a + 2**b) without overflow.")
positive = _elementwise("positive", _positive, "np.positive: +x (a copy; of booleans refused, as NumPy's).")

NUMPY.update({
    np.clip: clip, np.divmod: divmod_,
    np.prod: prod, np.cumprod: cumprod, np.diff: diff, np.pad: pad, np.fmax: fmax,
    np.fmin: fmin, np.heaviside: heaviside, np.fabs: fabs, np.degrees: degrees, np.rad2deg: degrees,
    np.radians: radians, np.deg2rad: radians, np.logaddexp2: logaddexp2, np.positive: positive,
})
