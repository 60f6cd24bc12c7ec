"""Plan a resharding as a list of steps from DTensor's case table, one mesh axis per step.

The table (per mesh axis m):
  S(k) -> R    Allgather along k          R -> S(k)   ShardSlice (a local view, no communication)
  P    -> R    Allreduce                  P -> S(k)   ReduceScatter along k
  S(i) -> S(j) AllToAll
A tensor axis may be sharded over several mesh axes (an ordered tuple, outermost first).  A
step may only add or remove the innermost mesh axis of a tensor axis: that keeps every
intermediate a plain layout (each device's piece one block) and every collective one over the
local pieces as they lie.  Moving axis 0 from DIDx to DIDy on a 2-D mesh (`[R, S(0)] ->
[S(0), R]`) is then Allgather over DIDx and a ShardSlice over DIDy; the sequence is found by a
shortest-path search over layouts: fewest collectives first, then fewest elements moved per
device, then the table's order (slices, reductions, all-to-alls, gathers).
"""
from __future__ import annotations

import heapq
import math

from shardfuse.layout import Layout, axis_entry, mesh_axes, shard_count
from shardfuse.ops import Op, Reduce

ORDER = {Op.SHARD_SLICE: 0, Op.REDUCE_SCATTER: 1, Op.ALLREDUCE: 2, Op.ALLTOALL: 3, Op.ALLGATHER: 4}


def _with(axes, j, names):
    axes = list(axes)
    axes[j] = axis_entry(names)
    return tuple(axes)


def _moves(lay: Layout, shape, mesh, keep_partial):
    """(step, layout after) for every single table step from `lay`."""
    axes = lay.axes

    def fits(j, m, axes_=axes):
        return shape is None or shape[j] % (shard_count(axes_[j], mesh) * mesh.axis_size(m)) == 0

    def add(axes_, j, m):
        return _with(axes_, j, mesh_axes(axes_[j]) + (m,))

    for m in mesh.axis_names:
        if m in lay.partial:
            if m in keep_partial:
                continue
            rest = tuple(p for p in lay.partial if p != m)
            yield (Op.ALLREDUCE, m, None, None), Layout(axes, rest, partial_op=lay.partial_op)
            for j in range(len(axes) if lay.partial_op == Reduce.SUM else 0):  # (max / min: Allreduce, then a slice)
                if fits(j, m):
                    yield (Op.REDUCE_SCATTER, m, j, None), Layout(add(axes, j, m), rest)
            continue
        src = lay.mesh_axis_of(m)
        if src is None:
            for j in range(len(axes)):
                if fits(j, m):
                    yield (Op.SHARD_SLICE, m, j, None), Layout(add(axes, j, m), lay.partial)
        elif mesh_axes(axes[src])[-1] == m:  # only the innermost mesh axis of a tensor axis can leave it
            dropped = _with(axes, src, mesh_axes(axes[src])[:-1])
            yield (Op.ALLGATHER, m, src, None), Layout(dropped, lay.partial)
            for j in range(len(axes)):
                if j != src and fits(j, m, dropped):
                    yield (Op.ALLTOALL, m, src, j), Layout(add(dropped, j, m), lay.partial)


def _moved(kind, before: Layout, after: Layout, shape, mesh) -> int:
    """Elements a device sends or receives for one step (0 for a local slice)."""
    if kind == Op.SHARD_SLICE or shape is None:
        return 0
    local = {lay: math.prod(lay.local_shape(shape, mesh)) for lay in (before, after)}
    return local[after] if kind == Op.ALLGATHER else local[before]


def reshard_steps(src: Layout, dst: Layout, mesh, shape=None):
    """[(kind, mesh axis, tensor axis, target axis, layout after)] taking placement src to dst."""
    index = {m: k for k, m in enumerate(mesh.axis_names)}
    # (pending sums in the mesh's order: a sum pending over (DIDy, DIDx) is the one pending over (DIDx,
    # DIDy); a vocabulary sharded over both axes gave its lookup those two orders and no step between them)
    src, dst = (Layout(lay.axes, tuple(sorted(lay.partial, key=index.get)), partial_op=lay.partial_op)
                for lay in (src, dst))
    made = [m for m in dst.partial if m not in src.partial]
    if src.partial and dst.partial and src.partial_op != dst.partial_op:
        raise ValueError(f"cannot reshard pending {src.partial_op} values into pending {dst.partial_op} values")
    if made:  # a pending sum cannot be created by resharding, only by a contraction
        raise ValueError(f"cannot reshard {src.placements(mesh)} -> {dst.placements(mesh)} over {made[0]}")
    keep = set(dst.partial)
    start = (0, 0, ())  # (collectives, elements moved, table order of the steps)
    best = {src: start}
    heap = [(start, 0, src, ())]
    count = 0
    while heap:
        cost, _, lay, steps = heapq.heappop(heap)
        if lay == dst:
            return list(steps)
        if best.get(lay, cost) < cost:
            continue
        for step, nxt in _moves(lay, shape, mesh, keep):
            kind = step[0]
            c = (cost[0] + (kind != Op.SHARD_SLICE), cost[1] + _moved(kind, lay, nxt, shape, mesh),
                 cost[2] + ((ORDER[kind], index[step[1]]),))
            if nxt not in best or c < best[nxt]:
                best[nxt] = c
                count += 1
                heapq.heappush(heap, (c, count, nxt, steps + (step + (nxt,),)))
    raise ValueError(f"cannot reshard {src.placements(mesh)} -> {dst.placements(mesh)}: no sequence of "
                     f"table steps reaches it for shape {shape} on {mesh}")
