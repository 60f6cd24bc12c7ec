"""Every elementwise op as fn(xp, x, y or scalar, out) for any array module xp, in one table
(ELEMENTWISE): the NumPy backends run it with NumPy, and CuPy's kernels share it
(backends/cuda/kernels.py runs bfloat16 through float32 scratch and has its own one-kernel
sigmoid, silu, rsqrt and GELU).

Scalars arrive already in the operand's dtype's values where NumPy 2 would round them (the
tracer rounds a comparison's or maximum's scalar), so `x.dtype.type(s)` is exact here.  16-bit
floats with a scalar exponent, and the compositions (sigmoid, silu, rsqrt), run in float32 and
round once, as the existing scalar ops do."""
from __future__ import annotations

import math

import numpy as np

from shardfuse.backends import extrema
from shardfuse.ops import FLOAT_BINARY, MORE_MATH, Op



def _gelu(xp, x, _, out):
    """GELU, tanh form: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    inner = x * x
    inner *= 0.044715 * x
    inner += x
    inner *= 0.7978845608028654
    xp.tanh(inner, out=inner)
    inner += 1.0
    inner *= 0.5
    xp.multiply(x, inner, out=out)


def _scalar_op(fn, x, s, o, reflected=False):
    """fn(x, s) (fn(s, x) reflected) with a Python scalar s: for 16-bit x the loop runs in float32
    (dtype=, not promotion, which NumPy 1.x and older CuPy decide by value) and rounds once into
    o (1e5, or 1 / 1e-5, does not fit float16); else in x's own type (NumPy's result)."""
    if x.dtype.itemsize == 2:
        s = np.float32(s)
        return fn(s, x, out=o, dtype=np.float32) if reflected else fn(x, s, out=o, dtype=np.float32)
    s = x.dtype.type(s)
    return fn(s, x, out=o) if reflected else fn(x, s, out=o)


# The first ops, for any array module xp (NumPy here; CuPy has the same ufuncs).
_BASIC = {
    Op.ADD: lambda xp, x, y, o: xp.add(x, y, out=o),
    Op.SUB: lambda xp, x, y, o: xp.subtract(x, y, out=o),
    Op.MUL: lambda xp, x, y, o: xp.multiply(x, y, out=o),
    Op.DIV: lambda xp, x, y, o: xp.divide(x, y, out=o),
    Op.SCALE: lambda xp, x, s, o: _scalar_op(xp.multiply, x, s, o),
    Op.DIV_SCALAR: lambda xp, x, s, o: _scalar_op(xp.divide, x, s, o),
    Op.ADD_SCALAR: lambda xp, x, s, o: _scalar_op(xp.add, x, s, o),
    Op.RDIV: lambda xp, x, s, o: _scalar_op(xp.divide, x, s, o, reflected=True),
    # (x * -1, exact: NumPy 2.4.6's float64 `negative` wrote wrong values for some strided views, e.g.
    # x of shape (3, 1), strides (64, 8) into out strides (16, 8): x[1] became -1.0 for 8.0)
    Op.NEG: lambda xp, x, _, o: xp.multiply(x, x.dtype.type(-1), out=o),
    Op.EXP: lambda xp, x, _, o: xp.exp(x, out=o),
    Op.TANH: lambda xp, x, _, o: xp.tanh(x, out=o),
    Op.RELU: lambda xp, x, _, o: xp.maximum(x, x.dtype.type(0), out=o),
    Op.GELU: _gelu,
}


def _zero(o):
    """The exact filler of where's halves: x + (-0.0) is x for every float x (-0.0 and NaN too)."""
    return o.dtype.type(-0.0) if o.dtype.kind not in "biu" else o.dtype.type(0)


def _in32(fn):
    """fn(xp, x, s) computed in float32 for 16-bit x and rounded once into out; in x's type otherwise."""
    def run(xp, x, s, o):
        if x.dtype.itemsize == 2:
            o[...] = fn(xp, x.astype(np.float32), s)
        else:
            o[...] = fn(xp, x, s)
    return run


def _sigmoid(xp, x, _):
    """1 / (1 + e^-x); for x < 0 written e^x / (1 + e^x), so neither side overflows to NaN."""
    e = xp.exp(-xp.abs(x))
    return xp.where(x >= 0, 1 / (1 + e), e / (1 + e))


# NumPy has no erf: math's, element by element, in float64 (glibc's, within an ulp), rounded once into
# the output (16- and 32-bit values too).  NumPy only: the CuPy backend has its own kernels (kernels._FUSED).
_ERF, _ERFC = np.frompyfunc(math.erf, 1, 1), np.frompyfunc(math.erfc, 1, 1)


def _erf(xp, x, _, o):
    o[...] = np.asarray(_ERF(x.astype(np.float64)), np.float64)  # (frompyfunc's 0-d result is a float: a fuzzer)


def _gelu_erf(xp, x, _, o):
    """The exact GELU, x * Phi(x), as 0.5 x erfc(-x / sqrt 2) (jax.nn.gelu(approximate=False)'s form:
    no cancellation in 1 + erf(x / sqrt 2) for negative x), in float64, rounded once into o."""
    v = x.astype(np.float64)
    o[...] = 0.5 * v * np.asarray(_ERFC(v * -0.7071067811865476), np.float64)


def _scalar(fn, reflected=False):
    def run(xp, x, s, o):
        if x.dtype.itemsize == 2 and x.dtype.kind != "b":  # 16-bit floats: in float32, rounded once
            s = np.float32(s)
            return fn(s, x, out=o, dtype=np.float32) if reflected else fn(x, s, out=o, dtype=np.float32)
        s = x.dtype.type(s)
        return fn(s, x, out=o) if reflected else fn(x, s, out=o)
    return run


def _then(xp, c, x, o):  # where(c, x, 0)
    xp.copyto(o, _zero(o))
    xp.copyto(o, x, where=c)


def _else(xp, c, x, o):  # where(c, 0, x)
    xp.copyto(o, x)
    xp.copyto(o, _zero(o), where=c)


def _fill_then(xp, c, s, o):  # where(c, s, 0)
    xp.copyto(o, _zero(o))
    xp.copyto(o, o.dtype.type(s), where=c)


def _fill_else(xp, c, s, o):  # where(c, 0, s)
    xp.copyto(o, o.dtype.type(s))
    xp.copyto(o, _zero(o), where=c)


def _astype(xp, x, _, o):
    o[...] = x  # (NumPy's unsafe cast, as astype: floats to integers truncate toward zero)



def _power(xp, x, y, o):
    """x ** y of two float arrays: 16-bit ones in float32, rounded once into o (as the scalar powers)."""
    if x.dtype.itemsize == 2:
        o[...] = xp.power(x.astype(np.float32), y.astype(np.float32))
    else:
        xp.power(x, y, out=o)


def _cumsum(xp, x, _, o):
    """The running sum of the last axis (np.cumsum), in order: 16-bit floats summed in float32 and each
    prefix rounded once (as their sums); other dtypes in their own (NumPy's)."""
    if x.dtype.itemsize == 2:
        o[...] = xp.cumsum(x.astype(np.float32), axis=-1)
    else:
        xp.cumsum(x, axis=-1, out=o)


def _ufunc(op):  # (a MORE_MATH Op's value is its ufunc's name: Op.ARCSIN is "arcsin")
    return lambda xp, x, _, o: getattr(xp, op)(x, out=o)


def _binary_ufunc(op):  # (a comparison Op's value is its ufunc's name: Op.LT is "less"; so are FLOAT_BINARY's)
    return lambda xp, x, y, o: getattr(xp, op)(x, y, out=o)


def _compare_scalar(op):
    return lambda xp, x, s, o: getattr(xp, op)(x, x.dtype.type(s), out=o)


_TO_SCALAR = {Op.LT: Op.LT_SCALAR, Op.LE: Op.LE_SCALAR, Op.GT: Op.GT_SCALAR, Op.GE: Op.GE_SCALAR,
              Op.EQ: Op.EQ_SCALAR, Op.NE: Op.NE_SCALAR}

ELEMENTWISE = {
    **_BASIC,
    Op.SQRT: lambda xp, x, _, o: xp.sqrt(x, out=o),
    Op.LOG: lambda xp, x, _, o: xp.log(x, out=o),
    Op.RSQRT: _in32(lambda xp, x, _: 1 / xp.sqrt(x)),
    Op.SIGMOID: _in32(_sigmoid),
    Op.SIN: lambda xp, x, _, o: xp.sin(x, out=o),
    Op.COS: lambda xp, x, _, o: xp.cos(x, out=o),
    Op.LOG1P: lambda xp, x, _, o: xp.log1p(x, out=o),
    Op.EXPM1: lambda xp, x, _, o: xp.expm1(x, out=o),
    Op.ERF: _erf,
    **{op: _ufunc(op) for op in MORE_MATH},
    Op.GELU_ERF: _gelu_erf,
    Op.SIGN: _in32(lambda xp, x, _: xp.sign(x)),  # (16-bit through float32: ml_dtypes' sign(-0.0) is -0.0)
    Op.FLOOR: lambda xp, x, _, o: xp.floor(x, out=o),
    Op.CEIL: lambda xp, x, _, o: xp.ceil(x, out=o),
    Op.ROUND: lambda xp, x, _, o: xp.rint(x, out=o),  # (halves to even: np.round's decimals=0 is rint)
    Op.TRUNC: lambda xp, x, _, o: xp.trunc(x, out=o),
    Op.ISNAN: lambda xp, x, _, o: xp.isnan(x, out=o),
    Op.ISINF: lambda xp, x, _, o: xp.isinf(x, out=o),
    Op.ISFINITE: lambda xp, x, _, o: xp.isfinite(x, out=o),
    Op.SILU: _in32(lambda xp, x, _: x * _sigmoid(xp, x, _)),
    Op.POW: lambda xp, x, s, o: _scalar(xp.power)(xp, x, s, o),
    Op.RPOW: lambda xp, x, s, o: _scalar(xp.power, reflected=True)(xp, x, s, o),
    Op.POWER: _power,
    Op.MAXIMUM: lambda xp, x, y, o: xp.maximum(x, y, out=o),
    Op.MINIMUM: lambda xp, x, y, o: xp.minimum(x, y, out=o),
    Op.MAXIMUM_SCALAR: lambda xp, x, s, o: xp.maximum(x, x.dtype.type(s), out=o),
    Op.MINIMUM_SCALAR: lambda xp, x, s, o: xp.minimum(x, x.dtype.type(s), out=o),
    # (CuPy's floor_divide and remainder are NumPy's: Python's signs, 0 for an integer divided by 0)
    Op.FLOOR_DIVIDE: lambda xp, x, y, o: xp.floor_divide(x, y, out=o),
    Op.MOD: lambda xp, x, y, o: xp.remainder(x, y, out=o),
    **{op: _binary_ufunc(op) for op in _TO_SCALAR},
    **{scalar: _compare_scalar(op) for op, scalar in _TO_SCALAR.items()},
    Op.LOGICAL_NOT: lambda xp, x, _, o: xp.logical_not(x, out=o),
    **{op: _binary_ufunc(op) for op in (Op.BITWISE_AND, Op.BITWISE_OR, Op.BITWISE_XOR) + tuple(FLOAT_BINARY)},
    Op.INVERT: lambda xp, x, _, o: xp.invert(x, out=o),
    Op.WHERE_THEN: _then,
    Op.WHERE_ELSE: _else,
    Op.FILL_THEN: _fill_then,
    Op.FILL_ELSE: _fill_else,
    Op.ASTYPE: _astype,
    Op.FULL_LIKE: lambda xp, x, s, o: xp.copyto(o, o.dtype.type(s)),
    Op.ORDER_KEYS: extrema.to_keys,
    Op.FROM_ORDER_KEYS: extrema.from_keys,
    Op.REDUCE_MAX: lambda xp, x, _, o: xp.max(x, axis=-1, out=o),
    Op.REDUCE_MIN: lambda xp, x, _, o: xp.min(x, axis=-1, out=o),
    Op.CUMSUM: _cumsum,  # (NumPy only: the CuPy backend has its own kernel, kernels.Kernels.cumsum)
    Op.ARGSORT: lambda xp, x, _, o: xp.copyto(o, _argsort(xp, x)),
    Op.PERMUTE: lambda xp, x, order, o: xp.copyto(o, xp.take_along_axis(x, order, axis=-1)),
}


def _argsort(xp, x):
    """The stable ascending order of x's last axis (NaN last, as NumPy sorts); CuPy's argsort is a
    stable sort and takes no kind=."""
    return xp.argsort(x, axis=-1, kind="stable") if xp is np else xp.argsort(x, axis=-1)


def take_rows(xp, table, ids, rows, vocab, out):
    """out = table[ids] for the rows this device holds (rows: their global numbers, consecutive),
    zeros for the others (Megatron's vocab-parallel embedding: the devices' outputs sum to the
    lookup).  ids index as NumPy's (negative from the end of the vocabulary) and those outside
    [-vocab, vocab) are clamped to the first or last row, as JAX's indexing does; bfloat16 rows
    are moved as their bits."""
    loc = global_ids(xp, ids, vocab) - rows[0]
    held = (loc >= 0) & (loc < table.shape[0])
    picked = xp.take(table, xp.clip(loc, 0, table.shape[0] - 1), axis=0)
    mask = held.reshape(held.shape + (1,) * (table.ndim - 1))
    out[...] = xp.where(mask, picked, xp.asarray(not_held(picked.dtype), picked.dtype))


def not_held(dtype):
    """What a device writes for the rows it does not hold: -0.0 for floats (the sum over devices then
    keeps a -0.0 row's sign: -0.0 + -0.0 is -0.0, where +0.0 made it +0.0; a fuzzer), 0 otherwise; a
    bfloat16 moved as its uint16 bits gets -0.0's bits, 0x8000 (every uint16 buffer is a bfloat16's:
    shardfuse has no uint16 dtype)."""
    if dtype == np.uint16:
        return 0x8000
    return -0.0 if dtype.kind == "f" or dtype.name == "bfloat16" else 0


def box_slices(box, starts, outer, inner) -> tuple:
    """The slices of the box of extents `inner` in an array of extents `outer`: `box` per axis a start,
    or None for the next of `starts` (0-d integer arrays, read now); as jax.lax.dynamic_slice places
    it: a negative start counts from the end, then it is clamped so that the box fits."""
    it, out = iter(starts), []
    for s, n, b in zip(box, outer, inner):
        s = int(next(it)) if s is None else s
        s = min(max(s + n if s < 0 else s, 0), n - b)
        out.append(slice(s, s + b))
    return tuple(out)


def global_ids(xp, ids, vocab):
    """ids as row numbers: NumPy's negative ids from the end, those outside [-vocab, vocab) clamped."""
    g = ids.astype(np.int64)
    return xp.clip(xp.where(g < 0, g + vocab, g), 0, vocab - 1)


def scatter_add_rows(values, ids, rows, vocab, out):
    """out = the sum, per row this device holds (rows: their global numbers, consecutive), of the
    values of the positions whose id is that row; zeros where none is (take_rows's transpose, the
    embedding's gradient: the devices' outputs are the vocab-parallel gradient's pieces).  ids as
    take_rows reads them; repeated ids accumulate (np.add.at), in float32 for 16-bit values (as
    torch's embedding backward) and float32, in float64 for float64, then rounded once.  Every
    element of out is written.  Shapes: out [rows.size, ...] or a chunk of it split along axis 0
    (out.size = rows.size * width), values [*ids.shape, width elements]."""
    nloc = rows.size  # (at least 1: a vocabulary axis is never empty)
    width = out.size // nloc
    loc = global_ids(np, ids, vocab).reshape(-1) - rows.reshape(-1)[0]
    held = (loc >= 0) & (loc < nloc)
    acc = np.zeros((nloc, width), np.float64 if out.dtype == np.float64 else np.float32)
    np.add.at(acc, loc[held], values.reshape(loc.size, width)[held].astype(acc.dtype))
    out[...] = acc.reshape(out.shape)


def schedule(expr, n_in):
    """A fused step's ops.Expr over its n_in operands as a flat list, (op, argument slots, scalar,
    dtype) per node, node k writing slot n_in + k (the last: the step's output), each equal node once
    (a chain taken in at two reads of its value, tanh(u) * tanh(u), is computed once).  Made once
    when the step is bound."""
    steps, memo = [], {}

    def visit(e):
        if e.op is None:
            return e.arg
        if e not in memo:
            slots = [visit(a) for a in e.args]
            steps.append((e.op, slots, e.value, e.dtype))
            memo[e] = n_in + len(steps) - 1
        return memo[e]
    visit(expr)
    return steps


def evaluate(xp, steps, slots):
    """schedule()'s steps over `slots` (the operands, then a buffer per node, the last the output):
    op by op, each node in its own dtype, so NumPy's results are those of the unfused steps."""
    for k, (op, args, value, _) in enumerate(steps, len(slots) - len(steps)):
        ELEMENTWISE[op](xp, slots[args[0]], value if len(args) == 1 else slots[args[1]], slots[k])


def summer(dtype, axis, scale):
    """fn(x, o): o = x.sum(axis) * scale into o of `dtype`, 16-bit values summed in float32 (as on
    GPUs: NumPy sums bfloat16 in bfloat16), and scaled before they are rounded back (a float16 mean
    whose sum would overflow does not)."""
    acc = np.float64 if dtype == "float64" else np.int64 if dtype == "int64" else np.float32

    def total(x, o):
        if o.dtype == acc:  # (no temporary)
            np.sum(x, axis=axis, out=o)
            if scale != 1.0:
                o *= scale
            return
        s = np.sum(x, axis=axis, dtype=acc)
        o[...] = s if scale == 1.0 else s * scale
    return total


def row_schedule(exprs, in_shapes):
    """A FusedRows step's ops.Exprs (passes/fuse_rows.py: its expr, then those of its further
    results) as schedule()'s flat list, each equal node once, with each node's shape: ((op, argument
    slots, scalar, dtype, shape) per node, node k writing slot len(in_shapes) + k; the slot of each
    Expr's result).  A reduction node has its argument's shape with the last axis kept as 1; an
    elementwise one the broadcast of its arguments'."""
    steps, slot_of, shapes = [], {}, list(in_shapes)

    def visit(e):
        if e.op is None:
            return e.arg
        if e not in slot_of:
            slots = [visit(a) for a in e.args]
            shape = shapes[slots[0]][:-1] + (1,) if e.op in ROW_REDUCTIONS else \
                tuple(np.broadcast_shapes(*(shapes[k] for k in slots)))
            steps.append((e.op, slots, e.value, e.dtype, shape))
            shapes.append(shape)
            slot_of[e] = len(shapes) - 1
        return slot_of[e]
    roots = [visit(e) for e in exprs]
    return steps, roots


def _row_sum(xp, x, factor, o):
    summer(o.dtype.name, -1, 1.0 if factor is None else factor)(x, o[..., 0])


# a FusedRows step's reduction nodes: the result [..., 1], as the unfused steps reduce into [...]
ROW_REDUCTIONS = {
    Op.REDUCE_MAX: lambda xp, x, _, o: ELEMENTWISE[Op.REDUCE_MAX](xp, x, None, o[..., 0]),
    Op.REDUCE_MIN: lambda xp, x, _, o: ELEMENTWISE[Op.REDUCE_MIN](xp, x, None, o[..., 0]),
    Op.SUM: _row_sum,
}


def evaluate_rows(xp, steps, slots):
    """row_schedule()'s steps over `slots` (the operands, then a buffer per node of its shape): op by
    op, each node in its own dtype and each reduction as the unfused step reduces (summer's sums)."""
    for k, (op, args, value, *_) in enumerate(steps, len(slots) - len(steps)):
        fn = ROW_REDUCTIONS.get(op) or ELEMENTWISE[op]
        fn(xp, slots[args[0]], value if len(args) == 1 else slots[args[1]], slots[k])
