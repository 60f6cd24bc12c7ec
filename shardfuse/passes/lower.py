"""lower_to_host: array-level instructions become host-level ones that write into buffers.

Each `set` (a resharding) is compared mesh axis by mesh axis with DTensor's case table:
  S(k) -> R    Allgather along k          R -> S(k)   ShardSlice (a local view, no communication)
  P    -> R    Allreduce                  P -> S(k)   ReduceScatter along k
  S(i) -> S(j) AllToAll
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
            lay = Layout(lay.axes, tuple(p for p in lay.partial if p != m), lay.chunks)
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
