"""The front end: the annotations sf.shard / sf.replicate / sf.stream / sf.to_mesh on traced
values, and trace(), which runs a function on traced values (shardfuse.traced) into a Program.

Axis, chunk and mesh errors are raised here, at trace time, so nothing runs before they are found.
"""
from __future__ import annotations

import inspect

import numpy as np

from shardfuse.constants import captured, tracing
from shardfuse.ir import Program, TensorType, Value
from shardfuse.layout import Layout, layout_of
from shardfuse.mesh import STREAM, DeviceMesh
from shardfuse.ops import ELEMENTWISE, Op
from shardfuse.schedule import KEY as SCHEDULE, Schedule, scheduled
from shardfuse.spec import check_divides, normalize_axis, normalize_over, resolve_chunks
from shardfuse.traced import Builder, Traced
from shardfuse.tree import FlatFunction


def _sub_mesh(builder, mesh):
    """The mesh a value is placed on: the program's own (mesh=None), or a checked sub-mesh of it."""
    if mesh is None or mesh == builder.mesh:
        return builder.mesh
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh= must be an sf.DeviceMesh (the program's mesh or a sub-mesh of it), "
                        f"got {type(mesh).__name__}")
    prog = builder.mesh  # a program whose whole mesh is a sub-mesh takes sub-meshes of its devices
    if mesh.root != prog.root or not set(mesh.devices) <= set(prog.devices) or (mesh.is_root and not prog.is_root):
        raise ValueError(f"{mesh} is not the program's mesh {builder.mesh} nor a sub-mesh of it")
    return mesh


def _annotate(x: Traced, axis: int, what, chunks=None, algorithm="collective", on=None) -> Traced:
    """One annotation on x: a `set` whose output has the layout it states.  Annotations on one
    value compose into one `set` (values are pure: only the last layout counts), each placement
    restating the tensor axis it names (Layout.sharded: the mesh axes it names move there) and a
    stream only scheduling (the set's Schedule): the same rule as sf.shard on an sf.Array outside jit."""
    ax = normalize_axis(axis, x.ndim, x.shape)
    base, layout, attrs = _annotated_so_far(x)
    sched = attrs.get(SCHEDULE)
    if what == STREAM:
        sched = _streamed(x, layout, sched, ax, chunks, algorithm)
    else:
        layout = _placed(x, layout, sched, ax, what, _sub_mesh(x.builder, on))
    return x.builder.emit(Op.SET, (base,), TensorType(x.shape, x.dtype_name, layout), base.value.name,
                          **scheduled(attrs, sched))


def _annotated_so_far(x: Traced):
    """(the value the annotation applies to, its layout as annotations have stated it so far, the
    set's attributes, its schedule among them).  A value an annotation made: that annotation's
    input, layout and schedule, so that annotations compose.  Any other value starts replicated
    (on the sub-mesh it lives on): a function's annotations state its layouts whatever layout its
    arguments arrive in, which decides only the communication, and an op's result has no layout
    until the compiler picks one."""
    prev = x.builder.producer.get(x.value)
    if prev is not None and prev.attrs.get("annotation") and x.value not in x.builder.fresh:
        return Traced(x.builder, prev.ins[0]), prev.outs[0].type.layout, dict(prev.attrs)
    home = x.builder.homes.get(x.value)
    return x, Layout.replicated(x.ndim).on(home or x.builder.mesh), {"annotation": True}


def _streamed(x: Traced, layout: Layout, sched, ax: int, chunks, algorithm) -> Schedule:
    """The schedule streaming axis ax: the value stays where it is (its sharding, its mesh)."""
    name, shape, cur = x.value.name, x.shape, layout.axes[ax]
    if sched is not None:
        raise ValueError(f"{name} already has a stream axis ({sched.axis})")
    said = chunks if algorithm == "collective" else None  # (the ring's chunks are its D shards: checked when split)
    if said not in (None, "auto") and (said < 1 or shape[ax] % said):
        raise ValueError(f"stream chunks={said} does not divide axis {ax} of extent {shape[ax]}")
    if cur is not None and said is None:
        raise ValueError(f"sf.stream: axis {ax} of {_named(x)} is sharded over {cur}: streaming it too needs chunks= "
                         "(how many chunks each device's piece is cut into)")
    return Schedule(ax, chunks, algorithm)


def _placed(x: Traced, layout: Layout, sched, ax: int, over, sub) -> Layout:
    """layout with axis ax sharded over `over`, on `sub` (the program's mesh or a sub-mesh)."""
    if layout.mesh != sub:  # moved to another mesh: its sharding there is what this annotation states
        layout = Layout((None,) * layout.ndim, mesh=sub)
    over = normalize_over(over, sub)  # an unknown mesh axis name fails first
    if sched is not None and sched.axis == ax and sched.chunks is None:
        raise ValueError(f"axis {ax} of {x.value.name}{x.shape} is streamed without chunks=: it cannot be sharded "
                         "too")
    check_divides(x.shape, ax, over, sub, _named(x))
    return layout.sharded(ax, over)


def shard(x: "Traced", axis: int, over=None, mesh=None):
    """Place `axis` of x across the devices of mesh axis `over`, or of several mesh axes
    (``over=("dp", "tp")``: the first outermost, as JAX's ``P(("dp", "tp"))``).

    (sf.shard on a concrete array is shardfuse.api.shard.)"""
    return _annotate(x, axis, over, on=mesh)  # mesh=: a sub-mesh (pipeline stage) the value moves to


def replicate(x, mesh=None):
    """Annotate x as replicated on every device (DTensor's Replicate()): forces the gathers.
    With mesh= (a sub-mesh of the program's), replicated on that sub-mesh's devices.
    (sf.replicate on a concrete array is shardfuse.api.replicate.)"""
    out = TensorType(x.shape, x.dtype_name, Layout.replicated(x.ndim).on(_sub_mesh(x.builder, mesh)))
    return x.builder.emit(Op.SET, (x,), out, x.value.name, annotation=True)


def constrain(x: Traced, placements, mesh=None) -> Traced:
    """x annotated with a whole layout (sf.distribute inside sf.jit, JAX's with_sharding_constraint):
    each tensor axis sharded as `placements` (DTensor-style, a JAX-style spec or a Layout) state,
    the others replicated; on mesh= (a sub-mesh) as sf.replicate(x, mesh=) places it."""
    out = TensorType(x.shape, x.dtype_name, _whole_layout(x, placements, _sub_mesh(x.builder, mesh), "sf.distribute"))
    return x.builder.emit(Op.SET, (x,), out, x.value.name, annotation=True)


def _whole_layout(x: Traced, placements, sub, what: str):
    """The layout `placements` give x on mesh `sub` (None: the program's), checked (`what` names the caller)."""
    axes = placements.axes if isinstance(placements, Layout) else layout_of(placements, x.ndim, sub).axes
    if len(axes) != x.ndim:
        raise ValueError(f"{what}: a layout of {len(axes)} axes for {x.value.name}{x.shape}")
    for ax, names in enumerate(axes):
        if names is not None:
            check_divides(x.shape, ax, names, sub, _named(x))
    return Layout(tuple(axes)).on(sub)


def _named(x: Traced) -> str:
    """x as an error names it: its name, shape and what made it (an argument, or an op's result)."""
    made = x.builder.producer.get(x.value)
    what = "an argument" if made is None else "placed by sf.shard / sf.replicate" if made.op == Op.SET else \
        f"the result of {made.op}"
    return f"{x.value.name}{list(x.shape)} ({what})"


def to_mesh(x: Traced, mesh, axis: int | None = None, over: str | None = None, *, placements=None):
    """Move x to another mesh (a pipeline stage, `mesh.submesh(...)`), replicated there or
    sharded on `axis`, or cut on several axes as `placements` say (as sf.distribute's: a stage of
    dp x tp).  Unlike an annotation, this always makes a new value on the new mesh, so the op
    that produced x still runs where its operands are."""
    if not isinstance(x, Traced):
        raise TypeError("sf.to_mesh moves values inside an sf.jit function")
    sub = _sub_mesh(x.builder, mesh)
    layout = Layout.replicated(x.ndim).on(sub)
    if placements is not None:
        if axis is not None:
            raise TypeError("sf.to_mesh takes axis= or placements=, not both")
        if isinstance(placements, Layout) and (placements.partial or placements.mesh not in (None, sub)):
            raise ValueError(f"sf.to_mesh(placements=): a whole placement on {sub}, got {placements} (a pending sum "
                             "or another mesh's layout)")
        layout = _whole_layout(x, placements, sub, "sf.to_mesh")
    elif axis is not None:
        ax = normalize_axis(axis, x.ndim, x.shape)
        over = over or sub.axis_names[-1]
        check_divides(x.shape, ax, over, sub, _named(x))
        layout = layout.with_axis(ax, over)
    return x.builder.emit(Op.SET, (x,), TensorType(x.shape, x.dtype_name, layout), x.value.name + "_moved")


ALGORITHMS = ("collective", "ring")


def stream(x: Traced, axis: int, chunks: int | str | None = None, algorithm: str = "collective") -> Traced:
    """Ask for x to be produced chunk by chunk along `axis` (chunks=None: one chunk per index).

    A schedule relative to the placement stated so far: `sf.stream(sf.shard(c, axis=1), axis=0)`
    places c as sf.shard says and streams it.  As the first annotation on a value it starts, as
    every first annotation inside jit does, from replicated: `sf.stream(a @ b, axis=0)` is the
    pipelined AllGather+GEMM (c replicated).  To stream a value where propagation would place it,
    state that placement (tests/test_stream_only_schedules.py).

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
    normalize_axis(axis, x.ndim, x.shape)  # (an axis out of range is named before chunks=)
    chunks = resolve_chunks(chunks, algorithm)
    if algorithm == "ring":  # its chunks are the D shards: chunks=D may be said, and is checked once D is known
        return _ring_stream(x, axis, chunks)
    return _annotate(x, axis, STREAM, chunks)


def _ring_stream(x: Traced, axis: int, chunks) -> Traced:
    """The ring streams a matmul's product.  Of an elementwise epilogue of one (sf.stream(x @ w.T + b,
    axis=0, algorithm="ring"): a bias, an activation, ops of the product's shape whose other operands
    do not depend on a product), the product is streamed and the epilogue applied to the streamed
    result after the ring: the same values, the epilogue on the whole result (the collective
    algorithm pipelines it with the chunks instead)."""
    i = x.builder.producer.get(x.value)
    if i is not None and i.op in ELEMENTWISE:
        lead = [n for n, v in enumerate(i.ins) if v.type.shape == x.shape and _has_product(x.builder, v)]
        if len(lead) == 1 and len([v for v in i.ins if _has_product(x.builder, v)]) == 1:
            ins = [Traced(x.builder, v) for v in i.ins]
            ins[lead[0]] = _ring_stream(ins[lead[0]], axis, chunks)
            return x.builder.emit(i.op, ins, TensorType(x.shape, x.dtype_name), x.value.name, **i.attrs)
    return _annotate(x, axis, STREAM, chunks, "ring")


def _has_product(builder, v, seen=None) -> bool:
    """Whether v is a matmul's product or an elementwise op of one (each value looked at once: a
    value seen again found none, else the search would have ended)."""
    seen = set() if seen is None else seen
    i = builder.producer.get(v)
    if i is None or v in seen:
        return False
    seen.add(v)
    return i.op == Op.MATMUL or i.op in ELEMENTWISE and any(_has_product(builder, u, seen) for u in i.ins)


def input_names(fn, n: int) -> list:
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
    builder.entry = fn.fn if isinstance(fn, FlatFunction) else fn
    params = input_names(fn, len(specs))
    inputs = []
    for pname, spec in zip(params, specs):
        lay = None if spec.layout is None else spec.layout.on(spec.layout.home(mesh))  # (an sf.Array's: see array.py)
        v = Value(builder.namer(pname), TensorType(spec.shape, spec.dtype, lay))
        builder.homes.update({v: lay.mesh} if lay is not None else {})
        builder.weak.update({v} if spec.weak else set())
        inputs.append(v)
    with tracing(builder):  # (an op on an sf.Array inside fn is traced, the array a constant: array_ops.run)
        result = fn(*(Traced(builder, v) for v in inputs))
        results = result if isinstance(result, tuple) else (result,)
        # a Python or NumPy number, a NumPy array or an sf.Array returned (a learning rate in an aux dict, an
        # optimizer's zeros, placed by out_shardings): a constant of the program, returned as JAX returns it
        results = tuple(builder.constant(np.asarray(r) if isinstance(r, (bool, int, float, np.generic)) else r)
                        for r in results)
    for r in results:
        if not isinstance(r, Traced):
            raise TypeError(f"{fn.__name__} must return traced values, got {type(r).__name__}")
    const_inputs, const_arrays = captured(builder)  # (NumPy arrays met: inputs bound by the plan itself)
    return Program(name or fn.__name__, mesh, tuple(inputs) + const_inputs, tuple(r.value for r in results),
                   tuple(builder.instrs), streams, ("trace",), constants=const_arrays,
                   weak_bounds=weak_bounds(builder, inputs),
                   weak_outputs=tuple(k for k, r in enumerate(results) if r.value in builder.weak and r.shape == ()))


def weak_bounds(builder, inputs) -> tuple:
    """(input index, dtype) for each Python int argument (weak int64) that a promotion casts to int32
    (int32 x + s keeps int32, as NumPy 2 and JAX): the value is known only at the call, which checks
    that it fits (Plan.check_bounds), where the cast would wrap it silently.  An explicit
    s.astype("int32") is strong (its output not weak) and wraps as NumPy's astype does."""
    ints = {v: k for k, v in enumerate(inputs) if v in builder.weak and v.type.dtype == "int64"}
    return tuple(sorted({(ints[i.ins[0]], "int32") for i in builder.instrs if i.op == Op.ASTYPE and i.ins[0] in ints
                         and i.outs[0] in builder.weak and i.outs[0].type.dtype == "int32"}))
