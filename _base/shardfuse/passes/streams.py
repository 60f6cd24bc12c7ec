"""assign_streams: put each chunk of a stream loop on a worker stream (nvFuser's stream pass).

Per chunk i: switch to Stream(i % n), wait (on the device) for what the main stream had
issued before the loop, run the chunk, switch back, and make the main stream wait on the
worker (event-based: the host never blocks).  Workers wait on an event recorded once before
the loop, not on the main stream as it is mid-loop: that stream has already joined earlier
chunks, and waiting on it would serialise the pipeline.
"""
from __future__ import annotations

from dataclasses import replace

from shardfuse.ir import Idx, Instr, Namer, Value
from shardfuse.ops import Op
from shardfuse.streams import MAIN, Stream


def assign_streams(prog):
    # (a plan with no loop may still switch streams at top level: a gradient bucket's, passes/bucket.py)
    if not any(i.op in (Op.FOR, Op.SET_STREAM) for i in prog.instrs):
        return prog.with_instrs(prog.instrs, "assign_streams")
    namer = Namer.for_program(prog)
    out = [Instr(Op.GET_STREAM, (Value("main", "Stream"),))]
    for i in prog.instrs:
        if i.op != Op.FOR or i.attrs.get("scheduled"):  # a loop that a pass scheduled itself (the ring)
            out.append(i)
            continue
        n = min(prog.streams, i.attrs["extent"])
        worker = {"stream": Stream(Idx("i", n))}
        entry = Value(namer("entry"), "Event")
        out.append(Instr(Op.RECORD_EVENT, (entry,), attrs={"stream": MAIN}))
        body = ([Instr(Op.SET_STREAM, attrs=worker), Instr(Op.WAIT_EVENT, ins=(entry,))] + list(i.body)
                + [Instr(Op.SET_STREAM, attrs={"stream": MAIN}), Instr(Op.SYNCHRONIZE, attrs=worker)])
        out.append(replace(i, body=tuple(body)))
    return prog.with_instrs(out, "assign_streams")
