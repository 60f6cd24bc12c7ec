"""Traced values: what an `sf.jit` function's arguments are while it is traced.

Every operation on a `Traced` value appends one array-level instruction to the program being
built (`Builder`).  Shape, dtype and axis errors are raised here, at trace time, so nothing runs
before they are found.  The annotations on traced values are shardfuse.trace's.
"""
from __future__ import annotations

import math

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
        if _is_scalar(other):  # x op c: a scalar op on x (c the same on every device)
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
        if not _is_scalar(other):
            return NotImplemented
        return (-self)._unary(Op.ADD_SCALAR, value=float(other))

    def __rtruediv__(self, other):  # c / x
        if not _is_scalar(other):
            return NotImplemented
        return self._unary(Op.RDIV, value=float(other))

    # NumPy functions on traced values: the ones shardfuse has run as its own ops, the others are
    # refused naming what to write instead (NumPy's own error would say "no callable exp method")
    __array_priority__ = 1000

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        fn = _UFUNCS.get(ufunc) if method == "__call__" and not kwargs else None
        if fn is None:
            raise TypeError(f"np.{ufunc.__name__}{'.' + method if method != '__call__' else ''} on a traced value is not "
                            f"supported inside sf.jit; use operators (+ - * / @), x.sum(axis), x.T, x.reshape, or "
                            f"sf.exp / sf.tanh / sf.relu / sf.gelu")
        return fn(*inputs)

    def __neg__(self):
        return self._unary(Op.NEG)

    def sum(self, axis: int):
        return self._sum(axis, {})

    def mean(self, axis: int):
        """The sum scaled by 1 / n in one step, before it is rounded to a 16-bit dtype (a float16
        sum can overflow where the mean does not); NaN for an empty axis, as NumPy gives."""
        n = self.shape[normalize_axis(axis, self.ndim, self.shape)]
        return self._sum(axis, {"factor": 1.0 / n if n else math.nan})

    def _sum(self, axis, attrs):
        ax = normalize_axis(axis, self.ndim, self.shape)
        out = TensorType(self.shape[:ax] + self.shape[ax + 1:], self.dtype)
        return self.builder.emit(Op.SUM, (self,), out, "s", axis=ax, **attrs)

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
            shape = tuple(size // known if s == -1 else s for s in shape)
        if int(np.prod(shape)) != size or any(s < 1 for s in shape):
            raise ValueError(f"cannot reshape {self.shape} ({size} elements) to {shape}")
        out = TensorType(tuple(int(s) for s in shape), self.dtype)
        return self.builder.emit(Op.RESHAPE, (self,), out, self.value.name + "_r", shape=out.shape,
                                 mesh_axes=tuple(zip(self.builder.mesh.axis_names, self.builder.mesh.shape)))


def _is_scalar(x) -> bool:
    """A Python or NumPy real number (never a bool: True is not 1.0 here)."""
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


def _binary(method, reflected):
    """np.<ufunc>(a, b) with a traced operand: its own operator method (never a + b again, which
    with a NumPy scalar on the left would come back here)."""
    def call(a, b):
        out = getattr(a, method)(b) if isinstance(a, Traced) else getattr(b, reflected)(a) if reflected else NotImplemented
        if out is NotImplemented:
            raise TypeError(f"np.{method.strip('_')} of a {type(a).__name__} and a {type(b).__name__} inside sf.jit: "
                            "arrays are not captured as constants; make them inputs of the function")
        return out
    return call


_UFUNCS = {  # keyed by the NumPy ufunc itself
    np.add: _binary("__add__", "__radd__"), np.subtract: _binary("__sub__", "__rsub__"),
    np.multiply: _binary("__mul__", "__rmul__"), np.true_divide: _binary("__truediv__", "__rtruediv__"),
    np.matmul: _binary("__matmul__", None), np.negative: lambda a: -a,
    np.exp: lambda a: exp(a), np.tanh: lambda a: tanh(a),
}


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
