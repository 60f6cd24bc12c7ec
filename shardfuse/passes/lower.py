"""lower_to_host: array-level instructions become host-level ones that write into buffers.

Each `set` (a resharding) is compared mesh axis by mesh axis with DTensor's case table:
  S(k) -> R    Allgather along k          R -> S(k)   ShardSlice (a local view, no communication)
  P    -> R    Allreduce                  P -> S(k)   ReduceScatter along k
  S(i) -> S(j) AllToAll
A `set` between two meshes (pipeline stages: `mesh.submesh(...)`) moves data point to point,
with nvFuser's names: SendRecv (same placement, same size: device p to device p), Broadcast
(replicated, from the source's first device), Scatter (replicated -> sharded), Gather (sharded ->
the destination's first device, then Broadcast or Scatter within the destination).
and becomes those steps, each collective followed by its Wait.  Compute ops become
`Allocate` + `<Op> out <- inputs`.
"""
from __future__ import annotations

from dataclasses import replace

from shardfuse.ir import HOST_ONLY, Instr, Namer, Value
from shardfuse.layout import Layout


def lower_to_host(prog):
    namer = Namer.for_program(prog)
    return prog.with_instrs(_lower(prog.instrs, namer, prog.mesh), "lower_to_host")


def _lower(instrs, namer, mesh):
    out = []
    for i in instrs:
        if i.op == "for":
            out.append(replace(i, body=tuple(_lower(i.body, namer, mesh))))
        elif i.op in ("slice", "view", "transpose") or i.op in HOST_ONLY or i.into is not None:
            out.append(i)
        elif i.op == "reshape":  # a view of the local piece (the rule kept shards whole)
            out.append(Instr("view", i.outs, i.ins, {"shape": i.attrs["shape"]}))
        elif i.op == "set":
            out.extend(_lower_set(i.ins[0], i.outs[0], namer, mesh))
        else:
            o = i.outs[0]
            out += [Instr("allocate", (o,)), Instr(i.op, (), i.ins, i.attrs, into=o)]
    return out


def reshard_steps(src: Layout, dst: Layout, mesh):
    """[(kind, mesh axis, tensor axis, target axis)] that take placement src to dst."""
    steps = []
    for m in mesh.axis_names:
        s_ax, d_ax = src.mesh_axis_of(m), dst.mesh_axis_of(m)
        s_p, d_p = m in src.partial, m in dst.partial
        if (s_ax, s_p) == (d_ax, d_p):
            continue
        if s_ax is not None and d_ax is None and not d_p:
            steps.append(("allgather", m, s_ax, None))
        elif s_ax is None and not s_p and d_ax is not None:
            steps.append(("shard_slice", m, d_ax, None))
        elif s_p and d_ax is None and not d_p:
            steps.append(("allreduce", m, None, None))
        elif s_p and d_ax is not None:
            steps.append(("reduce_scatter", m, d_ax, None))
        elif s_ax is not None and d_ax is not None and not s_p and not d_p:
            steps.append(("alltoall", m, s_ax, d_ax))
        else:  # a pending sum cannot be created by resharding, only by a contraction
            raise ValueError(f"cannot reshard {src.placements(mesh)} -> {dst.placements(mesh)} over {m}")
    # Slices first (less data to move), reductions before gathers (reduce the smaller tensor).
    order = {"shard_slice": 0, "reduce_scatter": 1, "allreduce": 2, "alltoall": 3, "allgather": 4}
    return sorted(steps, key=lambda s: order[s[0]])


def _lower_set(x, y, namer, mesh):
    if x.type.layout.mesh != y.type.layout.mesh:
        return _lower_move(x, y, namer, mesh)
    steps = reshard_steps(x.type.layout.placement(), y.type.layout.placement(), mesh)
    if not steps:  # only the schedule changes: a copy keeps y a buffer of its own
        return [Instr("allocate", (y,)), Instr("copy", (), (x,), into=y)]
    out, cur = [], x
    lay = x.type.layout
    for n, (kind, m, ax, to_ax) in enumerate(steps):
        if kind == "allgather":
            lay = lay.with_axis(ax, None)
        elif kind == "alltoall":
            lay = lay.with_axis(ax, None).with_axis(to_ax, m)
        elif kind == "shard_slice":
            lay = lay.with_axis(ax, m)
        else:
            lay = replace(lay, partial=tuple(p for p in lay.partial if p != m))
            if kind == "reduce_scatter":
                lay = lay.with_axis(ax, m)
        last = n == len(steps) - 1
        nxt = y if last else Value(namer(f"{x.name}_{kind}"), x.type.with_layout(lay))
        if kind == "shard_slice":
            out.append(Instr("shard_slice", (nxt,), (cur,), {"axis": ax, "team": m}))
        else:
            h = Value(namer({"allgather": "ag", "allreduce": "ar", "reduce_scatter": "rs", "alltoall": "a2a"}[kind]),
                      "Comm")
            attrs = {"team": m} if ax is None else {"team": m, "axis": ax}
            if to_ax is not None:
                attrs["to_axis"] = to_ax
            out += [Instr("allocate", (nxt,)), Instr(kind, (h,), (cur,), attrs, into=nxt), Instr("wait", (), (h,))]
        cur = nxt
    return out


def _sharded_axis(lay):
    axes = list(lay.placement().sharded_axes())
    if len(axes) > 1:
        raise NotImplementedError(f"moving a value sharded on several axes ({lay.placements(lay.mesh)}) between "
                                  "meshes is not supported yet")
    return axes[0] if axes else None


def _lower_move(x, y, namer, mesh):
    """x on one mesh -> y on another: Allreduce pending sums at the source, then point-to-point."""
    out, cur = [], x
    src, dst = x.type.layout.placement(), y.type.layout.placement()
    if src.partial:  # reduce where the sums are, then move the smaller, whole value
        whole = Value(namer(f"{x.name}_reduced"), x.type.with_layout(replace(src, partial=())))
        out += _lower_set(cur, whole, namer, mesh)
        cur, src = whole, whole.type.layout
    a_mesh, b_mesh = src.mesh or mesh, dst.mesh or mesh
    s_ax, d_ax = _sharded_axis(src), _sharded_axis(dst)

    def move(kind, frm, to, target, axis=None):
        h = Value(namer(kind.lower()), "Comm")
        attrs = {"kind": kind, "from": frm, "to": to}
        if axis is not None:
            attrs["axis"] = axis
        out.extend([Instr("allocate", (target,)), Instr("transfer", (h,), (cur,), attrs, into=target),
                    Instr("wait", (), (h,))])
        return target

    A, B = a_mesh.devices, b_mesh.devices
    if s_ax == d_ax and (s_ax is None or len(A) == len(B)):
        kind = "SendRecv" if len(A) == len(B) else "Broadcast"
        move(kind, A if kind == "SendRecv" else A[:1], B, y, s_ax)
        return out
    if s_ax is None:  # replicated -> sharded
        move("Scatter", A[:1], B, y, d_ax)
        return out
    # sharded -> anything else: gather onto the destination's first device, then spread
    root = mesh.root.submesh(B[:1])
    gathered = y if (d_ax is None and len(B) == 1) else \
        Value(namer(f"{x.name}_gathered"), y.type.with_layout(Layout((None,) * y.type.ndim, mesh=root)))
    cur = move("Gather", A, B[:1], gathered, s_ax)
    if gathered is not y:
        if d_ax is None:
            move("Broadcast", B[:1], B, y)
        else:
            move("Scatter", B[:1], B, y, d_ax)
    return out
