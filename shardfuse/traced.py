"""Traced values: what an `sf.jit` function's arguments are while it is traced.

Every operation on a `Traced` value appends one array-level instruction to the program being
built (`Builder`).  Shape, dtype and axis errors are raised here, at trace time, so nothing runs
before they are found.  The annotations on traced values are shardfuse.trace's.
"""
from __future__ import annotations

import math
import operator

import numpy as np

from shardfuse.ir import Instr, Namer, TensorType, Value
from shardfuse.mesh import as_int
from shardfuse.ops import Op
from shardfuse.spec import check_axis, normalize_axis

class Builder:
    """Collects the instructions of one traced function."""

    def __init__(self, mesh):
        self.mesh = mesh
        self.instrs: list = []
        self.namer = Namer()
        self.producer: dict = {}  # value -> the instruction that made it
        self.homes: dict = {}  # value -> the sub-mesh it lives on, where known when traced

    def emit(self, op, ins, out_type, base, **attrs) -> "Traced":
        out = Value(self.namer(base), out_type)
        ins_ = Instr(op, (out,), tuple(t.value for t in ins), attrs)
        self.instrs.append(ins_)
        self.producer[out] = ins_
        lay, homes = getattr(out_type, "layout", None), {self.homes.get(t.value) for t in ins}
        home = lay.mesh if lay is not None else homes.pop() if len(homes) == 1 else None  # (propagation's rule)
        self.homes.update({out: home} if home is not None else {})
        return Traced(self, out)


class Traced:
    """A value inside a traced function (global shape, like a JAX tracer)."""

    def __init__(self, builder: Builder, value: Value):
        self.builder, self.value = builder, value

    shape = property(lambda self: self.value.type.shape)
    dtype = property(lambda self: self.value.type.dtype)
    ndim = property(lambda self: len(self.value.type.shape))

    def __repr__(self):
        return f"Traced({self.value.name}: {self.value.type})"

    def _other(self, other, what):
        if not isinstance(other, Traced) or other.builder is not self.builder:
            raise TypeError(f"{what}: both operands must be values of the traced function, got {type(other).__name__}")
        if other.dtype != self.dtype:
            raise TypeError(f"{what} of {self.value.name} and {other.value.name}: dtypes do not match: {self.dtype} "
                            f"and {other.dtype}")
        return other

    def __matmul__(self, other):
        b = self._other(other, Op.MATMUL)
        sa, sb, na, nb = self.shape, b.shape, self.value.name, b.value.name  # (the parameters' names for inputs)
        if len(sa) < 2 or len(sb) < 2:
            raise ValueError(f"matmul needs operands of at least 2 axes, got {na}{sa} and {nb}{sb}")
        if sa[-1] != sb[-2]:
            raise ValueError(f"matmul {na} @ {nb}: contraction sizes differ: {na}{sa} has K={sa[-1]} on its last "
                             f"axis, {nb}{sb} has K={sb[-2]} on its second-to-last axis")
        if len(sb) > 2 and sb[:-2] != sa[:-2]:
            raise ValueError(f"matmul {na} @ {nb}: batch axes differ: {na}{sa} and {nb}{sb}")
        out = TensorType(sa[:-1] + (sb[-1],), self.dtype)
        return self.builder.emit(Op.MATMUL, (self, b), out, "c")

    def _elementwise(self, other, op):
        if is_scalar(other):  # x op c: a scalar op on x (c the same on every device)
            c = float(other)
            if op in (Op.MUL, Op.DIV):
                return self._unary(Op.SCALE, value=c) if op == Op.MUL else self._unary(Op.DIV_SCALAR, value=c)
            return self._unary(Op.ADD_SCALAR, value=c if op == Op.ADD else -c)
        b = self._other(other, op)
        try:
            shape = tuple(np.broadcast_shapes(self.shape, b.shape))
        except ValueError:
            raise ValueError(f"{op} of {self.value.name} and {b.value.name}: shapes {self.shape} and {b.shape} do not "
                             "broadcast") from None
        return self.builder.emit(op, (self, b), TensorType(shape, self.dtype), op[0])

    def _unary(self, op, **attrs):
        return self.builder.emit(op, (self,), TensorType(self.shape, self.dtype), op[0], **attrs)

    def __add__(self, other):
        return self._elementwise(other, Op.ADD)

    def __sub__(self, other):
        return self._elementwise(other, Op.SUB)

    def __mul__(self, other):
        return self._elementwise(other, Op.MUL)

    __radd__, __rmul__ = __add__, __mul__  # (c + x, c * x: reflected only for scalars; both commute)

    def __truediv__(self, other):
        return self._elementwise(other, Op.DIV)

    def __rsub__(self, other):  # c - x
        if not is_scalar(other):
            return NotImplemented
        return (-self)._unary(Op.ADD_SCALAR, value=float(other))

    def __rtruediv__(self, other):  # c / x
        if not is_scalar(other):
            return NotImplemented
        return self._unary(Op.RDIV, value=float(other))

    # NumPy on traced values: a function or ufunc shardfuse has runs as its op (the NUMPY table),
    # any other is refused naming what to write instead (never an ndarray made of traced values)
    __array_priority__ = 1000

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        fn = NUMPY.get(ufunc) if method == "__call__" and not kwargs else None
        if fn is None:
            raise TypeError(unsupported(ufunc, method, kwargs))
        return fn(*inputs)

    def __array_function__(self, func, types, args, kwargs):
        fn = NUMPY.get(func)
        if fn is None:
            raise TypeError(unsupported(func))
        return fn(*args, **kwargs)

    # Python asking for a concrete value: a traced one has a shape and a dtype, no numbers yet
    def _concrete(self, what: str, instead: str):
        raise ConcretizationError(f"{what} of the traced value {_describe(self)} inside sf.jit: its numbers exist "
                                  f"only when the compiled plan runs; {instead}")

    def __bool__(self):
        self._concrete("bool()", "Python's if / while / and / or / not need a concrete value: decide the branch "
                                 "outside the jitted function (a parameter with a default stays a Python value), "
                                 "or compute both sides and combine them arithmetically (sf.relu, *, +)")

    def __int__(self):
        self._concrete("int()", _NUMBER)

    def __float__(self):
        self._concrete("float()", _NUMBER)

    def __complex__(self):
        self._concrete("complex()", _NUMBER)

    def __index__(self):
        self._concrete("use as an int (an index, an extent)", _NUMBER)

    def __array__(self, dtype=None, copy=None):
        self._concrete("np.asarray / np.array", "inside sf.jit use shardfuse's ops (the operators, x.sum(axis), "
                                                "np.exp, ...); outside, np.asarray(the jitted function's result)")

    def __iter__(self):
        self._concrete("iteration", "there is no indexing inside sf.jit: work on whole axes (x.sum(axis), "
                                    "x.reshape(...), x.T), or iterate over the result outside the jitted function")

    def __contains__(self, item):  # (without it, Python turns the iteration's error into "not iterable")
        self.__iter__()

    def __len__(self):  # the shape is static: len() is known
        if not self.shape:
            raise TypeError(f"len() of the 0-d traced value {_describe(self)} (as NumPy: len() of unsized object)")
        return self.shape[0]

    def __eq__(self, other, op="=="):  # (Python's default compares identity: x == y would be False, silently)
        raise TypeError(f"{op} on the traced value {_describe(self)} inside sf.jit is not supported (NumPy compares "
                        "elementwise, Python by identity): compare the results outside the jitted function, or "
                        "write `x is y` for identity")

    def __ne__(self, other):
        return self.__eq__(other, "!=")

    __hash__ = object.__hash__  # (a dict key by identity)

    def __abs__(self):
        return absolute(self)

    def __neg__(self):
        return self._unary(Op.NEG)

    def sum(self, axis=None):
        """The sum over `axis`: an int, a tuple of them, or None (every axis), as NumPy's."""
        return self._reduce(axis, mean=False)

    def mean(self, axis=None):
        """The mean over `axis` (as sum): each axis' sum scaled by 1 / n in one step, before it is
        rounded to a 16-bit dtype (a float16 sum can overflow where the mean does not); NaN for
        an empty axis, as NumPy gives."""
        return self._reduce(axis, mean=True)

    def _reduce(self, axis, mean: bool):
        v = self
        for ax in sorted(reduced_axes(axis, self.ndim, self.shape), reverse=True):  # the last first: no renumbering
            n, attrs = v.shape[ax], {}
            if mean:
                attrs["factor"] = 1.0 / n if n else math.nan
            out = TensorType(v.shape[:ax] + v.shape[ax + 1:], v.dtype)
            v = v.builder.emit(Op.SUM, (v,), out, "s", axis=ax, **attrs)
        return v

    def transpose(self, *perm):
        perm = tuple(perm[0]) if len(perm) == 1 and isinstance(perm[0], (tuple, list)) else perm
        perm = tuple(check_axis(p) for p in perm) or tuple(reversed(range(self.ndim)))
        if sorted(perm) != list(range(self.ndim)):
            raise ValueError(f"transpose: {perm} is not a permutation of the {self.ndim} axes of {self.shape}")
        out = TensorType(tuple(self.shape[p] for p in perm), self.dtype)
        return self.builder.emit(Op.TRANSPOSE, (self,), out, self.value.name + "_t", perm=tuple(perm))

    T = property(lambda self: self.transpose())

    def reshape(self, *shape):
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        shape = tuple(as_int(s, f"reshape of {self.shape}: an extent") for s in shape)
        size = int(np.prod(self.shape))
        if shape.count(-1) == 1:
            known = int(np.prod([s for s in shape if s != -1]))
            if known == 0:  # (NumPy refuses too: any extent fits an empty array)
                raise ValueError(f"cannot reshape {self.shape} ({size} elements) to {shape}: -1 is ambiguous "
                                 "beside an extent 0")
            shape = tuple(size // known if s == -1 else s for s in shape)
        if int(np.prod(shape)) != size or any(s < 1 for s in shape):
            raise ValueError(f"cannot reshape {self.shape} ({size} elements) to {shape}")
        out = TensorType(tuple(int(s) for s in shape), self.dtype)
        return self.builder.emit(Op.RESHAPE, (self,), out, self.value.name + "_r", shape=out.shape)


class ConcretizationError(TypeError):
    """A traced value used where Python needs its numbers (bool(), int(), float(), np.asarray,
    a loop over it) inside sf.jit, as JAX's ConcretizationTypeError: the message names the value
    and what to write instead."""


_NUMBER = ("a number computed inside sf.jit is known only after the call: return it and read the result "
           "(np.asarray(result)); shapes are static (x.shape)")


def is_scalar(x) -> bool:
    """A Python or NumPy real number (never a bool: True is not 1.0 here)."""
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


def reduced_axes(axis, ndim: int, shape) -> tuple:
    """The axes a reduction's axis= names, distinct and in range: every axis for None, one int, or a tuple."""
    axes = tuple(range(ndim)) if axis is None else axis if isinstance(axis, tuple) else (axis,)
    axes = tuple(normalize_axis(a, ndim, shape) for a in axes)
    if len(set(axes)) != len(axes):
        raise ValueError(f"duplicate value in axis={axis!r}")
    return axes


def _traced(x, what):
    if not isinstance(x, Traced):
        raise TypeError(f"sf.{what} takes values inside an sf.jit function, got {type(x).__name__}")
    return x


def exp(x):
    """e**x elementwise, inside an sf.jit function (np.exp(x) works too)."""
    return _traced(x, Op.EXP)._unary(Op.EXP)


def tanh(x):
    """tanh elementwise, inside an sf.jit function (np.tanh(x) works too)."""
    return _traced(x, Op.TANH)._unary(Op.TANH)


def relu(x):
    """max(x, 0) elementwise, inside an sf.jit function."""
    return _traced(x, Op.RELU)._unary(Op.RELU)


def gelu(x):
    """GELU, tanh form (as in GPT-2 and Megatron)."""
    return _traced(x, Op.GELU)._unary(Op.GELU)


def linear(x, w, b=None):
    """x @ w (+ b): a dense layer."""
    y = _traced(x, "linear") @ w
    return y if b is None else y + b


def absolute(x):
    """|x| elementwise (np.abs(x), abs(x)): relu(x) + relu(-x), exact (one of the two is zero)."""
    return relu(x) + relu(-x)


# ---- NumPy's functions on traced values ---------------------------------------------------------
def _binary(method, reflected):
    """np.<ufunc>(a, b) with a traced operand: its own operator method (never a + b again, which
    with a NumPy scalar on the left would come back here).  Named as `operator`'s functions."""
    def call(a, b):
        out = getattr(a, method)(b) if isinstance(a, Traced) else getattr(b, reflected)(a) if reflected else NotImplemented
        if out is NotImplemented:
            raise TypeError(f"np.{method.strip('_')} of a {type(a).__name__} and a {type(b).__name__} inside sf.jit: "
                            "arrays are not captured as constants; make them inputs of the function")
        return out
    call.__name__ = method.strip("_")
    return call


def _defaults_only(what: str, takes: str, **given):
    """Refuse the arguments of a NumPy function shardfuse's op lacks (None / False: NumPy's defaults)."""
    bad = [k for k, v in given.items() if v is not None and v is not False]
    if bad:
        raise TypeError(f"{what} with {', '.join(k + '=' for k in bad)} is not supported on traced shardfuse values "
                        f"(inside sf.jit): write {takes}")


def _describe(v) -> str:
    """A traced value as the tracer knows it: its name, shape and dtype."""
    return f"{v.value.name} (shape {v.shape}, {v.dtype})" if isinstance(v, Traced) else type(v).__name__


def _dot(a, b, out=None):
    _defaults_only("np.dot", "np.dot(a, b)", out=out)
    if is_scalar(a) or is_scalar(b):
        return a * b
    if getattr(a, "ndim", None) == 2 and getattr(b, "ndim", None) == 2:
        return a @ b
    raise TypeError(f"np.dot of {_describe(a)} and {_describe(b)} inside sf.jit: shardfuse runs np.dot as a matmul "
                    "of 2-D operands only (NumPy's dot of other ranks is no matmul); write a @ b (a matmul, "
                    "batched over leading axes), reshaping 1-D operands to 2-D first")


def _transpose(a, axes=None):
    return a.transpose() if axes is None else a.transpose(axes)


def _swapaxes(a, axis1, axis2):
    perm = list(range(a.ndim))
    i, j = normalize_axis(axis1, a.ndim, a.shape), normalize_axis(axis2, a.ndim, a.shape)
    perm[i], perm[j] = j, i
    return a.transpose(perm)


def _reshape(a, shape, order="C", *, copy=None):  # (copy= changes nothing: traced values are never written)
    if order != "C":
        raise TypeError(f"np.reshape(..., order={order!r}) is not supported on traced shardfuse values (inside "
                        "sf.jit): write x.reshape(shape) (C order)")
    return a.reshape(shape)


_REDUCED = ", a new value of x's dtype (reshape it where NumPy would keep dims)"


def _sum(a, axis=None, dtype=None, out=None, keepdims=False, **rest):
    _defaults_only("np.sum", "np.sum(x, axis) or x.sum(axis)" + _REDUCED, dtype=dtype, out=out, keepdims=keepdims,
                   **rest)
    return a.sum(axis)


def _mean(a, axis=None, dtype=None, out=None, keepdims=False, **rest):
    _defaults_only("np.mean", "np.mean(x, axis) or x.mean(axis)" + _REDUCED, dtype=dtype, out=out, keepdims=keepdims,
                   **rest)
    return a.mean(axis)


NUMPY = {  # NumPy function or ufunc -> the same on traced values: adding an op is one line
    np.add: _binary("__add__", "__radd__"), np.subtract: _binary("__sub__", "__rsub__"),
    np.multiply: _binary("__mul__", "__rmul__"), np.divide: _binary("__truediv__", "__rtruediv__"),
    np.matmul: _binary("__matmul__", None), np.negative: operator.neg, np.absolute: absolute,
    np.exp: exp, np.tanh: tanh,
    np.dot: _dot, np.transpose: _transpose, np.swapaxes: _swapaxes, np.reshape: _reshape,
    np.sum: _sum, np.mean: _mean,
}


def numpy_name(f) -> str:
    """np.sum, np.linalg.norm: a NumPy function as its users write it."""
    module = getattr(f, "__module__", None) or "numpy"
    return ("np" + module[len("numpy"):] if module.startswith("numpy") else module) + "." + f.__name__


def unsupported(func, method="__call__", kwargs=()) -> str:
    """What a NumPy function (or a ufunc's method) shardfuse lacks on traced values says."""
    what = numpy_name(func) + ("" if method == "__call__" else f".{method}")
    what += f" with {', '.join(k + '=' for k in kwargs)}" if kwargs else ""
    return (f"{what} is not supported on traced shardfuse values (inside sf.jit); supported: "
            f"{', '.join(sorted(numpy_name(f) for f in NUMPY))} (np.dot: 2-D), the operators + - * / @, x.sum(axis), "
            "x.mean(axis), x.T, x.reshape(...), sf.relu, sf.gelu; or compute it outside the jitted function on its "
            "result")
