"""passes/fuse.py's FusedSum: a Sum whose operand an elementwise chain writes for it alone is one
step, and the chain's result is never written (softmax's backward sums g * y, a 2 GiB float32
buffer in the layer's training step; the norms sum x and (x - mean)^2).  On NumPy devices the
step evaluates the chain op by op and sums as the Sum does, so results equal the unfused plan's
(SHARDFUSE_FUSE=0) bit for bit in every float dtype; tests/test_gpu_fused_sum.py runs the same
cases through the generated CuPy reduction kernel.  Inputs are fresh random values (the seed is
in each failure's message); buffers are poisoned (conftest), so an unwritten element fails."""
from __future__ import annotations

import os
import re

import numpy as np
import pytest

import shardfuse as sf
from shardfuse.dtypes import np_dtype
from shardfuse.ops import ELEMENTWISE, Op
from shardfuse.transformer import adam_step, init_params

MESH = sf.DeviceMesh((4,), ("tp",), backend="numpy")
DTYPES = ["float64", "float32", "float16", "bfloat16"]


def fresh_rng():
    """(generator, seed): a new seed every run."""
    seed = int.from_bytes(os.urandom(4), "little")
    return np.random.default_rng(seed), seed


def randn(r, shape, dtype):
    """Normal values (none zero) rounded to dtype."""
    return r.standard_normal(shape).astype(np_dtype(dtype))


def _softmax_backward(x, g):
    return sf.grad(lambda x, g: (sf.nn.softmax(sf.shard(x, axis=0)) * g).sum())(x, g)


def _layer_norm_backward(x, w, g):
    return sf.grad(lambda x, w: (sf.nn.layer_norm(x, w, None) * g).sum(), argnums=(0, 1))(x, w)


def _pair(shape_y):
    return lambda r, dt: (randn(r, (8, 16), dt), randn(r, shape_y, dt))


# name -> (function, make(rng, dtype) -> arguments): each plan holds a FusedSum
CASES = {
    "softmax backward, rows sharded": (_softmax_backward, _pair((8, 16))),
    "product over the last axis, kept": (lambda x, y: (x * y).sum(-1, keepdims=True), _pair((8, 16))),
    "broadcast operand and a scale (a mean)": (lambda x, b: ((x - b) * (x + 1.0)).mean(-1), _pair((16,))),
    "first axis, broadcast column": (lambda x, c: sf.exp(x * 0.5 - c).sum(0), _pair((8, 1))),
    "summed axis sharded (then an Allreduce)": (lambda x, y: (sf.shard(x, axis=1) * y).sum(1), _pair((8, 16))),
    "layer_norm backward": (_layer_norm_backward,
                            lambda r, dt: (randn(r, (2, 8, 16), dt), randn(r, (16,), dt), randn(r, (2, 8, 16), dt))),
}


def leaves(out) -> list:
    """A result, or each of a tuple of them, as NumPy arrays."""
    return [np.asarray(a) for a in (out if isinstance(out, (tuple, list)) else [out])]


def fused_and_unfused(fn, args, monkeypatch, mesh=MESH):
    """(fused results, fused plan, unfused results, unfused plan), whatever SHARDFUSE_FUSE the run set."""
    monkeypatch.delenv("SHARDFUSE_FUSE", raising=False)
    fused = sf.jit(fn, mesh=mesh)
    got, plan = fused(*args), fused.lower(*args)
    monkeypatch.setenv("SHARDFUSE_FUSE", "0")
    unfused = sf.jit(fn, mesh=mesh)
    want, plain = unfused(*args), unfused.lower(*args)
    monkeypatch.delenv("SHARDFUSE_FUSE")
    return leaves(got), plan, leaves(want), plain


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", CASES)
def test_fused_sums_equal_the_unfused_steps_bit_for_bit(name, dtype, monkeypatch):
    fn, make = CASES[name]
    r, seed = fresh_rng()
    got, plan, want, plain = fused_and_unfused(fn, make(r, dtype), monkeypatch)
    assert any(summed(i) for i in plan.program.instrs), plan
    assert not any(summed(i) for i in plain.program.instrs), plain
    for g, w in zip(got, want):
        assert np.all(np.isfinite(g.astype(np.float64))), f"seed {seed}: unwritten (poisoned) elements"
        np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8), err_msg=f"seed {seed}")


def summed(i) -> bool:
    """A FusedSum, or a row group holding a sum (passes/fuse_rows.py takes a softmax's backward in)."""
    return i.op == Op.FUSED_SUM or (i.op == Op.FUSED_ROWS and Op.SUM in i.attrs["expr"].ops())


def _compute(prog) -> list:
    return [i for i in prog.instrs if i.into is not None]


def test_a_product_summed_is_one_step_and_no_buffer(monkeypatch):
    """(x * y).sum(-1): one FusedSum and one buffer (the result), where the unfused plan writes
    the product and sums it."""
    r, _ = fresh_rng()
    x, y = randn(r, (8, 16), "float32"), randn(r, (8, 16), "float32")
    _, plan, _, plain = fused_and_unfused(lambda x, y: (x * y).sum(-1), (x, y), monkeypatch)
    # plan <lambda>(x: f32[8, 16], y: f32[8, 16]) -> (s: f32[8])
    #   s = Allocate f32[8]  (per call)
    #   FusedSum s <- x, y, axis=1, expr=mul(#0, #1)
    assert "  FusedSum s <- x, y, axis=1, expr=mul(#0, #1)\n" in str(plan), plan
    assert [i.op for i in _compute(plan.program)] == [Op.FUSED_SUM]
    assert [i.op for i in _compute(plain.program)] == [Op.MUL, Op.SUM]
    made = [i.outs[0].type.shape for i in plan.program.instrs if i.op == Op.ALLOCATE]
    assert made == [(8,)], plan


def test_a_mean_keeps_its_factor_and_a_widening_cast_is_read_through(monkeypatch):
    """A bfloat16 layer norm's mean of x.astype(float32): the FusedSum reads x itself (no float32
    copy of x, the cast also folded into its other reader) and keeps the mean's factor."""
    r, seed = fresh_rng()
    x = randn(r, (4, 32), "bfloat16")
    got, plan, want, _ = fused_and_unfused(lambda x: sf.nn.layer_norm(x, None, None), (x,), monkeypatch)
    assert re.search(r"FusedRows \w+ <- x, expr=.*sum\(astype\(#0\), 0.03125\)", str(plan)), plan  # (the norm: one row group)
    assert not any(i.op == Op.ASTYPE for i in plan.program.instrs), plan
    np.testing.assert_array_equal(got[0].view(np.uint8), want[0].view(np.uint8), err_msg=f"seed {seed}")


def test_a_product_read_twice_viewed_or_returned_is_summed_as_it_was(monkeypatch):
    """The chain's result is still needed (read by another step, through a view, or returned), or
    the values are integers (summed in int64): a Sum of its own, the product written."""
    r, _ = fresh_rng()
    x, y = randn(r, (8, 16), "float32"), randn(r, (8, 16), "float32")
    i32 = r.integers(-50, 50, (8, 16)).astype(np.int32)
    for fn, args in [(lambda x, y: (lambda m: (m.sum(-1), m + 1.0))(x * y), (x, y)),
                     (lambda x, y: (lambda m: (m.sum(-1), m.T * 2.0))(x * y), (x, y)),
                     (lambda x, y: (lambda m: (m.sum(-1), m))(x * y), (x, y)),
                     (lambda x, y: (x * y).sum(-1), (i32, i32))]:
        got, plan, want, _ = fused_and_unfused(fn, args, monkeypatch)
        assert not any(i.op == Op.FUSED_SUM for i in plan.program.instrs), plan
        assert any(i.op == Op.SUM for i in plan.program.instrs), plan
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)


def unfused_sums(prog) -> list:
    """The Sums left whose operand an elementwise step wrote for them alone (made once, read by
    nothing else, never viewed): the sums passes/fuse.py should have taken the chain into."""
    writer = {i.into: i for i in prog.instrs if i.into is not None and (i.op in ELEMENTWISE or i.op == Op.FUSED)}
    reads = {}
    for i in prog.walk():
        for v in i.ins:
            reads[v] = reads.get(v, 0) + 1
    return [i for i in prog.instrs if i.op == Op.SUM and i.ins[0] in writer and reads[i.ins[0]] == 1
            and i.into.type.dtype != "int64"]


def test_the_layer_training_step_sums_no_chain_it_could_fuse():
    """In the layer's training step (benchmarks/train_memory.py's, small) every Sum of a chain
    written for it alone is a FusedSum: softmax's sum(g * y) over the scores (the float32 [batch,
    heads, seq, seq] buffer it wrote), and the norms' sums (tests/test_train_memory.py pins the
    bytes: 7.63 -> 5.75 GiB at the benchmark's size)."""
    hidden, heads, seq, batch = 64, 4, 16, 2
    p = {k: sf.TensorSpec(a.shape, "bfloat16") for k, a in init_params(np.random.default_rng(0), hidden).items()}
    x = sf.TensorSpec((batch, seq, hidden), "bfloat16")
    plan = sf.jit(adam_step(heads), mesh=sf.DeviceMesh(1, backend="numpy"), donate_argnums=(0, 1, 2)).lower(
        p, dict(p), dict(p), x, x)
    prog = plan.program
    assert not unfused_sums(prog), [str(i) for i in unfused_sums(prog)]
    scores = [i for i in prog.instrs if summed(i) and i.ins[-1].type.shape == (batch, heads, seq, seq)]
    assert len(scores) == 2 and all(i.op == Op.FUSED_ROWS for i in scores), str(plan)  # (softmax's forward and backward)
