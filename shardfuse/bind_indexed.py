"""The executor's binders of the steps that index with integers read when the plan runs (entries of
executor.BIND): Take and ScatterAdd (rows of a table at ids), DynamicSlice and DynamicUpdateSlice (a
box at starts held in 0-d buffers: the backend reads them on its device, never the host).  Each takes
the Executable and returns the backend's step."""
from __future__ import annotations

from shardfuse.ops import Op


def bind_rows(exe, i, env, stream, devices):
    """Take and ScatterAdd: (table or values, ids, rows) -> into, over a vocabulary of `vocab` rows."""
    bind = exe.backend.bind_take if i.op == Op.TAKE else exe.backend.bind_scatter_add
    a, ids, rows = (exe.refs[v] for v in i.ins)
    return bind(a, ids, rows, exe.refs[i.into], stream, i.attrs["vocab"], devices=devices)


def bind_box(exe, i, env, stream, devices):
    """DynamicSlice (operand, *starts -> into, the box) and DynamicUpdateSlice (update, *starts -> the box
    of into): `starts` per axis a static start, or None for the next 0-d start buffer."""
    bind = exe.backend.bind_dynamic_slice if i.op == Op.DYNAMIC_SLICE else exe.backend.bind_update_slice
    a, *starts = (exe.refs[v] for v in i.ins)
    return bind(a, tuple(starts), exe.refs[i.into], i.attrs["starts"], stream, devices=devices)


INDEXED = {Op.TAKE: bind_rows, Op.SCATTER_ADD: bind_rows, Op.DYNAMIC_SLICE: bind_box, Op.DYNAMIC_UPDATE_SLICE: bind_box}
