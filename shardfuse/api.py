"""sf.shard and sf.replicate: one name for both worlds.  Inside an sf.jit function they annotate
a traced value (shardfuse.trace); on a concrete array they place it on a mesh and return an
sf.Array (shardfuse.array)."""
from __future__ import annotations

from typing import Any

from shardfuse import trace
from shardfuse.array import Array, replicated
from shardfuse.mesh import DeviceMesh


def shard(x: Any, axis: int, over: str | tuple = "DIDx", mesh: DeviceMesh | None = None) -> Any:
    """Place `axis` of x across the devices of mesh axis `over`, or of several mesh axes
    (``over=("dp", "tp")``: the first outermost, as JAX's ``P(("dp", "tp"))``).

    In a traced function this annotates a value (mesh=: a sub-mesh, a pipeline stage, the value
    moves to); on a concrete global array it returns an `sf.Array` holding this process' pieces
    (give `mesh`)."""
    if isinstance(x, trace.Traced):
        return trace.shard(x, axis, over, mesh)
    return Array.from_global(x, mesh, axis, over)


def replicate(x: Any, mesh: DeviceMesh | None = None) -> Any:
    """Replicated on every device (DTensor's Replicate()).  In a traced function this annotates
    x and forces the gathers (mesh=: a sub-mesh of the program's, replicated on its devices).
    On a concrete array (NumPy, CuPy, torch, JAX) with mesh=, returns an `sf.Array` that every
    device of mesh holds whole: place a weight once and pass it to every call."""
    if isinstance(x, trace.Traced):
        return trace.replicate(x, mesh)
    return replicated(x, mesh)
