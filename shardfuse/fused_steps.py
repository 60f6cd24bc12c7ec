"""The executor's binder of fused steps (passes/fuse.py's Fused, passes/fuse_rows.py's FusedRows):
the step's expressions, operands and results handed to the backend as Refs."""
from __future__ import annotations

from shardfuse.ops import Op


def bind_fused(exe, i, env, stream, devices):
    """Fused or FusedRows step i bound on the backend of executor.Executable `exe` (a FusedRows step's
    further results are its `outs`, their Exprs attrs["more"])."""
    ins, out = [exe.refs[v] for v in i.ins], exe.refs[i.into]
    if i.op == Op.FUSED:
        return exe.backend.bind_fused(i.attrs["expr"], ins, out, stream, devices=devices)
    return exe.backend.bind_fused_rows(i.attrs["expr"], ins, out, stream, devices=devices,
                                       more=i.attrs.get("more", ()), more_outs=[exe.refs[v] for v in i.outs])
