"""The one IR, used from tracing to the final host program.

Every stage is a `Program`: a list of `Instr` over `Value`s.  Traced programs hold
array-level ops (set, matmul, add, mul, sum, view); the passes rewrite them step by step
into host-level ops (Allocate, Slice, Allgather, Wait, For, SetCurrentStream, ...), and
that last program is the plan the executor runs.  Values are immutable; passes build new
instructions instead of editing old ones.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from shardfuse.layout import Layout, format_type
from shardfuse.ops import Op
from shardfuse.schedule import KEY as SCHEDULE

@dataclass(frozen=True)
class TensorType:
    shape: tuple
    dtype: str
    layout: Layout | None = None  # None: not known yet (filled in by propagation)

    @property
    def ndim(self):
        return len(self.shape)

    def with_layout(self, layout):
        return replace(self, layout=layout)

    def __str__(self):
        return format_type(self.shape, self.dtype, self.layout)


@dataclass(frozen=True, eq=False)
class Value:
    """A named value: a tensor (type is a TensorType) or a handle ('Comm')."""

    name: str
    type: object

    def __repr__(self):
        return self.name


@dataclass(frozen=True)
class Idx:
    """A loop index expression: `i`, `i % mod` (a slot in a per-stream pool), `(i + 1) % 2`,
    or, with `ring` (a mesh axis), `(rank - i) % mod`: the block a device holds at ring step i."""

    var: str
    mod: int | None = None
    offset: int = 0
    ring: str | None = None

    def eval(self, env: dict, rank: int = 0) -> int:
        v = (rank - env[self.var] if self.ring else env[self.var]) + self.offset
        return v % self.mod if self.mod else v

    def __str__(self):
        v = f"rank({self.ring}) - {self.var}" if self.ring else self.var
        if self.offset:
            v += f" {'+' if self.offset > 0 else '-'} {abs(self.offset)}"
        if self.mod:
            return f"({v}) % {self.mod}" if (self.offset or self.ring) else f"{v} % {self.mod}"
        return v


class LoopResult(NamedTuple):
    """A chunk a stream loop makes that is used after it: chunk i is slice i of `whole` along `axis`."""

    chunk: Value  # made in the loop's body
    whole: Value  # the whole value, made by the loop (passes/pipeline.py) chunk by chunk
    axis: int


@dataclass(frozen=True, eq=False)
class Instr:
    op: str
    outs: tuple = ()
    ins: tuple = ()
    attrs: dict = field(default_factory=dict)  # plain data only (tests/test_architecture.py): no Values
    into: Value | None = None  # destination buffer of a host-level compute or collective
    body: tuple = ()  # for `for`
    # For a `for` from form_stream_loops until allocate_buffers: the LoopResults, the whole values
    # the loop makes.  allocate_buffers makes them explicit (an Allocate of the whole before the
    # loop, a Slice of it per chunk) and empties this, so a plan's loops carry none.
    results: tuple = ()

    def values(self):
        """The values it reads or writes into (not those it makes: outs, and a loop's results)."""
        return self.ins + ((self.into,) if self.into is not None else ())


@dataclass(frozen=True)
class Program:
    name: str
    mesh: object
    inputs: tuple
    outputs: tuple
    instrs: tuple
    streams: int = 4
    history: tuple = ()  # the passes that produced this program, in order
    donated: tuple = ()  # indices of inputs whose buffers outputs may take (sf.jit's donate_argnums)
    # NumPy arrays and sf.Arrays captured while tracing (shardfuse/constants.py): the last len(constants) inputs,
    # bound by the plan at each call after the function's arguments
    constants: tuple = field(default=(), compare=False, repr=False)
    # (input index, integer dtype) per Python int argument that a promotion narrows (trace.weak_bounds):
    # the plan checks at each call that the value fits, as NumPy 2 and JAX raise OverflowError
    weak_bounds: tuple = field(default=(), compare=False, repr=False)
    # the positions of the 0-d results weakly typed as JAX's (a step count + 1): their sf.Arrays stay weak
    weak_outputs: tuple = field(default=(), compare=False, repr=False)

    def with_instrs(self, instrs, by: str, **changes) -> "Program":
        return replace(self, instrs=tuple(instrs), history=self.history + (by,), **changes)

    def walk(self):
        """Every instruction, loop bodies included, in program order."""
        yield from walk(self.instrs)

    def __str__(self):
        return format_program(self)

    def _repr_pretty_(self, p, cycle):  # (IPython, a cell's last expression: the text, not the dataclass dump)
        p.text(str(self))


def local_shape(v: Value, mesh) -> tuple:
    """The shape of v's piece on one device (its layout's sub-mesh, else `mesh`); the global
    shape while no layout is known."""
    lay = v.type.layout
    return v.type.shape if lay is None else lay.local_shape(v.type.shape, mesh)


def walk(instrs):
    for ins in instrs:
        yield ins
        yield from walk(ins.body)


def holds(when, env) -> bool:
    """A guard `(var, "<" or ">", value)` on a loop step, decided when the loop is unrolled."""
    var, op, value = when
    return env[var] < value if op == "<" else env[var] > value


def unroll(instrs, env=None):
    """(instruction, loop variables) in the order one call issues them: loops unrolled, guarded
    steps that do not hold left out.  The executor binds exactly this sequence; plan.collectives()
    counts it."""
    env = env or {}
    for ins in instrs:
        if "when" in ins.attrs and not holds(ins.attrs["when"], env):
            continue
        if ins.op == Op.FOR:
            for it in range(ins.attrs["extent"]):
                yield from unroll(ins.body, {**env, ins.attrs["var"]: it})
        else:
            yield ins, env


def same_program(a: Program, b: Program) -> bool:
    """Whether two programs are one plan, values compared by name and type (Values are equal only
    to themselves): sf.jit compiles a plain array and a replicated sf.Array of one shape apart (their
    specs differ) into the same program, which one plan, bound once, then serves."""
    def key(x):
        if isinstance(x, Value):
            return "value", x.name, x.type
        if isinstance(x, Instr):
            return x.op, key(x.outs), key(x.ins), key(x.into), key(x.attrs), key(x.body)
        if isinstance(x, dict):
            return "dict", tuple((key(k), key(v)) for k, v in x.items())
        return tuple(key(e) for e in x) if isinstance(x, (tuple, list)) else x

    def constants(p):  # (captured when traced: NumPy arrays by value, sf.Arrays by identity)
        return [("sf.Array", id(c)) if hasattr(c, "sharding") else (c.dtype, c.shape, c.tobytes())
                for c in p.constants]
    return (key((a.name, a.streams, a.donated, a.inputs, a.outputs, a.instrs)) == key((b.name, b.streams, b.donated,
                                                                                        b.inputs, b.outputs, b.instrs))
            and a.mesh == b.mesh and constants(a) == constants(b))


class Namer:
    """Fresh, readable value names: a, a_1, a_2 ..."""

    def __init__(self, taken=()):
        self.taken = set(taken)

    def __call__(self, base: str) -> str:
        name = base
        for k in itertools.count(1):
            if name not in self.taken:
                break
            name = f"{base}_{k}"
        self.taken.add(name)
        return name

    @staticmethod
    def for_program(prog: Program) -> "Namer":
        names = {v.name for v in prog.inputs}
        for ins in prog.walk():
            names.update(v.name for v in ins.outs)
            names.update(r.whole.name for r in ins.results)  # (a loop makes them: no instruction's outs)
        return Namer(names)


def substitute(instrs, mapping: dict):
    """Instructions with values replaced by mapping[value] (old -> new), recursively."""
    def sub(v):
        return mapping.get(v, v)

    out = []
    for ins in instrs:
        out.append(replace(
            ins,
            outs=tuple(sub(v) for v in ins.outs),
            ins=tuple(sub(v) for v in ins.ins),
            into=sub(ins.into) if ins.into is not None else None,
            body=tuple(substitute(ins.body, mapping)),
            results=tuple(LoopResult(sub(r.chunk), sub(r.whole), r.axis) for r in ins.results),
        ))
    return out


# ---- printing: one instruction per line; a line that defines a value shows its type ----

def _type_text(t, home=None) -> str:
    """A value's type, a tensor's sub-mesh shown where it is not `home` (the program's mesh)."""
    return format_type(t.shape, t.dtype, t.layout, home=home) if isinstance(t, TensorType) else str(t)


def _typed(v: Value, home=None) -> str:
    return f"{v.name}: {_type_text(v.type, home)}"


def _attrs(a: dict, skip=()) -> str:
    return ", ".join(f"{k}={v}" for k, v in a.items() if k not in skip)


_STREAM_FORMATS = {
    Op.GET_STREAM: "{out} = GetCurrentStream",
    Op.SET_STREAM: "SetCurrentStream {stream!r}",
    Op.SYNCHRONIZE: "Synchronize {stream!r}",
    Op.RECORD_EVENT: "{out} = RecordEvent {stream!r}",
    Op.WAIT_EVENT: "WaitEvent {ins}",
    Op.WAIT: "Wait {ins}",
}


def _fmt(ins: Instr, home=None) -> str:
    a, op = ins.attrs, ins.op
    ins_s = ", ".join(v.name for v in ins.ins)
    if op == Op.FOR:
        return f"For {a['var']} in range({a['extent']}):"
    if op == Op.ALLOCATE:
        where = "per call" if a.get("per_call") else (
            "double buffer" if a.get("ring") else "one per stream" if a.get("pool") else "once")
        if "slab" in a:  # storage shared with buffers whose lives do not overlap (passes/reuse.py)
            where += f", in slab {a['slab']}" + (f", in place of {a['in_place_of']}" if "in_place_of" in a else "")
        if a.get("order"):  # stored with the gathered axis first (see passes/fold.py)
            where += ", rank-major"
        if a.get("blocks"):  # a staging buffer stored as communication reads it (passes/contiguity.py)
            where += ", as {1} blocks of axis {0}".format(*a["blocks"])
        v = ins.outs[0]
        pool = f"{a['pool']} x " if a.get("pool") else ""
        return f"{v.name} = Allocate {pool}{_type_text(v.type, home)}  ({where})"
    if op in _STREAM_FORMATS:
        out = ins.outs[0].name if ins.outs else ""
        if op in (Op.RECORD_EVENT, Op.WAIT_EVENT) and "index" in a:  # one event per loop step
            out, ins_s = f"{out}[{a['index']}]", f"{ins_s}[{a['index']}]"
        return _STREAM_FORMATS[op].format(out=out, ins=ins_s, stream=a.get("stream"))
    if op in (Op.SLICE, Op.SHARD_SLICE, Op.VIEW, Op.SELECT, Op.TRANSPOSE, Op.SLICE_ARRAY):
        name = {Op.SLICE: "Slice", Op.SHARD_SLICE: "ShardSlice", Op.VIEW: "View", Op.SELECT: "Select",
                Op.TRANSPOSE: "Transpose", Op.SLICE_ARRAY: "SliceArray"}[op]
        extra = _attrs(a, skip=("shape", "when"))
        return f"{_typed(ins.outs[0], home)} = {name} {ins_s}" + (f", {extra}" if extra else "")
    if ins.into is not None:  # host-level compute and communication write into a buffer
        name = {Op.MATMUL: "Matmul", Op.SUM: "Sum", Op.FUSED_SUM: "FusedSum", Op.FUSED_ROWS: "FusedRows", Op.COPY: "Copy",
                Op.ALLGATHER: "Allgather", Op.ALLREDUCE: "Allreduce", Op.REDUCE_SCATTER: "ReduceScatter", Op.ALLTOALL: "AllToAll",
                Op.SENDRECV: "SendRecv", Op.TAKE: "Take", Op.SCATTER_ADD: "ScatterAdd",
                Op.DYNAMIC_SLICE: "DynamicSlice", Op.DYNAMIC_UPDATE_SLICE: "DynamicUpdateSlice",
                Op.ORDER_KEYS: "OrderKeys", Op.FROM_ORDER_KEYS: "FromOrderKeys"
                }.get(op, op.capitalize())
        rhs = " @ ".join(v.name for v in ins.ins) if op == Op.MATMUL else ins_s
        if op == Op.FUSED_ROWS and "more" in a:  # a row group that writes more values (passes/fuse_rows.py), each an Expr
            more = {**a, "more": f"({', '.join(map(str, a['more']))})"}
            return f"{name} {', '.join(v.name for v in (ins.into, *ins.outs))} <- {rhs}, {_attrs(more, skip=('when',))}"
        if op == Op.TRANSFER:  # a move between meshes, in nvFuser's words
            name, a = a["kind"], {k: v for k, v in a.items() if k != "kind"}
        extra = f", {_attrs(a, skip=('when',))}" if set(a) - {"when"} else ""
        lhs = f"{ins.outs[0].name} = " if ins.outs else ""
        return f"{lhs}{name} {ins.into.name} <- {rhs}{extra}"
    # array-level (traced) ops; a scheduled one marks its output's stream axis, with the chunks
    sched = a.get(SCHEDULE)
    outs = ", ".join(f"{v.name}: {format_type(v.type.shape, v.type.dtype, v.type.layout, sched and sched.axis, home)}"
                     for v in ins.outs)
    shown = {k: v for k, v in a.items() if k != SCHEDULE}
    if sched is not None and sched.chunks is not None:
        shown["chunks"] = sched.chunks
    if sched is not None and sched.ring:
        shown["algorithm"] = sched.algorithm
    extra = f", {_attrs(shown)}" if shown else ""
    return f"{outs} = {op}({ins_s}{extra})"


def format_instrs(instrs, indent: int = 1, home=None) -> list:
    lines = []
    for ins in instrs:
        when = ins.attrs.get("when")
        guard = f"[{' '.join(map(str, when))}] " if when else ""
        lines.append("  " * indent + guard + _fmt(ins, home))
        lines.extend(format_instrs(ins.body, indent + 1, home))
    return lines


def format_program(prog: Program) -> str:
    ins = ", ".join(_typed(v, prog.mesh) for v in prog.inputs)
    outs = ", ".join(_typed(v, prog.mesh) for v in prog.outputs)
    mesh = " x ".join(f"{n}={s}" for n, s in zip(prog.mesh.axis_names, prog.mesh.shape))
    head = [f"plan {prog.name}({ins}) -> ({outs})", f"  # mesh {mesh}, streams={prog.streams}"]
    if prog.constants:
        names = ", ".join(v.name for v in prog.inputs[len(prog.inputs) - len(prog.constants):])
        what = "arrays" if any(hasattr(c, "sharding") for c in prog.constants) else "NumPy arrays"  # (sf.Arrays too)
        head.append(f"  # constants: {names} ({what} captured when traced; the plan binds them at each call)")
    body = format_instrs(prog.instrs, home=prog.mesh)
    tail = ["  return " + ", ".join(v.name for v in prog.outputs)]
    return "\n".join(head + body + tail)
