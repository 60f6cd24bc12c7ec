"""allocate_buffers: decide where every buffer lives and how long.

- A buffer a program output lives in is allocated per call (the caller keeps it); an output
  that would be a view of an input is copied into one.
- Every other buffer is allocated once per compiled plan and reused across calls.
- Inside a stream loop, a chunk that leaves the loop is a slice of a whole buffer allocated
  before the loop; a chunk used only inside it (the gathered chunk of A) comes from a pool
  of one buffer per stream, `Select pool, i % n`: chunks on the same stream run in order,
  so they may share a buffer, and no two streams ever do.
"""
from __future__ import annotations

from dataclasses import replace

from shardfuse.ir import Idx, Instr, Namer, Value, walk
from shardfuse.ops import VIEWS, Op

def view_bases(prog) -> dict:
    """value -> the buffer it is a view of (values that are no view are absent)."""
    base = {}
    for i in walk(prog.instrs):
        if i.op in VIEWS:
            base[i.outs[0]] = base.get(i.ins[0], i.ins[0])
        for r in i.results:  # (a loop's, until this pass makes them Slices of the whole)
            base[r.chunk] = r.whole
    return base


def output_roots(prog):
    """The buffers program outputs are views of."""
    base = view_bases(prog)
    return {base.get(v, v) for v in prog.outputs}


def _copy_aliased_outputs(prog, instrs, namer):
    """An output that is an input or a view of one (identity, a local shard slice, `.T`), or of
    an earlier output's buffer (`return y, y`), gets a buffer of its own: a result must never
    change when the caller later writes its argument or another result."""
    base, taken = view_bases(prog), set(prog.inputs)
    outputs, tail = [], []
    for v in prog.outputs:
        root = base.get(v, v)
        if root not in taken:
            taken.add(root)
        else:
            c = Value(namer(v.name + "_copy"), v.type)
            tail += [Instr(Op.ALLOCATE, (c,), attrs={"per_call": True}), Instr(Op.COPY, (), (v,), into=c)]
            v = c
        outputs.append(v)
    return instrs + tail, tuple(outputs)


def mark_per_call(prog) -> list:
    """prog's instructions with each top-level buffer that a program output lives in made per
    call, every other once (for a pass that changed which buffers the outputs are views of)."""
    roots = output_roots(prog)
    return [replace(i, attrs={**i.attrs, "per_call": i.outs[0] in roots}) if i.op == Op.ALLOCATE and not i.attrs.get("pool")
            else i for i in prog.instrs]


def allocate_buffers(prog):
    namer = Namer.for_program(prog)
    roots = output_roots(prog)
    out = []
    for i in prog.instrs:
        if i.op == Op.ALLOCATE:
            out.append(replace(i, attrs={**i.attrs, "per_call": i.outs[0] in roots}))
        elif i.op == Op.FOR:
            out.extend(hoist_allocations(i, prog.streams, roots, namer))
        else:
            out.append(i)
    out, outputs = _copy_aliased_outputs(prog, out, namer)
    return prog.with_instrs(out, "allocate_buffers", outputs=outputs)


def hoist_allocations(loop, streams, roots, namer) -> list:
    """The loop's allocations moved before it (a pool per stream, or the whole of a result),
    then the loop; `roots`: the buffers program outputs are views of."""
    nstreams = min(streams, loop.attrs["extent"])
    pre, body = [], []
    results = {r.chunk: r for r in loop.results}
    for b in loop.body:
        if b.op != Op.ALLOCATE:
            body.append(b)
            continue
        oc = b.outs[0]
        if oc in results:
            full, ax = results[oc].whole, results[oc].axis
            pre.append(Instr(Op.ALLOCATE, (full,), attrs={"per_call": full in roots}))
            body.append(Instr(Op.SLICE, (oc,), (full,), {"axis": ax, "index": Idx("i")}))
        else:
            pool = Value(namer(oc.name.removesuffix("_i") + "_pool"), oc.type)
            pre.append(Instr(Op.ALLOCATE, (pool,), attrs={"pool": nstreams, **_kept(b.attrs, "blocks")}))
            body.append(Instr(Op.SELECT, (oc,), (pool,), {"index": Idx("i", nstreams)}))
    # the results are now the Allocate and Slices just made: the loop no longer carries them
    return pre + [replace(loop, body=tuple(body), results=())]


def _kept(attrs, *names) -> dict:
    return {n: attrs[n] for n in names if n in attrs}
