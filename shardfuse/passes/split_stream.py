"""split_stream_axes: make `sf.stream(x, axis, chunks=S)` a real axis of extent S.

The natural layout `x[M, K]` sharded on rows, `sf.stream(x @ w, axis=0, chunks=S)` becomes
the seed's form: x viewed as [D, S, m, K] (D the sharded factor), the product computed as
[D, S:Stream, m, N], and viewed back to [M, N].  Views are free: no data moves.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import replace

from shardfuse.ir import Instr, Namer, TensorType, Value, substitute
from shardfuse.ops import ELEMENTWISE, LOCAL_SCANS, Op
from shardfuse.layout import Layout, shard_count
from shardfuse.rules import rule
from shardfuse import schedule
from shardfuse.schedule import scheduled


def _split(shape, axes, ax, factors, new_axes):
    return (shape[:ax] + factors + shape[ax + 1:], axes[:ax] + new_axes + axes[ax + 1:])


def _sharded_inputs(i, amap):
    """Inputs of i whose axis mapped to the stream axis is sharded (placement, not schedule)."""
    return [v for v, a in zip(i.ins, amap) if a is not None and v.type.layout.axes[a] is not None]


def _shard_count(i, amap, mesh_axis, lay, k, mesh) -> int:
    """How many shards mesh_axis cuts the stream axis into, on the mesh of each value it shards
    there (a move between meshes reads one mesh and writes another): they must agree."""
    counts = {v.type.layout.sharding(mesh).count(a) for v, a in zip(i.ins, amap)
              if a is not None and v.type.layout.axes[a] == mesh_axis}
    if lay.axes[k] is not None:
        counts.add(lay.sharding(mesh).count(k))
    if len(counts) > 1:
        raise ValueError(f"the stream axis of {i.outs[0].name} is sharded {sorted(counts)} ways on the meshes it moves "
                         "between: stream it before or after the move, not on it")
    return counts.pop() if counts else 1


def _split_attrs(i, amap, k, n):
    """The op's attributes once its stream axis k (input axis amap[0]) is split into n axes."""
    if i.op == Op.TRANSPOSE:  # output axis j reads input axis perm[j]; axes after the split shift by n - 1
        a = amap[0]
        perm = []
        for j, p in enumerate(i.attrs["perm"]):
            perm += [a + t for t in range(n)] if j == k else [p + (n - 1 if p > a else 0)]
        return {**i.attrs, "perm": tuple(perm)}
    if i.op == Op.SUM:
        ax = i.attrs["axis"]
        return {**i.attrs, "axis": ax + (n - 1 if ax > amap[0] else 0)}
    if (i.op in (Op.SLICE_ARRAY, Op.CONCAT) or i.op in LOCAL_SCANS) and amap[0] is None:
        how = {Op.CUMSUM: "sums along", Op.ARGSORT: "sorts along", Op.PERMUTE: "permutes"}.get(i.op, "cuts or joins")
        raise ValueError(f"sf.stream(..., chunks=) of {i.outs[0].name} along the axis its {i.op} {how} is not "
                         "supported: stream another axis, or the value before the op, or its consumer")
    if i.op == Op.SLICE_ARRAY:  # (an uncut axis: begin 0, step 1, for each axis it splits into)
        a = amap[0]
        return {key: v[:a] + (v[a],) * n + v[a + 1:] if isinstance(v, tuple) else v for key, v in i.attrs.items()}
    if i.op == Op.CONCAT:
        ax = i.attrs["axis"]
        return {**i.attrs, "axis": ax + (n - 1 if ax > amap[0] else 0)}
    if i.op == Op.SCATTER_ADD and amap[2] is not None:  # (its rows: each chunk would scatter into a range)
        raise ValueError(f"sf.stream(...) of {i.outs[0].name}, a scatter_add, along its rows is not supported: "
                         "stream another axis, or its consumer")
    if i.op == Op.RESHAPE:
        raise ValueError(f"sf.stream(..., chunks=) of {i.outs[0].name}, the result of a reshape, is not supported: "
                         "stream the value before the reshape, or its consumer")
    return i.attrs


def _broadcast_view(v, ndim, k, n, namer, out):
    """A broadcast operand of an elementwise op whose axis k becomes n axes: NumPy aligns
    operands from the right, so it is viewed at the output's rank first, with n unit axes at k
    (else a (4, 2, 1) operand would meet the split axes of a (4, 2, 8) result, not its own)."""
    lay = v.type.layout
    pad = ndim - v.type.ndim
    shape, axes = (1,) * pad + v.type.shape, (None,) * pad + lay.axes
    shape, axes = _split(shape, axes, k, (1,) * n, (None,) * n)
    vv = Value(namer(v.name + "_split"), TensorType(shape, v.type.dtype, Layout(axes, lay.partial, mesh=lay.mesh)))
    out.append(Instr(Op.VIEW, (vv,), (v,), {"shape": shape}))
    return vv


def _splittable(p, a, chunks) -> bool:
    """Whether split_stream takes p streamed along its output axis a in `chunks` (its checks, before
    it would refuse): a matmul on a row or batch axis (rows only where B has no batch axes) or an
    elementwise op, the axis sharded over one entry at most, on one mesh, dividing into the chunks."""
    amap = rule(p.op, "axis_map")(p, a)
    if p.op == Op.MATMUL and (amap[0] is None or amap[1] is None and p.ins[1].type.ndim > 2):
        return False
    if p.op in LOCAL_SCANS and amap[0] is None:  # (a running sum along the stream axis: made whole before)
        return False
    o = p.outs[0]
    entries = {v.type.layout.axes[b] for v, b in zip(p.ins, amap) if b is not None} | {o.type.layout.axes[a]}
    entries.discard(None)
    if p.op not in ELEMENTWISE | {Op.MATMUL} or len(entries) > 1 or len({v.type.layout.mesh for v in p.ins}) > 1:
        return False
    if o.type.layout.axes[a] is not None and chunks is None:  # (as sf.stream says: a sharded axis needs chunks=)
        return False
    d = shard_count(entries.pop(), o.type.layout.mesh) if entries else 1
    return not isinstance(chunks, int) or o.type.shape[a] % (d * chunks) == 0


def stream_epilogue_producers(instrs, outputs) -> list:
    """A streamed elementwise op (an epilogue: + bias, an activation) streams the op that makes its
    operand too, where that operand is used only there: `sf.stream(relu(x @ w), axis=0)` puts the
    GEMM in the loop beside its collectives, as nvFuser inlines a producer into its consumer's
    stream loop (else the GEMM ran whole before the loop and nothing overlapped it).  Chains of
    epilogues stream back to their GEMM.  The collective algorithm only (the ring streams its
    product at trace time)."""
    uses = Counter(v for i in instrs for v in i.ins)
    uses.update(outputs)
    producer = {o: i for i in instrs for o in i.outs}
    given = {}  # instruction -> the schedule it is given
    for i in reversed(instrs):
        sched = given.get(i) or schedule.of(i)
        if sched is None or sched.ring or i.op not in ELEMENTWISE:
            continue
        for v, a in zip(i.ins, rule(i.op, "axis_map")(i, sched.axis)):
            p = producer.get(v)
            if (a is not None and p is not None and uses[v] == 1 and schedule.of(p) is None and p not in given
                    and v.type.shape[a] == i.outs[0].type.shape[sched.axis] and _splittable(p, a, sched.chunks)):
                given[p] = sched.on_axis(a, sched.chunks)
    return [replace(i, attrs=scheduled(i.attrs, given[i])) if i in given else i for i in instrs]


def _split_input(i, v, a, k, fac, mesh_axis, made, namer, out):
    """Operand v of i (its axis a maps to the stream axis k, split into `fac`) as i's chunks read it:
    a view (appended to out), the split form its producer made, or v itself where no axis maps."""
    o = i.outs[0]
    if a is None and i.op in ELEMENTWISE and isinstance(v.type, TensorType):
        v = _broadcast_view(v, o.type.ndim, k, len(fac), namer, out)
    if a is None:
        return v
    vl = v.type.layout
    d_axis = vl.axes[a] if vl.axes[a] == mesh_axis else None  # only an input sharded there keeps it
    shp, axs = _split(v.type.shape, vl.axes, a, fac, ((d_axis,) + (None,) * (len(fac) - 1)) if mesh_axis
                      else (None, None))
    split_type = TensorType(shp, v.type.dtype, Layout(axs, vl.partial, mesh=vl.mesh))
    if v in made and made[v].type == split_type:  # split the same way by its producer: read that, so the
        return made[v]                             # two line up in one stream loop
    vv = Value(namer(v.name + "_split"), split_type)
    out.append(Instr(Op.VIEW, (vv,), (v,), {"shape": shp}))
    return vv


def split_stream_axes(prog):
    namer = Namer.for_program(prog)
    out, alias = [], {}
    made = {}  # a split op's result viewed back -> its split form
    for i in stream_epilogue_producers(prog.instrs, prog.outputs):
        i = substitute([i], alias)[0]
        sched = schedule.of(i)
        if sched is None:
            out.append(i)
            continue
        o = i.outs[0]
        lay, ring = o.type.layout, sched.ring
        k, s = sched.axis, None if ring else sched.chunks
        amap = rule(i.op, "axis_map")(i, k)
        if not (s or ring) and not _sharded_inputs(i, amap):
            out.append(i)  # one chunk per index of an axis no input shards: the loop slices it directly
            continue
        if i.op == Op.MATMUL and amap[0] is None:
            raise ValueError("sf.stream(..., chunks=) on the N axis of a matmul is not supported: stream a row or batch axis")
        if i.op == Op.MATMUL and amap[1] is None and i.ins[1].type.ndim > 2:  # (B's batch axes would not line up)
            raise ValueError(f"sf.stream(..., chunks=) on the row axis {k} of {o.name} = {i.ins[0].name} @ "
                             f"{i.ins[1].name}, whose B has batch axes, is not supported: stream a batch axis, or the "
                             "rows of a matmul with a 2-D B")
        sharded = {v.type.layout.axes[a] for v, a in zip(i.ins, amap) if a is not None} - {None}
        if lay.axes[k] is not None:  # (the axis is sharded and streamed: chunks of each device's shard)
            sharded.add(lay.axes[k])
        if len(sharded) > 1:
            raise ValueError(f"the stream axis {k} of {o.name} is sharded over different mesh axes by it and its inputs "
                             f"{sorted(sharded, key=str)}: "
                             "stream it before or after the reshard, not on it")
        mesh_axis = sharded.pop() if sharded else None
        d = _shard_count(i, amap, mesh_axis, lay, k, prog.mesh)
        extent = o.type.shape[k]
        if s is None and not ring:
            # chunks omitted on an axis an input shards: one chunk per index of each device's shard.
            # Slicing single indices of the sharded axis itself would cut across shards.
            s = max(extent // d, 1)  # (an empty axis: one empty chunk)
        if ring:  # the ring's chunks are the shards: [D:Stream, m]
            if mesh_axis is None:
                raise ValueError(f"algorithm='ring' streams {o.name} along axis {k}, but no input shards that axis")
            if sched.chunks not in (None, d):
                raise ValueError(f"algorithm='ring' streams {o.name} in one chunk per device of {mesh_axis}: chunks "
                                 f"must be {d} (or omitted), got {sched.chunks}")
            if extent == d:
                out.append(i)
                continue
            s, fac = d, (d, extent // d)
        elif extent % (d * s):
            raise ValueError(f"stream chunks={s} on axis {k} of {o.name}{o.type.shape}: the extent {extent} must divide "
                             f"into {d} device(s) x {s} chunks")
        else:
            m = extent // (d * s)
            fac = (d, s, m) if mesh_axis else (s, m)
        new_ins = [_split_input(i, v, a, k, fac, mesh_axis, made, namer, out) for v, a in zip(i.ins, amap)]
        # the split output: [D, S:Stream, m] (D sharded as the axis was), or [S:Stream, m]
        split_axes, stream = ((lay.axes[k], None, None), k + 1) if mesh_axis and not ring else ((None, None), k)
        shp, axs = _split(o.type.shape, lay.axes, k, fac, split_axes)
        o_split = Value(namer(o.name + "_split"), TensorType(shp, o.type.dtype, Layout(axs, lay.partial, mesh=lay.mesh)))
        split = scheduled(_split_attrs(i, amap, k, len(fac)), sched.on_axis(stream))  # (one chunk per index of S)
        out.append(Instr(i.op, (o_split,), tuple(new_ins), split))
        o_back = Value(o.name, o.type)
        out.append(Instr(Op.VIEW, (o_back,), (o_split,), {"shape": o.type.shape}))
        alias[o], made[o_back] = o_back, o_split
    outputs = tuple(alias.get(v, v) for v in prog.outputs)
    return prog.with_instrs(out, "split_stream_axes", outputs=outputs)
