"""The layer's training step holds less (issue 32): planned bytes pinned on NumPy devices.

benchmarks/layer_vs_torch.py --train (hidden 4096, 32 heads, seq 2048, batch 4, bfloat16) planned
14.8 GiB of buffers made once (16.9 GiB unfused), and on the GPU bound that twice: the first call
(torch arrays) and the next (the step's own results, replicated sf.Arrays) compiled two plans of
one program.  Now: one plan (jit.py, ir.same_program), the softmax's max shift held constant by
sf.grad (autodiff.stop_gradient: no [.., seq, seq] scores kept for the ties of the max), elementwise
steps written in place of an operand that dies there (passes/reuse.py), and a widening cast read
by two steps folded into both (passes/fuse.py): 8.0 GiB (12.2 GiB unfused), BENCHMARKS.md.  A sum
of an elementwise chain (softmax's and the norms' backward: sum(g * y), the norms' means) is one
step that never writes the chain's result (passes/fuse.py, FusedSum): 7.63 -> 5.75 GiB fused.

At hidden 256, 32 heads, seq 128, batch 4 every buffer is 1/256 of the benchmark's (scores,
activations and weights all scale by it), so the bytes below are the benchmark's / 256."""
from __future__ import annotations

import numpy as np
import pytest

import shardfuse as sf
from shardfuse.ops import Op
from shardfuse.transformer import adam_step, init_params

ONE = sf.DeviceMesh(1, backend="numpy")


def train_step(heads):
    """benchmarks/layer_vs_torch.py's step (shardfuse.transformer.adam_step), jitted with donation."""
    return sf.jit(adam_step(heads), mesh=ONE, donate_argnums=(0, 1, 2))


def state(rng, hidden, batch, seq, dtype="bfloat16"):
    p = {k: v.astype(sf.dtypes.np_dtype(dtype)) for k, v in init_params(rng, hidden).items()}
    x, t = (rng.standard_normal((batch, seq, hidden)).astype(p["wq"].dtype) for _ in range(2))
    return p, {k: np.zeros_like(a) for k, a in p.items()}, {k: np.zeros_like(a) for k, a in p.items()}, x, t


# (+ 4 bytes fused since 16-bit sums are float32 until rounded once: the loss's 0-d partial)
@pytest.mark.parametrize("fuse, was, most", [("1", 62265856, 24128516), ("0", 71177216, 51191808)])
def test_the_benchmark_step_plans_far_less(monkeypatch, fuse, was, most):
    """Bytes made once, per device (x 256: 14.8 -> 5.75 GiB fused, 16.9 -> 12.2 GiB unfused); about
    two float32 [4, 32, 128, 128] score buffers (exp and probabilities, kept for the backward) and
    two bfloat16 ones, where there were seven and a half."""
    monkeypatch.setenv("SHARDFUSE_FUSE", fuse)
    hidden, heads, seq, batch = 256, 32, 128, 4
    p = {k: sf.TensorSpec(a.shape, "bfloat16") for k, a in init_params(np.random.default_rng(0), hidden).items()}
    x = sf.TensorSpec((batch, seq, hidden), "bfloat16")
    plan = train_step(heads).lower(p, dict(p), dict(p), x, x)
    assert plan.memory()["persistent"] <= most < was, plan.memory()


def test_a_step_called_with_its_own_results_binds_one_plan():
    """Plain arrays first, then the step's results (replicated sf.Arrays): two specs, one program,
    one plan (one set of buffers).  Results are the same as the first plan's would be."""
    rng = np.random.default_rng(1)
    step = train_step(4)
    s = list(state(rng, 32, 2, 8, "float32"))
    losses = []
    for _ in range(3):
        *s[:3], loss = step(*s)
        losses.append(float(loss))
    plans = step.cached_plans()
    assert len(plans) == 2 and len({id(plan) for plan in plans.values()}) == 1, plans
    assert losses[2] < losses[0]


def test_softmax_keeps_no_scores_for_its_max():
    """The gradient of softmax without the max's backward (its true value is zero): no comparison
    with the max over the scores in the plan, and the float64 gradient p * (g - sum(g * p))."""
    rng = np.random.default_rng(2)
    x, g = rng.standard_normal((3, 5, 7)), rng.standard_normal((3, 5, 7))
    f = sf.jit(sf.grad(lambda x, g: (sf.nn.softmax(x) * g).sum()), mesh=ONE)
    assert all(i.op != Op.EQ for i in f.lower(x, g).program.walk())
    e = np.exp(x - x.max(-1, keepdims=True))
    p = e / e.sum(-1, keepdims=True)
    np.testing.assert_allclose(f(x, g).gather(), p * (g - (g * p).sum(-1, keepdims=True)), rtol=1e-12, atol=1e-14)


def _in_place(plan) -> dict:
    return {i.outs[0].name: i.attrs["in_place_of"] for i in plan.program.instrs if "in_place_of" in i.attrs}


def test_in_place_only_where_each_element_is_read_before_it_is_written(monkeypatch):
    """exp(x * 2) + 1 is written in place of x * 2, then of its exp; not a where's half (NumPy
    fills its result first), nor over an operand also read through a transpose."""
    monkeypatch.setenv("SHARDFUSE_FUSE", "0")
    x = np.arange(16.0).reshape(4, 4) / 16
    chain = sf.jit(lambda x: (sf.exp(x * 2.0) + 1.0) * x, mesh=ONE)
    np.testing.assert_array_equal(chain(x).gather(), (np.exp(x * 2.0) + 1.0) * x)
    assert _in_place(chain.lower(x)) == {"e": "s", "a": "e"}
    mask = np.tril(np.ones((4, 4), bool))
    where = sf.jit(lambda x: sf.where(mask, sf.exp(x), 0.0) * x, mesh=ONE)
    np.testing.assert_array_equal(where(x).gather(), np.where(mask, np.exp(x), 0.0) * x)
    assert _in_place(where.lower(x)) == {"a": "f"}  # (w = where(mask, e, 0) not over e)
    viewed = sf.jit(lambda x: (lambda e: e * e.T)(sf.exp(x)) * 2.0 + 1.0, mesh=ONE)
    np.testing.assert_array_equal(viewed(x).gather(), np.exp(x) * np.exp(x).T * 2.0 + 1.0)
    assert "m" not in _in_place(viewed.lower(x))  # (m = e * e.T: not over e)


def test_a_widening_cast_read_twice_joins_both_readers(monkeypatch):
    """A bfloat16 -> float32 cast read by two elementwise steps: each reads the bfloat16 operand
    (no float32 buffer), bit for bit the unfused plan's."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 8)).astype(sf.dtypes.np_dtype("bfloat16"))

    def f(x):
        w = (x @ x.T).astype("float32")
        return sf.exp(w) * 0.5, w * w + 1.0
    fused = sf.jit(f, mesh=ONE)
    plan = fused.lower(x)
    assert not any(i.op == Op.ASTYPE for i in plan.program.walk()), plan
    assert all(v.type.dtype != "float32" for i in plan.program.instrs if i.op == Op.ALLOCATE
               and not i.attrs.get("per_call") for v in i.outs)
    monkeypatch.setenv("SHARDFUSE_FUSE", "0")
    for got, want in zip(fused(x), sf.jit(f, mesh=ONE)(x)):
        np.testing.assert_array_equal(got.gather(), want.gather())
