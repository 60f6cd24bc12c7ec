"""NumPy's shape functions and x-shaped constants, inside sf.jit and on sf.Arrays outside it:
np.ravel / x.ravel / x.flatten, np.squeeze / x.squeeze, np.expand_dims, np.moveaxis, np.matrix_transpose /
x.mT, np.take_along_axis (a comparison with np.arange and a sum, as sf.nn.cross_entropy's), np.copy / x.copy,
np.tril / np.triu (a constant mask and a where), np.roll (two slices joined), np.ones_like / np.zeros_like / np.full_like, np.shape / np.ndim / np.size.

Each is written with an op shardfuse has, so its sharding is that op's: ravel, squeeze and
expand_dims are reshapes (a view where no sharded axis is cut; a cut one is gathered first,
printed), a copy is a new value (outside jit: new buffers, the sharding kept), and the *_like
constants are `full_like` steps with the input's sharding (no communication; a pending sum is
made whole first, as for every nonlinear op).  On sf.Arrays each call is a one-op plan.
"""
from __future__ import annotations

import math

import numpy as np

from shardfuse import dtypes
from shardfuse.ops import Op
from shardfuse.spec import normalize_axis, reduced_axes
from shardfuse.traced import NUMPY, Traced, cast, describe, is_weak_scalar
from shardfuse.traced_numpy import apply_op, maximum, minimum, where


def _order_c(what, order, allowed=("C",)):
    if order not in allowed:
        memory = " ('K' and 'A' follow a memory layout, which shardfuse values do not have: JAX refuses 'K' too)" \
            if order in ("K", "A") else ""
        raise TypeError(f"{what}(..., order={order!r}) is not supported on shardfuse values (inside sf.jit and on "
                        f"sf.Arrays): they are read in C order{memory}; write it without order=")


def ravel(a, order="C"):
    """np.ravel / x.ravel / x.flatten: x.reshape(-1), C order (a sharded inner axis is gathered first); 'K' and
    'A' are refused (NumPy reads a transposed view's memory order: a.T.ravel('K') is not a.T.ravel())."""
    _order_c("np.ravel", order)
    return a.reshape(-1)


def squeeze(a, axis=None):
    """np.squeeze / x.squeeze: the axes of extent 1 removed (all of them, or those `axis` names,
    each of extent 1, as NumPy's), a reshape."""
    if axis is None:
        axes = tuple(k for k, n in enumerate(a.shape) if n == 1)
    else:
        axes = reduced_axes(tuple(axis) if isinstance(axis, list) else axis, len(a.shape), a.shape)
        bad = [k for k in axes if a.shape[k] != 1]
        if bad:
            raise ValueError(f"squeeze of {describe(a)}: cannot select an axis to squeeze out which has size not "
                             f"equal to one (axis {bad[0]} has extent {a.shape[bad[0]]})")
    return a.reshape(tuple(n for k, n in enumerate(a.shape) if k not in axes))


def expand_dims(a, axis):
    """np.expand_dims: axes of extent 1 inserted at `axis` (an int or a tuple, placed in the result
    as NumPy places them), a reshape."""
    axes = axis if isinstance(axis, (tuple, list)) else (axis,)
    ndim = len(a.shape) + len(axes)
    where = sorted(normalize_axis(k, ndim, a.shape) for k in axes)
    if len(set(where)) != len(where):
        raise ValueError(f"np.expand_dims: repeated axis in axis={axis!r}")
    rest = iter(a.shape)
    return a.reshape(tuple(1 if k in where else next(rest) for k in range(ndim)))


def _copy_traced(v):
    return v.reshape(v.shape)  # (a new value: inside jit, annotations of it start afresh, as x[:]'s)


def copy(a, order="K", subok=False):
    """np.copy / x.copy: the same values as a new array (outside jit new buffers, the sharding
    kept: a donated original leaves the copy intact)."""
    _order_c("np.copy", order, ("C", "K", "A"))
    return apply_op(_copy_traced, np.copy.__name__, a)


def _full_traced(v, value, dtype):
    dt = dtype or v.dtype_name
    c = float(value) if dtypes.is_float(dt) else bool(value) if dt == "bool" else int(value)
    return v.unary_op(Op.FULL_LIKE, dt, value=c)


def full_like(a, fill_value, dtype=None, order="K", subok=True, shape=None, *, device=None):
    """np.full_like: an array of a's shape, sharding and dtype (or `dtype`) holding `fill_value`
    (a scalar) in every element, as NumPy's (cast to the dtype)."""
    if shape is not None or device is not None:
        raise TypeError("np.*_like with shape= or device= is not supported on shardfuse values (inside sf.jit and on "
                        "sf.Arrays): the result has the input's shape and sharding; write np.ones_like(x), or make "
                        "the array outside and pass it in")
    _order_c("np.full_like", order, ("C", "K", "A"))
    if not is_weak_scalar(fill_value):
        raise TypeError(f"np.full_like: fill_value must be a Python or NumPy scalar inside sf.jit and on sf.Arrays, got "
                        f"{type(fill_value).__name__}; for an array write np.where(True, value, x) or x * 0 + value")
    dt = None if dtype is None else dtypes.normalize_dtype(dtype)
    return apply_op(_full_traced, np.full_like.__name__, a, fill_value, dt)


def ones_like(a, dtype=None, order="K", subok=True, shape=None, *, device=None):
    """np.ones_like: np.full_like(a, 1, dtype)."""
    return full_like(a, 1, dtype, order, subok, shape, device=device)


def zeros_like(a, dtype=None, order="K", subok=True, shape=None, *, device=None):
    """np.zeros_like: np.full_like(a, 0, dtype)."""
    return full_like(a, 0, dtype, order, subok, shape, device=device)


def size(a, axis=None):
    """np.size: the number of elements (of one axis, with axis=), known without the values."""
    return math.prod(a.shape) if axis is None else a.shape[normalize_axis(axis, len(a.shape), a.shape)]


def moveaxis(a, source, destination):
    """np.moveaxis: the axes `source` moved to `destination` (ints or sequences of them), the others
    kept in order, as NumPy's; a transpose (each axis keeps its sharding)."""
    n = len(a.shape)

    def axes(v):
        return [normalize_axis(k, n, a.shape) for k in (v if isinstance(v, (tuple, list)) else (v,))]
    src, dst = axes(source), axes(destination)
    if len(src) != len(dst):
        raise ValueError("np.moveaxis: `source` and `destination` arguments must have the same number of elements")
    if len(set(src)) != len(src) or len(set(dst)) != len(dst):
        raise ValueError(f"np.moveaxis: repeated axis in source={source!r} or destination={destination!r}")
    order = [k for k in range(n) if k not in src]
    for d, s in sorted(zip(dst, src)):
        order.insert(d, s)
    return a.transpose(tuple(order))


def flip(m, axis=None):
    """np.flip: the order of the elements along `axis` (an int, a tuple, None: every axis) reversed, as
    NumPy's (m[::-1] along each: a view of a whole axis, a slice with step -1)."""
    n = len(m.shape)
    given = range(n) if axis is None else axis if isinstance(axis, (tuple, list)) else (axis,)
    axes = [normalize_axis(k, n, m.shape) for k in given]
    if len(set(axes)) != len(axes):
        raise ValueError(f"np.flip: repeated axis in axis={axis!r}")
    return m[tuple(slice(None, None, -1) if k in axes else slice(None) for k in range(n))] if n else m


def _band(keep):
    """np.tril / np.triu: where(np.tril(ones) / np.triu(ones), m, 0) over the last two axes, as
    NumPy's (the mask a constant, replicated: no communication whatever m's sharding)."""
    def band(m, k=0):
        if len(m.shape) < 2:
            raise ValueError(f"np.{keep.__name__} of {describe(m)}: shardfuse's needs at least 2 dimensions "
                             "(NumPy's makes a 1-D input a square matrix first)")
        mask = keep(np.ones(m.shape[-2:], bool), int(k))
        return where(mask, m, False if m.dtype == np.bool_ else 0)
    band.__name__ = keep.__name__
    return band


def matrix_transpose(x):
    """np.matrix_transpose / x.mT: the last two axes swapped (a transpose: each axis keeps its sharding)."""
    if len(x.shape) < 2:
        raise ValueError(f"np.matrix_transpose / x.mT of {describe(x) if isinstance(x, Traced) else x.shape}: the "
                         "array must have at least 2 dimensions (as NumPy's)")
    return x.swapaxes(-1, -2)


def take_along_axis(arr, indices, axis=-1):
    """np.take_along_axis as NumPy's: out[..., j, ...] = arr[..., indices[..., j, ...], ...] along `axis`
    (None: of the flattened array, with 1-D indices), indices int32 / int64 of arr's rank, the other
    axes broadcast; negative indices count from the end and those outside [-n, n) are clamped to the
    first or last element, as sf.take's (NumPy raises).  The cross-entropy's target gather,
    np.take_along_axis(logp, labels[..., None], -1), as sf.nn.cross_entropy picks the target: no
    gather of the array, each index compared with np.arange(n) (a constant) and where(hit, arr, 0)
    summed along the axis.  It costs k * n elements per row (k the indices' extent along the axis, n
    arr's): one pass over arr for one index per row; a large k (a permutation from np.argsort) is k
    passes, better done outside on gathered NumPy arrays.  With the axis sharded each device sums its
    part and one Allreduce of the [.., k] result combines them; other axes keep their sharding.  The
    gradient (of arr) is the where's and the sum's: the cotangent at the picked elements."""
    return apply_op(_take_along_axis, "take_along_axis", arr, indices, axis)


def _take_along_axis(arr, ids, axis):
    if not (isinstance(arr, Traced) and isinstance(ids, Traced) and ids.dtype_name in ("int32", "int64")):
        raise TypeError(f"np.take_along_axis of {describe(arr)} at {describe(ids)}: arr must be an array and indices "
                        "an integer array (int32 or int64) inside sf.jit and on sf.Arrays")
    if axis is None:
        if ids.ndim != 1:
            raise ValueError(f"np.take_along_axis(..., axis=None): indices {describe(ids)} must be 1-D (as NumPy's)")
        arr, axis = arr.reshape(-1), 0
    if ids.ndim != arr.ndim:
        raise ValueError(f"np.take_along_axis: indices {describe(ids)} and arr {describe(arr)} must have the same "
                         "number of dimensions (as NumPy's: write indices[..., None] for one index per row)")
    ax = normalize_axis(axis, arr.ndim, arr.shape)
    n, k = arr.shape[ax], ids.shape[ax]
    try:
        np.broadcast_shapes(arr.shape[:ax] + arr.shape[ax + 1:], ids.shape[:ax] + ids.shape[ax + 1:])
    except ValueError:
        raise ValueError(f"np.take_along_axis: the axes other than {ax} of {describe(arr)} and {describe(ids)} do "
                         "not broadcast") from None
    perm = [j for j in range(arr.ndim) if j != ax] + [ax]  # (the axis last: a transpose, a view)
    a, i = (v if ax == arr.ndim - 1 else v.transpose(perm) for v in (arr, ids))
    i = minimum(maximum(where(i < 0, i + n, i), 0), n - 1)
    every = np.arange(n, dtype=ids.dtype)  # (a constant: the axis's sharding slices it)
    zero = False if arr.dtype_name == "bool" else 0
    if k == 1:
        picked = where(i == every, a, zero).sum(-1, keepdims=True)
    else:  # [.., k, n]: each of the k indices compared with every element of its row
        picked = where(i.reshape(i.shape + (1,)) == every, a.reshape(a.shape[:-1] + (1, n)), zero).sum(-1)
    picked = cast(picked, arr.dtype_name) if arr.dtype_name != "bool" else picked > 0
    return picked if ax == arr.ndim - 1 else picked.transpose([perm.index(j) for j in range(arr.ndim)])


def roll(a, shift, axis=None):
    """np.roll: the elements shifted by `shift` along `axis` (ints, or tuples of them, static; None: of the flattened
    array, as NumPy's), those past the end back at the start: two slices joined (a sharded axis is gathered first,
    as a slice's; the rest keep their sharding)."""
    return apply_op(_roll_traced, np.roll.__name__, a, shift, axis)


def _roll_traced(v, shift, axis):
    from shardfuse.shape_ops import concatenate

    if any(isinstance(a, Traced) or hasattr(type(a), "one_op") for a in (shift, axis)):
        raise TypeError(f"np.roll of {describe(v)}: shift and axis must be Python ints (static: the two slices' "
                        "extents are shapes); for a shift known when the plan runs write sf.take(x, (np.arange(n) - "
                        "shift) % n, axis)")
    if axis is None:
        return _roll_traced(v.reshape(-1), shift, 0).reshape(v.shape)
    shifts, axes = np.broadcast_arrays(np.asarray(shift), np.asarray(axis))
    if shifts.ndim > 1 or shifts.dtype.kind not in "iu" or axes.dtype.kind not in "iu":
        raise TypeError(f"np.roll of {describe(v)}: shift and axis must be Python ints or tuples of them (static), got "
                        f"shift={shift!r}, axis={axis!r}")
    for k, ax in zip(shifts.reshape(-1), axes.reshape(-1)):
        ax = normalize_axis(int(ax), v.ndim, v.shape)
        n = v.shape[ax]
        k = int(k) % n if n else 0
        if k:
            cut = (slice(None),) * ax
            v = concatenate([v[cut + (slice(n - k, n),)], v[cut + (slice(0, n - k),)]], ax)
    return v


NUMPY.update({
    np.roll: roll, np.matrix_transpose: matrix_transpose, np.take_along_axis: take_along_axis,
    np.moveaxis: moveaxis, np.tril: _band(np.tril), np.triu: _band(np.triu), np.flip: flip,
    np.flipud: lambda m: flip(m, 0), np.fliplr: lambda m: flip(m, 1),
    np.ravel: ravel, np.squeeze: squeeze, np.expand_dims: expand_dims, np.copy: copy,
    np.full_like: full_like, np.ones_like: ones_like, np.zeros_like: zeros_like,
    np.shape: lambda a: tuple(a.shape), np.ndim: lambda a: len(a.shape), np.size: size,
})
