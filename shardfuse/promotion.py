"""The dtypes of binary ops on traced values (and so on sf.Arrays): NumPy 2's, asked of NumPy itself.

Every binary operator and its reflected form (x + c and c + x, x - c and c - x, /, //, %, **, the
comparisons, & | ^) and np.maximum / np.minimum / np.where compute in the dtype NumPy's own type
resolution picks for their ufunc (`ufunc.resolve_dtypes`, NEP 50): a Python int / float is weak (it
takes the array's dtype unless it is of a higher kind: int32 x * 0.5 is float64, float16 x * 2.0 stays
float16), a Python bool is a bool; a NumPy scalar and a 0-d array are strong, as any array (float32 x -
np.float64(0.5) is float64); a traced value made from a Python scalar argument of sf.jit is weak, as
JAX's.  So `0.5 - int_array` is float64, `1.0 - mask` float64, `3 / int_array` float64, and where NumPy
refuses (`mask - mask`, `True - mask`) or answers in a dtype shardfuse lacks (int8 for `mask // mask`),
the TypeError comes here, at trace time, before anything runs (& | ^ of floats: logical.py's, saying
what to write).  No table of our own: a new dtype pair is NumPy's answer (bfloat16's through ml_dtypes).
"""
from __future__ import annotations

import functools
import operator
import os
import sys
import warnings
import weakref

import numpy as np

from shardfuse import dtypes
from shardfuse.ops import Op

# the ufunc whose type resolution an op follows (the others: np.add's, which is NumPy's plain promotion)
UFUNCS = {
    Op.ADD: np.add, Op.SUB: np.subtract, Op.MUL: np.multiply, Op.DIV: np.true_divide,
    Op.FLOOR_DIVIDE: np.floor_divide, Op.MOD: np.remainder, Op.POWER: np.power,
    Op.MAXIMUM: np.maximum, Op.MINIMUM: np.minimum,
    Op.LT: np.less, Op.LE: np.less_equal, Op.GT: np.greater, Op.GE: np.greater_equal, Op.EQ: np.equal,
    Op.NE: np.not_equal, Op.ARCTAN2: np.arctan2, Op.HYPOT: np.hypot, Op.COPYSIGN: np.copysign,
}  # (& | ^: np.add's promotion, then logical.py refuses floats, as NumPy's bitwise ufuncs, saying what to write)
# Python's comparison of a scalar beyond an integer dtype's range with 0 (which any element compares as)
COMPARE = {Op.LT: operator.lt, Op.LE: operator.le, Op.GT: operator.gt, Op.GE: operator.ge, Op.EQ: operator.eq,
           Op.NE: operator.ne}
_WEAK = (np.dtype(bool), int, float)  # a weak value of kind bool, integer, float as NumPy's resolution takes it


def numpy_operand(x):
    """x as `ufunc.resolve_dtypes` takes it: a Python int or float as its type (weak), a Python or
    NumPy bool as bool, a NumPy scalar as its dtype (strong); a traced value (it has `dtype_name`
    and `weak`) as its dtype, or where weak as the Python type of its kind."""
    if hasattr(x, "dtype_name"):
        return _WEAK[dtypes.KINDS[x.dtype_name]] if x.weak else dtypes.np_dtype(x.dtype_name)
    if isinstance(x, (bool, np.bool_)):
        return np.dtype(bool)
    if isinstance(x, np.generic):
        return x.dtype
    if isinstance(x, (int, float, complex)):
        return int if isinstance(x, int) else float if isinstance(x, float) else complex
    raise TypeError(f"an array or a Python / NumPy scalar was expected, got {type(x).__name__}")


_DEFAULTS = {int: np.dtype(np.int64), float: np.dtype(np.float64)}  # a weak scalar beside no array


def strong_operands(a, b) -> tuple:
    """NEP 50's rule for a weak operand (the Python type int or float) made explicit: the other
    operand's dtype where that is of the same kind or higher (int beside float16, float beside
    bfloat16), else its kind's default dtype.  NumPy's own resolution of a weak float beside an
    ml_dtypes type depends on the versions (ml_dtypes 0.6 with NumPy 2.5: bfloat16 * 0.5 computed in
    float32; 0.7: bfloat16), and a GPU machine had the former: the transformer layer's GEMMs ran in
    float32, 3x slower (2026-12-06)."""
    def strong(x, other):
        if x not in _DEFAULTS:
            return x
        if other not in _DEFAULTS and dtypes.KINDS.get(other.name, 2) >= (1 if x is int else 2):
            return other
        return _DEFAULTS[x]
    return strong(a, b), strong(b, a)


def describe(x) -> str:
    """An operand in a message: a traced value's name and dtype (weak: from a Python scalar), a scalar's type and value."""
    if hasattr(x, "dtype_name"):
        return f"{x.value.name} ({x.dtype_name}{', weak' if x.weak else ''})"
    return f"the {'Python' if type(x).__module__ == 'builtins' else 'NumPy'} scalar {x!r}"


@functools.lru_cache(maxsize=1024)
def _resolve(ufunc, a, b) -> tuple:
    return tuple(t.name for t in ufunc.resolve_dtypes((a, b, None)))


def loop_dtypes(op, a, b) -> tuple:
    """(the dtype NumPy 2 computes `op` of a and b in, the result's dtype), a and b traced values or
    scalars, in NumPy's order (c - x: the scalar first).  NumPy's refusal, or a dtype shardfuse lacks,
    is a TypeError that says what was expected."""
    ufunc = UFUNCS.get(op, np.add)
    try:
        t1, t2, out = _resolve(ufunc, *strong_operands(numpy_operand(a), numpy_operand(b)))
    except TypeError as e:
        raise TypeError(f"{_call(op, ufunc, a, b)}: NumPy 2 refuses it (np.{ufunc.__name__}: {e}); cast first, e.g. "
                        "x.astype('int32') or x.astype('float32')") from None
    if t1 == "float64" and out != "bool":  # (a comparison's result is bool: nothing follows in float64)
        _warn_widened(a, b)
    if t1 != t2 or not {t1, out} <= dtypes.TABLE.keys():
        why = " (NumPy's dtype of such ops of boolean operands)" if out == "int8" else ""
        raise TypeError(f"{_call(op, ufunc, a, b)}: NumPy 2 computes it in {t1} and {t2}, giving {out}{why}, a dtype "
                        f"shardfuse lacks (it has {', '.join(dtypes.DTYPES)}); cast an operand first, e.g. "
                        "x.astype('int32')")
    return t1, out


_WARNED = weakref.WeakSet()  # the traces (builders) warned once already


def _warn_widened(a, b) -> None:
    """A warning, once per trace, where a traced value of a narrower float dtype (bfloat16, float16,
    float32) computes in float64 because the other operand is a NumPy constant (an array the function
    closed over, or a NumPy scalar) of float64 or of an integer dtype (float32 * int64 is float64): NumPy 2's rule, which shardfuse follows, but JAX without
    x64 computes in float32, and a bfloat16 model's later GEMMs then silently ran in float64 (a probe:
    RoPE tables from np.cos, 7 of 10 GEMMs)."""
    for x, c in ((a, b), (b, a)):
        narrow = hasattr(x, "dtype_name") and x.dtype_name in ("bfloat16", "float16", "float32") and not x.weak
        if not narrow or x.builder in _WARNED:
            continue
        scalar = isinstance(c, np.generic) and not isinstance(c, np.bool_)  # (float64, or an integer: int64 too)
        if scalar or hasattr(c, "dtype_name") and _from_constants(c):
            _WARNED.add(x.builder)
            what = f"the NumPy scalar {c!r}" if scalar else f"a NumPy {c.dtype_name} array {c.shape}"
            warnings.warn(f"{x.dtype_name} value {x.value.name} {tuple(x.shape)} computes in float64 with {what} the "
                          "function closes over (NumPy 2's promotion, which shardfuse follows; JAX without x64 computes "
                          f"in float32), and so does what follows from it.  Cast the constant to {x.dtype_name} "
                          "(np.cos(t).astype(x.dtype)) or use a Python float, which takes the array's dtype",
                          UserWarning, stacklevel=_user_level())


def _from_constants(c) -> bool:
    """c is a NumPy constant the function closes over, or made from such constants by ops whose other
    operands are integers (a RoPE table's rows at traced positions, sf.take(COS, pos): a serving probe),
    not from a program input of float64."""
    consts = {v for _, _, v in c.builder.constants.values()}
    if c.value in consts:
        return True
    made = c.builder.producer  # (value -> the instruction that made it, kept by the builder)
    todo, seen, found = [c.value], set(), False
    while todo:
        v = todo.pop()
        if v in seen or v.type.dtype == "bool" or v.type.dtype.startswith(("int", "uint")):
            continue  # (ids, masks: no float data of their own)
        seen.add(v)
        if v in consts:
            found = True
        elif v not in made:
            return False  # (a program input's floats)
        else:
            todo += made[v].ins
    return found


def _user_level() -> int:
    """warnings.warn's stacklevel, from its caller's frame, of the first frame outside shardfuse (the
    user's line that made the op)."""
    f, level = sys._getframe(1), 1
    while f is not None and f.f_code.co_filename.startswith(_PACKAGE):
        f, level = f.f_back, level + 1
    return level


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _call(op, ufunc, a, b) -> str:
    if op in UFUNCS:
        return f"np.{ufunc.__name__}({describe(a)}, {describe(b)})"
    return f"{op} of {describe(a)} and {describe(b)}"


def beyond(c, dtype: str) -> bool:
    """Whether c is a Python int beyond the range of the integer dtype `dtype` (NumPy 2: an OverflowError
    for arithmetic; a comparison is decided as if by 0, every element the same way)."""
    if dtypes.is_float(dtype) or dtype == "bool" or isinstance(c, (bool, np.generic)) or not isinstance(c, int):
        return False
    info = np.iinfo(dtype)
    return not info.min <= c <= info.max


def scalar_value(c, dtype: str):
    """c as the plan stores it beside a value of `dtype` (the dtype NumPy computes in): a bool, an int or
    a float rounded to `dtype` first, as NumPy 2 rounds a weak scalar (float16 x * 0.1 multiplies by
    float16(0.1); the kernels of every backend then use the same value).
    A Python int beyond an integer dtype's range raises NumPy 2's OverflowError."""
    if beyond(c, dtype):
        raise OverflowError(f"Python integer {c} out of bounds for {dtype} (NumPy 2 raises too: NEP 50 casts a "
                            "Python int to the array's dtype); write it as an array of a wider dtype, or a float")
    if dtype == "bool":
        return bool(c)
    if not dtypes.is_float(dtype):
        return int(c)
    return dtypes.as_value(c, dtype)


def negated(c, dtype: str):
    """-c for x - c as x + (-c): an integer's in the dtype's two's complement (-(-2**63) wraps to itself, as
    NumPy's x - c does)."""
    if dtypes.is_float(dtype):
        return -c
    bits = 8 * dtypes.TABLE[dtype].itemsize
    return (-c + 2 ** (bits - 1)) % 2 ** bits - 2 ** (bits - 1)
