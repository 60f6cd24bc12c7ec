"""stage_strided_views: a reshape that cannot be a view of its source gets a copy first.

A `View` (a reshape of the local piece) is free only when the source's strides allow it
(NumPy's rule, strides.reshape_strides); the piece of `x.T`, of a slice of an inner axis or of
a rank-major gather destination may not.  This pass follows every local buffer's strides
through the program and, where a View would need a copy, writes it into the plan:
`Allocate` + `Copy` into a contiguous buffer, then the View of that.  Strides it cannot know
at compile time (a collective over a one-device team may bind as a view of a strided source)
count as unknown, and a View of them is staged too.
"""
from __future__ import annotations

from dataclasses import replace

from shardfuse.ir import Instr, Namer, Value
from shardfuse.layout import shard_count
from shardfuse.strides import contiguous_strides, reshape_strides

COLLECTIVES = ("allgather", "allreduce", "reduce_scatter", "alltoall")


def stage_strided_views(prog):
    namer = Namer.for_program(prog)
    strides: dict = {}
    return prog.with_instrs(_walk(prog.instrs, strides, prog.mesh, namer), "stage_strided_views")


def _local(v, mesh):
    return v.type.layout.local_shape(v.type.shape, mesh)


def _walk(instrs, strides, mesh, namer):
    def of(v):  # inputs and buffers allocated by the plan are C-contiguous
        return strides[v] if v in strides else contiguous_strides(_local(v, mesh))

    out = []
    for i in instrs:
        if i.op == "for":
            out.append(replace(i, body=tuple(_walk(i.body, strides, mesh, namer))))
            continue
        if i.op in ("slice", "shard_slice"):
            strides[i.outs[0]] = of(i.ins[0])
        elif i.op == "select":
            s = of(i.ins[0])
            strides[i.outs[0]] = None if s is None else s[1:]
        elif i.op == "transpose":
            s = of(i.ins[0])
            strides[i.outs[0]] = None if s is None else tuple(s[p] for p in i.attrs["perm"])
        elif i.op in COLLECTIVES:
            strides[i.into] = _destination_strides(i, of, mesh)
        elif i.op == "view":
            src, dst = i.ins[0], i.outs[0]
            s = of(src)
            new = None if s is None else reshape_strides(_local(src, mesh), s, _local(dst, mesh))
            if new is None:  # stage it: a contiguous copy, then the view of that
                tmp = Value(namer(src.name + "_contig"), src.type)
                out += [Instr("allocate", (tmp,)), Instr("copy", (), (src,), into=tmp)]
                i = replace(i, ins=(tmp,))
                new = contiguous_strides(_local(dst, mesh))
            strides[dst] = new
        out.append(i)
    return out


def _is_c(shape, strides) -> bool:
    """C-contiguous, ignoring axes of extent 1 (their strides never matter)."""
    return reshape_strides(shape, strides, (max(1, _size(shape)),)) is not None


def _size(shape):
    n = 1
    for e in shape:
        n *= e
    return n


def _destination_strides(i, of, mesh):
    """What the executor binds a collective's destination as (see Executable._gather_destinations
    and _one_device_destinations)."""
    x, y = i.ins[0], i.into
    if shard_count(i.attrs["team"], mesh) == 1:  # may be folded into a view of its source
        s = of(x)
        return contiguous_strides(_local(y, mesh)) if s is not None and _is_c(_local(x, mesh), s) else None
    k = i.attrs.get("axis")
    if i.op == "allgather" and k and _local(x, mesh)[k] == 1:  # stored rank-major: axis k first
        shape = _local(y, mesh)
        order = (k,) + tuple(j for j in range(len(shape)) if j != k)
        phys = contiguous_strides(tuple(shape[o] for o in order))
        out = [0] * len(shape)
        for j, o in enumerate(order):
            out[o] = phys[j]
        return tuple(out)
    return contiguous_strides(_local(y, mesh))
