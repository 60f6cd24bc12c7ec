"""The front end: traced values, the annotations sf.shard / sf.stream on them, and trace().

Inside an `sf.jit` function the arguments are `Traced` values; every operation appends
one array-level instruction to the program being built.  Shape, dtype, axis and mesh
errors are raised here, at trace time, so nothing runs before they are found.
"""
from __future__ import annotations

import inspect
import math
from dataclasses import replace

import numpy as np

from shardfuse.ir import Instr, Namer, Program, TensorType, Value
from shardfuse.layout import Layout, mesh_axes
from shardfuse.mesh import STREAM, DeviceMesh, as_int
from shardfuse.ops import Op
from shardfuse.spec import check_axis, check_divides, normalize_axis, normalize_over, resolve_chunks


class Builder:
    """Collects the instructions of one traced function."""

    def __init__(self, mesh):
        self.mesh = mesh
        self.instrs: list = []
        self.namer = Namer()
        self.producer: dict = {}  # value -> the instruction that made it
        self.homes: dict = {}  # value -> the sub-mesh it lives on, where known when traced
        self.kept: set = set()  # stream annotations that kept their value's sub-mesh (no mesh= given)

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


def _sub_mesh(builder, mesh):
    """None for the program's own mesh; a checked sub-mesh of it otherwise."""
    if mesh is None or mesh == builder.mesh:
        return None
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh= must be an sf.DeviceMesh (the program's mesh or a sub-mesh of it), "
                        f"got {type(mesh).__name__}")
    prog = builder.mesh  # a program whose whole mesh is a sub-mesh takes sub-meshes of its devices
    if mesh.root != prog.root or not set(mesh.devices) <= set(prog.devices) or (mesh.is_root and not prog.is_root):
        raise ValueError(f"{mesh} is not the program's mesh {builder.mesh} nor a sub-mesh of it")
    return mesh


def _annotate(x: Traced, axis: int, what, chunks=None, algorithm=None, on=None) -> Traced:
    """A `set` whose output has the annotated layout; annotations on one value compose."""
    shape = x.shape
    ax = normalize_axis(axis, x.ndim, shape)
    prev = x.builder.producer.get(x.value)
    base = x
    layout = Layout.replicated(x.ndim)
    attrs = {"annotation": True}
    if prev is not None and prev.attrs.get("annotation"):
        layout = prev.outs[0].type.layout
        base = Traced(x.builder, prev.ins[0])
        attrs = dict(prev.attrs)
        if prev.outs[0] in x.builder.kept and what != STREAM:  # a placement composed onto a stream that
            layout = replace(layout, mesh=None)  # kept the value's sub-mesh: as in the other order
    if algorithm is not None:
        attrs["algorithm"] = algorithm
    sub = _sub_mesh(x.builder, on)
    kept = sub is None and what == STREAM and layout.mesh is None and x.builder.homes.get(x.value) is not None
    sub = x.builder.homes[x.value] if kept else sub  # streaming a value does not move it off its sub-mesh
    if sub is not None:
        if layout.mesh is not None and layout.mesh != sub:
            raise ValueError(f"annotations on {x.value.name} name two meshes: {layout.mesh} and {sub}")
        layout = layout.on(sub)
    mesh = layout.mesh or x.builder.mesh
    cur = layout.axes[ax]
    name = x.value.name
    if what == STREAM:
        if STREAM in layout.axes:
            raise ValueError(f"{name} already has a stream axis ({layout.stream_axis()})")
        if chunks is not None and (chunks < 1 or shape[ax] % chunks):
            raise ValueError(f"stream chunks={chunks} does not divide axis {ax} of extent {shape[ax]}")
        if cur is not None and chunks is None:
            raise ValueError(f"axis {ax} of {name}{shape} is sharded over {cur}: streaming it too needs chunks=")
        layout = Layout(layout.with_axis(ax, STREAM).axes, chunks=chunks, stream_over=cur, mesh=layout.mesh)
    else:
        what = normalize_over(what, mesh)  # an unknown mesh axis name fails first
        for n in mesh_axes(what):
            if layout.placement().mesh_axis_of(n) is not None:
                raise ValueError(f"mesh axis {n} already shards axis {layout.placement().mesh_axis_of(n)} of {name}")
        if cur == STREAM and (layout.chunks is None or layout.stream_over):
            raise ValueError(f"axis {ax} of {name}{shape} is streamed without chunks=: it cannot be sharded too")
        if cur not in (None, STREAM):
            raise ValueError(f"axis {ax} of {name}{shape} is already sharded over {cur}: to shard it over several "
                             f"mesh axes, name them together (over=({cur!r}, {what!r}))")
        check_divides(shape, ax, what, mesh)
        if cur == STREAM:
            layout = Layout(layout.axes, chunks=layout.chunks, stream_over=what, mesh=layout.mesh)
        else:
            layout = Layout(layout.with_axis(ax, what).axes, chunks=layout.chunks, stream_over=layout.stream_over,
                            mesh=layout.mesh)
    out = TensorType(shape, x.dtype, layout)
    made = x.builder.emit(Op.SET, (base,), out, base.value.name, **attrs)
    x.builder.kept.update([made.value] if kept else [])
    return made


def shard(x: "Traced", axis: int, over="DIDx", mesh=None):
    """Place `axis` of x across the devices of mesh axis `over`, or of several mesh axes
    (``over=("dp", "tp")``: the first outermost, as JAX's ``P(("dp", "tp"))``).

    (sf.shard on a concrete array is shardfuse.api.shard.)"""
    return _annotate(x, axis, over, on=mesh)  # mesh=: a sub-mesh (pipeline stage) the value moves to


def replicate(x, mesh=None):
    """Annotate x as replicated on every device (DTensor's Replicate()): forces the gathers.
    With mesh= (a sub-mesh of the program's), replicated on that sub-mesh's devices.
    (sf.replicate on a concrete array is shardfuse.api.replicate.)"""
    out = TensorType(x.shape, x.dtype, Layout.replicated(x.ndim).on(_sub_mesh(x.builder, mesh)))
    return x.builder.emit(Op.SET, (x,), out, x.value.name, annotation=True)


def to_mesh(x: Traced, mesh, axis: int | None = None, over: str | None = None):
    """Move x to another mesh (a pipeline stage, `mesh.submesh(...)`), replicated there or
    sharded on `axis`.  Unlike an annotation, this always makes a new value on the new mesh, so
    the op that produced x still runs where its operands are."""
    if not isinstance(x, Traced):
        raise TypeError("sf.to_mesh moves values inside an sf.jit function")
    sub = _sub_mesh(x.builder, mesh)
    layout = Layout.replicated(x.ndim).on(sub)
    if axis is not None:
        ax = normalize_axis(axis, x.ndim, x.shape)
        over = over or (sub or x.builder.mesh).axis_names[-1]
        check_divides(x.shape, ax, over, sub or x.builder.mesh)
        layout = layout.with_axis(ax, over)
    return x.builder.emit(Op.SET, (x,), TensorType(x.shape, x.dtype, layout), x.value.name + "_moved")


ALGORITHMS = ("collective", "ring")


def stream(x: Traced, axis: int, chunks: int | str | None = None, algorithm: str = "collective") -> Traced:
    """Ask for x to be produced chunk by chunk along `axis` (chunks=None: one chunk per index).

    algorithm="collective": each chunk's input is all-gathered on a worker stream while other
    chunks multiply.  algorithm="ring": the chunks are the devices' own shards (chunks = D, or omitted),
    passed around a ring with Send/Recv; each step multiplies the shard that has arrived while
    the next one is in flight.

    chunks="auto": sf.jit compiles the plan for each S that divides the axis (up to 16), predicts
    each with the cost model (shardfuse/cost.py) and keeps the fastest; S = 1 (no pipelining)
    when overlap cannot pay.  Every "auto" of one function takes the same S; plan.explain() says why.
    """
    if not isinstance(x, Traced):
        raise TypeError("sf.stream annotates values inside an sf.jit function")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    chunks = resolve_chunks(chunks, algorithm, x.shape[normalize_axis(axis, x.ndim, x.shape)])
    if algorithm == "ring":  # its chunks are the D shards: chunks=D may be said, and is checked once D is known
        x = _annotate(x, axis, STREAM, None, algorithm)
        if chunks is not None:
            x.builder.producer[x.value].attrs["ring_chunks"] = chunks
        return x
    return _annotate(x, axis, STREAM, chunks, None)


def _input_names(fn, n: int) -> list:
    """Names of the traced inputs when fn is given n arguments.  The arguments fill fn's
    positional parameters in order (then its *args); a parameter with a default value that is
    not given keeps that Python value at trace time (it is no traced input)."""
    P = inspect.Parameter
    params = list(inspect.signature(fn).parameters.values())
    pos = [p for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    star = next((p for p in params if p.kind == P.VAR_POSITIONAL), None)
    required = [p for p in pos if p.default is P.empty]
    kw_required = [p.name for p in params if p.kind == P.KEYWORD_ONLY and p.default is P.empty]
    name = getattr(fn, "__name__", type(fn).__name__)
    if kw_required:
        raise TypeError(f"{name}: keyword-only parameters without a default ({', '.join(kw_required)}) cannot be "
                        "traced; give them a default, or make them positional")
    if n < len(required) or (star is None and n > len(pos)):
        if star is not None:
            takes = f"at least {len(required)}"
        elif len(required) == len(pos):
            takes = f"{len(pos)}"
        else:
            takes = f"{len(required)} to {len(pos)}"
        defaults = "" if len(required) == len(pos) else \
            f" ({', '.join(p.name for p in pos[len(required):])} keep their defaults when not given)"
        raise TypeError(f"{name} takes {takes} arguments, got {n}{defaults}")
    names = [p.name for p in pos[:n]]
    return names + [f"{star.name}{k}" for k in range(n - len(names))]


def trace(fn, mesh, specs, streams=4, name=None) -> Program:
    builder = Builder(mesh)
    params = _input_names(fn, len(specs))
    inputs = []
    for pname, spec in zip(params, specs):
        v = Value(builder.namer(pname), TensorType(spec.shape, spec.dtype, spec.layout))
        builder.homes.update({v: spec.layout.mesh} if spec.layout is not None and spec.layout.mesh else {})
        inputs.append(v)
    result = fn(*(Traced(builder, v) for v in inputs))
    results = result if isinstance(result, tuple) else (result,)
    for r in results:
        if not isinstance(r, Traced):
            raise TypeError(f"{fn.__name__} must return traced values, got {type(r).__name__}")
    return Program(name or fn.__name__, mesh, tuple(inputs), tuple(r.value for r in results),
                   tuple(builder.instrs), streams, ("trace",))
