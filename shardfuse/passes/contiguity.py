"""stage_strided_views: a reshape that cannot be a view of its source gets a copy first.

A `View` (a reshape of the local piece) is free only when the source's strides allow it
(NumPy's rule, strides.reshape_strides); the piece of `x.T`, of a slice of an inner axis or of
a rank-major gather destination may not.  This pass follows every local buffer's strides
through the program and, where a View would need a copy, writes it into the plan:
`Allocate` + `Copy` into a contiguous buffer, then the View of that.  Every stride is known at
compile time: one-device folding and rank-major buffers are already in the plan (passes/fold.py).
"""
from __future__ import annotations

from dataclasses import replace

from shardfuse.ir import Instr, Namer, Value, local_shape
from shardfuse.ops import Op
from shardfuse.passes.allocate import hoist_allocations, mark_per_call, output_roots
from shardfuse.strides import contiguous_strides, ordered_strides, reshape_strides


def stage_strided_views(prog):
    namer = Namer.for_program(prog)
    strides: dict = {}
    staged = replace(prog, instrs=tuple(_walk(prog.instrs, strides, prog.mesh, namer)))
    roots = output_roots(staged)  # a staging buffer inside a stream loop: a pool per stream, as any other there
    staged = replace(staged, instrs=tuple(x for i in staged.instrs for x in (
        hoist_allocations(i, prog.streams, roots, namer) if i.op == Op.FOR else (i,))))
    return prog.with_instrs(mark_per_call(staged), "stage_strided_views")  # an output may now view a staging buffer


def _walk(instrs, strides, mesh, namer):
    def of(v):  # inputs are C-contiguous
        return strides[v] if v in strides else contiguous_strides(local_shape(v, mesh))

    out = []
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
        out.append(i)
    return out


def _allocated(i, mesh):
    """Strides of a new buffer: C order, or the order fold_collectives chose (rank-major)."""
    shape = local_shape(i.outs[0], mesh)
    if i.attrs.get("pool"):
        shape = (i.attrs["pool"],) + shape
    return ordered_strides(shape, i.attrs.get("order"))
