"""bucket_allreduces: gradients summed a bucket at a time (PyTorch DDP's and Megatron's gradient
buckets), not one Allreduce each.

With the batch sharded over a data-parallel axis and the weights replicated over it, every
weight's gradient ends in an Allreduce of its own over that axis: many small collectives, each
paying a whole one's latency.  This pass merges top-level Allreduces of one team (or one chain of
teams: a bias replicated over dp and tp is summed over dp, then over tp), dtype and operator
whose inputs do not depend on one another's results:

- where each member's Allreduce stood, its input is copied into its box of one flat buffer
  (`Copy x_packed <- x`, x_packed a view of a SliceArray of the bucket);
- the bucket's Allreduce (printed `bucket=N`, N members) is issued right after the last member
  is copied in;
- its Wait, and the copies out (`Copy y <- y_summed`), go just before the first step that reads
  a member's result (for gradients, usually the end of the plan), so the bucket runs under the
  rest of the backward.

Where it runs beside the backward: MPI's Iallreduce progresses while the host issues the steps
after it; on GPUs (NCCL, or a virtual-device team's kernels) a collective runs on the stream it is
issued on, so the bucket goes on a communication stream of its own, as DDP's does (Stream(streams),
see _rewrite: Stream(4) under sf.jit's default streams=4).  The main stream records `ready` after
the last copy in; the side stream waits for it and runs the bucket's Allreduce (each team's, in
turn), and the plan goes back to main at once, which issues the rest of the backward without
waiting; at the wait point main joins the side stream (`Synchronize`) before the copies out:

    bucket_dp_summed = Allocate f32[...]
    ready = RecordEvent main
    SetCurrentStream Stream(4)
    WaitEvent ready
    ar_bucket = Allreduce bucket_dp_summed <- bucket_dp, team=dp, bucket=13
    SetCurrentStream main
    ...                                  (the backward's GEMMs, on main, beside it)
    Wait ar_bucket
    Synchronize Stream(4)
    Copy y <- y_summed

A gradient alone in its bucket (the cap reached, a key of its own, DDP's bucket of one large
layer) has nothing to merge with, so no flat buffer and no copies: its Allreduce, as it stands,
goes on the same side stream the same way (fork, Allreduce, back to main; Wait and join where its
result is first read), so it too runs under the rest of the backward instead of holding main up.
Only where main has no work before that first read (the loss' sum, read at once to seed the
backward; a last gradient with nothing after it) is it left on main, waited for at once, as
before: a fork and a join would overlap nothing.

passes/reuse.py knows this shape and keeps sharing buffers around it (its doc says why that is
safe); on the NumPy backends the stream steps are nothing and steps run in issue order.

A bucket holds at most SHARDFUSE_BUCKET_MB megabytes of each device's inputs (DDP's
bucket_cap_mb, default 25); SHARDFUSE_BUCKET_MB=0 turns the pass off.  An Allreduce sums
elementwise, so every element is summed as before and results do not change.  Only top-level
collectives are merged (a stream loop's are pipelined chunk by chunk already), over teams of
more than one device (passes/fold.py makes the others views).
"""
from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field

from shardfuse.ir import Instr, Namer, TensorType, Value, local_shape, walk
from shardfuse.layout import Layout, shard_count
from shardfuse.ops import COMMUNICATION, Op, Reduce, STREAM_OPS, VIEWS
from shardfuse.passes.reuse import nbytes
from shardfuse.streams import MAIN, Stream

CAP_MB = 25  # DDP's default bucket_cap_mb


def cap_bytes() -> int:
    """The bucket size limit per device, from SHARDFUSE_BUCKET_MB (0: no bucketing)."""
    raw = os.environ.get("SHARDFUSE_BUCKET_MB", "").strip()
    try:
        mb = float(raw) if raw else CAP_MB
    except ValueError:
        raise ValueError(f"SHARDFUSE_BUCKET_MB must be a number of megabytes (0: no bucketing), got {raw!r}") from None
    return int(mb * 2 ** 20)


@dataclass
class _Unit:
    """One value's reduction: its chain of (Allreduce, Wait), one per team, at top-level positions."""
    start: int
    end: int
    steps: list
    dropped: set  # the positions it replaces: its Allreduces, Waits and intermediate sums' Allocates
    key: tuple  # (teams, operators, dtype, sub-mesh): what may share a bucket
    nbytes: int

    @property
    def x(self):
        return self.steps[0][0].ins[0]

    @property
    def y(self):
        return self.steps[-1][0].into


@dataclass
class _Bucket:
    key: tuple
    units: list = field(default_factory=list)
    aliases: set = field(default_factory=set)  # members' results and views of them
    nbytes: int = 0
    wait_at: int = -1  # the position its Wait and copies out go before


def bucket_allreduces(prog):
    cap = cap_bytes()
    if cap <= 0:
        return prog.with_instrs(prog.instrs, "bucket_allreduces")
    prog = prog.with_instrs(_final_reads_last(prog), "bucket_allreduces")
    buckets = _assign(prog.instrs, _units(prog), cap)
    if not buckets:
        return prog
    return prog.with_instrs(_rewrite(prog, buckets), "bucket_allreduces")


def _final_reads_last(prog) -> list:
    """The top-level steps moved to the end of the program, each with its Allocate, that read an
    Allreduce's result and make a value no step reads (a reduced bfloat16 gradient cast to its
    float32 parameter's dtype: only returned), or chains of them and their views (a 16-bit sum
    reduced in float32, cast to bfloat16, viewed, cast to float32).  Where it stood it would be the
    first read of the result and close its bucket at once: each such gradient alone in its bucket,
    waited for at once (a review: 6 blocking Allreduces where float32 gradients shared 2 buckets).
    Moved later, it reads the same values: nothing after it writes what it reads; and only a step
    that alone writes its result (not one of a Copy and a DynamicUpdateSlice writing one buffer)."""
    instrs = prog.instrs
    reduced = {i.into for i in instrs if i.op == Op.ALLREDUCE}
    readers: dict = {}
    for k, i in enumerate(instrs):
        for v in {v for j in walk([i]) for v in j.ins}:
            readers.setdefault(v, set()).add(k)
    written = Counter(i.into for i in walk(instrs) if i.into is not None)
    alloc_at = {i.outs[0]: k for k, i in enumerate(instrs) if i.op == Op.ALLOCATE}
    made = {}  # position -> the value the step makes, for the steps that may move
    for k, i in enumerate(instrs):
        if i.op in VIEWS and len(i.outs) == 1:
            made[k] = i.outs[0]
        elif (i.op not in PASSIVE and not i.body and not i.outs and i.into in alloc_at and written[i.into] == 1
              and all(written[v] <= 1 for v in i.ins)):
            made[k] = i.into
    moved = set(made)
    while True:  # (the steps whose values only moved steps read, each reading a reduced or a moved one's value)
        ours = reduced | {made[k] for k in moved}
        keep = {k for k in moved if not readers.get(made[k], set()) - moved and ours & set(instrs[k].ins)}
        if keep == moved:
            break
        moved = keep
    moved |= {alloc_at[made[k]] for k in moved if made[k] in alloc_at}
    return [i for k, i in enumerate(instrs) if k not in moved] + [instrs[k] for k in sorted(moved)]


def _step_at(instrs, k, mesh):
    """(Allreduce, its Wait) at positions k and k + 1, if it is one this pass may merge."""
    if k + 1 >= len(instrs):
        return None
    a, w = instrs[k], instrs[k + 1]
    if a.op != Op.ALLREDUCE or "when" in a.attrs or w.op != Op.WAIT or w.ins != a.outs:
        return None
    if shard_count(a.attrs["team"], a.ins[0].type.layout.mesh) < 2:
        return None
    return a, w


def _units(prog) -> dict:
    """start position -> _Unit, for every mergeable Allreduce (with the ones chained after it
    whose only reader is the next: dp then tp)."""
    instrs, mesh = prog.instrs, prog.mesh
    reads = Counter(v for i in walk(instrs) for v in i.ins) + Counter(prog.outputs)
    alloc_at = {i.outs[0]: k for k, i in enumerate(instrs) if i.op == Op.ALLOCATE}
    units, k = {}, 0
    while k < len(instrs):
        step = _step_at(instrs, k, mesh)
        if step is None:
            k += 1
            continue
        steps, dropped, end = [step], {k, k + 1}, k + 1
        while True:
            y, nxt = steps[-1][0].into, _step_at(instrs, end + 2, mesh)
            alloc = instrs[end + 1] if end + 1 < len(instrs) else None
            if not (nxt and alloc.op == Op.ALLOCATE and alloc.outs[0] is nxt[0].into and nxt[0].ins[0] is y
                    and reads[y] == 1 and y in alloc_at):
                break
            steps.append(nxt)
            dropped |= {alloc_at[y], end + 2, end + 3}
            end += 3
        x = step[0].ins[0]
        key = (tuple(a.attrs["team"] for a, _ in steps), tuple(a.attrs.get("op", Reduce.SUM) for a, _ in steps),
               x.type.dtype, x.type.layout.mesh)
        units[k] = _Unit(k, end, steps, dropped, key, nbytes(x, mesh))
        k = end + 1
    return units


def _assign(instrs, units, cap) -> list:
    """The buckets, each with the position its results are first needed at: those of two or more
    members, and those of one where work runs before that position (a lone Allreduce, issued as it
    stands on the side stream).  A member joins the open bucket of its key unless that would pass
    the cap; a step that reads a result of a bucket (or a view of one) closes it there, so no
    member's input can depend on another's result."""
    buckets, open_, pending, k = [], {}, [], 0
    while k < len(instrs):
        u, top = units.get(k), instrs[k]
        if u is None and top.op in VIEWS:  # a view of a result is no read yet
            for b in pending:
                if top.ins[0] in b.aliases:
                    b.aliases.add(top.outs[0])
            k += 1
            continue
        reads = {u.x} if u else {v for i in walk([top]) for v in i.values()}
        for b in [b for b in pending if b.aliases & reads]:
            b.wait_at = k
            pending.remove(b)
            if open_.get(b.key) is b:
                del open_[b.key]
        if u is None:
            k += 1
            continue
        b = open_.get(u.key)
        if b is None or b.nbytes + u.nbytes > cap:
            b = open_[u.key] = _Bucket(u.key)
            buckets.append(b)
            pending.append(b)
        b.units.append(u)
        b.aliases.add(u.y)
        b.nbytes += u.nbytes
        k = u.end + 1
    for b in pending:
        b.wait_at = len(instrs)
    return [b for b in buckets if len(b.units) > 1 or _work_beside(instrs, b.units[0], b.wait_at)]


PASSIVE = VIEWS | STREAM_OPS | COMMUNICATION | {Op.ALLOCATE, Op.WAIT}  # no device work of their own


def _work_beside(instrs, u, wait_at) -> bool:
    """Whether main has work to run between u's Allreduce and its result's first read.  Where it has
    none (the loss' sum, read at once to seed the backward) the side stream would only add a fork
    and a join: u stays on main as it stands."""
    return any(instrs[k].op not in PASSIVE for k in range(u.end + 1, wait_at))


def _flats(b, mesh, namer) -> list:
    """The bucket's flat buffers: what it sends, then the result of each team's Allreduce."""
    teams, ops, dtype, sub = b.key
    size = sum(_size(u.x, mesh) for u in b.units)
    out = []
    for j in range(len(teams) + 1):
        lay = Layout((None,), partial=teams[j:], mesh=sub, partial_op=ops[j] if j < len(teams) else Reduce.SUM)
        name = f"bucket_{'_'.join(teams)}" + ("_summed" if j == len(teams) else "" if j == 0 else f"_{teams[j - 1]}")
        out.append(Value(namer(name), TensorType((size,), dtype, lay)))
    return out


def _size(v, mesh) -> int:
    n = 1
    for e in local_shape(v, mesh):
        n *= e
    return n


def _box(flat, v, offset, size, suffix, namer) -> tuple:
    """(v's box of the flat buffer, shaped as v's local piece; the two views that make it)."""
    box = Value(namer(f"{v.name}_box"), TensorType((size,), flat.type.dtype, flat.type.layout))
    shaped = Value(namer(f"{v.name}_{suffix}"), v.type)
    return shaped, [Instr(Op.SLICE_ARRAY, (box,), (flat,), {"begin": (offset,)}),
                    Instr(Op.VIEW, (shaped,), (box,), {"shape": v.type.shape})]


def _fork(side, namer) -> list:
    """Main records `ready` and the side stream waits for it: what main wrote so far is done there."""
    ready = Value(namer("ready"), "Event")
    return [Instr(Op.RECORD_EVENT, (ready,), attrs={"stream": MAIN}), Instr(Op.SET_STREAM, attrs={"stream": side}),
            Instr(Op.WAIT_EVENT, ins=(ready,))]


def _issue(b, flats, side, namer) -> tuple:
    """(the bucket issued on stream `side`: its buffers, the fork from main, its Allreduces, one per
    team, each but the last waited for there, and the switch back to main; the last one's Wait)."""
    teams, ops = b.key[0], b.key[1]
    out = [Instr(Op.ALLOCATE, (f,)) for f in flats[1:]] + _fork(side, namer)
    h = None
    for j, (team, op) in enumerate(zip(teams, ops)):
        if h is not None:
            out.append(Instr(Op.WAIT, (), (h,)))
        h = Value(namer("ar_bucket"), "Comm")
        attrs = {"team": team, **({"op": op} if op != Reduce.SUM else {}), "bucket": len(b.units)}
        out.append(Instr(Op.ALLREDUCE, (h,), (flats[j],), attrs, into=flats[j + 1]))
    return out + [Instr(Op.SET_STREAM, attrs={"stream": MAIN})], Instr(Op.WAIT, (), (h,))


def _issue_lone(u, instrs, side, namer) -> tuple:
    """(a lone member issued on stream `side` as it stands: no flat buffer, so no copies in or out;
    its chain's Allocates before the fork (a side region holds only communication and Waits), its
    Allreduces, each but the last waited for there, and the switch back to main; the last's Wait)."""
    out = [instrs[k] for k in range(u.start, u.end + 1) if instrs[k].op == Op.ALLOCATE] + _fork(side, namer)
    for a, w in u.steps[:-1]:
        out += [a, w]
    return out + [u.steps[-1][0], Instr(Op.SET_STREAM, attrs={"stream": MAIN})], u.steps[-1][1]


def _rewrite(prog, buckets) -> list:
    mesh, namer = prog.mesh, Namer.for_program(prog)
    # The buckets' stream: the stream loops' workers are Stream(0) .. Stream(n - 1), n = min(streams,
    # extent), and the ring's Stream(0) and Stream(1 % streams), so Stream(streams) is none of theirs
    # (a bucket never queues behind a chunk of a loop issued after it, nor a chunk behind the
    # bucket).  All buckets share it, in issue order, as DDP's one communication stream.
    side = Stream(prog.streams)
    starts, drop, waits = {}, set(), {}
    for b in sorted(buckets, key=lambda b: b.units[-1].start):  # (waited for in the order issued)
        offset = 0
        for u in b.units:
            starts[u.start] = (b, u, offset)
            drop |= u.dropped if len(b.units) > 1 else set(range(u.start, u.end + 1))  # (lone: issued as it is)
            offset += _size(u.x, mesh)
        waits.setdefault(b.wait_at, []).append(b)
    flats, joins, out = {}, {}, []
    for k, top in enumerate(prog.instrs + (None,)):
        for b in waits.get(k, ()):  # the results are needed from here on
            # main joins the side stream right after the Wait (the shape passes/reuse.py relies on)
            out += [joins[id(b)], Instr(Op.SYNCHRONIZE, attrs={"stream": side})]
            for u in b.units if len(b.units) > 1 else ():  # (a lone one summed into its own result)
                shaped, views = _box(flats[id(b)][-1], u.y, starts[u.start][2], _size(u.x, mesh), "summed", namer)
                out += views + [Instr(Op.COPY, (), (shaped,), into=u.y)]
        if top is None:
            break
        if k in starts and len(starts[k][0].units) == 1:
            issued, joins[id(starts[k][0])] = _issue_lone(starts[k][1], prog.instrs, side, namer)
            out += issued
        elif k in starts:  # a member: its input copied into the bucket where its Allreduce stood
            b, u, offset = starts[k]
            if u is b.units[0]:
                flats[id(b)] = _flats(b, mesh, namer)
                out.append(Instr(Op.ALLOCATE, (flats[id(b)][0],)))
            shaped, views = _box(flats[id(b)][0], u.x, offset, _size(u.x, mesh), "packed", namer)
            out += views + [Instr(Op.COPY, (), (u.x,), into=shaped)]
            if u is b.units[-1]:  # the last input is in: issue the bucket now
                issued, joins[id(b)] = _issue(b, flats[id(b)], side, namer)
                out += issued
        if k not in drop:
            out.append(top)
    return out
