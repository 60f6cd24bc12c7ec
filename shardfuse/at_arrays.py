"""x.at[...] with integer arrays on one or several axes, the others whole (JAX's advanced-index
`.at`): a serving step's per-sequence KV-cache write, `cache.at[np.arange(B), :, positions].set(new)`
(each sequence's token at its own position), and its .add and .get (a serving probe could write only
one position for the whole batch).

The indexed axes are moved to the front and merged into one (a transpose and a reshape), the index
arrays broadcast together and made one flat id each, and the rows written as sf.scatter_add writes
them: `.set` selects the scattered rows where an id landed (sf.where), `.add` adds them, `.get` is
sf.take of the merged rows.  The value's and the result's axes follow NumPy's rule: the broadcast
index axes first where the indexed axes are apart (x[ids, :, pos]: [B, H, D]), in their place where
they are adjacent (x[:, ids]).  Ids count negative ones from the end; .set / .add drop an id outside
[-n, n) (JAX's), .get clamps it.  Which of repeated ids' values .set keeps is unspecified in JAX;
here the last one's, as NumPy's x[ids] = v (found at trace time for NumPy ids, by a sort for traced
ones).  Where the first index is np.arange of its axis and each other index holds one id per row (the KV-cache write), the rows are written where they lie by a
mask (a where over the array: no communication with the rows over dp and the rest over tp).  Cost:
the array is rewritten whole (O(its size), not the in-place scatter of JAX with donation): a decode
step's write costs about what its attention's read of the cache costs.
"""
from __future__ import annotations

import math

import numpy as np

from shardfuse import dtypes
from shardfuse.traced import Traced, cast, describe


def _merged(x, axes, ids):
    """(x with the indexed axes first and merged, the flat ids [S], whether each is inside x, the
    permutation, the broadcast index shape S)."""
    from shardfuse.numpy_broadcast import broadcast_to

    shape = tuple(np.broadcast_shapes(*(tuple(i.shape) for i in ids)))
    rest = [a for a in range(x.ndim) if a not in axes]
    perm = list(axes) + rest
    extents = [x.shape[a] for a in axes]
    xm = x.transpose(perm).reshape((math.prod(extents),) + tuple(x.shape[a] for a in rest))
    flat, inside = 0, None
    for i, n in zip(ids, extents):
        i = broadcast_to(x.builder.constant(i), shape)
        ok = (i >= -n) & (i < n)
        inside = ok if inside is None else inside & ok
        flat = flat * n + _from_end(i, n).clip(0, n - 1)  # (outside: clamped here, masked by `inside`)
    return xm, flat, inside, perm, shape


def _from_end(i, n):
    """ids counting negative ones from the end of an axis of n."""
    return i + n * (i < 0)


def _index_axes_first(axes, k, ndim) -> tuple:
    """(where NumPy puts the k broadcast index axes in x[idx]: in place of the indexed axes where those
    are adjacent, else first; the order moving them first in an array of ndim axes laid out so)."""
    lead = axes[0] if list(axes) == list(range(axes[0], axes[0] + len(axes))) else 0
    return lead, list(range(lead, lead + k)) + list(range(lead)) + list(range(lead + k, ndim))


def _value_first(x, axes, v, shape):
    """v broadcast to x[idx]'s shape (NumPy's order), given with the index axes first."""
    from shardfuse.numpy_broadcast import broadcast_to

    rest = tuple(x.shape[a] for a in range(x.ndim) if a not in axes)
    lead, order = _index_axes_first(axes, len(shape), len(rest) + len(shape))
    v = x.builder.constant(np.asarray(v, x.dtype)) if not isinstance(v, Traced) else v
    v = broadcast_to(cast(v, x.dtype_name), rest[:lead] + shape + rest[lead:])
    return v.transpose(order) if order != sorted(order) else v


def scattered(x, v):
    """v as x.at's scatter adds it: floats as they are; int32 and bool values in float64, exact (the scatter's
    kernels add floats: a probe's x.at[ids].add on an int32 array named sf.scatter_add); int64 refused, as
    float64 holds its values exactly only below 2**53."""
    if x.dtype_name == "int64":
        raise TypeError(f"x.at[...] at index arrays of the int64 array {describe(x)} is not supported (its rows are "
                        "written by a float scatter, exact only below 2**53): cast x to int32, or index a basic slice")
    return v if dtypes.is_float(x.dtype_name) else v.astype("float64")


def unscattered(x, total):
    """A scatter's float64 total of int32 values back in x's dtype, wrapped as NumPy's int32 sums wrap (the sum
    is exact in float64; a cast of one beyond int32 saturated, a review); others cast as they are."""
    if x.dtype_name == "int32":
        total = (total + 2.0 ** 31) % 2.0 ** 32 - 2.0 ** 31
    return total.astype(x.dtype_name)


def _unmerged(x, xm, perm):
    return xm.reshape(tuple(x.shape[a] for a in perm)).transpose(tuple(int(j) for j in np.argsort(perm)))


def _row_mask(x, axes, ids):
    """True at (b, ids_1[b], ...) for each row b along axes[0]: broadcastable to x (ids outside drop out)."""
    mask, rows = None, [len(ids[0]) if d == axes[0] else 1 for d in range(x.ndim)]
    for a, i in zip(axes[1:], ids[1:]):
        n = x.shape[a]
        at = np.arange(n).reshape([n if d == a else 1 for d in range(x.ndim)])
        m = _from_end(x.builder.constant(i), n).reshape(rows if i.ndim else [1] * x.ndim) == at
        mask = m if mask is None else mask & m
    return mask


def _row_values(x, axes, v):
    """v (broadcast to x[idx], rows first) in x's axis order, of extent 1 along the other indexed axes."""
    vf = _value_first(x, axes, v, (x.shape[axes[0]],))
    order = [axes[0]] + [a for a in range(x.ndim) if a not in axes] + list(axes[1:])
    vf = vf.reshape(tuple(vf.shape) + (1,) * (len(axes) - 1))
    return vf.transpose([order.index(d) for d in range(x.ndim)])


def at_set(x, spec, v, *ids):
    """x.at[...].set(v) at integer arrays (the module's docstring)."""
    from shardfuse.take import scatter_clamped  # (the values masked here)
    from shardfuse.traced_numpy import where

    axes, by_rows, distinct = spec
    if by_rows:
        return where(_row_mask(x, axes, ids), _row_values(x, axes, v), x)
    xm, flat, inside, perm, shape = _merged(x, axes, ids)
    last = None if distinct else _last_of_repeats(ids, [x.shape[a] for a in axes], flat, inside, shape)
    mask = (inside if last is None else inside & last).reshape(shape + (1,) * (xm.ndim - 1))
    written = scatter_clamped(flat, where(mask, scattered(x, _value_first(x, axes, v, shape)), 0), xm.shape[0])
    hit = scatter_clamped(flat, mask.astype("float32"), xm.shape[0]) > 0
    return _unmerged(x, where(hit, unscattered(x, written), xm), perm)


def _last_of_repeats(ids, extents, flat, inside, shape):
    """Whether each id is the last one at its position (NumPy's x[ids] = v: the last write wins; JAX leaves
    which unspecified, so equal values give that value), None where no id repeats: known when every index is
    a NumPy array, else found by a stable argsort of the flat ids (a probe: a repetition penalty's
    lg.at[rows, history].set(...) summed the repeated tokens' values)."""
    from shardfuse.at_keys import positions
    from shardfuse.constants import value_of
    from shardfuse.numpy_math import argsort
    from shardfuse.shape_ops import concatenate

    n = math.prod(shape)
    if n < 2:
        return None
    known = [value_of(i) if isinstance(i, Traced) else np.asarray(i) for i in ids]
    if all(i is not None for i in known):  # (at trace time: a plan without repeats is unchanged)
        key = positions(known, extents)
        last = np.zeros(n, bool)
        last[n - 1 - np.unique(key[::-1], return_index=True)[1]] = True
        return None if last.all() else flat.builder.constant(last.reshape(shape))
    key = (flat * inside - ~inside).reshape(n)  # (ids outside: -1, dropped anyway)
    order = argsort(key)
    ordered = key[order]
    last = concatenate([ordered[:-1] != ordered[1:], np.ones(1, bool)])  # (the last of each run of one id)
    return last[argsort(order)].reshape(shape)


def at_add(x, spec, v, *ids):
    """x.at[...].add(v) at integer arrays (repeated ids accumulate, as JAX's)."""
    from shardfuse.take import scatter_clamped  # (the values masked here)
    from shardfuse.traced_numpy import where

    axes, by_rows = spec[:2]
    if by_rows:
        return x + where(_row_mask(x, axes, ids), _row_values(x, axes, v), 0).astype(x.dtype)
    xm, flat, inside, perm, shape = _merged(x, axes, ids)
    vf = scattered(x, _value_first(x, axes, v, shape))
    added = scatter_clamped(flat, where(inside.reshape(shape + (1,) * (xm.ndim - 1)), vf, 0), xm.shape[0])
    return _unmerged(x, xm + unscattered(x, added), perm)


def at_get(x, spec, *ids):
    """x.at[...].get() at integer arrays: x[idx] in NumPy's order, ids clamped (as JAX's)."""
    from shardfuse.take import take

    axes = spec[0]
    xm, flat, _, _, shape = _merged(x, axes, ids)
    rows = take(xm, flat)  # [*S, *rest]: the index axes first, moved back where NumPy puts them
    _, order = _index_axes_first(axes, len(shape), rows.ndim)
    back = tuple(int(j) for j in np.argsort(order))
    return rows.transpose(back) if order != sorted(order) else rows
