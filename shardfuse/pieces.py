"""Where the pieces of a global array lie: each local device's index into it, and the pieces
themselves (adopted by the backend: device arrays stay on their device).  Below the executor and
sf.Array, which both place arguments this way; `Placed` is what the executor takes as already
placed (sf.Array is one)."""
from __future__ import annotations

from collections.abc import Sequence

from shardfuse.interop import array_info, check_input
from shardfuse.layout import Layout
from shardfuse.runtime import backend_of
from shardfuse.spec import check_divides, normalize_axis, normalize_over


class Placed:
    """A value already placed on a mesh: `mesh`, global `shape`, `dtype_name`, `sharding` (a Layout),
    `shards` (this process' pieces, one per local device) and `pieces_contiguous`.  sf.Array is the one kind."""

    __slots__ = ()


def device_index(shape, layout: Layout, mesh, device: int):
    """The index (tuple of slices) of `device`'s piece of a global array (None: it holds none)."""
    sh = layout.sharding(mesh)
    if device not in sh.mesh.devices:
        return None
    idx = []
    for i, n in enumerate(shape):
        c, size = sh.block(i, device), n // sh.count(i)
        idx.append(slice(c * size, (c + 1) * size))
    return tuple(idx)


_UNSEEN = object()
_MEMO: dict = {}  # (mesh geometry, what, ...) -> what _memo remembered
MEMO_SIZE = 4096  # entries kept before the memo starts over (ever-changing shapes)


def _memo(mesh, key, make):
    """make(), remembered for the hot path (sf.shard and calls on the same shapes find it in one
    lookup).  What is remembered here depends on the mesh's geometry alone, so it is keyed by
    that geometry and holds no mesh object: this table keeps no mesh (nor its GPU streams,
    handles and workspaces) alive, and equal meshes share their entries."""
    key = (mesh.geometry,) + key
    got = _MEMO.get(key, _UNSEEN)
    if got is _UNSEEN:  # (not None: split_axis remembers None)
        got = make()  # raises for bad input: nothing is remembered then
        if len(_MEMO) >= MEMO_SIZE:
            _MEMO.clear()
        _MEMO[key] = got
    return got


def _geometry(layout: Layout):
    """A layout as a memo key: the sub-mesh it lives on (if any) by its geometry, not the object."""
    sub = layout.mesh
    if sub is None:
        return layout
    return layout.axes, layout.partial, layout.partial_op, sub.shape, sub.axis_names, sub.devices  # (no copy made)


def local_indices(shape: tuple, layout: Layout, mesh) -> tuple:
    """Per local device: device_index of its piece (remembered: results exported every call ask)."""
    return _memo(mesh, ("indices", shape, _geometry(layout)),
                 lambda: tuple(device_index(shape, layout, mesh, d) for d in mesh.local_devices))


def piece_indices(shape: tuple, layout: Layout, mesh) -> tuple:
    """Per local device: the index of its piece of a global array of this shape, () when the
    piece is the whole array, None when the device holds none (outside the value's sub-mesh)."""
    def make():
        return tuple(() if idx is not None and all(s == slice(0, n) for s, n in zip(idx, shape)) else idx
                     for idx in local_indices(shape, layout, mesh))
    return _memo(mesh, ("pieces", shape, _geometry(layout)), make)


def split_axis(shape: tuple, layout: Layout, mesh):
    """The axis (> 0) whose consecutive equal blocks, in local device order, are the local devices'
    pieces, every other axis whole; None for any other layout (remembered, like the indices)."""
    def make():
        indices = piece_indices(shape, layout, mesh)
        if len(indices) < 2 or not all(indices):  # a device holding none, or all of x
            return None
        cut = [a for a, s in enumerate(indices[0]) if s != slice(0, shape[a])]
        if len(cut) != 1 or cut[0] == 0:  # axis 0's blocks are contiguous views already
            return None
        ax, n = cut[0], shape[cut[0]] // len(indices)
        want = [tuple(slice(j * n, (j + 1) * n) if a == ax else slice(0, shape[a]) for a in range(len(shape)))
                for j in range(len(indices))]
        return ax if list(indices) == want else None
    return _memo(mesh, ("split", shape, _geometry(layout)), make)


def placement(shape: tuple, layout: Layout, mesh) -> tuple:
    """(piece_indices, split_axis) of a global array of this shape: what local_pieces cuts it by
    (remembered, one lookup: a plan and sf.shard ask on every call)."""
    return _memo(mesh, ("placement", shape, _geometry(layout)),
                 lambda: (piece_indices(shape, layout, mesh), split_axis(shape, layout, mesh)))


class SplitViews(Sequence):
    """The devices' pieces as consecutive blocks of one contiguous buffer `outer` [d, ...]: piece j
    is outer[j], made when first read.  A graph-mode call needs only their addresses (`pointers`),
    and a CuPy view costs about 2.5 us of host time: eight virtual devices' views were most of
    sf.shard's 22 us at D = 8 (issue 29, item 2)."""

    __slots__ = ("outer", "_views")

    def __init__(self, outer):
        self.outer = outer
        self._views = None

    def __len__(self):
        return len(self.outer)

    def __getitem__(self, j):
        if self._views is None:
            self._views = [self.outer[k] for k in range(len(self.outer))]
        return self._views[j]

    def pointers(self) -> list:
        """Each piece's device address, without making the pieces."""
        base, step = self.outer.data.ptr, self.outer.strides[0]
        return [base + j * step for j in range(len(self.outer))]


def local_pieces(x, dtype: str, layout: Layout, mesh, info=None, fenced=None, where=None):
    """This process' pieces of a global array x (one per local device), each contiguous on its
    device.  x is any array the backend can adopt: device arrays stay on the device (a piece is
    a zero-copy view where the layout allows, a device-side copy otherwise).  `fenced`: a
    stream the backend's streams already wait for (see the backends' adopt); `where`: x's
    placement() when the caller has it (a plan, from its input types)."""
    be = backend_of(mesh)
    x = be.adopt(x, info, fenced)
    shape = tuple(x.shape)
    if layout.ndim == 0:  # a 0-d array: each device holds it whole (CuPy's contiguous copy of one is 1-d)
        return [be.piece(x, j).reshape(()) for j in range(len(mesh.local_devices))]
    indices, ax = where or placement(shape, layout, mesh)
    homes = be.ordinals or ()
    if ax is not None and len(set(homes)) <= 1 and x.flags.c_contiguous:
        # Devices of one GPU (or NumPy's) holding consecutive blocks of an inner axis: one copy
        # with that axis moved outermost, each device's piece a contiguous view of it, instead of
        # a slice and a strided copy per device (several host calls each)
        d = len(indices)
        blocks = x.reshape(shape[:ax] + (d, shape[ax] // d) + shape[ax + 1:])
        outer = be.piece(blocks.transpose((ax,) + tuple(a for a in range(len(shape) + 1) if a != ax)), 0)
        return SplitViews(outer)
    whole: dict = {}  # GPU (None: host) -> its piece of the whole of x, made once per GPU
    out, spare = [], None
    for j, idx in enumerate(indices):
        if idx is None:  # a device outside the value's sub-mesh holds a placeholder, never read
            if spare is None:  # (one element broadcast: no memory of a piece's size, never read)
                spare = be.empty(layout.local_shape(x.shape, mesh), dtype, devices=())
            out.append(spare[j])
        elif idx:
            out.append(be.piece(x[idx], j))
        else:  # all of x: devices of one GPU (virtual devices, NumPy's) share one read-only buffer
            home = homes[j] if homes else None
            if home not in whole:
                whole[home] = be.piece(x, j)
            out.append(whole[home])
    return out


def global_placement(shape: tuple, mesh, axis: int | None, over: str) -> tuple:
    """(layout, placement) of a global array of this shape sharded on `axis` over mesh axis `over`
    (replicated for axis None), checked; remembered, one lookup per sf.shard call."""
    def make():
        layout = Layout.replicated(len(shape))
        if axis is not None:
            ax = normalize_axis(axis, len(shape), shape)
            layout = layout.with_axis(ax, normalize_over(over, mesh))
            for a, name in layout.sharded_axes().items():
                check_divides(shape, a, name, mesh)
        return layout, placement(shape, layout, mesh)
    return _memo(mesh, ("layout", shape, axis, tuple(over) if isinstance(over, list) else over), make)


def check_args(prog, args, backend, accepted: set, infos=None) -> list:
    """Every argument against the plan's inputs, before any work is queued.  Returns the
    ArrayInfo of each plain argument (None for placed ones); `infos` when the caller has them.
    `accepted`: the caller's cache of (input, layout, shape, dtype) already checked."""
    if len(args) != len(prog.inputs):
        raise TypeError(f"{prog.name} takes {len(prog.inputs)} arguments, got {len(args)}")
    out = []
    for k, (arg, v) in enumerate(zip(args, prog.inputs)):
        lay = v.type.layout
        if isinstance(arg, Placed):
            out.append(None)
            # hot path: a (layout, shape, dtype) once accepted for this input is not checked again
            key = (v, arg.sharding, arg.shape, arg.dtype_name)
            if key in accepted:
                continue
            if arg.shape != v.type.shape or arg.dtype_name != v.type.dtype:
                raise ValueError(f"{v.name}: expected shape {v.type.shape} and dtype {v.type.dtype}, got an "
                                 f"sf.Array of shape {arg.shape} and dtype {arg.dtype_name}")
            if arg.sharding != lay.held_by(prog.mesh):
                raise ValueError(f"{v.name}: plan expects layout {lay.placements(prog.mesh)}, "
                                 f"got {arg.sharding.placements(prog.mesh)}")
            accepted.add(key)
            continue
        info = infos[k] if infos is not None else array_info(arg, calling=True)
        if info.shape != v.type.shape or info.dtype != v.type.dtype:
            raise ValueError(f"{v.name}: expected shape {v.type.shape} and dtype {v.type.dtype}, got a "
                             f"{info.describe()}")
        check_input(info, backend, v.name)
        out.append(info)
    return out
