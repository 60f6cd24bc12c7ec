"""Traced values: what an `sf.jit` function's arguments are while it is traced.

Every operation on a `Traced` value appends one array-level instruction to the program being
built (`Builder`).  Shape, dtype and axis errors are raised here, at trace time, so nothing runs
before they are found.  The annotations on traced values are shardfuse.trace's.
"""
from __future__ import annotations

import math

import numpy as np

from shardfuse import constants, dtypes, promotion
from shardfuse.ir import Instr, Namer, TensorType, Value
from shardfuse.mesh import as_int, meeting_mesh, mixed_meshes
from shardfuse.numpy_methods import NUMPY, NumpyMethods, c_order, cast_to
from shardfuse.ops import ELEMENTWISE, Op
from shardfuse.spec import check_axis, normalize_axis, reduced_axes
from shardfuse.jax_gradients import abs_at_zero, shared_ties

# "getitem" (x[key]) and "broadcast_matmul" (a @ b with NumPy's broadcasting) on traced values, written with the
# ops below: shardfuse.shape_ops fills it (it builds on this module)
SHAPE_OPS: dict = {}

class Builder:
    """Collects the instructions of one traced function."""

    def __init__(self, mesh):
        self.mesh, self.instrs, self.namer = mesh, [], Namer()
        self.producer: dict = {}  # value -> the instruction that made it
        self.known_layouts: dict = {}  # value -> autodiff_layouts.known_layout's answer (producers never change)
        self.homes: dict = {}  # value -> the sub-mesh it lives on, where known when traced
        self.fresh: set = set()  # sf.grad's primals: annotations do not compose through them (JAX's new tracers)
        self.no_gradient: set = set()  # values sf.grad holds constant (autodiff.stop_gradient)
        self.custom_rules: list = []  # the sf.custom_vjp calls traced under sf.grad (shardfuse.custom_vjp)
        self.recomputing = 0  # > 0 while sf.checkpoint's backward traces its function again
        self.entry = None  # the function sf.jit traces (shardfuse.trace), unwrapped from its pytree form
        self.constants: dict = {}  # id(a NumPy array met) -> (it, its value then, its input): shardfuse.constants
        self.weak: set = set()  # values weakly typed as JAX's: Python scalar arguments, and elementwise ops of them

    def constant(self, x):
        """x as a value of this program where it is a NumPy array (shardfuse/constants.py); else x."""
        return Traced(self, constants.capture(self, x)) if constants.is_constant(x) else x

    def emit(self, op, ins, out_type, base, **attrs) -> "Traced":
        if self.recomputing and op == Op.SET:  # (a resharding sf.checkpoint does again: never the forward's, shared)
            attrs["recomputed"] = True
        out = Value(self.namer(base), out_type)
        self.producer[out] = ins_ = Instr(op, (out,), tuple(t.value for t in ins), attrs)
        self.instrs.append(ins_)
        if ins and op in ELEMENTWISE and all(t.value in self.weak for t in ins):  # (JAX: weak in, weak out)
            self.weak.add(out)
        lay, homes = getattr(out_type, "layout", None), {self.homes.get(t.value) for t in ins} - {None}
        if homes and meeting_mesh(homes) is None:  # (refused where the user's line is: a probe)
            raise ValueError(mixed_meshes(op, [(t.value.name, self.homes.get(t.value)) for t in ins]))
        home = lay.mesh if lay is not None else meeting_mesh(homes)  # (propagation's: larger meshes' values copied)
        self.homes.update({out: home} if home is not None else {})
        return Traced(self, out)


class Traced(NumpyMethods):
    """A value inside a traced function (global shape, like a JAX tracer); x.var, x.clip, x.argmax,
    x // y, x % y & co. are NumPy's functions of the NUMPY table (numpy_methods.py)."""

    def __init__(self, builder: Builder, value: Value):
        self.builder, self.value = builder, value

    shape = property(lambda self: self.value.type.shape)
    dtype = property(lambda self: dtypes.np_dtype(self.value.type.dtype))  # (a NumPy dtype, as a JAX tracer's)
    dtype_name = property(lambda self: self.value.type.dtype)  # (its name, as the IR and dtypes.py keep it)
    ndim = property(lambda self: len(self.value.type.shape))
    weak = property(lambda self: self.value in self.builder.weak)  # (a Python scalar argument's: spec.TensorSpec)
    size = property(lambda self: math.prod(self.value.type.shape))

    def __getitem__(self, index):
        """NumPy's basic indexing (ints, slices, '...', None), and table[ids] of a traced int array."""
        return SHAPE_OPS["getitem"](self, index)

    def __repr__(self):
        return f"Traced({self.value.name}: {self.value.type})"

    def _other(self, other, what):
        other = self.builder.constant(other)  # (a NumPy array: a replicated constant)
        if not isinstance(other, Traced) or other.builder is not self.builder:
            raise TypeError(f"{what}: both operands must be values of the traced function, got {type(other).__name__}")
        return other

    def promote_with(self, other, what):
        """(self, other) cast to the dtype NumPy 2 computes `what` of them in (promotion.loop_dtypes:
        NEP 50, a weak value as a Python scalar; float64 for the true division of integers)."""
        b = self._other(other, what)
        dt = promotion.loop_dtypes(what, self, b)[0]
        return cast(self, dt), cast(b, dt)

    def with_scalar(self, c, what=Op.ADD, reflected=False):
        """(self cast to the dtype NumPy 2 computes `what` of it and the scalar c in, c as a value of that dtype,
        rounded to it as NumPy 2 and JAX round a weak scalar (float16 x * 0.1 multiplies by float16(0.1));
        reflected: c op x): a Python scalar is weak, as in NumPy 2 and JAX (x * 2.0 keeps float16; int32 x *
        0.5 is float64); a NumPy scalar is not (float32 x * np.float64(3) is float64; a weak x's op with one of its kind or higher is strong)."""
        dt = promotion.loop_dtypes(what, *((c, self) if reflected else (self, c)))[0]
        x = cast(self, dt)
        if x.weak and isinstance(c, np.generic) and dtypes.KINDS[c.dtype.name] >= dtypes.KINDS[self.dtype_name]:
            x = x.unary_op(Op.ASTYPE, dt)
            self.builder.weak.discard(x.value)
        return x, promotion.scalar_value(c, dt)

    def elementwise_op(self, op, ins, dtype, **attrs):
        try:
            shape = tuple(np.broadcast_shapes(*(v.shape for v in ins)))
        except ValueError:
            raise ValueError(f"{op} of {' and '.join(v.value.name for v in ins)}: shapes "
                             f"{' and '.join(str(v.shape) for v in ins)} do not broadcast") from None
        return self.builder.emit(op, ins, TensorType(shape, dtype), op[0], **attrs)

    def __matmul__(self, other):
        a, b = self.promote_with(other, Op.MATMUL)  # (f32 @ f64: f64, as NumPy and JAX)
        na, nb = self.value.name, getattr(getattr(other, "value", None), "name", b.value.name)  # (not a cast's names)
        if not dtypes.is_float(a.dtype_name):
            raise TypeError(f"matmul {na} @ {nb} of {a.dtype_name} values: shardfuse multiplies float arrays (cuBLAS "
                            "has no integer GEMM here); cast first: x.astype('float32')")
        self, sa, sb = a, a.shape, b.shape
        if not sa or not sb:
            raise ValueError(f"matmul of a 0-d operand, {na}{sa} @ {nb}{sb} (NumPy refuses it too): write {na} * {nb}")
        if sa[-1] != sb[-2 if len(sb) > 1 else 0]:
            raise ValueError(f"matmul {na} @ {nb}: contraction sizes differ: {na}{sa} has K={sa[-1]} on its last "
                             f"axis, {nb}{sb} has K={sb[-2 if len(sb) > 1 else 0]} on its "
                             f"{'second-to-last' if len(sb) > 1 else 'only'} axis")
        if len(sa) < 2 or len(sb) < 2 or (len(sb) > 2 and sb[:-2] != sa[:-2]):
            return SHAPE_OPS["broadcast_matmul"](self, b)  # NumPy's 1-D operands, broadcast batch axes
        out = TensorType(sa[:-1] + (sb[-1],), self.dtype_name)
        return self.builder.emit(Op.MATMUL, (self, b), out, "c")

    def _elementwise(self, other, op, reflected=False):
        if is_weak_scalar(other):  # x op c, c op x: a scalar step on x (c the same on every device)
            x, c = self.with_scalar(other, op, reflected=reflected)
            if reflected and op == Op.DIV:
                return x.unary_op(Op.RDIV, value=c)
            if reflected and op == Op.SUB:  # c - x as -x + c: exact (in NumPy's dtype: bool refused)
                return x.unary_op(Op.NEG).unary_op(Op.ADD_SCALAR, value=c)
            if op in (Op.MUL, Op.DIV):
                return x.unary_op(Op.SCALE, value=c) if op == Op.MUL else x.unary_op(Op.DIV_SCALAR, value=c)
            return x.unary_op(Op.ADD_SCALAR, value=c if op == Op.ADD else promotion.negated(c, x.dtype_name))
        if reflected:
            return NotImplemented
        a, b = self.promote_with(other, op)
        return a.elementwise_op(op, (a, b), a.dtype_name)

    def unary_op(self, op, dtype=None, **attrs):
        return self.builder.emit(op, (self,), TensorType(self.shape, dtype or self.dtype_name), op[0], **attrs)

    def _compare(self, other, op):
        """x op y elementwise, a boolean array (JAX's and NumPy's ==, not Python's identity)."""
        if is_weak_scalar(other):
            if promotion.beyond(other, promotion.loop_dtypes(op, self, other)[0]):  # (as NumPy 2: as 0 compares)
                return self.unary_op(Op.FULL_LIKE, "bool", value=promotion.COMPARE[op](0, other))
            x, c = self.with_scalar(other, op)
            return x.unary_op(SCALAR_OF[op], "bool", value=c)
        if not isinstance(other, Traced) and not constants.is_constant(other):
            return NotImplemented
        a, b = self.promote_with(other, op)
        return a.elementwise_op(op, (a, b), "bool")

    __lt__ = lambda self, other: self._compare(other, Op.LT)  # noqa: E731 (c < x is x > c: Python reflects)
    __le__ = lambda self, other: self._compare(other, Op.LE)  # noqa: E731
    __gt__ = lambda self, other: self._compare(other, Op.GT)  # noqa: E731
    __ge__ = lambda self, other: self._compare(other, Op.GE)  # noqa: E731
    __eq__ = lambda self, other: self._compare(other, Op.EQ)  # noqa: E731
    __ne__ = lambda self, other: self._compare(other, Op.NE)  # noqa: E731
    __hash__ = object.__hash__  # (a dict key by identity)

    def __pow__(self, other):  # x ** y: np.power's (numpy_broadcast.py), x ** 2 np.square's as NumPy's (bools: int8)
        return NUMPY[np.square](self) if type(other) is int and other == 2 else NUMPY[np.power](self, other)

    def __rpow__(self, other):  # c ** x
        return NUMPY[np.power](other, self) if is_weak_scalar(other) else NotImplemented

    def astype(self, dtype, order="K", casting="unsafe", subok=True, copy=True):
        """x in another dtype (float16, bfloat16, float32, float64, int32, int64, bool), as NumPy's
        astype (floats to integers truncate toward zero; casting= checked); a cast to x's own dtype is x."""
        dt = cast_to(self.dtype_name, dtype, casting)
        if dt == self.dtype_name and not self.weak:
            return self
        out = self.unary_op(Op.ASTYPE, dt)
        self.builder.weak.discard(out.value)  # (a dtype stated is strong, as JAX's astype, even a weak value's own)
        return out

    def __add__(self, other):
        return self._elementwise(other, Op.ADD)

    def __sub__(self, other):
        return self._elementwise(other, Op.SUB)

    def __mul__(self, other):
        return self._elementwise(other, Op.MUL)

    __radd__, __rmul__ = __add__, __mul__  # (c + x, c * x: both commute, and so do their dtypes)

    def __truediv__(self, other):
        return self._elementwise(other, Op.DIV)

    def __rsub__(self, other):  # c - x
        return self._elementwise(other, Op.SUB, reflected=True)

    def __rtruediv__(self, other):  # c / x
        return self._elementwise(other, Op.DIV, reflected=True)

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
        raise ConcretizationError(f"{what} of the traced value {describe(self)} (inside sf.jit, sf.grad, ...): its numbers exist "
                                  f"only when the compiled plan runs; {instead}")

    def __bool__(self):
        self._concrete("bool()", "Python's if / while / and / or / not need a concrete value: decide the branch outside "
                                 "the jitted function (a parameter with a default stays a Python value, and sf.jit(..., "
                                 "static_argnums= / static_argnames=) keeps a flag one, compiling a plan per value, as "
                                 "JAX does), or compute both sides and combine them (np.where, sf.relu, *, +)")

    def __int__(self):
        self._concrete("int()", _NUMBER)

    def __float__(self):
        self._concrete("float()", _NUMBER)

    def __complex__(self):
        self._concrete("complex()", _NUMBER)

    def __index__(self):
        self._concrete("use as an int (an index, an extent)", _NUMBER)

    def __array__(self, dtype=None, copy=None):
        self._concrete("np.asarray / np.array", "inside sf.jit use shardfuse's ops (the operators, x.sum(axis), np.exp, "
                                                "...; table[t]: sf.take(table, t, axis=0)); outside, np.asarray(the result)")

    def __iter__(self):  # (JAX's: the rows along the first axis, a static index each; len() refuses a 0-d value)
        return (self[k] for k in range(len(self)))

    def __contains__(self, item):  # (NumPy's `in` is (x == item).any(): a traced bool)
        self._concrete("`in`", "write (x == item).any() and use it as a value (sf.where), not in an if")

    def __len__(self):  # the shape is static: len() is known
        if not self.shape:
            raise TypeError(f"len() of the 0-d traced value {describe(self)} (as NumPy: len() of unsized object)")
        return self.shape[0]

    def __abs__(self):  # relu(x) + relu(-x), exact; of ints relu(x) - min(x, 0) (|INT_MIN| wraps as NumPy's)
        if not dtypes.is_float(self.dtype_name):
            return self if self.dtype_name == "bool" else self.unary_op(Op.RELU) - self.unary_op(Op.MINIMUM_SCALAR, value=0)
        return abs_at_zero(self, self.unary_op(Op.RELU) + (-self).unary_op(Op.RELU))

    def __neg__(self):
        if self.dtype_name == "bool":
            raise TypeError(f"-x of the boolean array {describe(self)}: NumPy 2 refuses it; write ~x, or -x.astype('int32')")
        return self.unary_op(Op.NEG)

    def sum(self, axis=None, dtype=None, out=None, keepdims=False, initial=None, where=None):
        """The sum over `axis` as NumPy's (ints, bools in int64; 16-bit floats in float32, rounded once);
        NumPy's argument order (x.sum(axis, dtype, out, keepdims, initial, where))."""
        if dtype is None and out is None and where is None and initial is None:
            return self._reduce(axis, Op.SUM, keepdims)
        return NUMPY[np.sum](self, axis, dtype, out, keepdims, initial, where)

    def mean(self, axis=None, dtype=None, out=None, keepdims=False, *, where=None):  # (NaN if empty)
        """The mean over `axis` (as sum): each axis' sum scaled by 1 / n before it is rounded."""
        if dtype is None and out is None and where is None:
            return self._reduce(axis, "mean", keepdims)
        return NUMPY[np.mean](self, axis, dtype, out, keepdims, where=where)

    def max(self, axis=None, out=None, keepdims=False, initial=None, where=None):
        """The largest element over `axis` (NaN if any is), NumPy's arguments; ties share a gradient."""
        if out is not None or initial is not None or where is not None:
            return NUMPY[np.max](self, axis, out, keepdims, initial, where)
        return shared_ties(self, self._reduce(axis, Op.REDUCE_MAX, keepdims), axis, keepdims)

    def min(self, axis=None, out=None, keepdims=False, initial=None, where=None):
        """The smallest element over `axis` (NaN if any is), NumPy's arguments; ties share a gradient."""
        if out is not None or initial is not None or where is not None:
            return NUMPY[np.min](self, axis, out, keepdims, initial, where)
        return shared_ties(self, self._reduce(axis, Op.REDUCE_MIN, keepdims), axis, keepdims)

    def _reduce(self, axis, kind, keepdims=False):
        axes = reduced_axes(axis, self.ndim, self.shape)
        summed = kind in (Op.SUM, "mean")
        v = self.astype("int64" if kind == Op.SUM else "float64") if summed and not dtypes.is_float(self.dtype_name) \
            else self  # (NumPy's dtypes of integer sums and means)
        wide = "float32" if summed and self.dtype_name in ("float16", "bfloat16") else None  # (rounded once, a probe)
        for ax in sorted(axes, reverse=True):  # the last first: no renumbering
            n, attrs = v.shape[ax], {}
            out = TensorType(v.shape[:ax] + v.shape[ax + 1:], wide or v.dtype_name)
            if summed:
                if kind == "mean":
                    attrs["factor"] = 1.0 / n if n else math.nan
                v = v.builder.emit(Op.SUM, (v,), out, "s", axis=ax, **attrs)
                continue
            if n == 0:
                raise ValueError(f"{kind} of {describe(self)} over axis {ax} of extent 0 (as NumPy: a zero-size "
                                 "reduction has no identity)")
            if ax != v.ndim - 1:  # the reduced axis last (a view), then one reduction of the last axis
                v = v.transpose([a for a in range(v.ndim) if a != ax] + [ax])
            v = v.builder.emit(kind, (v,), out, "m")
        v = v.astype(self.dtype_name) if wide and axes else v
        if keepdims:
            v = v.reshape(tuple(1 if a in axes else n for a, n in enumerate(self.shape)))
        return v

    def transpose(self, *perm):
        perm = tuple(perm[0]) if len(perm) == 1 and isinstance(perm[0], (tuple, list)) else perm
        perm = tuple(normalize_axis(check_axis(p), self.ndim, self.shape) for p in perm) \
            or tuple(reversed(range(self.ndim)))  # (negative axes count from the end, as NumPy's)
        if sorted(perm) != list(range(self.ndim)):
            raise ValueError(f"transpose: {perm} is not a permutation of the {self.ndim} axes of {self.shape}")
        out = TensorType(tuple(self.shape[p] for p in perm), self.dtype_name)
        return self.builder.emit(Op.TRANSPOSE, (self,), out, self.value.name + "_t", perm=tuple(perm))

    T = property(lambda self: self.transpose())

    def reshape(self, *shape, order="C"):
        c_order("x.reshape", order)
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        shape = tuple(as_int(s, f"reshape of {self.shape}: an extent") for s in shape)
        size = int(np.prod(self.shape))
        if shape.count(-1) == 1:  # (beside an extent 0 it stays -1, refused: NumPy refuses too, any extent fits)
            known = int(np.prod([s for s in shape if s != -1]))
            shape = tuple(size // known if s == -1 and known else s for s in shape)
        if int(np.prod(shape)) != size or any(s < (0 if size == 0 else 1) for s in shape):
            raise ValueError(f"cannot reshape {self.shape} ({size} elements) to {shape}, the value {self.value.name}"
                             + (": -1 is ambiguous beside an extent 0" if -1 in shape and 0 in shape else ""))
        if size == 0:  # (no elements: an empty constant of the new shape, x[2:][None] as NumPy's, a probe)
            return self.builder.constant(np.zeros(shape, dtypes.np_dtype(self.dtype_name)))
        out = TensorType(shape, self.dtype_name)
        return self.builder.emit(Op.RESHAPE, (self,), out, self.value.name + "_r", shape=out.shape)

    # JAX's functional updates, x.at[idx].set(v) / .add(v) / .get(), and x[idx] = v's refusal: update_slice.py
    at = property(lambda self: SHAPE_OPS["at"](self))

    def __setitem__(self, key, value):
        SHAPE_OPS["setitem"](self, key, value)


class ConcretizationError(TypeError):
    """A traced value used where Python needs its numbers (bool(), int(), float(), np.asarray, a loop over
    it) inside sf.jit, as JAX's ConcretizationTypeError: the message names the value and what to write."""


_NUMBER = ("a number computed inside sf.jit is known only after the call: return it and read the result (np.asarray"
           "(result)); shapes are static (x.shape); table[t] of a traced t: sf.take(table, t, axis=0), sf.dynamic_slice")


def cast(x: Traced, dtype: str) -> Traced:  # (x in dtype for a promotion: weak where x is; astype is strong)
    return x if dtype == x.dtype_name else x.unary_op(Op.ASTYPE, dtype)


def is_weak_scalar(x) -> bool:  # (a Python or NumPy scalar, bools included: comparisons, where, maximum)
    return is_scalar(x) or isinstance(x, (bool, np.bool_))


SCALAR_OF = {op: getattr(Op, f"{op.name}_SCALAR") for op in (Op.LT, Op.LE, Op.GT, Op.GE, Op.EQ, Op.NE)}


def is_scalar(x) -> bool:
    """A Python or NumPy real number (never a bool: True is not 1.0 here), ml_dtypes' bfloat16 too."""
    if isinstance(x, (int, float, np.integer, np.floating)):
        return not isinstance(x, (bool, np.bool_))
    return isinstance(x, np.generic) and type(x).__name__ == "bfloat16"  # (outside np.floating)


def describe(v) -> str:  # (a traced value as the tracer knows it: its name, shape and dtype)
    return f"{v.value.name} (shape {v.shape}, {v.dtype_name})" if isinstance(v, Traced) else type(v).__name__


def numpy_name(f) -> str:  # (np.sum, np.linalg.norm: a NumPy function as its users write it)
    module = getattr(f, "__module__", None) or "numpy"
    return ("np" + module[len("numpy"):] if module.startswith("numpy") else module) + "." + f.__name__


def unsupported(func, method="__call__", kwargs=()) -> str:
    """What a NumPy function (or a ufunc's method) shardfuse lacks on traced values says."""
    what = numpy_name(func) + ("" if method == "__call__" else f".{method}")
    what += f" with {', '.join(k + '=' for k in kwargs)}" if kwargs else ""
    return (f"{what} is not supported on traced shardfuse values (inside sf.jit); supported: "
            f"{', '.join(sorted(numpy_name(f) for f in NUMPY))} (np.dot: 1-D and 2-D), the operators + - * / // % @ ** "
            "< <= > >= == != & | ^ ~, x.sum / mean / max / min / any / all / var / std / argmax / argmin(axis, "
            "keepdims=), x.clip, x.astype(dtype), x.T, x.reshape / ravel / squeeze(...), "
            "x[a:b, i, ..., None], sf.split / concatenate / stack, sf.relu, sf.gelu, sf.silu, sf.sigmoid, sf.rsqrt, "
            "sf.where; or compute it outside the jitted function on its result")
