"""sf.take(table, ids, axis=0): the elements of `table` at integer `ids` along `axis`, as np.take
(and jnp.take), inside sf.jit and on sf.Arrays outside it; np.take(table, ids) of traced values
runs it too (traced.NUMPY); it is what indexing a traced value with a traced integer array is
to call (Traced.__getitem__).

    @sf.jit(mesh=mesh)
    def embed(table, ids):                     # table [vocab, hidden], ids [batch, seq] int32
        table = sf.shard(table, axis=0)        # the vocabulary sharded: Megatron's vocab-parallel embedding
        return sf.take(table, ids)             # [batch, seq, hidden]: one Allreduce of the result

Semantics: the result has shape table.shape[:axis] + ids.shape + table.shape[axis + 1:] and the
table's dtype; ids are int32 or int64 arrays of any shape (0-d too).  ids in [-n, n) index as
NumPy's (negative from the end); ids outside are clamped to the first or last element, as JAX's
indexing (`x[ids]`) does, where NumPy would raise (a compiled plan cannot raise per element).

Sharding: the ids' axes keep their layout in the result, and so do the table's other axes.  With
the table sharded along `axis` (the vocabulary), each device looks up the ids in its own rows and
writes zeros for the others; the result is a pending sum made whole by one Allreduce (or a
ReduceScatter where the result is annotated sharded: sequence parallelism), never a gather of the
table (shardfuse/rules_take.py).

sf.scatter_add(ids, values, size) is take's transpose (JAX's `.at[ids].add`): the gradient of a
lookup, and sf.grad's rule for take (shardfuse/autodiff.py) is one.
"""
from __future__ import annotations

import functools

import numpy as np

from shardfuse import dtypes
from shardfuse.ir import TensorType
from shardfuse.ops import Op
from shardfuse.spec import normalize_axis
from shardfuse.traced import NUMPY, Traced, describe

_INTS = ("int32", "int64")


@functools.lru_cache(maxsize=64)
def _row_numbers(n: int) -> np.ndarray:
    """np.arange(n), one array per extent, so that a program's takes of one table share one constant."""
    rows = np.arange(n, dtype=np.int64)
    rows.setflags(write=False)
    return rows


def take(table, ids, axis=0):
    """The elements of `table` at `ids` along `axis` (np.take's; see the module's docstring)."""
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"sf.take: axis must be an int, got {axis!r} (for np.take's axis=None, take from "
                        "table.reshape(-1))")
    if isinstance(ids, (int, np.integer)) and not isinstance(ids, (bool, np.bool_)):  # (one id, as np.take's: a
        ids = np.asarray(ids, np.int64)  # 0-d array; a NumPy int is static outside jit now, a review)
    return _run(_take, Op.TAKE, (table, ids, int(axis)), "np.take")


def _run(fn, op, args, numpy_name):
    """fn(a, b, param) on traced values (NumPy arrays among a, b captured as constants), or as a
    one-op plan where an sf.Array is among them (outside jit)."""
    traced = next((a for a in args[:2] if isinstance(a, Traced)), None)
    if traced is not None:
        return fn(*(traced.builder.constant(a) for a in args[:2]), *args[2:])
    for a in args[:2]:
        if hasattr(type(a), "one_op"):  # sf.Array (array_ops.ArrayOps): a one-op plan
            return a.one_op(fn, args, str(op))
    raise TypeError(f"sf.{op} takes values inside an sf.jit function or sf.Arrays, got "
                    f"{type(args[0]).__name__} and {type(args[1]).__name__} (for NumPy arrays: {numpy_name})")


def _take(table, ids, axis):
    if not isinstance(table, Traced) or not isinstance(ids, Traced):
        bad = table if not isinstance(table, Traced) else ids
        raise TypeError(f"sf.take(table, ids): both must be arrays, got {type(bad).__name__}")
    if ids.dtype_name not in _INTS:
        raise TypeError(f"sf.take: ids must be an integer array (int32 or int64), got {describe(ids)}; "
                        "cast with ids.astype('int32') if its values are whole numbers")
    if table.ndim == 0:
        raise ValueError(f"sf.take from the 0-d value {describe(table)}: a table needs at least one axis")
    axis = normalize_axis(axis, table.ndim, table.shape)
    n = table.shape[axis]
    if n == 0:
        raise ValueError(f"sf.take from {describe(table)} along axis {axis} of extent 0: there is nothing to take")
    moved = table if axis == 0 else table.transpose((axis,) + tuple(a for a in range(table.ndim) if a != axis))
    rows = table.builder.constant(_row_numbers(n))
    out = TensorType(ids.shape + moved.shape[1:], table.dtype_name)
    got = table.builder.emit(Op.TAKE, (moved, ids, rows), out, "e", vocab=n)
    if axis == 0:
        return got
    k = ids.ndim  # the table's axes before `axis` go back in front of the ids' axes
    return got.transpose(tuple(range(k, k + axis)) + tuple(range(k)) + tuple(range(k + axis, got.ndim)))


def scatter_add(ids, values, size):
    """out[size, *values.shape[ids.ndim:]]: zeros, then out[ids[t]] += values[t] for every position
    t of the ids (repeated ids accumulate), inside sf.jit and on sf.Arrays outside it.  JAX's
    `jnp.zeros((size, ...)).at[ids].add(values)` (and `jax.ops.segment_sum(values, ids, size)`),
    PyTorch's `index_put_(..., accumulate=True)`; the transpose of sf.take, so it is the gradient of
    an embedding lookup (sf.grad of sf.take computes it, with no one-hot [tokens, vocab] matrix).

        counts = sf.scatter_add(ids, np.ones(ids.shape), vocab)       # how often each id occurs
        grad_table = sf.scatter_add(ids, grad_out, vocab)             # [vocab, hidden]

    ids (int32 / int64, any shape) count negative ones from the end; one outside [-size, size) is
    dropped, its values added nowhere (JAX's `.at[ids].add` and `segment_sum`: a MoE's tokens over
    capacity sent to row `size`; sf.take clamps such ids instead).  values are floats; float16 and bfloat16 are summed in float32
    and rounded once.  Sharding: positions sharded (data / sequence parallel) make the result a
    pending sum over those mesh axes (one Allreduce, or a ReduceScatter into a sharded result); a
    result sharded over its first axis (sf.shard(..., axis=0)) has each device add only the ids in
    its rows, no communication for that axis (shardfuse/rules_take.py)."""
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
        raise TypeError(f"sf.scatter_add: size must be a positive int (the result's first extent), got {size!r}")
    return _run(_scatter_add, Op.SCATTER_ADD, (ids, values, int(size)), "np.add.at")


def _scatter_add(ids, values, size):
    if not isinstance(ids, Traced) or not isinstance(values, Traced):
        bad = ids if not isinstance(ids, Traced) else values
        raise TypeError(f"sf.scatter_add(ids, values, size): both must be arrays, got {type(bad).__name__}")
    if ids.dtype_name not in _INTS:
        raise TypeError(f"sf.scatter_add: ids must be an integer array (int32 or int64), got {describe(ids)}")
    if not dtypes.is_float(values.dtype_name):
        raise TypeError(f"sf.scatter_add: values must be floats (float16, bfloat16, float32, float64), got "
                        f"{describe(values)}; cast with values.astype('float32')")
    if values.shape[:ids.ndim] != ids.shape:
        raise ValueError(f"sf.scatter_add: values {describe(values)} must start with the ids' shape {ids.shape} "
                         "(one value, or row of values, per id)")
    inside = ((ids >= -size) & (ids < size)).reshape(ids.shape + (1,) * (values.ndim - ids.ndim))
    return scatter_clamped(ids, NUMPY[np.where](inside, values, 0), size)


def scatter_clamped(ids, values, size: int):
    """sf.scatter_add of traced values with ids outside [-size, size) clamped to the first or last row,
    as take's transpose reads them (x.at[...] masks its values first, shardfuse/at_arrays.py)."""
    return scatter_rows(values, ids, ids.builder.constant(_row_numbers(size)), size)


def scatter_rows(values, ids, rows, n: int):
    """The scatter_add step (Op.SCATTER_ADD) over the vocabulary `rows` (np.arange(n) as a value:
    pinned sharded, the result's rows are, each device adding the ids in its own)."""
    out = TensorType((n,) + values.shape[ids.ndim:], values.dtype_name)
    return values.builder.emit(Op.SCATTER_ADD, (values, ids, rows), out, "scattered", vocab=n)


def np_take(a, indices, axis=None, out=None, mode=None):
    """np.take on traced values: axis=None takes from the flattened array, as NumPy's; mode="clip"
    is what every mode does here (see the module's docstring), mode="wrap" is refused."""
    if out is not None:
        raise TypeError("np.take(..., out=) is not supported on traced shardfuse values (inside sf.jit): "
                        "write sf.take(table, ids, axis), a new value")
    if mode not in (None, "raise", "clip"):
        raise TypeError(f"np.take(..., mode={mode!r}) is not supported inside sf.jit: ids outside the axis are "
                        "clamped (mode='clip'), as JAX's indexing does")
    if axis is None:
        return take(a.reshape(-1), indices, 0)  # (NumPy arrays, traced values and sf.Arrays alike)
    return take(a, indices, axis)


NUMPY[np.take] = np_take  # (np.take of traced values, and of sf.Arrays: array_ops)
