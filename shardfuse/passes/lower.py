"""lower_to_host: array-level instructions become host-level ones that write into buffers.

Each `set` (a resharding) becomes the steps of DTensor's case table that `reshard_steps`
(passes/reshard_plan.py) plans: Allgather, ShardSlice, Allreduce, ReduceScatter, AllToAll.
A `set` between two meshes (pipeline stages: `mesh.submesh(...)`) moves data point to point,
with nvFuser's names: SendRecv (same placement, same size: device p to device p), Broadcast
(replicated, from the source's first device), Scatter (replicated -> sharded), Gather (sharded ->
the destination's first device, then Broadcast or Scatter within the destination).
and becomes those steps, each collective followed by its Wait.  Compute ops become
`Allocate` + `<Op> out <- inputs`.
"""
from __future__ import annotations

import itertools
import math

from dataclasses import replace

from shardfuse.dtypes import order_key_dtype as key_dtype
from shardfuse.ir import Instr, Namer, Value
from shardfuse.layout import Layout, mesh_axes
from shardfuse.passes.reshard_plan import reshard_steps
from shardfuse.ops import HOST_ONLY, Op, Reduce


def lower_to_host(prog):
    namer = Namer.for_program(prog)
    return prog.with_instrs(_lower(prog.instrs, namer, prog.mesh), "lower_to_host")


def _lower(instrs, namer, mesh, results=()):
    out = []
    for i in instrs:
        if i.op == Op.FOR:
            out.append(replace(i, body=tuple(_lower(i.body, namer, mesh, {r.chunk for r in i.results}))))
        elif i.op in (Op.SLICE, Op.VIEW, Op.TRANSPOSE, Op.SLICE_ARRAY) or i.op in HOST_ONLY or i.into is not None:
            out.append(i)
        elif i.op == Op.RESHAPE:  # a view of the local piece (the rule kept shards whole)
            out.append(Instr(Op.VIEW, i.outs, i.ins, {"shape": i.attrs["shape"]}))
        elif i.op == Op.SET:
            y = i.outs[0]
            steps = _lower_set(i.ins[0], y, namer, mesh)
            if i.attrs.get("keep"):  # (sf.grad's remat="keep": its gather may read the forward's, passes/keep.py)
                steps = [replace(s, attrs={**s.attrs, "keep": True}) if s.op == Op.ALLGATHER else s for s in steps]
            if y in results and steps[-1].op == Op.SHARD_SLICE:
                # a chunk that leaves its loop is written into its result; a ShardSlice only views
                view = Value(namer(y.name + "_view"), y.type)
                steps[-1] = replace(steps[-1], outs=(view,))
                steps += [Instr(Op.ALLOCATE, (y,)), Instr(Op.COPY, (), (view,), into=y)]
            out.extend(steps)
        elif i.op == Op.CONCAT:
            out += _lower_concat(i, namer)
        elif i.op == Op.DYNAMIC_UPDATE_SLICE:  # x copied into the result, then the box written (no copy
            o = i.outs[0]  # where x is donated: passes/donate.py)
            out += [Instr(Op.ALLOCATE, (o,)), Instr(Op.COPY, (), i.ins[:1], into=o),
                    Instr(i.op, (), i.ins[1:], i.attrs, into=o)]
        else:
            o = i.outs[0]
            out += [Instr(Op.ALLOCATE, (o,)), Instr(i.op, (), i.ins, i.attrs, into=o)]
    return out


def _lower_concat(i, namer):
    """Allocate the result, then Copy each input into its box of it (a SliceArray view: the axis of a
    concatenation is whole on every device, so a box's global offset is its local one)."""
    y, ax, at = i.outs[0], i.attrs["axis"], 0
    out = [Instr(Op.ALLOCATE, (y,))]
    for x in i.ins:
        box = Value(namer(f"{y.name}_{x.name}"), x.type.with_layout(y.type.layout))
        begin = tuple(at if j == ax else 0 for j in range(y.type.ndim))
        out += [Instr(Op.SLICE_ARRAY, (box,), (y,), {"begin": begin}), Instr(Op.COPY, (), (x,), into=box)]
        at += x.type.shape[ax]
    return out


def _lower_set(x, y, namer, mesh):
    if x.type.layout.mesh != y.type.layout.mesh:
        return _lower_move(x, y, namer, mesh)
    op = x.type.layout.partial_op
    if op != Reduce.SUM and key_dtype(x.type.dtype):  # pending maxima of floats: moved as integer keys
        kx = Value(namer(f"{x.name}_keys"), replace(x.type, dtype=key_dtype(x.type.dtype)))
        ky = Value(namer(f"{y.name}_keys"), replace(y.type, dtype=kx.type.dtype))
        return [Instr(Op.ALLOCATE, (kx,)), Instr(Op.ORDER_KEYS, (), (x,), {"value": op}, into=kx),
                *_lower_set(kx, ky, namer, mesh),
                Instr(Op.ALLOCATE, (y,)), Instr(Op.FROM_ORDER_KEYS, (), (ky,), {"value": op}, into=y)]
    where = x.type.layout.mesh
    steps = reshard_steps(x.type.layout, y.type.layout, x.type.layout.mesh, x.type.shape)
    if not steps:  # equal layouts (a streamed `set` that moves nothing): a copy keeps y a buffer of its own
        return [Instr(Op.ALLOCATE, (y,)), Instr(Op.COPY, (), (x,), into=y)]
    out, cur = [], x
    for n, (kind, m, ax, to_ax, lay) in enumerate(steps):
        lay = lay.on(where)
        last = n == len(steps) - 1
        nxt = y if last else Value(namer(f"{x.name}_{kind}"), x.type.with_layout(lay))
        if kind == Op.SHARD_SLICE:
            out.append(Instr(Op.SHARD_SLICE, (nxt,), (cur,), {"axis": ax, "team": m}))
        else:
            h = Value(namer({Op.ALLGATHER: "ag", Op.ALLREDUCE: "ar", Op.REDUCE_SCATTER: "rs", Op.ALLTOALL: "a2a"}[kind]),
                      "Comm")
            attrs = {"team": m} if ax is None else {"team": m, "axis": ax}
            if kind == Op.ALLREDUCE and x.type.layout.partial_op != Reduce.SUM:  # (printed: Allreduce ..., op=max)
                attrs["op"] = x.type.layout.partial_op
            if to_ax is not None:
                attrs["to_axis"] = to_ax
            out += [Instr(Op.ALLOCATE, (nxt,)), Instr(kind, (h,), (cur,), attrs, into=nxt), Instr(Op.WAIT, (), (h,))]
        cur = nxt
    return out


def _sharded_axis(sh):
    """The one tensor axis sh cuts (None: none), or "several"."""
    axes = [i for i, d in enumerate(sh.dims) if d]
    return "several" if len(axes) > 1 else axes[0] if axes else None


def _move_blocks(x, y, src, dst, namer, mesh, move):
    """A move between meshes by blocks (a stage of dp x tp, or blocks of other sizes): where both meshes
    cut x into the same blocks each device of y receives its block from a holder of it (SendRecv, the
    holders taken in turn); else x is cut on its own mesh into y's blocks first, or moved in its own
    blocks to y's mesh cut so and made y's there (whichever mesh's axes can cut them); None where
    neither can.  Both x and y cut some axis (the caller moves a whole value, or makes one, itself)."""
    ndim = y.type.ndim
    counts, want = [src.count(i) for i in range(ndim)], [dst.count(i) for i in range(ndim)]
    if counts == want:
        holders: dict = {}
        for d in src.mesh.devices:
            holders.setdefault(tuple(src.block(i, d) for i in range(ndim)), []).append(d)
        frm, taken = [], {}
        for d in dst.mesh.devices:
            b = tuple(dst.block(i, d) for i in range(ndim))
            k = taken[b] = taken.get(b, -1) + 1
            frm.append(holders[b][k % len(holders[b])])
        move("SendRecv", frm, dst.mesh.devices, y)
        return []
    cut = _cut_like(src.mesh, x.type.layout.axes, want)
    if cut is not None:  # cut into y's blocks where x lives, then sent
        mid = Value(namer(f"{x.name}_cut"), x.type.with_layout(Layout(cut, mesh=x.type.layout.mesh)))
        return _lower_set(x, mid, namer, mesh) + _lower_move(mid, y, namer, mesh)
    cut = _cut_like(dst.mesh, y.type.layout.axes, counts)
    if cut is None:
        return None
    there = Value(namer(f"{x.name}_moved"), y.type.with_layout(Layout(cut, mesh=y.type.layout.mesh)))
    return _lower_move(x, there, namer, mesh) + _lower_set(there, y, namer, mesh)  # (sent in x's blocks, then made y's)


def _cut_like(m, axes: tuple, counts: list):
    """Per tensor axis the mesh axes of m that cut a value into `counts` blocks along each axis, keeping
    as much of `axes` (the value's own) as can be: the most mesh axes left outermost where they are (the
    blocks they hold stay in place); None where no mesh axes of m cut so."""
    def kept(cut):
        return sum(len(list(itertools.takewhile(lambda p: p[0] == p[1], zip(mesh_axes(a), mesh_axes(c)))))
                   for a, c in zip(axes, cut))
    cuts = []
    for owner in itertools.product(range(-1, len(counts)), repeat=len(m.axis_names)):  # (mesh axis -> tensor axis)
        got = [[n for n, o in zip(m.axis_names, owner) if o == i] for i in range(len(counts))]
        if [math.prod(m.axis_size(n) for n in g) for g in got] == counts:
            for order in itertools.product(*(itertools.permutations(g) for g in got)):
                cuts.append(tuple(None if not g else g[0] if len(g) == 1 else g for g in order))
    return max(cuts, key=kept, default=None)  # (the first of the best: every rank picks the same)


def _holders(sh, ax) -> list:
    """Per block of tensor axis ax (None: the whole value), in block order, the devices holding
    it: a value sharded over some mesh axes is replicated over the others, and over a tuple of
    mesh axes its blocks follow the tuple's order, not the devices' (Sharding.block)."""
    held: dict = {}
    for d in sh.mesh.devices:
        held.setdefault(0 if ax is None else sh.block(ax, d), []).append(d)
    return [held[b] for b in range(len(held))]


def _lower_move(x, y, namer, mesh):
    """x on one mesh -> y on another: Allreduce pending sums at the source, then point to point:
    block p of x's holders to the devices of y holding block p (same sharding), else gathered
    onto y's first device and spread from there (Scatter where every device of y holds a block
    of its own, else Broadcast and each device's local slice)."""
    out, cur = [], x
    src, dst = x.type.layout.sharding(mesh), y.type.layout.sharding(mesh)
    s_ax, d_ax = _sharded_axis(src), _sharded_axis(dst)  # (refused before any step)
    if dst.partial:  # (insert_resharding reduces sums before they move: each device would hold the whole sum)
        raise NotImplementedError(f"{y.name}: a pending sum moved between meshes ({dst.placements()})")
    if src.partial:  # reduce where the sums are, then move the smaller, whole value
        whole = Value(namer(f"{x.name}_reduced"), x.type.with_layout(replace(x.type.layout, partial=())))
        out += _lower_set(cur, whole, namer, mesh)
        cur = whole

    def move(kind, frm, to, target, axis=None):
        h = Value(namer(kind.lower()), "Comm")
        attrs = {"kind": kind, "from": tuple(frm), "to": tuple(to)}
        if axis is not None:
            attrs["axis"] = axis
        out.extend([Instr(Op.ALLOCATE, (target,)), Instr(Op.TRANSFER, (h,), (cur,), attrs, into=target),
                    Instr(Op.WAIT, (), (h,))])
        return target

    A, B = src.mesh.devices, dst.mesh.devices
    if "several" in (s_ax, d_ax):  # (a stage of several mesh axes: dp x tp)
        def whole(v):  # (v's value replicated on v's mesh)
            return Value(namer(f"{x.name}_whole"), v.type.with_layout(Layout((None,) * v.type.ndim, mesh=v.type.layout.mesh)))
        if s_ax is None:  # moved whole, then each device's block cut
            there = whole(y)
            return out + _lower_move(cur, there, namer, mesh) + _lower_set(there, y, namer, mesh)
        steps = None if d_ax is None else _move_blocks(cur, y, src, dst, namer, mesh, move)
        if steps is None:  # gathered whole where it is, then moved
            mid = whole(x)
            steps = _lower_set(cur, mid, namer, mesh) + _lower_move(mid, y, namer, mesh)
        return out + steps
    have, want = _holders(src, s_ax), _holders(dst, d_ax)
    if s_ax is None and set(B) <= set(A):  # every device of y holds x whole already: a copy of its own there
        whole = y if d_ax is None else \
            Value(namer(f"{x.name}_whole"), y.type.with_layout(Layout((None,) * y.type.ndim, mesh=y.type.layout.mesh)))
        out += [Instr(Op.ALLOCATE, (whole,)), Instr(Op.COPY, (), (cur,), into=whole)]
        return out if d_ax is None else out + _lower_set(whole, y, namer, mesh)  # (then its local slice)
    if s_ax is None and d_ax is None:
        move("SendRecv", A, B, y) if len(A) == len(B) else move("Broadcast", A[:1], B, y)
        return out
    if s_ax == d_ax and len(have) == len(want):  # block p from a holder of it to each device that wants it
        frm = [have[b][j % len(have[b])] for b, devs in enumerate(want) for j in range(len(devs))]
        move("SendRecv", frm, [d for devs in want for d in devs], y, s_ax)
        return out
    if s_ax is not None and d_ax is not None:  # blocks of other sizes or axes: none gathered onto one device
        steps = _move_blocks(cur, y, src, dst, namer, mesh, move)
        if steps is not None:
            return out + steps
    if s_ax is not None:  # gather onto the destination's first device
        root = mesh.root.submesh(B[:1])
        done = d_ax is None and len(B) == 1
        gathered = y if done else \
            Value(namer(f"{x.name}_gathered"), y.type.with_layout(Layout((None,) * y.type.ndim, mesh=root)))
        cur = move("Gather", [devs[0] for devs in have], B[:1], gathered, s_ax)
        if done:
            return out
        A = B[:1]
    if d_ax is None:
        move("Broadcast", A[:1], B, y)
    elif all(len(devs) == 1 for devs in want):  # every device of y holds a block of its own
        move("Scatter", A[:1], [devs[0] for devs in want], y, d_ax)
    else:  # replicated on y's mesh, then each device keeps its block (a local slice)
        whole = Value(namer(f"{x.name}_whole"),
                      y.type.with_layout(Layout((None,) * y.type.ndim, mesh=y.type.layout.mesh)))
        cur = move("Broadcast", A[:1], B, whole)
        out += _lower_set(cur, y, namer, mesh)
    return out
