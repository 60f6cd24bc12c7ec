"""lower_ring: the ring variant of the pipelined AllGather+GEMM (`sf.stream(..., algorithm="ring")`).

Instead of all-gathering each chunk, the D shards of A travel around the ring of the mesh
axis with point-to-point Send/Recv.  At step i each device multiplies the shard it holds,
block (rank - i) % D of the output, while it passes that shard on to rank + 1 and receives
the next from rank - 1.  Two streams: communication on Stream(0), GEMMs on Stream(1); a
double buffer holds the shard being multiplied and the one arriving.  Events order them:
the GEMM of step i waits until its shard `arrived[i - 1]`; the Send/Recv of step i, which
overwrites the buffer GEMM i - 1 read, waits until that GEMM is `done[i - 1]`.
"""
from __future__ import annotations

from shardfuse.ir import Idx, Instr, Namer, TensorType, Value
from shardfuse.layout import Layout
from shardfuse.mesh import STREAM
from shardfuse.rules import rule


def lower_ring(prog):
    namer = Namer.for_program(prog)
    producer = {o: i for i in prog.instrs for o in i.outs}
    ring_sets = set()
    blocks = {}
    for i in prog.instrs:
        if i.op == "matmul" and i.attrs.get("algorithm") == "ring":
            gathered = i.ins[0]
            s = producer.get(gathered)
            if s is None or s.op != "set":
                raise ValueError(f"algorithm='ring': {i.outs[0].name} needs its first operand gathered from shards")
            ring_sets.add(s)
            blocks[i] = _ring_block(i, s, prog, namer)
        elif i.attrs.get("algorithm") == "ring":
            o = i.outs[0]
            raise ValueError(f"algorithm='ring' streams the result of a matmul along its row (or batch) axis, "
                             f"where A's shards travel the ring; {o.name} = {i.op}(...) is no such result: stream "
                             f"the matmul's output instead, sf.stream(a @ b, axis=0, algorithm='ring')")
    out = []
    for i in prog.instrs:
        if i in ring_sets:
            continue
        out.extend(blocks.get(i, [i]))
    return prog.with_instrs(out, "lower_ring")


def _ring_block(mm, gather, prog, namer):
    c, b = mm.outs[0], mm.ins[1]
    a = gather.ins[0]
    k = c.type.layout.stream_axis()
    ka = rule("matmul", "axis_map")(mm, k)[0]
    team = a.type.layout.axes[ka]
    if team is None or team == STREAM:
        raise ValueError(f"algorithm='ring' streams axis {k} of {c.name}, but {a.name} is not sharded on axis {ka}")
    d = prog.mesh.axis_size(team)
    if c.type.shape[k] != d:
        raise ValueError(f"algorithm='ring': the stream axis of {c.name} must have one chunk per device ({d}), "
                         f"got {c.type.shape[k]}")
    comm, compute = 0, 1 % prog.streams
    block_shape = a.type.shape[:ka] + (a.type.shape[ka] // d,) + a.type.shape[ka + 1:]
    block_type = TensorType(block_shape, a.type.dtype, a.type.layout.placement().with_axis(ka, None))
    pool = Value(namer(a.name + "_ring"), block_type)
    first, cur, nxt = (Value(namer(a.name + s), block_type) for s in ("_ring_0", "_i", "_next"))
    chunk_type = TensorType(c.type.shape[:k] + (1,) + c.type.shape[k + 1:], c.type.dtype, c.type.layout.placement())
    c_i = Value(namer(c.name + "_i"), chunk_type)
    entry, arrived, done = Value(namer("entry"), "Event"), Value(namer("arrived"), "Event"), \
        Value(namer("done"), "Event")
    h = Value(namer("sr"), "Comm")
    step = Idx("i")
    later, not_last = ("i", ">", 0), ("i", "<", d - 1)

    def on(stream):
        return Instr("set_stream", attrs={"stream": f"Stream({stream})", "index": stream})

    body = (
        on(comm), Instr("wait_event", ins=(entry,)),
        Instr("wait_event", ins=(done,), attrs={"index": Idx("i", offset=-1), "when": later}),
        Instr("select", (cur,), (pool,), {"index": Idx("i", 2)}),
        Instr("select", (nxt,), (pool,), {"index": Idx("i", 2, offset=1)}),
        Instr("sendrecv", (h,), (cur,), {"team": team, "shift": 1, "when": not_last}, into=nxt),
        Instr("wait", ins=(h,), attrs={"when": not_last}),
        Instr("record_event", (arrived,), attrs={"stream": f"Stream({comm})", "index": step}),
        on(compute), Instr("wait_event", ins=(entry,)),
        Instr("wait_event", ins=(arrived,), attrs={"index": Idx("i", offset=-1), "when": later}),
        Instr("slice", (c_i,), (c,), {"axis": k, "index": Idx("i", d, ring=team)}),
        Instr("matmul", (), (cur, b), into=c_i),
        Instr("record_event", (done,), attrs={"stream": f"Stream({compute})", "index": step}),
        Instr("set_stream", attrs={"stream": "main"}),
        Instr("synchronize", attrs={"stream": f"Stream({comm})", "index": comm}),
        Instr("synchronize", attrs={"stream": f"Stream({compute})", "index": compute}),
    )
    loop = Instr("for", attrs={"var": "i", "extent": d, "results": {}, "scheduled": True}, body=body)
    return [
        Instr("allocate", (pool,), attrs={"pool": 2, "ring": True}),
        Instr("select", (first,), (pool,), {"index": 0}),
        Instr("copy", (), (a,), into=first),
        Instr("allocate", (c,)),
        Instr("record_event", (entry,), attrs={"stream": "main"}),
        loop,
    ]
