"""The layouts autodiff reads and states: where the forward says a value lives (`known_layout`),
the pins that state a cotangent's layout (`pin`: an annotation, printed and verified as one), and
the schedule hints sf.jit may drop (`drop_hints`).  Kept apart from the rules (shardfuse/autodiff.py)."""
from __future__ import annotations

from dataclasses import replace

from shardfuse import rules
from shardfuse.ir import TensorType
from shardfuse.layout import Layout
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
    return ct.builder.emit(Op.SET, (ct,), TensorType(ct.shape, ct.dtype, layout), name or ct.value.name,
                           annotation=True, **({"keep": True} if keep else {}))


def whole(layout):
    """The placement of layout with its pending sums made whole (what a cotangent may be pinned to:
    a cotangent pinned as pending would be summed over the devices again)."""
    return Layout(layout.axes, mesh=layout.mesh)


def known_layout(builder, v):
    """Where the forward states v lives (its pending sums made whole): an input's layout, an
    annotation's placement, what the rule of a view or a product infers from its operands' known
    layouts, or that of the operand an elementwise op keeps the shape of; None if unstated."""
    for _ in range(64):
        p = builder.producer.get(v)
        if p is None:  # (an input that arrives as pending sums: its cotangent is whole on each device)
            return whole(v.type.layout) if v.type.layout is not None else None
        if p.op == Op.SET:
            return p.outs[0].type.layout
        if p.op in (Op.TRANSPOSE, Op.RESHAPE, Op.MATMUL):  # (views and products: as propagation infers them)
            lays = [known_layout(builder, i) for i in p.ins]
            if any(lay is None or lay.mesh != builder.mesh for lay in lays):
                return None
            try:
                return whole(rules.infer(p, lays).on(builder.mesh))
            except ValueError:  # (a reshape no sharding maps: the compiler gathers, and says so)
                return None
        same = [i for i in p.ins if i.type.shape == v.type.shape and p.op in ELEMENTWISE]
        if not same:
            return None
        v = same[0]
    return None


def rows_merge(a: Traced, ct: Traced, b: Traced) -> bool:
    """Whether the weight gradient of a 2-D b may be one GEMM of a's and ct's batch and row axes
    merged into rows (Megatron's [s*b, h] view): no per-batch [..., K, N] products to sum, and a
    GEMM with K = batch x rows.  Only where the merge is a view on every device: no axis but the
    first sharded (a first axis sharded over dp stays sharded over dp when merged); merging a
    batch axis sharded over dp with rows sharded over tp is no layout, and stays batched."""
    if b.ndim != 2 or a.ndim < 3 or ct.ndim != a.ndim:
        return False
    if a.builder.mesh.size == 1:
        return True
    lays = (known_layout(a.builder, a.value), known_layout(ct.builder, ct.value))
    return all(lay is not None and lay.mesh == a.builder.mesh and all(e is None for e in lay.axes[1:-1])
               for lay in lays)


def drop_hints(prog):
    """prog with the schedule hints autodiff added taken out (each value keeps its placement):
    what sf.jit compiles when a hint's split is one the passes refuse."""
    if not any(i.op == Op.SET and i.attrs.get("hint") for i in prog.instrs):
        return None
    return prog.with_instrs([replace(i, attrs=scheduled(i.attrs, None)) if i.op == Op.SET and i.attrs.get("hint")
                             else i for i in prog.instrs], "drop_hints")
