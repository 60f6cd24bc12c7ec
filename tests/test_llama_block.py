"""A Llama-style block written as a JAX user writes it (NumPy calls in sf.jit) with Megatron's
shardings on a 2x2 ("dp", "tp") mesh: a vocab-parallel tied embedding, RMSNorm, causal attention,
SwiGLU, the tied output projection and cross entropy.  Its plan holds Megatron's collectives and
nothing else: forward, 7 Allreduces (the embedding's, attention's and the MLP's row-parallel
outputs, the cross entropy's max, sum of exponentials and target logit, the data-parallel mean
of the loss); none gathers a weight (a new user's port found every weight gathered after the
vocab-parallel embedding: the norm's scaling carried its pending sum into the column-parallel
GEMMs).  Values against a float64 NumPy reference, gradients by central differences."""
from __future__ import annotations

import numpy as np

import shardfuse as sf
from cases import directional

V, D, H, HD, F, B, T = 32, 16, 4, 4, 24, 4, 8
EPS = 1e-6
COLUMN, ROW = ("wq", "wk", "wv", "w_gate", "w_up"), ("wo", "w_down")
MESH = sf.DeviceMesh((2, 2), ("dp", "tp"), backend="numpy")


def params(rng):
    shapes = {"embed": (V, D), "attn_norm": (D,), "wq": (D, H * HD), "wk": (D, H * HD), "wv": (D, H * HD),
              "wo": (H * HD, D), "mlp_norm": (D,), "w_gate": (D, F), "w_up": (D, F), "w_down": (F, D),
              "final_norm": (D,)}
    return {k: (1 + 0.1 * rng.standard_normal(s)) if k.endswith("norm") else 0.3 * rng.standard_normal(s)
            for k, s in shapes.items()}


def loss(p, ids, targets, xp=np, nn=None):
    """The block's mean next-token loss; xp/nn: shardfuse's annotations and nn, or NumPy's reference."""
    shard = (lambda x, axis, over: sf.shard(x, axis=axis, over=over)) if nn else (lambda x, axis, over: x)
    w = {k: shard(p[k], 1, "tp") for k in COLUMN} | {k: shard(p[k], 0, "tp") for k in ROW}
    emb = shard(p["embed"], 0, "tp")  # the vocabulary over tp (Megatron's vocab-parallel embedding)

    def rms(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS) * g

    def heads(t):
        return t.reshape(B, T, H, HD).transpose(0, 2, 1, 3)
    x = emb[shard(ids, 0, "dp")]
    h = rms(x, p["attn_norm"])
    q, k, v = heads(h @ w["wq"]), heads(h @ w["wk"]), heads(h @ w["wv"])
    s = np.where(np.tril(np.ones((T, T), dtype=bool)), (q @ np.swapaxes(k, -1, -2)) / np.sqrt(HD), -1e9)
    e = np.exp(s - s.max(-1, keepdims=True))
    o = ((e / e.sum(-1, keepdims=True)) @ v).transpose(0, 2, 1, 3).reshape(B, T, H * HD)
    x = x + o @ w["wo"]
    h = rms(x, p["mlp_norm"])
    g = h @ w["w_gate"]
    x = x + (g / (1 + np.exp(-g)) * (h @ w["w_up"])) @ w["w_down"]
    logits = rms(x, p["final_norm"]) @ emb.T
    if nn:
        return nn.cross_entropy(logits, shard(targets, 0, "dp"))
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return -np.take_along_axis(logp, targets[..., None], -1).mean()


def inputs(seed):
    rng = np.random.default_rng(seed)
    return params(rng), rng.integers(0, V, (B, T)), rng.integers(0, V, (B, T))


def test_forward_is_megatrons_seven_allreduces_and_nothing_else():
    p, ids, targets = inputs(0)
    f = sf.jit(lambda p, i, t: loss(p, i, t, nn=sf.nn), mesh=MESH)
    plan = f.lower(p, ids, targets)
    assert plan.collectives() == {"allreduce": 7}, str(plan)
    np.testing.assert_allclose(float(f(p, ids, targets)), loss(p, ids, targets), rtol=1e-12)


def test_training_step_gathers_no_weight_and_its_gradients_are_right():
    p, ids, targets = inputs(1)
    f = sf.jit(sf.value_and_grad(lambda p, i, t: loss(p, i, t, nn=sf.nn)), mesh=MESH)
    plan = f.lower(p, ids, targets)
    # the forward's 7, the backward's row-parallel inputs' and the embedding's gradient (Megatron's
    # f/g conjugates), and the data-parallel sums of the gradients: Allreduces only
    assert plan.collectives() == {"allreduce": 11}, plan.collectives()
    value, grads = f(p, ids, targets)
    np.testing.assert_allclose(float(value), loss(p, ids, targets), rtol=1e-12)
    grads = {k: g.gather() for k, g in grads.items()}
    numeric, analytic = directional(lambda q: loss(q, ids, targets), p, grads, np.random.default_rng(2))
    assert abs(numeric - analytic) <= 1e-7 * (1 + abs(numeric)), (numeric, analytic)
