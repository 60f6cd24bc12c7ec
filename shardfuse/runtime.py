"""backend_of(mesh): the one place shardfuse/ reaches the backends (tests/test_architecture.py
pins it).  A mesh is geometry; its backend (streams, communicators, library handles) is made
here on first use and kept in the mesh object's declared `backend_cache` (mesh.py says why there,
not in a table here), so it lives as long as the mesh, no longer: no module-level table holds a
mesh (or a GPU's streams and workspaces) alive.
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
    be = mesh.backend_cache  # the hot path: one lookup (a call asks a few times)
    if be is None:
        root = mesh.root
        if mesh.is_root or mesh.nprocs > 1:
            be = root.backend_cache
            if be is None:
                be = root.backend_cache = make_backend(root)
        else:
            made = root.submesh_backend_cache  # (shape, devices, axis names) -> backend
            key = (mesh.shape, mesh.devices, mesh.axis_names)  # (a (2, 2) and a (1, 4) stage of the same
            # devices and names have other teams: keyed without the shape, one took the other's, a review)
            be = made.get(key)
            if be is None:
                be = made[key] = make_backend(mesh)
        mesh.backend_cache = be
    return be
