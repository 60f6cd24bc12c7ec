"""backend_of(mesh): the one place shardfuse/ reaches the backends (tests/test_architecture.py
pins it).  A mesh is geometry only; its backend (streams, communicators, library handles) is made
here on first use and kept on the mesh object itself, so it lives as long as the mesh, no longer:
no module-level table holds a mesh (or a GPU's streams and workspaces) alive.
"""
from __future__ import annotations

from shardfuse.backends import make_backend


def backend_of(mesh):
    """The backend instance for this process' devices of `mesh` (created once per mesh object).

    A sub-mesh in one process has a backend of its own, made for its devices (shared by equal
    sub-meshes of one root): the one that runs a program whose whole mesh is the sub-mesh
    (``sf.jit(f, mesh=mesh.submesh([0, 1]))``) and holds the arrays placed on it
    (``sf.shard(x, mesh=sub)``), one piece per device of the sub-mesh.  Under MPI a sub-mesh
    uses its root's backend, for placing and gathering arrays only."""
    be = mesh.__dict__.get("_backend")  # the hot path: one lookup (a call asks a few times)
    if be is None:
        root = mesh.root
        made = root.__dict__.setdefault("_backends", {})  # sub-mesh key -> backend, None: the root's
        key = None if mesh.is_root or mesh.nprocs > 1 else mesh.devices + mesh.axis_names
        be = made.get(key)
        if be is None:
            be = made[key] = make_backend(root if key is None else mesh)
        mesh.__dict__["_backend"] = be
    return be
