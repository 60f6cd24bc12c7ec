"""keep_gathered_inputs: a weight gradient reads the input the forward gathered, rather than
gathering it again (sf.grad's remat="keep"; the default, "regather", is Megatron's).

autodiff marks the backward's re-gather of a matmul's input `keep=True`, and lower_to_host copies
the mark onto its Allgather.  Where an earlier stream loop gathers the same value chunk by chunk
(an Allgather, over the same team, of `Slice xs, index=i` with xs the value or a View of it: the
forward's pipelined AllGather+GEMM), that loop keeps what it gathers: each gathered chunk goes
into its slice of one whole buffer, `x_kept`, a result of the loop (allocated once before it, as
allocate_buffers allocates loop results).  The chunk is gathered where it was (the pool slot the
GEMM reads) and copied in after its Wait, on the chunk's stream: a chunk of a split axis is not
contiguous in the whole buffer and communication writes contiguous buffers.  Where that slice is
contiguous, the Allgather writes it directly (no copy, no pool).  Where the forward gathers the
value whole (an Allgather outside a loop, not streamed), its buffer is the kept one.  The
backward's Allocate, Allgather and Wait become a View of the kept buffer, printed `kept=`.

The forward stays pipelined; the kept buffer lives from the forward's loop to the weight gradient
(passes/reuse.py sees that life; plan.memory() counts it).  A marked Allgather with nothing to
read (a ring loop, which passes shards around with no Allgather) stays, its mark dropped: the
plan prints what runs.
"""
from __future__ import annotations

import math
from dataclasses import replace

from shardfuse.ir import Idx, Instr, LoopResult, Namer, TensorType, Value, local_shape
from shardfuse.ops import Op
from shardfuse.rules import infer


def keep_gathered_inputs(prog):
    if not any(i.op == Op.ALLGATHER and i.attrs.get("keep") for i in prog.instrs):
        return prog.with_instrs(prog.instrs, "keep_gathered_inputs")
    namer = Namer.for_program(prog)
    views = {i.outs[0]: i.ins[0] for i in prog.instrs if i.op == Op.VIEW}
    sources = {}  # (value, team) -> (position, how the first gather of it there does it)
    kept = {}  # (value, team) -> the buffer that holds it gathered, once a marked gather reads it
    now = dict(enumerate(prog.instrs))  # position -> what stands there now (a loop that keeps, a View)
    for k, i in enumerate(prog.instrs):
        if i.op == Op.FOR:
            for key, how in _chunk_gathers(i, views).items():
                sources.setdefault(key, (k, how))
        elif i.op == Op.ALLGATHER and not i.attrs.get("keep"):
            sources.setdefault((i.ins[0], i.attrs["team"]), (k, ("whole", i)))
        elif i.op == Op.ALLGATHER:
            key = (i.ins[0], i.attrs["team"])
            at, how = sources.get(key, (None, None))
            full = kept.get(key) or (None if how is None else _kept_buffer(how, now[at], namer))
            now[k] = _viewed(i, full, prog.mesh) if full is not None else None
            if now[k] is None:  # nothing to read: gathered again, as "regather" does (and read by later ones)
                now[k] = replace(i, attrs={a: v for a, v in i.attrs.items() if a != "keep"})
                sources.setdefault(key, (k, ("whole", now[k])))
            elif key not in kept:
                kept[key] = full
                now[at] = _keeping(now[at], how, full, namer, prog.mesh) if how[0] == "chunk" else now[at]
    gone = {i.outs[0]: i.into for k, i in enumerate(prog.instrs) if now[k].op == Op.VIEW and i.op == Op.ALLGATHER}
    instrs = [now[k] for k, i in enumerate(prog.instrs)  # (the Allocate and Wait of a gather now a View: gone)
              if not (i.op == Op.WAIT and i.ins[0] in gone or i.op == Op.ALLOCATE and i.outs[0] in gone.values())]
    return prog.with_instrs(instrs, "keep_gathered_inputs")


def _chunk_gathers(loop, views) -> dict:
    """(value, team) -> ("chunk", the loop's Allgather, the Slice it gathers) for each Allgather in
    the loop's body of chunk i of a value (or of a View of it), every chunk taken once."""
    made = {b.outs[0]: b for b in loop.body if b.outs}
    found = {}
    for b in loop.body:
        s = made.get(b.ins[0]) if b.op == Op.ALLGATHER and "when" not in b.attrs else None
        if s is None or s.op != Op.SLICE or s.attrs["index"] != Idx(loop.attrs["var"]):
            continue
        xs = s.ins[0]
        if xs.type.shape[s.attrs["axis"]] == loop.attrs["extent"]:
            found.setdefault((views.get(xs, xs), b.attrs["team"]), ("chunk", b, s))
    return found


def _kept_buffer(how, loop, namer):
    """The buffer that holds the value gathered: the whole gather's, the loop's result that its
    chunks are already written into, or a new one the loop is to fill."""
    kind, g, *s = how
    if kind == "whole":
        return g.into
    xs, d = s[0].ins[0], g.into
    whole = next((r.whole for r in loop.results if r.chunk is d), None)
    if whole is not None:
        return whole
    return Value(namer(xs.name.removesuffix("_split") + "_kept"), TensorType(xs.type.shape, d.type.dtype, d.type.layout))


def _keeping(loop, how, full, namer, mesh):
    """The loop with each chunk it gathers written into its slice of `full`, a loop result: by the
    Allgather itself where that slice is contiguous, else copied there from the pool slot at the end
    of the chunk's step (on its stream, after the GEMM that reads the slot as before)."""
    _, g, s = how
    d, ax = g.into, s.attrs["axis"]
    if any(r.chunk is d for r in loop.results):
        return loop
    if math.prod(local_shape(full, mesh)[:ax]) == 1:
        return replace(loop, results=loop.results + (LoopResult(d, full, ax),))
    chunk = Value(namer(full.name + "_i"), d.type)
    body = loop.body + (Instr(Op.ALLOCATE, (chunk,)), Instr(Op.COPY, (), (d,), into=chunk))
    return replace(loop, body=body, results=loop.results + (LoopResult(chunk, full, ax),))


def _viewed(g, full, mesh):
    """The marked Allgather g as a View of `full` (the value it gathers, gathered), where that view
    is one the reshape rule gives g's layout; else None."""
    y = g.into
    view = Instr(Op.VIEW, (y,), (full,), {"shape": y.type.shape, "kept": f"allgather over {g.attrs['team']} "
                                                                          "(the forward's)"})
    if y.type.layout.mesh != mesh or full.type.layout.mesh != mesh:
        return None
    try:
        same = infer(replace(view, op=Op.RESHAPE), [full.type.layout]).on(None) == y.type.layout.on(None)
    except ValueError:  # (no sharding maps that reshape)
        return None
    return view if same else None
