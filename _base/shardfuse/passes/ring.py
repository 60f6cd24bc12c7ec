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

from shardfuse.rules import rule
from shardfuse.ops import Op
from shardfuse.schedule import axis_of, is_ring
from shardfuse.streams import MAIN, Stream


def lower_ring(prog):
    namer = Namer.for_program(prog)
    producer = {o: i for i in prog.instrs for o in i.outs}
    ring_sets = set()
    blocks = {}
    for i in prog.instrs:
        if i.op == Op.MATMUL and is_ring(i):
            gathered = i.ins[0]
            s = producer.get(gathered)
            if s is None or s.op != Op.SET:
                raise ValueError(f"algorithm='ring': {i.outs[0].name} needs its first operand gathered from shards")
            ring_sets.add(s)
            blocks[i] = _ring_block(i, s, prog, namer)
        elif is_ring(i):
            o = i.outs[0]
            raise ValueError(f"algorithm='ring' streams the result of a matmul along its row (or batch) axis, "
                             f"where A's shards travel the ring; {o.name} = {i.op}(...) is no such result: stream "
                             f"the matmul's output instead, sf.stream(a @ b, axis=0, algorithm='ring') (elementwise ops of "
                             f"one product, such as + bias or sf.gelu, may wrap it inside the stream)")
    out = []
    for i in prog.instrs:
        if i in ring_sets:
            continue
        out.extend(blocks.get(i, [i]))
    return prog.with_instrs(out, "lower_ring")


def _ring_block(mm, gather, prog, namer):
    c, b = mm.outs[0], mm.ins[1]
    a = gather.ins[0]
    k = axis_of(mm)
    ka = rule(Op.MATMUL, "axis_map")(mm, k)[0]
    team = a.type.layout.axes[ka]
    if team is None:
        raise ValueError(f"algorithm='ring' streams axis {k} of {c.name}, but {a.name} is not sharded on axis {ka}")
    if c.type.layout.mesh != prog.mesh or a.type.layout.mesh != prog.mesh:
        raise ValueError(f"algorithm='ring' on a value of a sub-mesh ({c.name}) is not supported: use the default "
                         "algorithm there, or the ring on the whole mesh")
    if isinstance(team, tuple) and len(team) > 1:
        raise ValueError(f"algorithm='ring' passes the shards of {a.name} around one mesh axis, but its axis {ka} is "
                         f"sharded over several {team}: shard it over one, or use the default algorithm")
    gathered, b_lay = mm.ins[0].type.layout, b.type.layout
    if gathered != a.type.layout.with_axis(ka, None) or b_lay.axes[-2] is not None \
            or b_lay.partial or c.type.layout.partial:
        raise ValueError(
            f"algorithm='ring' passes shards of A along the streamed axis {ka} and multiplies each by a B that is "
            f"whole along K: here {a.name} is {a.type.layout.placements(prog.mesh)} and B {b.name} is "
            f"{b_lay.placements(prog.mesh)}, so the matmul would contract a sharded K instead; replicate B "
            f"(sf.replicate(b)) or shard it on N, or use the default algorithm")
    if b.type.ndim > 2 and ka < a.type.ndim - 2:
        raise ValueError(f"algorithm='ring' streams the batch axis {ka} of {a.name}, but B {b.name}{b.type.shape} has "
                         "batch axes too, so each block of A would need its own block of B: use the default "
                         "algorithm, or a 2-D B")
    d = prog.mesh.axis_size(team)
    if c.type.shape[k] != d:
        raise ValueError(f"algorithm='ring': the stream axis of {c.name} must have one chunk per device ({d}), "
                         f"got {c.type.shape[k]}")
    comm, compute = 0, 1 % prog.streams
    block_shape = a.type.shape[:ka] + (a.type.shape[ka] // d,) + a.type.shape[ka + 1:]
    block_type = TensorType(block_shape, a.type.dtype, a.type.layout.with_axis(ka, None))
    pool = Value(namer(a.name + "_ring"), block_type)
    first, cur, nxt = (Value(namer(a.name + s), block_type) for s in ("_ring_0", "_i", "_next"))
    chunk_type = TensorType(c.type.shape[:k] + (1,) + c.type.shape[k + 1:], c.type.dtype, c.type.layout)
    c_i = Value(namer(c.name + "_i"), chunk_type)
    entry, arrived, done = Value(namer("entry"), "Event"), Value(namer("arrived"), "Event"), \
        Value(namer("done"), "Event")
    h = Value(namer("sr"), "Comm")
    step = Idx("i")
    later, not_last = ("i", ">", 0), ("i", "<", d - 1)

    def on(stream):
        return Instr(Op.SET_STREAM, attrs={"stream": Stream(stream)})

    body = (
        on(comm), Instr(Op.WAIT_EVENT, ins=(entry,)),
        Instr(Op.WAIT_EVENT, ins=(done,), attrs={"index": Idx("i", offset=-1), "when": later}),
        Instr(Op.SELECT, (cur,), (pool,), {"index": Idx("i", 2)}),
        Instr(Op.SELECT, (nxt,), (pool,), {"index": Idx("i", 2, offset=1)}),
        Instr(Op.SENDRECV, (h,), (cur,), {"team": team, "shift": 1, "when": not_last}, into=nxt),
        Instr(Op.WAIT, ins=(h,), attrs={"when": not_last}),
        Instr(Op.RECORD_EVENT, (arrived,), attrs={"stream": Stream(comm), "index": step}),
        on(compute), Instr(Op.WAIT_EVENT, ins=(entry,)),
        Instr(Op.WAIT_EVENT, ins=(arrived,), attrs={"index": Idx("i", offset=-1), "when": later}),
        Instr(Op.SLICE, (c_i,), (c,), {"axis": k, "index": Idx("i", d, ring=team)}),
        Instr(Op.MATMUL, (), (cur, b), into=c_i),
        Instr(Op.RECORD_EVENT, (done,), attrs={"stream": Stream(compute), "index": step}),
        Instr(Op.SET_STREAM, attrs={"stream": MAIN}),
        Instr(Op.SYNCHRONIZE, attrs={"stream": Stream(comm)}),
        Instr(Op.SYNCHRONIZE, attrs={"stream": Stream(compute)}),
    )
    loop = Instr(Op.FOR, attrs={"var": "i", "extent": d, "scheduled": True}, body=body)
    return [
        Instr(Op.ALLOCATE, (pool,), attrs={"pool": 2, "ring": True}),
        Instr(Op.SELECT, (first,), (pool,), {"index": 0}),
        Instr(Op.COPY, (), (a,), into=first),
        Instr(Op.ALLOCATE, (c,)),
        Instr(Op.RECORD_EVENT, (entry,), attrs={"stream": MAIN}),
        loop,
    ]
