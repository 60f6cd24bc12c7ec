"""Logical and bitwise ops, inside sf.jit and on sf.Arrays outside it, as NumPy's and JAX's:
``mask & np.tril(...)``, ``a | b``, ``a ^ b``, ``~a``; np.logical_and / or / xor / not,
np.bitwise_and / or / xor / invert (np.bitwise_not); and ``x.any(axis)`` / ``x.all(axis)``
(np.any, np.all).

- ``& | ^ ~`` of booleans are logical; of integers (int32, int64) bitwise; a boolean beside an
  integer is promoted to it, int32 beside int64 to int64 (NumPy's promotion); a Python scalar is
  weak (``mask & True`` stays bool, ``i32 & 7`` int32).  Floats are refused, as NumPy refuses them.
- np.logical_* take any dtype, read as ``x != 0`` (NaN counts as true), and give booleans.
- any / all are the max / min of ``x != 0`` (over a sharded axis each device's, then one Allreduce
  with max / min); over an axis of extent 0, NumPy's False / True.

Each is an elementwise op of ops.BINARY (the elementwise sharding rule; pending sums are made
whole first) with no gradient (boolean and integer results carry none, as in JAX).
"""
from __future__ import annotations

import numpy as np

from shardfuse.ops import Op
from shardfuse.spec import reduced_axes
from shardfuse.traced import NUMPY, Traced, describe, is_weak_scalar
from shardfuse.traced_numpy import apply_op, scalar_operands

_INTS = ("int32", "int64")
_SYMBOL = {Op.BITWISE_AND: "&", Op.BITWISE_OR: "|", Op.BITWISE_XOR: "^"}


def _refuse_floats(v, what):
    if v.dtype_name != "bool" and v.dtype_name not in _INTS:
        raise TypeError(f"{what} of {describe(v)}: & | ^ ~ are NumPy's bitwise ops, of booleans (logical) and "
                        "integers only, as NumPy's; compare first (x > 0), or use np.logical_and / or / xor / not, "
                        "which read any value as x != 0")


def _bitwise_traced(a, b, op):
    # (one op serves mask & True and True & mask, as x // 2 and 2 // x)
    what = f"x {_SYMBOL[op]} y (np.{op})"
    if not (is_weak_scalar(a) or is_weak_scalar(b)) and not (isinstance(a, Traced) and isinstance(b, Traced)):
        bad = b if isinstance(a, Traced) else a
        raise TypeError(f"{what}: an array or a Python scalar was expected, got {type(bad).__name__}")
    a, b = scalar_operands(a, b, op)
    _refuse_floats(a, what)
    return a.elementwise_op(op, (a, b), a.dtype_name)


def _bitwise(op, ufunc):
    def fn(x, y):
        return apply_op(_bitwise_traced, ufunc.__name__, x, y, op)
    fn.__name__ = ufunc.__name__
    fn.__doc__ = (f"np.{ufunc.__name__}(x, y), x {_SYMBOL[op]} y: of booleans logical, of integers bitwise, "
                  "NumPy's dtypes (a Python scalar weak); floats refused.")
    return fn


bitwise_and, bitwise_or, bitwise_xor = (_bitwise(op, u) for op, u in (
    (Op.BITWISE_AND, np.bitwise_and), (Op.BITWISE_OR, np.bitwise_or), (Op.BITWISE_XOR, np.bitwise_xor)))


def _invert_traced(v):
    _refuse_floats(v, "~x (np.invert)")
    return v.unary_op(Op.LOGICAL_NOT if v.dtype_name == "bool" else Op.INVERT)


def invert(x):
    """~x, np.invert (np.bitwise_not): of booleans logical not, of integers bitwise not; floats refused."""
    return apply_op(_invert_traced, np.invert.__name__, x)


def _as_bool(v):
    if not isinstance(v, Traced) or v.dtype_name == "bool":  # (a scalar, or what _bitwise_traced refuses)
        return v
    return v.astype("bool")  # (x != 0, NaN true: NumPy's)


def _logical_traced(a, b, op):
    a, b = (bool(v) if is_weak_scalar(v) else _as_bool(v) for v in (a, b))
    return _bitwise_traced(a, b, op)


def _logical(op, ufunc, doc):
    def fn(x, y):
        return apply_op(_logical_traced, ufunc.__name__, x, y, op)
    fn.__name__ = ufunc.__name__
    fn.__doc__ = doc
    return fn


logical_and = _logical(Op.BITWISE_AND, np.logical_and, "x and y elementwise (np.logical_and, jnp.logical_and): "
                       "booleans; other dtypes read as x != 0.")
logical_or = _logical(Op.BITWISE_OR, np.logical_or, "x or y elementwise (np.logical_or): booleans; other "
                      "dtypes read as x != 0.")
logical_xor = _logical(Op.BITWISE_XOR, np.logical_xor, "x xor y elementwise (np.logical_xor): booleans; other "
                       "dtypes read as x != 0.")


def _any_all(x, axis, keepdims, kind):
    m = _as_bool(x)
    axes = reduced_axes(axis, x.ndim, x.shape)
    if any(x.shape[a] == 0 for a in axes):  # (max and min have no identity: a count, NumPy's False / True)
        count = (m if kind == "any" else ~m).astype("int64").sum(axis, keepdims=keepdims)
        return count > 0 if kind == "any" else count == 0
    return m.max(axis, keepdims=keepdims) if kind == "any" else m.min(axis, keepdims=keepdims)


def _reduction_args(name, out, where, rest):
    if out is not None or where is not True or rest:
        given = [k + "=" for k, v in (("out", out), ("where", where)) if v is not None and v is not True] + \
            [k + "=" for k in rest]
        raise TypeError(f"np.{name} with {', '.join(given)} is not supported on shardfuse values (inside sf.jit and "
                        "on sf.Arrays): write "
                        f"np.{name}(x, axis, keepdims=) or x.{name}(axis, keepdims=), a new value")


def np_any(a, axis=None, out=None, keepdims=False, *, where=True, **rest):
    """np.any / x.any: whether any element over `axis` (an int, a tuple, None: all) is nonzero
    (NaN counts), a boolean array, as NumPy's."""
    _reduction_args("any", out, where, rest)
    return apply_op(_any_all, "any", a, tuple(axis) if isinstance(axis, list) else axis, bool(keepdims), "any")


def np_all(a, axis=None, out=None, keepdims=False, *, where=True, **rest):
    """np.all / x.all: whether every element over `axis` is nonzero (NaN counts), as NumPy's."""
    _reduction_args("all", out, where, rest)
    return apply_op(_any_all, "all", a, tuple(axis) if isinstance(axis, list) else axis, bool(keepdims), "all")


NUMPY.update({
    np.bitwise_and: bitwise_and, np.bitwise_or: bitwise_or, np.bitwise_xor: bitwise_xor, np.invert: invert,
    np.logical_and: logical_and, np.logical_or: logical_or, np.logical_xor: logical_xor,
    np.any: np_any, np.all: np_all,
})
