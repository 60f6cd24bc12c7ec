"""Shape ops on traced values, with NumPy's semantics: basic indexing (`x[i]`, `x[a:b]`, `x[..., j]`,
`x[None]`), `sf.split`, `sf.concatenate`, `sf.stack` (and np.split / np.concatenate / np.stack
through traced.NUMPY).  Outside sf.jit each is the same op in a one-op plan (array_ops).

An index is one `slice_array` (a box at static starts and steps, rank kept: an int is a box of
extent 1; a negative step reads its axis backwards, a view with a negative stride, as NumPy's)
then, where ints drop axes or None adds them, a reshape.  Both are views of each device's piece:
the box's axes are whole on every device (rules_shapes: a sharded one is gathered first), the
others keep their sharding.  A concatenation is one `concatenate`, lowered to a copy of each
input into its box of one buffer.  sf.split is slices, so its pieces share one gather.
"""
from __future__ import annotations

import math

import numpy as np

from shardfuse import dtypes
from shardfuse.at_keys import is_int
from shardfuse.ir import TensorType
from shardfuse.ops import Op
from shardfuse.spec import normalize_axis
from shardfuse.trace import replicate
from shardfuse.traced import SHAPE_OPS, Traced, describe


def expand_index(key, shape, what):
    """key as one entry per axis of x or None (a new axis): ints, (start, stop, step) and None;
    an Ellipsis expanded, ints checked and made positive, slices resolved as NumPy resolves them."""
    key = key if isinstance(key, tuple) else (key,)
    for k in key:
        if not (k is None or k is Ellipsis or isinstance(k, slice) or is_int(k)):
            raise TypeError(f"{what}: an index takes ints, slices, '...', None (NumPy's basic indexing) and one "
                            f"integer array (x[ids], x[:, ids]), got {type(k).__name__} {k!r}"
                            + ("; write a list of indices as an array, np.array([...]) (as JAX asks)"
                               if isinstance(k, list) else ""))
    if sum(k is Ellipsis for k in key) > 1:
        raise IndexError(f"{what}: an index can only have a single ellipsis ('...')")
    used = sum(k is not None and k is not Ellipsis for k in key)
    if used > len(shape):
        raise IndexError(f"{what}: too many indices for an array of shape {shape}: {used} given")
    at = next((n for n, k in enumerate(key) if k is Ellipsis), len(key))
    key = key[:at] + (slice(None),) * (len(shape) - used) + key[at + 1:]
    out, ax = [], 0
    for k in key:
        if k is None:
            out.append(None)
            continue
        n = shape[ax]
        if isinstance(k, slice):
            start, stop, step = k.indices(n)  # (non-int bounds raise here, as NumPy's)
            k = (start, start + max(len(range(start, stop, step)), 0) * step, step)
        elif not -n <= k < n:
            raise IndexError(f"{what}: index {k} is out of bounds for axis {ax} with size {n}")
        else:
            k = int(k) % n
        out.append(k)
        ax += 1
    return tuple(out)


def _is_array(k) -> bool:
    return isinstance(k, (Traced, np.ndarray)) or hasattr(type(k), "one_op")  # (one_op: an sf.Array)


def array_index(key, shape, what):
    """(the key's basic part, None where it cuts nothing; axis; ids) where the key holds an integer
    array (a traced one, a NumPy array or an sf.Array) alone or beside slices and '...': x[ids],
    x[:, ids], x[1:, ids], x[..., ids] are np.take(x[basic part], ids, axis), as NumPy's and JAX's
    indexing with one array; None where the key holds no array.  Other mixes are refused, saying what to write."""
    key = key if isinstance(key, tuple) else (key,)
    arrays = [n for n, k in enumerate(key) if _is_array(k)]
    if not arrays:
        return None
    n, ids = arrays[0], key[arrays[0]]
    if str(ids.dtype) == "bool":  # (take's own refusal would speak of ids)
        raise TypeError(f"{what} with a boolean mask ({describe(ids)}): a masked selection has a shape known only "
                        "from the mask's values, which a compiled plan does not have; keep the shape with "
                        "sf.where(mask, x, 0) (and a sum, or a count of mask.astype(...), where you need one)")
    if len(arrays) > 1 or any(not (k is Ellipsis or isinstance(k, slice)) for j, k in enumerate(key) if j != n):
        raise TypeError(f"{what}: an integer array index is supported alone or beside slices and '...' (x[ids], "
                        "x[:, ids], x[..., ids]: one lookup along that axis, np.take's), or several beside ints and whole "
                        "slices ':' (x[rows, cols], x[rows, :, pos]: x.at[...].get()'s), not beside None or a partial "
                        "slice; index in two steps (x[1:][rows, cols]), or write sf.take(x, ids, axis=...)")
    used = sum(k is not Ellipsis for k in key)
    if used > len(shape) or used < len(key) - 1:
        raise IndexError(f"{what}: too many indices for an array of shape {shape}, or more than one '...'")
    ellipsis = next((j for j, k in enumerate(key) if k is Ellipsis), len(key))
    axis = n if ellipsis > n else n - 1 + len(shape) - used  # ('...' before it: the axes it stands for)
    basic = key[:n] + (slice(None),) + key[n + 1:]
    return (None if all(k is Ellipsis or k == slice(None) for k in basic) else basic), axis, ids


def array_getitem(x, key, what, basic_getitem):
    """x[key] where key holds integer arrays (x a traced value or an sf.Array), else None: one array among
    slices is np.take's lookup along its axis (of basic_getitem(x, the rest of key)), several x.at[key].get()."""
    got = _advanced(x, key, what)
    found = None if got is not None else array_index(key, x.shape, what)
    if found is not None:
        from shardfuse.take import take  # (issue 31 item 4, alongside: table[ids])
        basic, axis, ids = found
        got = take(x if basic is None else basic_getitem(x, basic), ids, axis)
    return got


def _advanced(x, key, what):
    """x[key] as x.at[key].get() where key holds several integer arrays, or one beside an int, among whole
    slices (NumPy's advanced indexing, the arrays broadcast together: x[np.arange(B), lens - 1], a serving
    probe's last token per sequence; ids clamped as JAX's, an int out of range refused as NumPy's); else None
    (x a traced value or an sf.Array)."""
    from shardfuse.at_keys import array_key

    key = key if isinstance(key, tuple) else (key,)
    arrays, ints = sum(_is_array(k) for k in key), [j for j, k in enumerate(key) if is_int(k)]
    if not (arrays > 1 or arrays == 1 and ints) or array_key(x, key, what) is None:
        return None
    at = next((j for j, k in enumerate(key) if k is Ellipsis), len(key))
    for j in ints:
        ax = j if j < at else x.ndim - (len(key) - j)
        if not -x.shape[ax] <= key[j] < x.shape[ax]:
            raise IndexError(f"{what}: index {key[j]} is out of bounds for axis {ax} with size {x.shape[ax]}")
    return x.at[key].get()


def getitem(x: Traced, key):
    """x[key], NumPy's basic indexing (any step); an integer array among slices is a lookup (take)."""
    what = f"indexing {describe(x)}"
    got = array_getitem(x, key, what, getitem)
    if got is not None:
        return got
    idx = expand_index(key, x.shape, what)
    axes = [k for k in idx if k is not None]
    begin = tuple(k if is_int(k) else k[0] for k in axes)
    step = tuple(1 if is_int(k) else k[2] for k in axes)
    box = tuple(1 if is_int(k) else len(range(*k)) for k in axes)
    v = x
    if box != x.shape or any(begin) or any(s != 1 for s in step):  # (x[::-1] keeps its shape)
        attrs = {"begin": begin, **({"step": step} if any(s != 1 for s in step) else {})}
        v = x.builder.emit(Op.SLICE_ARRAY, (x,), TensorType(box, x.dtype_name), x.value.name + "_s", **attrs)
    shape = tuple(1 if k is None else len(range(*k)) for k in idx if not is_int(k))
    if 0 in shape and shape != v.shape:  # (an empty box's view: Traced.reshape's empty constant)
        return v.reshape(shape)
    if shape != v.shape or v is x:  # ints drop their axes, None adds one: a view (x[:] a new value, as
        # NumPy's view and JAX's: an annotation of it starts afresh instead of composing with x's)
        v = v.builder.emit(Op.RESHAPE, (v,), TensorType(shape, v.dtype_name), v.value.name + "_r", shape=shape)
    return v


def _traced_args(xs, what):
    xs = list(xs)
    if not xs:
        raise ValueError(f"{what} needs at least one array to join")
    first = next((v for v in xs if isinstance(v, Traced)), None)
    xs = [first.builder.constant(v) for v in xs] if first is not None else xs  # (NumPy arrays, sf.Arrays: constants)
    traced = [v for v in xs if isinstance(v, Traced)]
    if len(traced) != len(xs) or any(v.builder is not traced[0].builder for v in traced):
        bad = next(v for v in xs if not isinstance(v, Traced) or v.builder is not traced[0].builder)
        raise TypeError(f"{what}: every array must be a value of the traced function, got {type(bad).__name__}; "
                        "NumPy arrays and sf.Arrays are captured as constants, other arrays are not: make them "
                        "inputs of the function")
    return xs


def _outside(xs, what, min_ndim=0):
    """The first sf.Array among xs where none is traced (outside sf.jit), else None; the others
    must be arrays (plain ones are replicated), checked here so the refusal speaks of sf.Arrays."""
    if any(isinstance(v, Traced) for v in xs):
        return None
    first = next((v for v in xs if hasattr(type(v), "one_op")), None)
    bad = next((v for v in xs if len(getattr(v, "shape", ())) < min_ndim or not hasattr(v, "shape")), None)
    if first is not None and bad is not None:
        got = f"{type(bad).__name__} of shape {bad.shape}" if hasattr(bad, "shape") else f"{type(bad).__name__} {bad!r}"
        raise (ValueError if hasattr(bad, "shape") else TypeError)(
            f"np.{what} / sf.{what} of sf.Arrays: every item must be an array{' of rank >= 1' if min_ndim else ''} "
            f"(an sf.Array, or a NumPy array, replicated), got {got}")
    return first


def _concatenate_of(axis, *xs):
    return concatenate(xs, axis)


def _stack_of(axis, *xs):
    return stack(xs, axis)


def concatenate(xs, axis=0):
    """NumPy's concatenate: the arrays (same rank, equal extents but on `axis`) joined along axis,
    in their promoted dtype.  The axis must be whole on every device (a sharded one is gathered
    first: the plan prints the Allgather); the other axes keep the first input's sharding."""
    xs = list(xs)
    if (a := _outside(xs, "concatenate", 0 if axis is None else 1)) is not None:
        return a.one_op(_concatenate_of, (axis, *xs), "concatenate")
    xs = _traced_args(xs, "concatenate")
    if axis is None:  # flattened first: whole on every device (a flattening cuts across a sharded inner axis)
        return concatenate([v if v.ndim == 1 else _flat(v) for v in xs], 0)
    a = xs[0]
    if a.ndim == 0:
        raise ValueError(f"concatenate of 0-d arrays ({describe(a)}): zero-dimensional arrays cannot be concatenated")
    ax = normalize_axis(axis, a.ndim, a.shape)
    for v in xs[1:]:
        if v.ndim != a.ndim or any(m != n for j, (m, n) in enumerate(zip(v.shape, a.shape)) if j != ax):
            raise ValueError(f"concatenate along axis {ax}: every array must have the shape of the first, {a.shape}, "
                             f"but on that axis; got {describe(v)}")
    dt = a.dtype_name
    for v in xs[1:]:
        dt = dtypes.promote_types(dt, v.dtype_name)
    xs = [v.astype(dt) for v in xs]
    if len(xs) == 1:
        return xs[0]
    shape = a.shape[:ax] + (sum(v.shape[ax] for v in xs),) + a.shape[ax + 1:]
    return a.builder.emit(Op.CONCAT, tuple(xs), TensorType(shape, dt), "cat", axis=ax)


def _weak_numbers_in(xs):
    """NumPy scalars as 0-d arrays, and Python numbers beside arrays in the first array's dtype (weak, as JAX's: a
    scan whose carry starts as 0.0 stacks float32 values as float32, a review); others as they are."""
    xs = [np.asarray(v) if isinstance(v, np.generic) else v for v in xs]  # (an eager scan's first step, a probe)
    first = next((v for v in xs if not isinstance(v, (bool, int, float))), None)
    if first is None:
        return xs
    dt = dtypes.np_dtype(first.dtype_name) if hasattr(first, "dtype_name") else np.asarray(first).dtype
    return [np.asarray(v, dt) if isinstance(v, (bool, int, float)) else v for v in xs]


def stack(xs, axis=0):
    """NumPy's stack: the arrays (one shape) joined along a new axis."""
    xs = _weak_numbers_in(list(xs))
    if (a := _outside(xs, "stack")) is not None:
        return a.one_op(_stack_of, (axis, *xs), "stack")
    if xs and not any(isinstance(v, Traced) for v in xs):  # (host values only: NumPy's, as sf.lax.scan outside jit)
        return np.stack([np.asarray(v) for v in xs], axis=axis)
    xs = _traced_args(xs, "stack")
    shapes = {v.shape for v in xs}
    if len(shapes) > 1:
        raise ValueError(f"stack: all input arrays must have the same shape, got {sorted(shapes)}")
    ax = normalize_axis(axis, xs[0].ndim + 1, xs[0].shape)
    return concatenate([getitem(v, (slice(None),) * ax + (None,)) for v in xs], ax)


def split_points(indices_or_sections, n: int, what: str) -> list:
    """The (start, stop) of each piece, as np.split cuts an axis of extent n."""
    if is_int(indices_or_sections):
        k = int(indices_or_sections)
        if k <= 0 or n % k:
            raise ValueError(f"{what}: {k} sections do not divide the axis of extent {n} equally (np.split's rule); "
                             "give the split points instead (a list of indices)")
        cuts = [n // k * j for j in range(1, k)]
    elif isinstance(indices_or_sections, (list, tuple)) and all(is_int(c) for c in indices_or_sections):
        cuts = [int(c) for c in indices_or_sections]
    else:
        raise TypeError(f"{what}: indices_or_sections must be an int or a list of ints, got "
                        f"{type(indices_or_sections).__name__}")
    bounds = [0] + [min(max(c + n if c < 0 else c, 0), n) for c in cuts] + [n]
    return [(a, max(a, b)) for a, b in zip(bounds, bounds[1:])]


def split(x, indices_or_sections, axis=0):
    """NumPy's split: a list of slices of x along axis (sections, or split points).  A sharded axis
    is gathered once for all of them (printed in the plan); another axis splits locally."""
    if not (isinstance(x, Traced) or hasattr(type(x), "one_op")):
        raise TypeError(f"sf.split takes a value inside sf.jit or an sf.Array, got {type(x).__name__}")
    ax = normalize_axis(axis, len(x.shape), x.shape)
    pieces = split_points(indices_or_sections, x.shape[ax], f"split of {describe(x)} along axis {ax}")
    if not isinstance(x, Traced) and len(pieces) > 1:  # an sf.Array: the axis made whole once, not per piece
        x = x.one_op(_whole_along, (x, ax), "split")
    return [x[(slice(None),) * ax + (slice(a, b),)] for a, b in pieces]


def _whole_along(v: Traced, ax: int) -> Traced:
    """v (an sf.Array's one-op plan input: its layout known) with axis ax whole, the others as they are."""
    lay = v.value.type.layout
    if lay.axes[ax] is None:
        return v
    return v.builder.emit(Op.SET, (v,), TensorType(v.shape, v.dtype_name, lay.with_axis(ax, None)), v.value.name,
                          annotation=True)


def _no_extras(what, out=None, dtype=None, casting="same_kind"):
    if out is not None or dtype is not None or casting != "same_kind":
        raise TypeError(f"np.{what} with out=, dtype= or casting= is not supported on shardfuse values (inside sf.jit "
                        "and on sf.Arrays): write "
                        f"sf.{what}(arrays, axis) (NumPy's promoted dtype), then .astype(dtype)")


def np_concatenate(arrays, axis=0, out=None, *, dtype=None, casting="same_kind"):
    _no_extras("concatenate", out, dtype, casting)
    return concatenate(arrays, axis)


def np_stack(arrays, axis=0, out=None, *, dtype=None, casting="same_kind"):
    _no_extras("stack", out, dtype, casting)
    return stack(arrays, axis)


def np_transpose(a, axes=None):
    return a.transpose() if axes is None else a.transpose(axes)


def np_swapaxes(a, axis1, axis2):
    i, j = (normalize_axis(x, a.ndim, a.shape) for x in (axis1, axis2))
    return a.transpose([j if k == i else i if k == j else k for k in range(a.ndim)])


def np_reshape(a, shape, order="C", *, copy=None):  # (copy= changes nothing: traced values are never written)
    if order != "C":
        raise TypeError(f"np.reshape(..., order={order!r}) is not supported on traced shardfuse values (inside "
                        "sf.jit): write x.reshape(shape) (C order)")
    return a.reshape(shape)


NUMPY_SHAPES = {np.concatenate: np_concatenate, np.stack: np_stack, np.split: split, np.transpose: np_transpose,
                np.swapaxes: np_swapaxes, np.reshape: np_reshape}


def broadcast_matmul(a: Traced, b: Traced) -> Traced:
    """a @ b with NumPy's rules for 1-D operands (a unit axis added, then dropped) and for batch
    axes that broadcast, as views around the one matmul the compiler has (a's batch axes are the
    output's; b is 2-D or has the same ones): a batch axis only a has (b's extent 1) joins a's rows,
    one only b has joins b's columns, so (b, 1, m, k) @ (1, h, k, n) is one (b*m, k) @ (k, h*n)
    product, viewed back to (b, h, m, n).  Nothing is copied but what a view cannot give (printed)."""
    x = a.reshape((1,) + a.shape) if a.ndim == 1 else a
    y = b.reshape(b.shape + (1,)) if b.ndim == 1 else b
    try:
        batch = tuple(np.broadcast_shapes(x.shape[:-2], y.shape[:-2]))
    except ValueError:
        raise ValueError(f"matmul {describe(a)} @ {describe(b)}: the batch axes {x.shape[:-2]} and {y.shape[:-2]} do "
                         "not broadcast (NumPy's rule: equal extents, or 1)") from None
    nb, (m, k), n = len(batch), x.shape[-2:], y.shape[-1]
    x = _view(x, (1,) * (nb + 2 - x.ndim) + x.shape)
    y = _view(y, (1,) * (nb + 2 - y.ndim) + y.shape)
    xb, yb = x.shape[:-2], y.shape[:-2]
    shared = [i for i in range(nb) if xb[i] == yb[i] != 1]
    only_x = [i for i in range(nb) if xb[i] != 1 and yb[i] == 1]
    only_y = [i for i in range(nb) if yb[i] != 1 and xb[i] == 1]
    size = {i: batch[i] for i in range(nb)}
    lead = tuple(size[i] for i in shared)
    rows, cols = (math.prod(size[i] for i in only) for only in (only_x, only_y))
    units_x, units_y = ([i for i in range(nb) if i not in shared + only] for only in (only_x, only_y))  # extent 1
    x = _view(_permuted(x, units_x + shared + only_x + [nb, nb + 1]), lead + (rows * m, k))
    y = _view(_permuted(y, units_y + shared + [nb] + only_y + [nb + 1]), lead + (k, cols * n))
    c = x @ y
    order = shared + only_x + ["m"] + only_y + ["n"]
    c = _view(c, lead + tuple(size[i] for i in only_x) + (m,) + tuple(size[i] for i in only_y) + (n,))
    c = _permuted(c, [order.index(t) for t in sorted(shared + only_x + only_y) + ["m", "n"]])
    keep = batch + ((m,) if a.ndim > 1 else ()) + ((n,) if b.ndim > 1 else ())
    return _view(c, keep)


def _flat(v: Traced) -> Traced:
    return replicate(v, mesh=v.builder.homes.get(v.value)).reshape(-1)


def _view(v: Traced, shape) -> Traced:
    return v if v.shape == tuple(shape) else v.reshape(tuple(shape))


def _permuted(v: Traced, perm) -> Traced:
    return v if list(perm) == list(range(v.ndim)) else v.transpose(perm)


SHAPE_OPS.update(getitem=getitem, broadcast_matmul=broadcast_matmul)
