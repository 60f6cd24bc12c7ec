"""sf.dynamic_update_slice and sf.dynamic_slice (jax.lax's), and JAX's x.at[idx].set / .add / .get,
inside sf.jit and on sf.Arrays outside it: a box of an array written or read at start indices
known only when the plan runs (a traced int), so one plan serves every decode step of a KV cache.

    @sf.jit(mesh=mesh, donate_argnums=0)
    def step(cache, k, t):                     # cache [batch, heads, max_len, hd], k [batch, heads, 1, hd]
        return sf.dynamic_update_slice(cache, k, (0, 0, t, 0))   # or cache.at[:, :, t].set(k[:, :, 0])

Semantics (jax.lax's, allow_negative_indices=True): one start index per axis, a Python int or a 0-d
int32 / int64 value; a negative start counts from the end of its axis, then every start is clamped
so that the box fits (an update never lands partly outside).  The update is cast to the operand's
dtype (as NumPy's and JAX's `.at[].set` cast).  x.at[idx] takes ints, 0-d traced ints and slices of
step 1 (an int drops its axis, as x[idx] does); .set(v) broadcasts v to x[idx]'s shape.  As JAX's
`.at`: an index in [-n, n) counts negative ones from the end; .set / .add at an index outside it
drop the update (x comes back unchanged; a traced index: the box written back with its own values),
and .get clamps it (as JAX's x[idx] and .get() do).

Sharding (shardfuse/rules_update.py): an axis the box covers whole keeps its sharding, so a cache
with heads over tp and batch over dp is updated locally on every device, no communication; an
axis the box cuts (the sequence axis) must be whole on every device, and where it is sharded it
is gathered first (an Allgather the plan prints), as a static slice's.

Cost: the plan copies the operand into the result, then writes only the box (`Copy c <- cache`,
`DynamicUpdateSlice c <- k, t`); with the operand donated the copy is gone (passes/donate.py) and
each call writes the update's bytes into the donated buffer, in place.  Gradients: the operand's
cotangent is ct with the box zeroed, the update's the box of ct; a dynamic_slice's is a
dynamic_update_slice of zeros.
"""
from __future__ import annotations

import functools
import operator

import numpy as np

from shardfuse.at_arrays import at_add, at_get, at_set, scattered, unscattered
from shardfuse.at_keys import array_key, distinct_positions, fits, in_dtype, is_int, parse_box_key, static_int
from shardfuse.at_sharded import along_rows, sharded_box, sharded_position
from shardfuse.ir import TensorType
from shardfuse.ops import Op
from shardfuse.traced import SHAPE_OPS, Traced, cast, describe

_INTS = ("int32", "int64")


def _start(x, j, k, size, what):
    """(static start or None, the traced 0-d int or None) of axis j for a box of `size` (wrapped, clamped)."""
    n = x.shape[j]
    s = static_int(k)
    if s is None and not (isinstance(k, Traced) and k.ndim == 0 and k.dtype_name in _INTS):
        raise TypeError(f"{what}: start index {j} must be a Python int or a 0-d int32 / int64 value, got "
                        f"{describe(k) if isinstance(k, Traced) else repr(k)}"
                        + ("; cast it with .astype('int32')" if isinstance(k, Traced) and k.ndim == 0 else ""))
    if size == n:  # (the box covers the axis: clamping leaves 0 whatever the start)
        return 0, None
    if s is None:
        return None, k
    s = s + n if s < 0 else s
    return min(max(s, 0), n - size), None


def _starts(x, starts, sizes, what):
    """(static starts per axis, None for the dynamic ones; their 0-d traced ints in axis order)."""
    if len(starts) != x.ndim:
        raise ValueError(f"{what}: {len(starts)} start indices for {describe(x)}: one per axis ({x.ndim})")
    for j, (n, b) in enumerate(zip(x.shape, sizes)):
        if not is_int(b) or not 0 <= b <= n:
            raise ValueError(f"{what}: the box's extent {b!r} on axis {j} must be between 0 and {n} ({describe(x)})")
    got = [_start(x, j, k, sizes[j], what) for j, k in enumerate(starts)]
    return tuple(s for s, _ in got), [t for _, t in got if t is not None]


def _dispatch(fn, args, what):
    """fn(*args) on traced values (NumPy arrays captured), or as a one-op plan where an sf.Array is
    among them (outside jit: a Python int start becomes an int64 operand, so every start shares a plan)."""
    traced = next((a for a in args if isinstance(a, Traced)), None)
    if traced is not None:
        return fn(*(traced.builder.constant(a) for a in args))
    arrays = [a for a in args if hasattr(type(a), "one_op")]  # sf.Arrays (array_ops.ArrayOps); a tuple arg is static
    if not arrays:
        raise TypeError(f"{what} takes values inside an sf.jit function or sf.Arrays, got "
                        f"{', '.join(type(a).__name__ for a in args[:2])}")
    return arrays[0].one_op(fn, tuple(np.asarray(a, np.int64) if is_int(a) else a for a in args), what)


def _update(x, u, *starts):
    what = "sf.dynamic_update_slice"
    u = x.builder.constant(u)
    if not isinstance(x, Traced) or not isinstance(u, Traced):
        raise TypeError(f"{what}(operand, update, start_indices): operand and update must be arrays, got "
                        f"{describe(x)} and {describe(u)}")
    if u.ndim != x.ndim:
        raise ValueError(f"{what}: the update {describe(u)} must have the operand's rank ({describe(x)}); "
                         "add its unit axes (u[:, :, None]) or write x.at[...].set(u)")
    if u.dtype_name != x.dtype_name:  # (as jax.lax.dynamic_update_slice: a float64 update into a bfloat16 cache
        raise TypeError(f"{what}: the update {describe(u)} and the operand {describe(x)} differ in dtype; cast the "  # was
                        f"update (u.astype('{x.dtype_name}')), or write x.at[...].set(u), which casts")  # silently cast)
    static, dyn = _starts(x, starts, u.shape, what)  # (checked first)
    if (found := sharded_box(x, u.shape, starts)) is not None:  # (one position of a sharded axis: at_sharded.py)
        from shardfuse.numpy_broadcast import broadcast_to
        from shardfuse.traced_numpy import where
        ax, t = found
        return along_rows(x, ax, t if isinstance(t, Traced) else static_int(t), u, broadcast_to, where, clamp=True)
    return _emit_update(x, u, dyn, static)


def _slice(x, sizes, *starts):  # (module-level, as every fn given to _dispatch: one-op plans are cached by it)
    what = "sf.dynamic_slice"
    if not isinstance(x, Traced):
        raise TypeError(f"{what}(operand, start_indices, slice_sizes): operand must be an array, got {describe(x)}")
    static, dyn = _starts(x, starts, sizes, what)
    return _emit_slice(x, sizes, dyn, static)


def int_getitem(x, idx):
    """x[idx] of an sf.Array where idx (expand_index's) holds ints and whole slices only: a dynamic_slice with the ints
    as operands, one plan for every t of x[:, t] (a serving probe's loop compiled one per position); else None."""
    ints = [is_int(k) for k in idx]
    if len(idx) != x.ndim or not any(ints) or not all(i or k == (0, n, 1) for k, i, n in zip(idx, ints, x.shape)):
        return None
    sizes, shape = tuple(1 if i else n for i, n in zip(ints, x.shape)), tuple(n for i, n in zip(ints, x.shape) if not i)
    return _dispatch(_int_slice, (x, sizes, shape, *(k if i else 0 for k, i in zip(idx, ints))), "indexing")


def _int_slice(x, sizes, shape, *starts):
    return _slice(x, sizes, *starts).reshape(shape)


def _sizes(sizes, what) -> tuple:
    sizes = tuple(sizes) if isinstance(sizes, (tuple, list)) else (sizes,)
    if not all(is_int(b) for b in sizes):
        raise TypeError(f"{what}: slice_sizes must be Python ints (static: a plan's shapes are), got {sizes!r}")
    return tuple(int(b) for b in sizes)


def _as_list(starts) -> list:
    """The starts one per axis: a sequence, or a 1-D array of them (JAX's other form: its elements)."""
    if getattr(starts, "ndim", None) == 1:
        return [starts[j] for j in range(starts.shape[0])]
    return list(starts) if isinstance(starts, (tuple, list)) else [starts]


def dynamic_update_slice(operand, update, start_indices):
    """operand with the box at `start_indices` replaced by `update` (jax.lax.dynamic_update_slice):
    one start per axis (Python ints or 0-d int values, negative from the end), clamped so that the
    update fits; see the module's docstring for sharding and cost (donate the operand)."""
    return _dispatch(_update, (operand, update, *_as_list(start_indices)), "sf.dynamic_update_slice")


def dynamic_slice(operand, start_indices, slice_sizes):
    """The box of `operand` of extents `slice_sizes` (static ints) at `start_indices` (jax.lax.dynamic_slice):
    starts as dynamic_update_slice's, clamped so that the box fits."""
    sizes = _sizes(slice_sizes, "sf.dynamic_slice")
    return _dispatch(_slice, (operand, sizes, *_as_list(start_indices)), "sf.dynamic_slice")


# ---- x.at[idx] ------------------------------------------------------------------------------

def _box(desc, values):
    """(starts, box sizes, the indexed shape x[idx] has) of a parsed key."""
    starts, sizes, shape, it = [], [], [], iter(values)
    for d in desc:
        if d[0] == "i":
            starts.append(next(it))
            sizes.append(1)
        else:
            starts.append(d[1])
            sizes.append(d[2] - d[1])
            shape.append(d[2] - d[1])
    return starts, tuple(sizes), tuple(shape)


def _at_get(x, desc, *values):
    starts, sizes, shape = _box(desc, values)
    return _slice(x, sizes, *starts).reshape(shape)


def _in_range(x, desc, values):
    """Whether every index of the key lies in [-n, n) of its axis: False where a Python int does not,
    else True, or a traced 0-d bool where some index is traced."""
    ok = True
    for j, k in zip([j for j, d in enumerate(desc) if d[0] == "i"], values):
        n, s = x.shape[j], static_int(k)
        if s is not None and not -n <= s < n:
            return False
        if s is None:
            inside = (k >= -n) & (k < n)
            ok = inside if ok is True else ok & inside
    return ok


def _at_set(x, desc, v, *values):
    from shardfuse.numpy_broadcast import broadcast_to  # (they build on traced_numpy, which this module does not need)
    from shardfuse.traced_numpy import where

    if (found := sharded_position(x, desc, values)) is not None:  # (a sharded KV cache's write: no gather)
        return along_rows(x, *found, v, broadcast_to, where)
    starts, sizes, shape = _box(desc, values)
    ok = _in_range(x, desc, values)
    if isinstance(v, Traced) or isinstance(v, np.ndarray):  # (checked against x[idx]'s shape either way, as JAX)
        v = broadcast_to(cast(x.builder.constant(v), x.dtype_name), shape)
    else:  # a Python or NumPy scalar: a constant box of it (bound at each call, the box's size)
        v = x.builder.constant(np.full(shape, v, dtype=x.dtype))
    if ok is False:  # (JAX drops the update: the box, clamped, written back as it is)
        v = _slice(x, sizes, *starts)
    v = v.reshape(sizes)
    if ok is not True and ok is not False:  # (a traced index out of range: its box's own values)
        v = where(ok, v, _slice(x, sizes, *starts))
    return _update(x, v, *starts)


def _at_add(x, desc, v, *values):
    # the update in the array's dtype first, as JAX's .at[].add (int32 -3 plus 0.5 is -3, not -2)
    v = v.astype(x.dtype_name) if isinstance(v, Traced) else np.asarray(v, dtype=x.dtype)
    if (found := sharded_position(x, desc, values)) is not None:  # (no gather of a sharded axis: at_sharded.py)
        from shardfuse.numpy_broadcast import broadcast_to
        from shardfuse.traced_numpy import where
        return along_rows(x, *found, v, broadcast_to, where, add=True)
    return _at_set(x, desc, _at_get(x, desc, *values) + v, *values)


class At:
    """x.at (JAX's): x.at[idx].set(v), .add(v) and .get() as new values (see the module's docstring)."""

    def __init__(self, x):
        self.x = x

    def __getitem__(self, key):
        return AtIndex(self.x, key)


def _ids_key(key):
    """The ids of x.at[ids] (an integer array of one axis or more indexing the first axis; no other
    index), else None."""
    ids = key[0] if isinstance(key, tuple) and len(key) == 1 else key
    if isinstance(ids, (list, np.ndarray)):
        ids = np.asarray(ids)
        return ids if ids.ndim and ids.dtype.kind == "i" else None
    return ids if (isinstance(ids, Traced) or hasattr(type(ids), "one_op")) and ids.ndim else None


def _at_ids_add(x, ids, v):
    """x.at[ids].add(v): v (broadcast to ids.shape + x.shape[1:], in x's dtype) summed into the rows at
    ids, repeated ids accumulating (sf.scatter_add); an id outside [-n, n) adds nothing (JAX's drop)."""
    from shardfuse.numpy_broadcast import broadcast_to
    from shardfuse.take import scatter_add
    from shardfuse.traced_numpy import where

    n, shape = x.shape[0], ids.shape + x.shape[1:]
    v = broadcast_to(cast(x.builder.constant(np.asarray(v, x.dtype) if not isinstance(v, Traced) else v),
                          x.dtype_name), shape)
    inside = ((ids >= -n) & (ids < n)).reshape(ids.shape + (1,) * (x.ndim - 1))
    return x + unscattered(x, scatter_add(ids, where(inside, scattered(x, v), 0), n))


def _at_ids_get(x, ids):
    from shardfuse.take import take
    return take(x, ids)


_COMBINED = dict(multiply=operator.mul, divide=operator.truediv, power=operator.pow, min=np.minimum, max=np.maximum,
                 apply=lambda a, fn: fn(a))


def _at_combined(at, name, v):
    """x[idx] op v set back (JAX's .multiply, .divide, .power, .min, .max, .apply(fn)); at index arrays only where the
    ids Python knows cannot repeat (JAX applies op per repeated id); no integer .divide (JAX's is float, NumPy raises)."""
    if name == "divide" and at.x.dtype_name in ("int32", "int64", "bool"):
        raise TypeError(f"x.at[...].divide of an {at.x.dtype_name} array: cast x to a float dtype first")
    if not (at.arrays[0][2] if at.arrays is not None else at.ids is None or distinct_positions((at.ids,), at.x.shape[:1])):
        raise TypeError(f"x.at[ids].{name}: ids that may repeat (traced ones, or NumPy ids repeating) are supported by "
                        ".set and .add only; give distinct NumPy ids")
    return at.set(_COMBINED[name](at.get(), v if name == "apply" else in_dtype(v, at.x.dtype_name)))


class AtIndex:
    """x.at[idx]: .set(v) (a dynamic_update_slice), .add(v) (x[idx] + v set back), .get() (a dynamic_slice);
    at an array of ids along the first axis, .add (sf.scatter_add) and .get (sf.take); at integer arrays
    on several axes (a per-sequence KV-cache write), shardfuse/at_arrays.py."""

    def __init__(self, x, key):
        self.x = x
        self.ids = _ids_key(key)
        self.arrays = array_key(x, key) if self.ids is None else None  # (integer arrays on several axes)
        if self.ids is None and self.arrays is None:
            self.desc, self.values = parse_box_key(x, key, "x.at[...]")

    def set(self, v):
        """x with x[idx] replaced by v (broadcast to x[idx]'s shape, cast to x's dtype); x itself where
        an index is out of range (JAX's: the update dropped)."""
        fits(self.x, v)
        if self.ids is not None:  # (rows at ids: the arrays' path, the first axis indexed)
            spec = ((0,), False, distinct_positions((self.ids,), (self.x.shape[0],)))
            return _dispatch(at_set, (self.x, spec, v, self.ids), "x.at[ids].set")
        if self.arrays is not None:
            return _dispatch(at_set, (self.x, self.arrays[0], v, *self.arrays[1]), "x.at[...].set")
        return _dispatch(_at_set, (self.x, self.desc, v, *self.values), "x.at[...].set")

    def add(self, v):
        """x with v added to x[idx] (nothing added where an index is out of range, as JAX drops it)."""
        fits(self.x, v)
        if self.ids is not None:
            return _dispatch(_at_ids_add, (self.x, self.ids, v), "x.at[ids].add")
        if self.arrays is not None:
            return _dispatch(at_add, (self.x, self.arrays[0], v, *self.arrays[1]), "x.at[...].add")
        return _dispatch(_at_add, (self.x, self.desc, v, *self.values), "x.at[...].add")

    def get(self):
        """x[idx] (indices clamped, as every .at index is)."""
        if self.ids is not None:
            return _dispatch(_at_ids_get, (self.x, self.ids), "x.at[ids].get")
        if self.arrays is not None:
            return _dispatch(at_get, (self.x, self.arrays[0], *self.arrays[1]), "x.at[...].get")
        return _dispatch(_at_get, (self.x, self.desc, *self.values), "x.at[...].get")

    multiply, divide, power, min, max, apply = (functools.partialmethod(_at_combined, name) for name in _COMBINED)


def refuse_setitem(x, key, value):
    """x[key] = value: shardfuse's values are immutable (as JAX's arrays); the error says what to write."""
    raise TypeError(f"'{type(x).__name__}' object does not support item assignment: shardfuse values are immutable, as "
                    "JAX's arrays; write x = x.at[idx].set(value) (ints, traced 0-d ints, slices, index arrays in idx) or "
                    "x = sf.dynamic_update_slice(x, update, start_indices), and donate x (sf.jit(..., donate_argnums="
                    "...)) so that the update is written in place of x")


SHAPE_OPS["at"] = At  # (Traced.at and sf.Array.at)
SHAPE_OPS["setitem"] = refuse_setitem


# ---- gradients (merged into autodiff's VJP table) ---------------------------------------------

def _emit_update(x, u, idx, starts):
    return x.builder.emit(Op.DYNAMIC_UPDATE_SLICE, (x, u, *idx), TensorType(x.shape, x.dtype_name), x.value.name,
                          starts=starts)


def _emit_slice(x, sizes, idx, starts):
    if not idx:  # (every start known: a static slice, a view)
        return SHAPE_OPS["getitem"](x, tuple(slice(s, s + b) for s, b in zip(starts, sizes)))
    return x.builder.emit(Op.DYNAMIC_SLICE, (x, *idx), TensorType(tuple(sizes), x.dtype_name), x.value.name + "_ds",
                          starts=starts)


def _update_vjp(ins, xs, out, ct, instrs):
    """The operand's cotangent: ct with the box zeroed; the update's: the box of ct (the same starts)."""
    _, u, *idx = xs
    zeros = u.unary_op(Op.FULL_LIKE, ct.dtype_name, value=0.0)
    starts = ins.attrs["starts"]
    return [_emit_update(ct, zeros, idx, starts), _emit_slice(ct, u.shape, idx, starts)] + [None] * len(idx)


def _slice_vjp(ins, xs, out, ct, instrs):
    """The operand's cotangent: zeros with ct written in the box (a dynamic_update_slice)."""
    x, *idx = xs
    zeros = x.unary_op(Op.FULL_LIKE, ct.dtype_name, value=0.0)
    return [_emit_update(zeros, ct, idx, ins.attrs["starts"])] + [None] * len(idx)


VJP = {Op.DYNAMIC_UPDATE_SLICE: _update_vjp, Op.DYNAMIC_SLICE: _slice_vjp}
