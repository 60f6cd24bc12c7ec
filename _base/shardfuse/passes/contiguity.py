"""stage_strided_views: every copy that a buffer's strides call for, decided here and printed.

This pass follows every local buffer's strides through the program (every stride is known at
compile time: one-device folding and rank-major buffers are already in the plan, passes/fold.py)
and writes a copy where one is needed, so that the executor binds only the plan's steps:
- A `View` (a reshape of the local piece) is free only when the source's strides allow it
  (NumPy's rule, strides.reshape_strides); the piece of `x.T`, of a slice of an inner axis or of
  a rank-major gather destination may not be: `Allocate` + `Copy` into a contiguous buffer, then
  the View of that.
- Communication reads and writes contiguous buffers only (the backend protocol), and rank by
  rank: a gathered or scattered axis as D blocks, block r first (`comm_blocks`).  An operand
  whose view of that kind is strided (a chunk of an inner axis, the gather of an inner axis)
  goes through a staging buffer: `Allocate` (stored in blocks where the collective needs blocks:
  "D blocks of axis k") + `Copy` before the collective, or after its `Wait` for what it writes.
"""
from __future__ import annotations

from dataclasses import replace

from shardfuse.ir import Instr, Namer, Value, local_shape
from shardfuse.layout import shard_count
from shardfuse.ops import COMMUNICATION, Op
from shardfuse.passes.allocate import hoist_allocations, mark_per_call, output_roots
from shardfuse.strides import contiguous_strides, is_contiguous, ordered_strides, rank_major, reshape_strides


def stage_strided_views(prog):
    namer = Namer.for_program(prog)
    strides: dict = {}
    staged = replace(prog, instrs=tuple(_walk(prog.instrs, strides, prog.mesh, namer)))
    roots = output_roots(staged)  # a staging buffer inside a stream loop: a pool per stream, as any other there
    staged = replace(staged, instrs=tuple(x for i in staged.instrs for x in (
        hoist_allocations(i, prog.streams, roots, namer) if i.op == Op.FOR else (i,))))
    return prog.with_instrs(mark_per_call(staged), "stage_strided_views")  # an output may now view a staging buffer


def comm_blocks(i, mesh) -> tuple:
    """(send, recv) of communication i: (axis, D) where it reads or writes that axis as D blocks,
    rank r's first (as the [D, ...] view protocol.rank_major makes), else None."""
    a = i.attrs
    if i.op == Op.TRANSFER:
        return ((a["axis"], len(a["to"])) if a["kind"] == "Scatter" else None,
                (a["axis"], len(a["from"])) if a["kind"] == "Gather" else None)
    if i.op not in (Op.ALLGATHER, Op.REDUCE_SCATTER, Op.ALLTOALL):
        return None, None
    d = shard_count(a["team"], i.ins[0].type.layout.mesh)
    if i.op == Op.ALLGATHER:
        return None, (a["axis"], d)
    if i.op == Op.REDUCE_SCATTER:
        return (a["axis"], d), None
    return (a["to_axis"], d), (a["axis"], d)  # AllToAll: block r of the target axis goes to rank r


def _walk(instrs, strides, mesh, namer):
    def of(v):  # inputs are C-contiguous
        return strides[v] if v in strides else contiguous_strides(local_shape(v, mesh))

    out, after_wait = [], {}  # comm handle -> the copies out of its staging buffer
    for i in instrs:
        if i.op == Op.FOR:
            out.append(replace(i, body=tuple(_walk(i.body, strides, mesh, namer))))
            continue
        if i.op in (Op.SLICE, Op.SHARD_SLICE):
            strides[i.outs[0]] = of(i.ins[0])
        elif i.op == Op.SELECT:
            strides[i.outs[0]] = of(i.ins[0])[1:]
        elif i.op == Op.TRANSPOSE:
            strides[i.outs[0]] = tuple(of(i.ins[0])[p] for p in i.attrs["perm"])
        elif i.op == Op.SLICE_ARRAY:
            st = i.attrs.get("step", (1,) * len(of(i.ins[0])))
            strides[i.outs[0]] = tuple(s * k for s, k in zip(of(i.ins[0]), st))
        elif i.op == Op.ALLOCATE:
            strides[i.outs[0]] = _allocated(i, mesh)
        elif i.op == Op.VIEW:
            src, dst = i.ins[0], i.outs[0]
            new = reshape_strides(local_shape(src, mesh), of(src), local_shape(dst, mesh))
            if new is None:  # stage it: a contiguous copy, then the view of that
                tmp = Value(namer(src.name + "_contig"), src.type)
                out += [Instr(Op.ALLOCATE, (tmp,)), Instr(Op.COPY, (), (src,), into=tmp)]
                i = replace(i, ins=(tmp,))
                new = contiguous_strides(local_shape(dst, mesh))
            strides[dst] = new
        elif i.op in COMMUNICATION:
            i, before, after_wait[i.outs[0]] = _stage(i, of, mesh, namer)
            out += before
        elif i.op == Op.WAIT:
            out += [i] + after_wait.pop(i.ins[0], [])
            continue
        out.append(i)
    return out


def _stage(i, of, mesh, namer):
    """(communication i on contiguous operands, what goes before it, what goes after its Wait)."""
    guard = {"when": i.attrs["when"]} if "when" in i.attrs else {}  # (a ring step's): the copies' too
    before, after = [], []
    for side, (v, blocks) in enumerate(zip((i.ins[0], i.into), comm_blocks(i, mesh))):
        shape, st = local_shape(v, mesh), of(v)
        if is_contiguous(*(rank_major(shape, st, *blocks) if blocks else (shape, st))):
            continue
        chunk = v.name.endswith("_i")  # a chunk's: x_staged_i, from the pool x_staged_pool
        tmp = Value(namer(v.name.removesuffix("_i") + "_staged" + ("_i" if chunk else "")), v.type)
        before.append(Instr(Op.ALLOCATE, (tmp,), attrs={"blocks": blocks} if blocks else {}))
        if side == 0:  # what it sends, copied in first
            before.append(Instr(Op.COPY, (), (v,), guard, into=tmp))
            i = replace(i, ins=(tmp,) + i.ins[1:])
        else:  # what it receives, copied out once it has arrived
            after.append(Instr(Op.COPY, (), (tmp,), guard, into=v))
            i = replace(i, into=tmp)
    return i, before, after


def _allocated(i, mesh):
    """Strides of a new buffer: C order, or the order fold_collectives chose (rank-major)."""
    shape = local_shape(i.outs[0], mesh)
    if i.attrs.get("pool"):
        shape = (i.attrs["pool"],) + shape
    return ordered_strides(shape, i.attrs.get("order"))
