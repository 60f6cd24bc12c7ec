"""sf.Arrays placed on a pipeline stage outside jit (`sf.shard(w, axis, mesh=stage)`), as the arrays of the
whole mesh that live on that stage: the form plans of the whole mesh take and return (jit.py, array_ops.py)."""
from __future__ import annotations

from shardfuse.runtime import backend_of


def on_root(x, mesh):
    """x, an sf.Array placed on a sub-mesh of `mesh` (sf.shard(w, axis, mesh=stage)), as the sf.Array of
    `mesh` living on that sub-mesh, the form plans of `mesh` take and return (a pipeline probe: a stage's
    weights placed so were refused by every program of the whole mesh): x's pieces where its devices
    are, a placeholder (never read) elsewhere: one element broadcast to the piece's shape, so it holds no
    memory (a review: a weight's size on every other device, each call); made once per x (the same
    buffers each call: a graph's pointers stay); not owned, so a donation writes a copy.  Else x."""
    if getattr(x, "shards", None) is None or x.mesh is mesh or not mesh.is_root or x.mesh.root != mesh or x.mesh == mesh:
        return x
    made = x.root_view
    if made is not None and made[0] is mesh and made[1] is x.shards and made[2].shards is made[3]:
        return made[2]
    lay, mine, spare, pieces = x.sharding.on(x.sharding.home(x.mesh)), dict(zip(x.mesh.local_devices, x.shards)), None, []
    for j, d in enumerate(mesh.local_devices):
        if d not in mine and spare is None:
            local = lay.local_shape(x.shape, mesh)
            spare = backend_of(mesh).empty(local, x.dtype_name, devices=())
        pieces.append(mine[d] if d in mine else spare[j])
    out = type(x)(mesh, x.shape, x.dtype_name, lay, pieces, x.pieces_contiguous)
    out.weak = x.weak
    x.root_view = (mesh, x.shards, out, pieces)
    return out
