"""Layouts: how each axis of a global array is placed on the mesh.

A Layout gives, per tensor axis, one of: None (replicated), a mesh axis name (sharded over that
mesh axis, e.g. "DIDx") or an ordered tuple of mesh axis names (sharded over all of them, the
first the outermost, as JAX's `P(("dp", "tp"))`).  `partial` names mesh axes over which the
local values are partial sums still to be reduced.  When a value is produced (sf.stream) is no
part of it: that is the producing instruction's Schedule (shardfuse/schedule.py).
`sharding(mesh)` is the same on the mesh it lives on (shardfuse/sharding.py); placements in
DTensor's words (Shard(i) / Replicate() / Partial()) are derived from that.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from shardfuse.dtypes import short_name
from shardfuse.mesh import STREAM
from shardfuse.ops import Reduce
from shardfuse.sharding import Sharding


def mesh_axes(entry) -> tuple:
    """The mesh axes one tensor axis is sharded over, outermost first (() for None)."""
    if entry is None:
        return ()
    return entry if isinstance(entry, tuple) else (entry,)


def axis_entry(names):
    """The canonical entry for sharding over `names`: None, one name, or a tuple of two or more."""
    names = tuple(names)
    return None if not names else names[0] if len(names) == 1 else names


def free_axes(entry, used):
    """The mesh axes of `entry` not in `used` (None, one name or a tuple, as layouts write them)."""
    return axis_entry(n for n in mesh_axes(entry) if n not in used) if entry is not None else None


def unshard(axes, pending, stream=None) -> list:
    """A mesh axis that holds pending sums cannot also shard an axis: such an output is made
    unsharded over it there, keeping the entry's other mesh axes (its `set` reduce-scatters the
    sums instead); the stream axis keeps its own."""
    return [a if j == stream else free_axes(a, pending) for j, a in enumerate(axes)]


def shard_count(entry, mesh) -> int:
    """How many pieces an axis with this entry is cut into on `mesh`."""
    return math.prod(mesh.axis_size(n) for n in mesh_axes(entry))


@dataclass(frozen=True)
class Layout:
    axes: tuple  # per tensor axis: None | mesh axis name | tuple of mesh axis names
    partial: tuple = ()  # mesh axes with a pending sum
    mesh: object = None  # the sub-mesh the value lives on (None: the program's whole mesh)
    partial_op: str = Reduce.SUM  # how the pending values combine: "sum", or "max" / "min" (a max of a sharded axis)

    def __post_init__(self):  # (no pending values, no operator: layouts without them compare equal)
        if not self.partial and self.partial_op != Reduce.SUM:
            object.__setattr__(self, "partial_op", Reduce.SUM)
        # hashed once: every call's dispatch key and check hold its arguments' layouts
        object.__setattr__(self, "_hash", hash((self.axes, self.partial, self.mesh, self.partial_op)))

    def __hash__(self):
        return self._hash

    def __reduce__(self):  # (by its fields: a str hash differs between processes, so _hash is made anew)
        return Layout, (self.axes, self.partial, self.mesh, self.partial_op)

    def __repr__(self):  # (the fields that say something: mesh None is the value's own mesh, not "no mesh")
        extra = [f"partial={self.partial!r}"] if self.partial else []
        extra += [f"partial_op={self.partial_op.value!r}"] if self.partial_op != Reduce.SUM else []
        extra += [f"mesh={self.mesh!r}"] if self.mesh is not None else []
        return f"Layout({', '.join([repr(self.axes)] + extra)})"

    @staticmethod
    def replicated(ndim: int) -> "Layout":
        return Layout((None,) * ndim)

    @property
    def ndim(self):
        return len(self.axes)

    def sharded_axes(self) -> dict:
        """{tensor axis: mesh axis name} for sharded axes."""
        return {i: a for i, a in enumerate(self.axes) if a is not None}

    def mesh_axis_of(self, name: str):
        """Tensor axis sharded over mesh axis `name` (alone or with others), or None."""
        for i, a in enumerate(self.axes):
            if name in mesh_axes(a):
                return i
        return None

    def with_axis(self, i: int, what) -> "Layout":
        axes = list(self.axes)
        axes[i] = what
        return replace(self, axes=tuple(axes))

    def sharded(self, i: int, entry) -> "Layout":
        """The annotation rule: tensor axis i sharded over `entry` (None: replicated), each mesh axis
        it names moved off any other tensor axis (a mesh axis shards at most one); every other axis
        keeps its sharding.  Pending sums are resolved."""
        names = set(mesh_axes(entry))
        axes = [axis_entry(n for n in mesh_axes(a) if n not in names) for a in self.axes]
        axes[i] = entry
        return replace(self, axes=tuple(axes), partial=())

    def on(self, mesh) -> "Layout":
        """The same layout on `mesh` (None: the program's whole mesh)."""
        return self if self.mesh is mesh else replace(self, mesh=mesh)

    def home(self, mesh):
        """The mesh the value lives on.  Inside the compiler every layout names its mesh; an
        sf.Array's layout names only a sub-mesh, None meaning the array's own mesh `mesh` (`held_by`
        writes that convention)."""
        return mesh if self.mesh is None else self.mesh

    def held_by(self, mesh) -> "Layout":
        """The layout as an sf.Array on `mesh` states it: mesh None where it lives on `mesh` itself."""
        return self.on(None) if self.mesh == mesh else self

    def sharding(self, mesh) -> Sharding:
        """The same, on the mesh the value lives on (see home)."""
        return Sharding(self.home(mesh), tuple(mesh_axes(a) for a in self.axes), self.partial)

    def local_shape(self, shape, mesh) -> tuple:
        return self.sharding(mesh).local_shape(shape)

    def placements(self, mesh) -> tuple:
        """DTensor-style placement per mesh axis, compact: 'S(i)', 'R' or 'P'."""
        return tuple(str(p) for p in self.sharding(mesh).placements())


def _entry_text(entry) -> str:
    return f"({','.join(entry)})" if isinstance(entry, tuple) else entry


def format_type(shape, dtype, layout, stream=None, home=None) -> str:
    """`f32[8, 4:DIDx, 16, 32]`: extents, with the mesh axes of sharded axes; `stream`, the axis
    the producing instruction's schedule streams (printed `:Stream`, `:DIDx+Stream` where sharded
    too: nvFuser's parallel types); `@devices(...)` where the value lives on another mesh than
    `home` (the program's; None: its root mesh)."""
    short = short_name(dtype)
    if layout is None:
        return f"{short}[{', '.join(map(str, shape))}] ?"
    dims = [str(n) if a is None else f"{n}:{_entry_text(a)}" for n, a in zip(shape, layout.axes)]
    if stream is not None:
        dims[stream] += f"+{STREAM}" if layout.axes[stream] is not None else f":{STREAM}"
    text = f"{short}[{', '.join(dims)}]"
    if layout.mesh is not None and layout.mesh != (home or layout.mesh.root):
        text += f" @devices{layout.mesh.devices}"
    if layout.partial:
        op = "" if layout.partial_op == Reduce.SUM else f"{layout.partial_op}: "
        text += f" partial({op}{', '.join(layout.partial)})"
    return text


def layout_of(placements, ndim: int, mesh) -> "Layout":
    """The Layout for DTensor-style placements (one Shard(dim) / Replicate() per mesh axis, in the
    mesh's axis order; several Shard(d) of one dim shard it over those mesh axes, the first
    outermost) or a JAX-style spec (one entry per tensor axis: None, a mesh axis name, or a tuple
    of them; missing trailing entries are None)."""
    from shardfuse.placements import Partial, Replicate, Shard, from_compact

    if isinstance(placements, (str, Shard, Replicate, Partial)) or not isinstance(placements, (tuple, list)):
        replicated = " (for a replicated array give () or sf.P())" * (placements is None)
        raise TypeError(f"placements: a list or tuple (one sf.Shard(dim) / sf.Replicate() per mesh axis, or one "
                        f"entry per tensor axis: None, a mesh axis name or a tuple of them), got {placements!r}"
                        + replicated)
    items = tuple(placements)
    # (the compact forms Layout.placements prints, ('R', 'S(1)'), read back, where no mesh axis has that name)
    compact = [from_compact(p) if isinstance(p, str) and p not in mesh.axis_names
               else p if isinstance(p, (Shard, Replicate, Partial)) else None for p in items]
    if items and all(c is not None for c in compact):  # (mixed with placements too: (sf.Shard(0), 'R'))
        items = tuple(compact)
    axes: list = [() for _ in range(ndim)]
    if items and all(isinstance(p, (Shard, Replicate, Partial)) for p in items):
        if len(items) != len(mesh.axis_names):
            raise ValueError(f"placements {tuple(map(str, items))}: one per mesh axis of {mesh} "
                             f"({len(mesh.axis_names)}), got {len(items)}")
        for name, p in reversed(list(zip(mesh.axis_names, items))):  # (a StridedShard places its axis among later ones)
            if isinstance(p, Partial):
                raise ValueError("Partial() is no placement of a whole value (it is what a contraction leaves pending)")
            if isinstance(p, Shard):
                if not -ndim <= p.dim < ndim:
                    raise ValueError(f"Shard({p.dim}) of a value of {ndim} axes")
                d = p.dim % ndim
                axes[d] = _strided_insert(axes[d], name, getattr(p, "split_factor", 1), mesh, p)
    else:
        if len(items) > ndim:
            raise ValueError(f"spec {items}: {len(items)} entries for a value of {ndim} axes")
        for k, entry in enumerate(items):
            if not (entry is None or isinstance(entry, str) or (isinstance(entry, (tuple, list))
                                                                and all(isinstance(n, str) for n in entry))):
                raise TypeError(f"spec {items}: entry {k} must be None, a mesh axis name or a tuple of them (JAX's "
                                f"P(...)), or give one sf.Shard(dim) / sf.Replicate() per mesh axis; got {entry!r}")
            names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
            for n in names:
                mesh.axis_index(n)  # an unknown mesh axis name fails here
            axes[k] = names
    used = [n for a in axes for n in a]
    if len(used) != len(set(used)):
        raise ValueError(f"{items}: a mesh axis shards two tensor axes")
    return Layout(tuple(axis_entry(a) if a else None for a in axes))


def _strided_insert(later: tuple, name: str, split: int, mesh, p) -> tuple:
    """`later` (the mesh axes after `name` in the mesh's order that shard the same tensor axis, outermost
    first) with `name` placed below the leading ones whose sizes multiply to split (1: outermost)."""
    for k in range(len(later) + 1):
        if math.prod(mesh.axis_size(n) for n in later[:k]) == split:
            return later[:k] + (name,) + later[k:]
    raise ValueError(f"{p!r} on mesh axis {name!r}: split_factor must be the product of the sizes of leading mesh "
                     f"axes among {later} (the later mesh axes sharding dim {p.dim}, outermost first), got {split}")
