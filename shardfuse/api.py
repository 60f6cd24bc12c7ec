"""sf.shard and sf.replicate: one name for both worlds.  Inside an sf.jit function they annotate
a traced value (shardfuse.trace); on a concrete array they place it on a mesh and return an
sf.Array (shardfuse.array)."""
from __future__ import annotations

from typing import Any

import numpy as np

from shardfuse import constants, trace, tree
from shardfuse.traced import Traced
from shardfuse.array import WEAK_TYPES, Array, replicated
from shardfuse.layout import Layout, layout_of
from shardfuse.mesh import DeviceMesh
from shardfuse.placements import Partial, Replicate, Shard
from shardfuse.spec import normalize_axis, normalize_over


def shard(x: Any, axis: int, over: str | tuple | None = None, mesh: DeviceMesh | None = None) -> Any:
    """Place `axis` of x across the devices of mesh axis `over` (default: the mesh's last axis,
    DIDx on an unnamed mesh), or of several mesh axes (``over=("dp", "tp")``: the first
    outermost, as JAX's ``P(("dp", "tp"))``).

    In a traced function this annotates a value (mesh=: a sub-mesh, a pipeline stage, the value
    moves to); on a concrete global array it returns an `sf.Array` holding this process' pieces
    (give `mesh`)."""
    if isinstance(axis, (tuple, list)):  # (a JAX-style spec or placements: sf.distribute's argument)
        raise TypeError(f"sf.shard(x, axis, over=...) takes one tensor axis, got {axis!r}: for a whole layout "
                        f"(JAX's PartitionSpec, DTensor's placements) write sf.distribute(x, mesh, {axis!r})")
    x = _captured(x, mesh)
    if isinstance(x, Traced):
        return trace.shard(x, axis, over, mesh)
    if isinstance(x, Array):  # resharded by the annotation rule (Layout.sharded), as inside sf.jit
        _same_mesh(x, mesh, "sf.shard")
        lay = x.sharding
        if lay.mesh is not None:  # moved off its sub-mesh to the whole mesh: sharded there as this states only
            lay = Layout.replicated(x.ndim)
        lay = lay.sharded(normalize_axis(axis, x.ndim, x.shape), normalize_over(over, x.mesh))
        return x.redistribute(list(lay.axes))
    return Array.from_global(x, mesh, axis, over)


def replicate(x: Any, mesh: DeviceMesh | None = None) -> Any:
    """Replicated on every device (DTensor's Replicate()).  In a traced function this annotates
    x and forces the gathers (mesh=: a sub-mesh of the program's, replicated on its devices).
    On a concrete array (NumPy, CuPy, torch, JAX) with mesh=, returns an `sf.Array` that every
    device of mesh holds whole: place a weight once and pass it to every call."""
    x = _captured(x, mesh)
    if isinstance(x, Traced):
        return trace.replicate(x, mesh)
    if isinstance(x, Array):
        _same_mesh(x, mesh, "sf.replicate")
        return x.full_array()
    return replicated(x, mesh)


def distribute(x: Any, mesh: DeviceMesh, placements: Any) -> Any:
    """x placed on mesh by DTensor-style placements (one `sf.Shard(dim)` / `sf.Replicate()` per
    mesh axis: DTensor's distribute_tensor), a JAX-style spec (one entry per tensor axis: None, a
    mesh axis name or a tuple of them: JAX's device_put with NamedSharding(mesh, P(...))) or a
    Layout (a plan's input_layouts / output_layouts).  On an sf.Array of that mesh, the same as
    x.redistribute(placements).  Inside sf.jit, a traced value annotated with that whole layout
    (JAX's with_sharding_constraint: axes not named replicated).  A pytree x: each leaf, with
    placements one for all or a pytree of them in x's structure (specs, as jax.device_put takes a
    pytree of shardings, or a plan's Layouts; a None there leaves its leaf as it is); a Python number placed
    stays weak, as there."""
    if isinstance(placements, Layout):
        if placements.partial:
            raise ValueError(f"sf.distribute: {placements} pends sums over {placements.partial}: no placement of a "
                             "whole value (a plan's layouts of its results never pend them)")
        if placements.mesh is not None and placements.mesh != mesh:  # (a sub-mesh's layout: placed there)
            mesh = placements.mesh
    if isinstance(x, Traced):
        return trace.constrain(x, placements, mesh)
    if tree.is_container(x):
        if placements is None:  # (a subtree left as it is: JAX's unspecified, a prefix's None)
            return x
        if _is_placement(placements) and not _leaf_specs_over(placements, x):  # (one for every leaf)
            return tree.tree_map(lambda v: distribute(v, mesh, placements), x)
        return _by_prefix(x, mesh, placements, ())
    if isinstance(placements, Layout):
        placements = list(placements.axes)
    if isinstance(x, Array):
        _same_mesh(x, mesh, "sf.distribute")
        return x.redistribute(placements)
    from shardfuse.interop import array_info

    placed = Array.from_layout(x, mesh, layout_of(placements, len(array_info(x).shape), mesh))
    placed.weak = type(x) in WEAK_TYPES  # (a Python number stays weak, as jax.device_put keeps it)
    return placed


def _captured(x, mesh):
    """x, a NumPy array placed with no mesh= while a function is traced (a table it closes over:
    jnp.asarray's use), as a constant of the program, which the annotation then places; else x as
    given (with mesh=, an sf.Array made once and captured with its layout: not bound from the host
    at every call, a review)."""
    builder = constants.active()
    return builder.constant(x) if builder is not None and mesh is None and isinstance(x, np.ndarray) else x


def _by_prefix(x, mesh, placements, path):
    """x's subtrees placed by a pytree of placements that is a prefix of x's structure (JAX's rule for
    shardings: a placement, or None for as it is, stands for a whole subtree)."""
    if placements is None or _is_placement(placements) and not _leaf_specs_over(placements, x):
        return x if placements is None else distribute(x, mesh, placements)
    where = "".join(f"[{k!r}]" for k in path) or "the top"
    if isinstance(placements, dict) and isinstance(x, dict):
        if set(placements) != set(x):
            raise ValueError(f"sf.distribute: the placements at {where} have keys {sorted(placements)}, the value "
                             f"{sorted(x)}: a pytree of placements must follow the value's structure (a prefix of it)")
        return type(x)({k: _by_prefix(x[k], mesh, placements[k], path + (k,)) for k in x})
    if isinstance(placements, (list, tuple)) and isinstance(x, (list, tuple)) and len(placements) == len(x):
        parts = [_by_prefix(v, mesh, p, path + (k,)) for k, (v, p) in enumerate(zip(x, placements))]
        return type(x)(*parts) if hasattr(type(x), "_fields") else type(x)(parts)
    raise ValueError(f"sf.distribute: the placements at {where} ({type(placements).__name__}) do not follow the value "
                     f"there ({type(x).__name__}{f' of {len(x)}' if isinstance(x, (list, tuple, dict)) else ''}): a "
                     "pytree of placements is a prefix of the value's, each leaf a placement or None")


def _leaf_specs_over(p, x) -> bool:
    """A plain tuple over a tuple or list of as many values, each entry None or a leaf's spec (no bare mesh
    axis name): a pytree of them, as JAX reads it ((None, None): each as it comes; (None, ("dp", "tp")) for
    a function's two results, a README probe), not one spec for every leaf (which sf.P(...) writes)."""
    return type(p) is tuple and isinstance(x, (list, tuple)) and len(x) == len(p) and \
        all(e is None or isinstance(e, (tuple, list, Layout)) for e in p)


def _is_placement(p) -> bool:
    """A Layout, DTensor-style placements or a JAX-style spec (entries None, mesh axis names or tuples
    of them), not a pytree of them: what one leaf is placed by."""
    if isinstance(p, Layout):
        return True
    if isinstance(p, list) and p and all(isinstance(e, (Shard, Replicate, Partial)) for e in p):
        return True
    return isinstance(p, tuple) and all(e is None or isinstance(e, str) or (  # (an sf.P is a leaf, no entry:
        type(e) is tuple and e and all(isinstance(n, str) for n in e)) for e in p)  # (P('dp'), P('tp')) is two)


def _same_mesh(x: Array, mesh, what: str) -> None:
    if mesh is not None and mesh != x.mesh:
        raise ValueError(f"{what}: the sf.Array lives on {x.mesh}, not {mesh}; move values between meshes inside "
                         "sf.jit with sf.to_mesh")
