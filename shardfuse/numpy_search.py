"""NumPy's searches on traced values and sf.Arrays, as compositions of comparisons and sums:
np.searchsorted, np.digitize, np.isin and np.interp; their entries of the NUMPY table.

np.searchsorted(a, v) counts, for each v, the elements of the sorted 1-D `a` before it (side="left":
a < v; "right": a <= v), in NumPy's sort order (NaN after every number, so a NaN v goes after the
numbers of a, as NumPy's): a [.., n] comparison of v's elements with a's, summed over a's axis.  It
costs len(a) elements per element of v (no binary search: the plan's shapes are static, and a GPU
compares them all at once), and an `a` sharded is summed where it lies (one Allreduce of the counts).
np.isin compares each element with every test element the same way.  np.interp finds each x's
interval with searchsorted and reads its ends with sf.take; its gradient (in x, xp and fp) is the
ops'.  The results are NumPy's: int64 positions, boolean tests, float64 interpolants.
"""
from __future__ import annotations

import math

import numpy as np

from shardfuse import dtypes
from shardfuse.numpy_math import isnan
from shardfuse.ops import Op
from shardfuse.traced import NUMPY, Traced, describe
from shardfuse.traced_numpy import apply_op, where


def searchsorted(a, v, side="left", sorter=None):
    """np.searchsorted: where each v would go in the sorted 1-D `a` (int64; see the module's docstring)."""
    if side not in ("left", "right"):
        raise ValueError(f"np.searchsorted: side must be 'left' or 'right', got {side!r}")
    return apply_op(_searchsorted, "searchsorted", a, v, side == "right", sorter)


def _searchsorted(a, v, right, sorter):
    if not isinstance(a, Traced) or a.ndim != 1:
        raise ValueError(f"np.searchsorted: a must be a 1-D array, got {describe(a) if isinstance(a, Traced) else a!r}")
    if sorter is not None:
        a = NUMPY[np.take](a, sorter)
    w = v if isinstance(v, Traced) else a.builder.constant(np.asarray(v))
    col = w.reshape(w.shape + (1,))
    if dtypes.is_float(a.dtype_name) or dtypes.is_float(w.dtype_name):  # (NumPy's order: NaN last)
        before = (a <= col) | isnan(col) if right else (a < col) | (isnan(col) & ~isnan(a))
    else:
        before = a <= col if right else a < col
    return before.sum(-1)


def digitize(x, bins, right=False):
    """np.digitize: the index of the bin each x falls in, for monotonic bins (searchsorted of x in bins,
    side "right" unless right=True; decreasing bins read backwards, as NumPy's).  Bins known when the
    plan is built are checked to be monotonic, as NumPy's; traced bins are taken as increasing where
    bins[0] <= bins[-1], else decreasing (both counts made, one picked)."""
    b = None if isinstance(bins, Traced) or hasattr(type(bins), "one_op") else np.asarray(bins)
    rising = None
    if b is not None:
        steps = np.diff(b)
        if not ((steps >= 0).all() or (steps <= 0).all()):
            raise ValueError("np.digitize: bins must be monotonically increasing or decreasing")
        rising = bool((steps >= 0).all())
    return apply_op(_digitize, "digitize", x, bins, bool(right), rising)


def _digitize(x, bins, right, rising):
    side = not right  # (searchsorted's right=)
    if rising is True:
        return _searchsorted(bins, x, side, None)
    falling = bins.shape[0] - _searchsorted(bins[::-1], x, side, None)  # (NumPy's: the same side, reversed)
    if rising is False:
        return falling
    return where(bins[0] <= bins[bins.shape[0] - 1], _searchsorted(bins, x, side, None), falling)


def isin(element, test_elements, assume_unique=False, invert=False, *, kind=None):
    """np.isin: whether each element is among test_elements (a boolean of element's shape; NaN never is,
    as NumPy's); invert=True: whether it is not."""
    return apply_op(_isin, "isin", element, test_elements, bool(invert))


def _isin(e, t, invert):
    e = e if isinstance(e, Traced) else t.builder.constant(np.asarray(e))
    t = t if isinstance(t, Traced) else e.builder.constant(np.asarray(t))
    if not math.prod(t.shape):  # (no test elements: nothing is in them)
        return e.unary_op(Op.FULL_LIKE, "bool", value=bool(invert))
    found = (e.reshape(e.shape + (1,)) == t.reshape(-1)).any(-1)
    return ~found if invert else found


def interp(x, xp, fp, left=None, right=None, period=None):
    """np.interp: the piecewise-linear interpolant through (xp, fp) (xp increasing) at x, float64, fp[0]
    (left=) below xp[0] and fp[-1] (right=) above xp[-1], NaN for a NaN x; period= is refused."""
    if period is not None:
        raise TypeError("np.interp(period=) is not supported on shardfuse values (inside sf.jit and on sf.Arrays)")
    return apply_op(_interp, "interp", x, xp, fp, left, right)


def _interp(x, xp, fp, left, right):
    x, xp, fp = (v.astype("float64") if isinstance(v, Traced) else np.asarray(v, np.float64) for v in (x, xp, fp))
    b = next(v for v in (x, xp, fp) if isinstance(v, Traced)).builder
    x, xp, fp = (b.constant(v) for v in (x, xp, fp))
    n = xp.shape[0]
    if xp.ndim != 1 or fp.shape != (n,) or n == 0:
        raise ValueError(f"np.interp: xp and fp must be 1-D of one non-zero length, got {xp.shape} and {fp.shape}")
    if n == 1:
        y = where(x == x, fp[0], fp[0])  # (fp[0] everywhere, NaN x included, as NumPy's)
    else:
        j = NUMPY[np.clip](_searchsorted(xp, x, True, None) - 1, 0, n - 2)
        x0, x1 = NUMPY[np.take](xp, j), NUMPY[np.take](xp, j + 1)
        y0, y1 = NUMPY[np.take](fp, j), NUMPY[np.take](fp, j + 1)
        y = where(x == xp[n - 1], fp[n - 1], y0 + (y1 - y0) / (x1 - x0) * (x - x0))  # (the last point exactly)
    y = where(x < xp[0], fp[0] if left is None else left, y)
    return where(x > xp[n - 1], fp[n - 1] if right is None else right, y)


NUMPY.update({np.searchsorted: searchsorted, np.digitize: digitize, np.isin: isin, np.interp: interp})
