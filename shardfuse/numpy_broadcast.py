"""NumPy's broadcasting functions and binary math on traced values and sf.Arrays: np.broadcast_to,
np.repeat / x.repeat (an int count, or a count per element known when traced: a take), np.tile, np.outer,
np.logaddexp, np.power / x ** y (a scalar or an array exponent) and np.arctan2 / hypot / copysign /
signbit; their entries of the NUMPY table, `unbroadcast` (broadcasting's transpose, the sum over the
broadcast axes, which autodiff's rules use) and the derivatives of the ops here (`VJP`: Op.POWER,
ARCTAN2, HYPOT, COPYSIGN, merged into autodiff.VJP).

All but the power of two arrays and the binary float functions (one elementwise step each) are
compositions of ops shardfuse has, so they shard as those do:
np.broadcast_to(x, shape) is x plus a small constant of zeros that has the broadcast axes alone
(an elementwise step: x's axes keep their sharding, the new ones are replicated, nothing moves),
and its gradient is the sum over the broadcast axes; np.repeat(x, r, axis) is x with an axis of 1
after `axis`, broadcast to r and merged into it by a reshape (GQA's repeat_kv, `np.repeat(k, G,
axis=1)` of heads sharded over tp: a view, no communication); np.tile repeats whole axes the same
way, the count before the axis, so a tiled sharded axis is gathered first (the reshape's rule,
printed); np.outer is a column times a row; np.logaddexp is the stable max(a, b) + log1p(exp(-|a - b|)).
x ** y of two arrays is one elementwise step (Op.POWER: NumPy's and CUDA's pow of floats, so a
negative x with an integral y is NumPy's signed result and with another y NaN, as NumPy's).
"""
from __future__ import annotations

import numpy as np

from shardfuse import dtypes
from shardfuse.mesh import as_int
from shardfuse.ops import Op
from shardfuse.spec import normalize_axis
from shardfuse.traced import NUMPY, Traced, cast, describe, is_weak_scalar
from shardfuse.traced_numpy import apply_op, maximum, scalar_operands, where


def unbroadcast(ct: Traced, shape) -> Traced:
    """ct summed over the axes broadcasting added or stretched, to `shape` (broadcast_to's transpose)."""
    if ct.shape == tuple(shape):
        return ct
    lead = ct.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, n in enumerate(shape) if n == 1 and ct.shape[lead + i] != 1)
    return ct.sum(axis=axes).reshape(shape) if axes else ct.reshape(shape)


def _extents(what, shape, empty=False) -> tuple:
    """A shape argument (an int or a sequence of ints) as a tuple of positive ints (empty=True: or 0)."""
    shape = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
    shape = tuple(as_int(n, f"{what}: an extent") for n in shape)
    if any(n < 0 for n in shape):
        raise ValueError(f"{what}: negative extents in {shape} (as NumPy: all elements of the shape must be >= 0)")
    if 0 in shape and not empty:
        raise ValueError(f"{what}: an extent 0 in {shape}: shardfuse's arrays are never empty")
    return shape


def broadcast_to(array, shape, subok=False):
    """np.broadcast_to as NumPy's: x broadcast to `shape` (axes aligned from the right, each of x's
    extents equal to the target's or 1).  A new value, not a read-only view: x plus a constant of zeros
    that has the broadcast axes alone (-0.0 for floats: x + -0.0 is x, signed zeros included; logical
    or for booleans), one elementwise step; x's axes keep their sharding.  The gradient is the sum over
    the broadcast axes."""
    return apply_op(_broadcast_to, "broadcast_to", array, _extents("np.broadcast_to", shape, empty=True))


def _broadcast_to(x, shape):
    lead = len(shape) - x.ndim
    if lead < 0 or any(m not in (n, 1) for m, n in zip(x.shape, shape[lead:])):
        raise ValueError(f"np.broadcast_to: {describe(x)} cannot be broadcast to {shape} (NumPy's rule: the axes "
                         "aligned from the right, each extent of the array equal to the shape's or 1)")
    if shape == x.shape:
        return x
    if 0 in shape:  # (no elements: an empty constant, as Traced.reshape's; x[4:].at[...].add(c) reaches it, a probe)
        return x.builder.constant(np.zeros(shape, x.dtype))
    stretch = tuple(n if k < lead or x.shape[k - lead] != n else 1 for k, n in enumerate(shape))
    if x.dtype_name == "bool":
        return x | np.zeros(stretch, bool)
    return x + np.full(stretch, -0.0 if dtypes.is_float(x.dtype_name) else 0, x.dtype)


def _count(what, n) -> int:
    """A repeat count: a Python or NumPy int (or a sequence of one, which NumPy broadcasts), 0 or more."""
    if isinstance(n, (list, tuple, np.ndarray)) and np.size(n) == 1:
        n = np.asarray(n).reshape(())[()]
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)):
        raise TypeError(f"{what}: repeats must be an int, or a list or NumPy array of ints known when the plan is "
                        f"built, got {type(n).__name__} {n!r}: traced counts would give a shape that depends on "
                        "their values")
    return _extents(what, int(n), empty=True)[0]


def repeat(a, repeats, axis=None):
    """np.repeat / x.repeat with an int `repeats` (each element `repeats` times in a row along `axis`;
    axis None: of the flattened array), as NumPy's: GQA's repeat_kv, np.repeat(k, G, axis=1).  An
    axis of 1 after `axis` broadcast to `repeats` (broadcast_to) and merged into it (a reshape: a view
    where the axis is sharded, its devices' rows repeated in place).  A count per element, known when
    the plan is built (a list or a NumPy array of ints): the elements taken by ids, np.take's rule (an
    axis sharded is gathered first); traced counts are refused (the shape would depend on them)."""
    if isinstance(repeats, (list, tuple, np.ndarray)) and np.size(repeats) != 1:
        return apply_op(_repeat_each, "repeat", a, _counts(repeats), axis)
    return apply_op(_repeat, "repeat", a, _count("np.repeat", repeats), axis)


def _counts(repeats) -> tuple:
    r = np.asarray(repeats)
    if r.ndim != 1 or (r.size and r.dtype.kind not in "iu") or (r < 0).any():
        raise ValueError(f"np.repeat: repeats must be an int or a 1-D sequence of non-negative ints, got {repeats!r}")
    return tuple(int(n) for n in r)


def _repeat_each(x, counts, axis):
    if axis is None:
        x, axis = x.reshape(-1), 0
    ax = normalize_axis(axis, x.ndim, x.shape)
    if len(counts) != x.shape[ax]:
        raise ValueError(f"np.repeat of {describe(x)}: {len(counts)} counts for axis {ax} of extent {x.shape[ax]} "
                         "(NumPy's: one count per element, or one for all)")
    return NUMPY[np.take](x, np.repeat(np.arange(len(counts)), counts), axis=ax)


def _repeat(x, r, axis):
    if axis is None:
        x, axis = x.reshape(-1), 0
    ax = normalize_axis(axis, x.ndim, x.shape)
    if r == 1:
        return x
    wide = _broadcast_to(x.reshape(x.shape[:ax + 1] + (1,) + x.shape[ax + 1:]),
                         x.shape[:ax + 1] + (r,) + x.shape[ax + 1:])
    return wide.reshape(x.shape[:ax] + (x.shape[ax] * r,) + x.shape[ax + 1:])


def tile(A, reps):  # noqa: N803 (NumPy's name)
    """np.tile as NumPy's: A repeated reps[k] times whole along axis k (reps an int or a sequence of ints
    >= 0, 0 giving an empty value; the shorter of A's shape and reps padded with 1s in front).  Each repeated axis gets an axis of
    `reps` before it (broadcast_to), merged with it by a reshape: a repeated axis that is sharded is
    gathered first (printed in the plan), the others keep their sharding."""
    return apply_op(_tile, "tile", A, _extents("np.tile", reps, empty=True))


def _tile(x, reps):
    n = max(len(reps), x.ndim)
    reps, shape = (1,) * (n - len(reps)) + reps, (1,) * (n - x.ndim) + x.shape
    wide, target = [], []
    for r, m in zip(reps, shape):
        wide += [1, m] if r != 1 else [m]
        target += [r, m] if r != 1 else [m]
    return _broadcast_to(x.reshape(tuple(wide)), tuple(target)).reshape(tuple(r * m for r, m in zip(reps, shape)))


def outer(a, b, out=None):
    """np.outer as NumPy's: a and b flattened, out[i, j] = a[i] * b[j] (dtypes promoted; of booleans a
    logical and): a column times a row, so a's sharding shards the rows and b's the columns."""
    if out is not None:
        raise TypeError("np.outer with out= is not supported on shardfuse values (inside sf.jit and on sf.Arrays): "
                        "write y = np.outer(a, b), a new value")
    return apply_op(_outer, "outer", a, b)


def _outer(a, b):
    if not (isinstance(a, Traced) and isinstance(b, Traced)):
        raise TypeError(f"np.outer of {describe(a)} and {describe(b)}: both operands must be arrays inside sf.jit and "
                        "on sf.Arrays; for a scalar write x * c")
    col, row = a.reshape(-1, 1), b.reshape(1, -1)
    return col & row if a.dtype_name == b.dtype_name == "bool" else col * row


def logaddexp(x1, x2):
    """np.logaddexp: log(exp(a) + exp(b)) elementwise without overflow, as max(a, b) + log1p(exp(-|a - b|))
    (the difference taken as 0 where a == b, so two equal infinities give themselves, as NumPy's; NaN
    propagates), arrays broadcast or a scalar on either side; NumPy's dtypes (integers in float64),
    16-bit floats computed in float32 and rounded once.  The gradient is the ops' (sigmoid(a - b) for
    a, half each where a == b, as JAX's)."""
    return apply_op(_logaddexp, "logaddexp", x1, x2)


def _logaddexp(a, b):
    a, b = scalar_operands(a, b, "logaddexp")
    dt = dtypes.float_result(a.dtype_name)
    wide = "float32" if dtypes.TABLE[dt].itemsize == 2 else dt
    a, b = cast(a, wide), cast(b, wide)
    d = where(a == b, 0.0, a - b)
    return cast(maximum(a, b) + (-abs(d)).unary_op(Op.EXP).unary_op(Op.LOG1P), dt)


def power(x1, x2):
    """np.power / x ** y, as NumPy's: a Python or NumPy scalar exponent (x ** 2, x ** 0.5: one step
    with the scalar baked in), a scalar base (2.0 ** x), or two arrays broadcast, such as a traced
    0-d learning-rate exponent (lr * decay ** t): one elementwise step of floats (NumPy's dtypes,
    weak Python scalar arguments kept weak; 16-bit floats in float32, rounded once), NaN for a
    negative x and a non-integral y, as NumPy's.  An integer array exponent is refused, of an integer
    array or of a scalar base (NumPy's integer power raises for a negative exponent, which a compiled
    plan cannot), and so is a negative scalar exponent of integers, as NumPy refuses it."""
    return apply_op(_power, str(Op.POWER), x1, x2)


def _power(a, b):
    if isinstance(a, Traced) and is_weak_scalar(b):
        x, c = a.with_scalar(b, Op.POWER)
        if c < 0 and not dtypes.is_float(x.dtype_name):
            raise ValueError(f"x ** {b!r} of {describe(a)}: integers to negative integer powers are not allowed "
                             "(NumPy's ValueError); write x.astype('float64') ** c")
        return x.unary_op(Op.POW, value=c)
    if isinstance(b, Traced) and is_weak_scalar(a):
        x, c = b.with_scalar(a, Op.POWER, reflected=True)
        if not dtypes.is_float(x.dtype_name) and b.dtype_name != "bool":  # (a bool exponent is never negative)
            raise TypeError(f"{a!r} ** x of the integer array {describe(b)}: shardfuse's integer powers take a "
                            "scalar exponent (NumPy's raise for a negative one, which a compiled plan cannot); "
                            "write c ** x.astype('float64')")
        return x.unary_op(Op.RPOW, value=c)
    if not (isinstance(a, Traced) and isinstance(b, Traced)):
        raise TypeError(f"x ** y of {describe(a)} and {describe(b)} (inside sf.jit or on sf.Arrays): shardfuse's "
                        "powers take arrays and real Python or NumPy scalars")
    if not any(dtypes.is_float(v.dtype_name) for v in (a, b)):  # (before NumPy's int8 of two booleans)
        raise TypeError(f"x ** y of {describe(a)} and the array {describe(b)} (inside sf.jit and on sf.Arrays): "
                        f"shardfuse's power of two arrays is of floats ({a.dtype_name} here; NumPy's integer power "
                        "raises for a negative exponent, which a compiled plan cannot); write "
                        "x.astype('float64') ** y, or a Python int exponent (x ** 2)")
    x, y = a.promote_with(b, Op.POWER)
    return x.elementwise_op(Op.POWER, (x, y), x.dtype_name)


def _float_binary(op):
    """np.arctan2 / hypot / copysign: one elementwise step of two floats (arrays broadcast, promoted, a
    scalar on either side; NumPy's dtypes: integers in float64, booleans in float16)."""
    def traced(a, b):
        a, b = scalar_operands(a, b, op)
        return a.elementwise_op(op, (a, b), a.dtype_name)

    def fn(x1, x2):
        return apply_op(traced, str(op), x1, x2)
    fn.__name__ = str(op)
    return fn


arctan2, hypot, copysign = (_float_binary(op) for op in (Op.ARCTAN2, Op.HYPOT, Op.COPYSIGN))
arctan2.__doc__ = "np.arctan2(y, x) elementwise: the angle of (x, y) in [-pi, pi], NumPy's signed zeros and infinities."
hypot.__doc__ = "np.hypot(x, y) elementwise: sqrt(x**2 + y**2) without overflow or underflow in between."
copysign.__doc__ = "np.copysign(x, y) elementwise: |x| with y's sign bit (of -0.0 and a negative NaN too)."


def signbit(x):
    """np.signbit elementwise: True where x's sign bit is set (-0.0 and a negative NaN too), boolean;
    of integers x < 0, of booleans False, as NumPy's."""
    return apply_op(_signbit, "signbit", x)


def _signbit(v):
    if not dtypes.is_float(v.dtype_name):
        return v < 0 if v.dtype_name != "bool" else v.unary_op(Op.FULL_LIKE, "bool", value=False)
    one = v.unary_op(Op.FULL_LIKE, value=1.0)
    return one.elementwise_op(Op.COPYSIGN, (one, v), v.dtype_name) < 0


def square(x):
    """x ** 2 elementwise (np.square, and x ** 2 as NumPy's: of booleans int8, which shardfuse lacks)."""
    if x.dtype_name == "bool":
        raise TypeError(f"np.square (or x ** 2) of the boolean array {describe(x)}: NumPy 2 gives int8, a dtype "
                        "shardfuse lacks; cast first, e.g. x.astype('int32') ** 2 (np.power(x, 2) is int64)")
    return power(x, 2)


NUMPY.update({
    np.broadcast_to: broadcast_to, np.repeat: repeat, np.tile: tile, np.outer: outer, np.logaddexp: logaddexp,
    np.power: power, np.square: square, np.arctan2: arctan2, np.atan2: arctan2, np.hypot: hypot,
    np.copysign: copysign, np.signbit: signbit,
})


def _power_rule(ins, xs, out, ct, instrs):
    """JAX's: d/dx = y x^(y - 1) (0 where y == 0), d/dy = log(x) x^y (0 where x == 0: log(1))."""
    x, y = xs
    dx = ct * where(y == 0, 0.0, y * x ** (y - 1.0))
    dy = ct * (where(x == 0, 1.0, x).unary_op(Op.LOG) * out)
    return [unbroadcast(dx, x.shape), unbroadcast(dy, y.shape)]


def _arctan2_rule(ins, xs, out, ct, instrs):
    """d/dy atan2(y, x) = x / (x^2 + y^2), d/dx = -y / (x^2 + y^2), as (ct / h) (x / h) with h = hypot(x, y):
    no x^2 + y^2 to overflow or underflow (float16 at 1e-4 or 300)."""
    y, x = xs
    h = x.elementwise_op(Op.HYPOT, (x, y), x.dtype_name)
    r = ct / h
    return [unbroadcast(r * (x / h), y.shape), unbroadcast(-(r * (y / h)), x.shape)]


def _hypot_rule(ins, xs, out, ct, instrs):
    x, y = xs
    r = ct / out
    return [unbroadcast(r * x, x.shape), unbroadcast(r * y, y.shape)]


def _copysign_rule(ins, xs, out, ct, instrs):
    """d/dx copysign(x, y) = +-1: the product of x's and y's signs (y gets none: piecewise constant)."""
    x, y = xs
    one = x.unary_op(Op.FULL_LIKE, value=1.0)
    flip = one.elementwise_op(Op.COPYSIGN, (one, x), x.dtype_name) * one.elementwise_op(Op.COPYSIGN, (one, y),
                                                                                        x.dtype_name)
    return [unbroadcast(ct * flip, x.shape), None]


VJP = {Op.POWER: _power_rule, Op.ARCTAN2: _arctan2_rule, Op.HYPOT: _hypot_rule, Op.COPYSIGN: _copysign_rule}
