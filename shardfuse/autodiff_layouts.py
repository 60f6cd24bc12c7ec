"""The layouts autodiff reads and states: where the forward says a value lives (`known_layout`),
the pins that state a cotangent's layout (`pin`: an annotation, printed and verified as one), and
the schedule hints sf.jit may drop (`drop_hints`).  Kept apart from the rules (shardfuse/autodiff.py)."""
from __future__ import annotations

from dataclasses import replace

from shardfuse import rules
from shardfuse.ir import TensorType
from shardfuse.layout import Layout, axis_entry, mesh_axes
from shardfuse.ops import ELEMENTWISE, Op
from shardfuse.schedule import scheduled
from shardfuse.traced import Traced


def pin(ct: Traced, layout: Layout, name: str | None = None, keep: bool = False) -> Traced:
    """ct annotated with `layout` (an annotation, so printed and verified as one); ct itself where
    an annotation already pinned it there.  keep: the gather this pin makes may read what the
    forward gathered (sf.grad's remat="keep", passes/keep.py)."""
    p = ct.builder.producer.get(ct.value)
    if p is not None and p.op == Op.SET and p.attrs.get("annotation") and p.outs[0].type.layout == layout:
        return ct
    return ct.builder.emit(Op.SET, (ct,), TensorType(ct.shape, ct.dtype_name, layout), name or ct.value.name,
                           annotation=True, **({"keep": True} if keep else {}))


def whole(layout):
    """The placement of layout with its pending sums made whole (what a cotangent may be pinned to:
    a cotangent pinned as pending would be summed over the devices again)."""
    return Layout(layout.axes, mesh=layout.mesh)


def gathered_from(x, lay):
    """x's stated placement where `lay` gathers x (on x's mesh, sharding no axis x does not shard
    alike: lay is x's with some mesh axes made whole), else None.  Not where x splits an axis over
    two mesh axes ((dp, tp): propagation then splits the gradient's product over tp to meet it,
    and resharding across the nesting costs more than the Allreduce and slice it replaces)."""
    had = known_layout(x.builder, x.value)
    if had is None or had == lay or had.mesh != lay.mesh or lay.partial or len(had.axes) != len(lay.axes) or \
            any(len(mesh_axes(h)) > 1 for h in had.axes):
        return None
    gathers = all(set(mesh_axes(e)) <= set(mesh_axes(h)) for e, h in zip(lay.axes, had.axes))
    return had if gathers else None


def known_layout(builder, v, strict=None):
    """Where the forward states v lives (its pending sums made whole): an input's layout, an
    annotation's placement, what the rule of a view or a product infers from its operands' known
    layouts, or that of the operand an elementwise op keeps the shape of; None if unstated.
    strict (a dict, the values already answered): where an elementwise op's operands of its shape
    are known in different layouts, None (the compiler picks one of them: not knowable here)."""
    if strict is not None and v in strict:
        return strict[v]
    if strict is None:  # (answered once per value: a deep model's backward asks along the same chains)
        known = builder.known_layouts
        if v not in known:
            known[v] = _known_layout(builder, v, None)
        return known[v]
    return _known_layout(builder, v, strict)


def _known_layout(builder, v, strict):
    for _ in range(64):
        p = builder.producer.get(v)
        if p is None:  # (an input that arrives as pending sums: its cotangent is whole on each device)
            if v.type.layout is None and any(held[2] is v for held in builder.constants.values()):
                return Layout.replicated(len(v.type.shape))  # (a NumPy constant: replicated, constants.py)
            return whole(v.type.layout) if v.type.layout is not None else None
        if p.op == Op.SET:
            return p.outs[0].type.layout
        if p.op in (Op.TRANSPOSE, Op.RESHAPE, Op.MATMUL, Op.TAKE):  # (views, products, lookups: as propagation infers them)
            lays = [known_layout(builder, i) for i in p.ins]
            # (one stage's operands, beside values replicated on the whole mesh: constants, copied to the stage)
            meshes = {lay.mesh for lay in lays if lay is not None and (lay.mesh is not None or any(lay.axes))}
            if any(lay is None for lay in lays) or len(meshes) > 1:
                return None
            mesh = meshes.pop() if meshes else builder.mesh
            try:  # (a constant's replicated layout has no mesh yet: the rules read its axes' sizes, a fuzzer)
                return whole(rules.infer(p, [lay if lay.mesh is not None else lay.on(mesh) for lay in lays]).on(mesh))
            except ValueError:  # (a reshape no sharding maps: the compiler gathers, and says so)
                return None
        same = [i for i in p.ins if i.type.shape == v.type.shape and p.op in ELEMENTWISE]
        if not same:
            return None
        if strict is not None and len(set(same)) > 1:
            lays = {known_layout(builder, i, strict) for i in same}
            strict[v] = lays.pop() if len(lays) == 1 else None
            return strict[v]
        home = builder.homes.get(v)  # (an operand where v lives first: c * h of a whole-mesh c and a stage's h)
        v = next((i for i in same if builder.homes.get(i) == home), same[0])
    return None


def rows_merge(a: Traced, ct: Traced, b: Traced) -> bool:
    """Whether the weight gradient of a 2-D b may be one GEMM of a's and ct's batch and row axes
    merged into rows (Megatron's [s*b, h] view): no per-batch [..., K, N] products to sum, and a
    GEMM with K = batch x rows.  Only where the merge is a view on every device: no axis but the
    first sharded (a first axis sharded over dp stays sharded over dp when merged), and that one
    sharded alike in both; merging a batch axis sharded over dp with rows sharded over tp is no
    layout, and stays batched."""
    if b.ndim != 2 or a.ndim < 3 or ct.ndim != a.ndim:
        return False
    if a.builder.mesh.size == 1:
        return True
    memo: dict = {}
    lays = (known_layout(a.builder, a.value, memo), known_layout(ct.builder, ct.value, memo))
    return all(lay is not None and lay.mesh == a.builder.mesh and all(e is None for e in lay.axes[1:-1])
               for lay in lays) and lays[0].axes[0] == lays[1].axes[0]  # (rows split alike: no move of either)


def regathered(a: Traced, ct: Traced, keep=False):
    """(a, ct) for the weight gradient a^T ct, the rows of one gathered where a mesh axis shards the
    rows of one and the columns of the other (the sequence-parallel case: x's tokens and dH's
    columns over tp).  Megatron and TransformerEngine gather the activation again there; left to
    itself the planner would move the larger operand (an AllToAll of dH, then a ReduceScatter).
    A mesh axis sharding the rows of both (data parallel) stays: the product pends a sum over it.
    keep: each such gather is marked `keep=True`, for passes/keep.py to read what an earlier loop
    gathered instead: the forward's AllGather+GEMM's of a, the backward's of ct (a row-parallel
    dgrad gathers it chunk by chunk just before, as TransformerEngine's Userbuffers keeps dY)."""
    la, lc = known_layout(a.builder, a.value), known_layout(ct.builder, ct.value)
    if la is None or lc is None or la.mesh != a.builder.mesh or lc.mesh != a.builder.mesh:
        return a, ct
    rows = lambda lay: {n for e in lay.axes[:-1] for n in mesh_axes(e)}  # noqa: E731
    last = lambda lay: set(mesh_axes(lay.axes[-1]))  # noqa: E731
    out = []
    for x, lay, other in ((a, la, lc), (ct, lc, la)):
        clash = rows(lay) & last(other)
        if clash:
            lay = Layout(tuple(axis_entry(n for n in mesh_axes(e) if n not in clash) for e in lay.axes[:-1])
                         + (lay.axes[-1],), mesh=lay.mesh)
            x = pin(x, lay, keep=keep)
        out.append(x)
    return tuple(out)


def drop_hints(prog):
    """prog with the schedule hints autodiff added taken out (each value keeps its placement):
    what sf.jit compiles when a hint's split is one the passes refuse."""
    if not any(i.op == Op.SET and i.attrs.get("hint") for i in prog.instrs):
        return None
    return prog.with_instrs([replace(i, attrs=scheduled(i.attrs, None)) if i.op == Op.SET and i.attrs.get("hint")
                             else i for i in prog.instrs], "drop_hints")


def at_home(a: Traced, g: Traced, v):
    """Two parts of v's gradient, each moved (replicated) to the mesh v lives on where they come from
    different stages (a value used on two pipeline stages: the add between its parts was unannotated and
    refused, a review); as they are otherwise (no sub-mesh: both homes None)."""
    homes = g.builder.homes
    if homes.get(a.value) == homes.get(g.value):
        return a, g
    home = homes.get(v) or g.builder.mesh
    return tuple(t.builder.emit(Op.SET, (t,), TensorType(t.shape, t.dtype_name, Layout.replicated(t.ndim).on(home)),
                                t.value.name + "_home") for t in (a, g))


def moved_back(ct: Traced, x: Traced, home, moved: Layout) -> Traced:
    """The cotangent of a move between meshes (sf.to_mesh, an annotation with mesh=) moved back to
    where x lives, as the forward moved x: a move, not an annotation, so ct's producer stays on its
    own stage; x's cut there where the forward states it, else the cut it was `moved` to where `home`
    has those mesh axes (an embedding's rows over dp: it went back through one device, a probe), else
    replicated.  ct as it is for a plain argument (where its gradient goes is sf.grad's, transforms.py)."""
    back = known_layout(x.builder, x.value)
    if back is not None and (back.mesh or x.builder.mesh) != home:  # (x = c * h: c's layout, c on the whole
        back = None                                                  # mesh, h's and x's a stage, a review)
    if back is None and x.value in x.builder.producer:
        names = {n for a in moved.axes for n in mesh_axes(a)}
        dst = moved.mesh or x.builder.mesh
        fits = all(n in home.axis_names and home.axis_size(n) == dst.axis_size(n) for n in names)
        back = Layout(moved.axes if fits else (None,) * x.ndim).on(home)
    if back is None:
        return ct
    return ct.builder.emit(Op.SET, (ct,), TensorType(ct.shape, ct.dtype_name, back), ct.value.name + "_back")
