"""Which x.at[key] (and x[key]) keys index with integer arrays on one or more axes (NumPy's advanced
indexing, shardfuse/at_arrays.py computes them): the key checked and its indexed axes and ids, read by
update_slice's x.at and by shape_ops' x[key] alike."""
from __future__ import annotations

import math

import numpy as np

from shardfuse import dtypes
from shardfuse.promotion import scalar_value
from shardfuse.traced import Traced, describe


def array_key(x, key, what="x.at[...]"):
    """(positions of the indexed axes, their index arrays) where key indexes x with integer arrays (NumPy
    or traced, one or more) and whole slices (':', '...') only, and is not ids on the first axis alone
    (update_slice's own path); else None."""
    key = key if isinstance(key, tuple) else (key,)
    at = next((a for a, k in enumerate(key) if k is Ellipsis), None)  # (by identity: == of an array is elementwise)
    if at is not None:
        key = key[:at] + (slice(None),) * (x.ndim - len(key) + 1) + key[at + 1:]
    for a, k in enumerate(key):
        kind = np.asarray(k).dtype.kind if isinstance(k, (list, np.ndarray)) else getattr(k, "dtype", None) and k.dtype.kind
        if kind == "b":  # (a mask's astype('int32') would index rows 0 and 1: no advice to cast it)
            fix = "sf.where(mask[:, None], value, x)" if what.startswith("x.at") else "sf.where(mask, x, 0) (the shape kept)"
            raise TypeError(f"{what}: a boolean mask ({_what(k)}, axis {a}) has no static count of rows; write "
                            f"{fix} (or index with np.nonzero(mask)[0] of a NumPy mask)")
        if kind and kind not in "iu" and not isinstance(k, (int, np.integer)):
            raise TypeError(f"{what}: an index must be an integer (JAX's), got {_what(k)} of dtype {k.dtype} on "
                            f"axis {a}; cast it (pos.astype('int32'))")
    if not any(_is_ids(k) for k in key):  # (ints, 0-d values and slices alone: update_slice's basic index)
        return None
    shapes = [tuple(k.shape) if hasattr(k, "shape") else np.shape(k) for k in key if _is_ids(k)]
    try:
        np.broadcast_shapes(*shapes)
    except ValueError:
        raise ValueError(f"{what}: the index arrays' shapes {', '.join(map(str, shapes))} do not broadcast "
                         "together (NumPy's rule: one id per row of the others)") from None
    # (an integer scalar beside index arrays is one more, broadcast: NumPy's advanced indexing, so
    # cache.at[np.arange(B), :, t] with one position t for every row is the rows' form too, a probe)
    arrays = [(a, k) for a, k in enumerate(key) if _is_ids(k) or _is_ids(k, ndim=0)]
    whole = len(arrays) + sum(isinstance(k, slice) and k == slice(None) for k in key) == len(key)
    if not whole or len(key) > x.ndim or [a for a, _ in arrays] == [0] and len(key) == 1:
        return None
    axes, ids = tuple(a for a, _ in arrays), tuple(k if isinstance(k, Traced) else np.asarray(k) for _, k in arrays)
    distinct = distinct_positions(ids, [x.shape[a] for a in axes])
    return (axes, _rows(x, axes, ids), distinct), ids


def distinct_positions(ids, extents) -> bool:
    """Whether the ids Python knows (NumPy arrays and ints) alone make every position they write distinct,
    so that no id can repeat whatever the traced ones hold: a .set needs no sort for its last writes then."""
    if math.prod(np.broadcast_shapes(*(tuple(np.shape(i)) for i in ids))) < 2:
        return True
    key = positions(ids, extents)
    return key is not None and len(np.unique(key)) == key.size


def positions(ids, extents):
    """The flat position each id writes (the index arrays broadcast together, flattened), over the ids Python
    knows only (NumPy arrays and ints; traced ones and sf.Arrays skipped), ids outside their axis each a
    negative number of its own (they are dropped); None where none is known."""
    shape = np.broadcast_shapes(*(tuple(np.shape(i)) for i in ids))
    key, known = np.zeros(shape, np.int64), False
    for i, e in zip(ids, extents):
        if isinstance(i, Traced) or hasattr(type(i), "one_op"):  # (known when the plan runs only)
            continue
        i, known = np.broadcast_to(np.asarray(i), shape), True
        key = np.where((i >= -e) & (i < e) & (key >= 0), key * e + i % e, -1)
    return np.where(key >= 0, key, -1 - np.arange(key.size).reshape(shape)).reshape(-1) if known else None


def _what(k) -> str:
    return f"the value {k.value.name}" if isinstance(k, Traced) else type(k).__name__


def _is_ids(k, ndim=1) -> bool:
    """k is an integer index array (NumPy or traced) of at least `ndim` axes; ndim=0: an integer scalar
    (a Python or NumPy int, a 0-d array or value)."""
    if isinstance(k, (bool, np.bool_)):
        return False
    if ndim == 0 and isinstance(k, (int, np.integer)):
        return True
    if isinstance(k, (list, np.ndarray)):
        k = np.asarray(k)
    elif not (isinstance(k, Traced) or hasattr(type(k), "one_op")):
        return False
    return k.dtype.kind in "iu" and (k.ndim >= 1 if ndim else k.ndim == 0)


def _rows(x, axes, ids) -> bool:
    """The first index is np.arange of its whole axis (a NumPy array, as given) and every index one id
    per row of it (a batch's sequences, each at its own position): written where it lies, by a mask
    per row (no merged axis to scatter into: with the batch over dp, that was a cache-sized buffer
    summed over dp, a probe)."""
    first = ids[0]
    return (len(axes) > 1 and isinstance(first, np.ndarray) and first.ndim == 1 and len(first) == x.shape[axes[0]]
            and bool((first == np.arange(len(first))).all())
            and all(i.ndim == 0 or i.ndim == 1 and i.shape[0] == len(first) for i in ids))


def in_dtype(v, dtype: str):
    """An update of x.at[...].multiply / .power / .min / .max in x's dtype first, as JAX converts it
    (an int32 x's .multiply(2.5) multiplies by 2, as its .add(2.5) adds 2; NumPy's product then a
    truncation gave -7 for -3, a fuzzer)."""
    if isinstance(v, (bool, int, float, np.generic)):
        return dtypes.np_dtype(dtype).type(v)
    return np.asarray(v).astype(dtypes.np_dtype(dtype)) if isinstance(v, (np.ndarray, list, tuple)) else v.astype(dtype)


def fits(x, v):
    """A Python int v checked against x's dtype before an sf.Array's one-op plan takes it as an int64
    operand (a probe: 2**40 set into an int32 sf.Array wrapped; inside jit it raised), as NumPy 2 does."""
    if isinstance(v, int) and not isinstance(v, bool):
        scalar_value(v, x.dtype_name)


def is_int(k) -> bool:
    return isinstance(k, (int, np.integer)) and not isinstance(k, (bool, np.bool_))


def static_int(k):
    """k as a Python int where it is a Python or NumPy int or a 0-d NumPy int array, else None."""
    if isinstance(k, np.ndarray) and k.ndim == 0 and k.dtype.kind in "iu":
        k = k[()]
    return int(k) if is_int(k) else None


def parse_box_key(x, key, what):
    """(static description per axis, the key's index values in order): ("i",) an index (an int or a
    traced 0-d int, the axis dropped) or ("s", start, stop) a slice of step 1."""
    key = key if isinstance(key, tuple) else (key,)
    if sum(k is Ellipsis for k in key) > 1:
        raise IndexError(f"{what}: an index can only have a single ellipsis ('...')")
    used = sum(k is not Ellipsis and k is not None for k in key)  # (None: refused below, by name, a probe)
    if used > x.ndim:
        raise IndexError(f"{what}: too many indices for {describe(x)}: {used} given")
    at = next((n for n, k in enumerate(key) if k is Ellipsis), len(key))
    key = key[:at] + (slice(None),) * (x.ndim - used) + key[at + 1:]
    desc, values = [], []
    for j, k in enumerate(key):
        if isinstance(k, slice):
            start, stop, step = k.indices(x.shape[j])
            if step != 1:
                raise IndexError(f"{what}: a slice of step {step} on axis {j}: .at[] takes boxes (slices of step 1); "
                                 "x[::k] reads a strided slice, and sf.where(mask, v, x) sets one")
            desc.append(("s", start, max(stop, start)))
        elif getattr(k, "ndim", 0) and (isinstance(k, Traced) or hasattr(type(k), "one_op")):
            raise TypeError(f"{what}: an array of indices on axis {j} ({describe(k) if isinstance(k, Traced) else k!r}): "
                            ".at[] takes integer arrays beside ints and whole slices ':' (x.at[ids], x.at[rows, :, pos]), not "
                            "beside a partial slice or None: index the whole axis, or slice the result")
        elif static_int(k) is not None or isinstance(k, Traced) or hasattr(type(k), "one_op"):
            desc.append(("i",))
            values.append(k)
        else:
            raise TypeError(f"{what}: .at[] takes ints, 0-d int values, slices of step 1 and '...', got "
                            f"{describe(k) if isinstance(k, Traced) else repr(k)} on axis {j}; and integer arrays beside "
                            "ints and whole slices (x.at[ids], x.at[rows, :, pos])")
    return tuple(desc), values
