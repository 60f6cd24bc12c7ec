"""Stream pipelining: the pass that makes communication of one chunk overlap another's GEMM.

mark_stream_intermediates: a value made only to feed a stream-parallel op (the gathered A
  of the seed case) becomes stream-parallel itself on the axis that maps to the stream axis,
  so it is produced chunk by chunk instead of whole.
form_stream_loops: each run of consecutive stream-parallel instructions becomes one `for`
  loop over the chunks; inputs from outside are sliced per chunk, results are written into
  chunks of whole buffers (the loop's `results`, ir.LoopResult: chunk value, whole value, axis).  Later streamed consumers of a
  chunk the loop gathers for several of them join it (Q, K and V's GEMMs on the one Allgather of
  each chunk of x), with what lies between hoisted before the loop or deferred after it.
"""
from __future__ import annotations

from collections import defaultdict

from dataclasses import replace

from shardfuse.ir import Idx, Instr, LoopResult, Namer, TensorType, Value, walk

from shardfuse.ops import HOST_ONLY, LOCAL_SCANS, Op
from shardfuse.rules import rule
from shardfuse import schedule
from shardfuse.schedule import Schedule, axis_of, scheduled


def _chunk_axis(o, users, marked):
    """The axis of o that maps to the stream axis of every consumer of o, where all its
    consumers are stream-parallel, read o's chunks along one axis and have as many chunks
    (a value shared by several streamed consumers, share_resharding's gathered x of Q, K and V,
    is streamed for all of them at once); else None."""
    axes = set()
    for c in users:
        sched = marked.get(c) or schedule.of(c)
        if sched is None:
            return None
        amap = rule(c.op, "axis_map")(c, sched.axis)
        axes.update((amap[p], c.outs[0].type.shape[sched.axis]) for p, v in enumerate(c.ins) if v is o)
    if len(axes) != 1:
        return None
    ((j, extent),) = axes
    return j if j is not None and o.type.shape[j] == extent else None


def mark_stream_intermediates(prog):
    consumers = defaultdict(list)
    for i in prog.instrs:
        for v in dict.fromkeys(i.ins):
            consumers[v].append(i)
    outputs = set(prog.outputs)
    marked = {}  # instruction -> the schedule it is given
    for i in reversed(prog.instrs):
        if i.op == Op.VIEW or len(i.outs) != 1:
            continue
        o = i.outs[0]
        users = consumers[o]
        if o in outputs or schedule.of(i) is not None or not users:
            continue
        j = _chunk_axis(o, users, marked)
        if j is None or o.type.layout.axes[j] is not None:
            continue
        # its own inputs must be whole along that axis: a chunk of a sharded axis cuts across
        # shards (the value is then made whole, before the loop)
        if any(a is not None and v.type.layout.axes[a] is not None
               for v, a in zip(i.ins, rule(i.op, "axis_map")(i, j))):
            continue
        marked[i] = Schedule(j)
    instrs = [replace(i, attrs=scheduled(i.attrs, marked[i])) if i in marked else i for i in prog.instrs]
    return prog.with_instrs(instrs, "mark_stream_intermediates")


def _chunk_type(v, axis):
    t = v.type
    shape = t.shape[:axis] + (1,) + t.shape[axis + 1:]
    return TensorType(shape, t.dtype, t.layout)


def _stream_extent(i):
    """Number of chunks of an array-level instruction whose output is stream-parallel, else None."""
    k = axis_of(i)
    if i.op in HOST_ONLY or i.into is not None or not i.outs or k is None:
        return None
    # a view that merges axes into the stream axis, or cuts it, and a cumsum along it have no per-chunk
    # input: made whole
    cuts = i.op in (Op.RESHAPE, Op.SLICE_ARRAY, Op.CONCAT) or i.op in LOCAL_SCANS
    if cuts and all(a is None for a in rule(i.op, "axis_map")(i, k)):
        return None
    return i.outs[0].type.shape[k]


# The executor unrolls every loop at bind time, one step per chunk and device: a stream axis of
# 20000 indices with chunks omitted would issue 20000 steps per call for no gain in overlap.
MAX_STREAM_CHUNKS = 1024


def form_stream_loops(prog):
    namer = Namer.for_program(prog)
    instrs, out = list(prog.instrs), []
    k = 0
    while k < len(instrs):
        i = instrs[k]
        s = _stream_extent(i)
        if s is None:
            out.append(i)
            k += 1
            continue
        if s > MAX_STREAM_CHUNKS:
            o = i.outs[0]
            raise ValueError(f"{o.name}{o.type.shape} is streamed in {s} chunks: at most {MAX_STREAM_CHUNKS} (each "
                             f"chunk is a step of every call); give sf.stream(..., chunks=S) with fewer, larger chunks")
        group = [i]
        k += 1
        while k < len(instrs) and _stream_extent(instrs[k]) == s and _chunks_line_up(group, instrs[k]):
            group.append(instrs[k])
            k += 1
        hoisted, group, deferred, rest = _join_sharers(instrs, k, group, s)
        out += hoisted
        instrs[k:rest] = deferred
        later = {v for j in walk(instrs[k:]) for v in j.values()} | set(prog.outputs)  # loop bodies too (the ring)
        out.append(_make_loop(group, s, later, namer))
    return prog.with_instrs(out, "form_stream_loops")


def _join_sharers(instrs, k, group, s):
    """Later streamed consumers of a chunk the group makes (share_resharding's one Allgather of x
    for Q, K and V; a chunk's gather that a weight's whole gather separates from its GEMM) join its
    loop, so that each takes the chunk that one collective brought.  Between the group and the last of
    them (instrs[k:rest]), an instruction the loop does not feed and that is not streamed is
    hoisted before the loop (the Allgather of wk), any other is deferred after it.  Returns
    (hoisted, group, deferred, rest); nothing moves if no consumer joins.  A loop or host-level
    instruction ends the search."""
    shared = {o for j in group for o in j.outs}
    joined, hoisted, deferred = list(group), [], []
    blocked = {o for j in group for o in j.outs}  # made in the loop or after it
    late = set()  # made by a deferred instruction
    rest = k
    for n in range(k, len(instrs) if shared else k):
        j = instrs[n]
        if j.op in HOST_ONLY or j.into is not None or j.body:
            break
        deps = {v for x in walk([j]) for v in x.values()}
        if (_stream_extent(j) == s and deps & shared and not deps & late
                and _chunks_line_up(joined, j)):
            joined.append(j)
            shared.update(j.outs)
            blocked.update(j.outs)
            rest = n + 1
        elif _stream_extent(j) is None and not deps & blocked:
            hoisted.append(j)
        else:
            deferred.append(j)
            blocked.update(j.outs)
            late.update(j.outs)
    if rest == k:
        return [], group, [], k
    window = instrs[k:rest]
    return ([j for j in hoisted if j in window], joined, [j for j in deferred if j in window], rest)


def _chunks_line_up(group, i):
    """Whether i can take chunk i of each value the group makes: its rule maps its stream axis to
    that value's stream axis (a re-stream along another axis of the same extent cannot: it waits
    for the whole value, in a loop of its own)."""
    made = {o: axis_of(j) for j in group for o in j.outs}
    amap = rule(i.op, "axis_map")(i, axis_of(i))
    return all(a == made[v] for v, a in zip(i.ins, amap) if v in made)


def _make_loop(group, extent, used_later, namer):
    chunk, body, results = {}, [], []
    for i in group:
        o, ko = i.outs[0], axis_of(i)
        attrs = scheduled(i.attrs, None)  # (a chunk's step: the loop is the schedule)
        amap = rule(i.op, "axis_map")(i, ko)
        ins = []
        for v, a in zip(i.ins, amap):
            if v in chunk:
                ins.append(chunk[v])
            elif a is None:
                ins.append(v)
            else:
                vc = Value(namer(v.name + "_i"), _chunk_type(v, a))
                body.append(Instr(Op.SLICE, (vc,), (v,), {"axis": a, "index": Idx("i")}))
                ins.append(vc)
        oc = Value(namer(o.name + "_i"), _chunk_type(o, ko))
        if i.op in (Op.TRANSPOSE, Op.RESHAPE, Op.SLICE_ARRAY) and o in used_later:
            # a view writes nothing: a chunk that leaves the loop is copied into its result
            view = Value(namer(o.name + "_view_i"), oc.type)
            body += [Instr(i.op, (view,), tuple(ins), attrs), Instr(Op.SET, (oc,), (view,))]
        else:
            body.append(Instr(i.op, (oc,), tuple(ins), attrs))
        chunk[o] = oc
        if o in used_later:
            results.append(LoopResult(oc, o, ko))
    return Instr(Op.FOR, attrs={"var": "i", "extent": extent}, body=tuple(body), results=tuple(results))
