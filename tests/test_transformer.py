"""sf.nn.transformer_layer and the GPT model (issues 31 item 8, 32 item 4): the forward against the
float64 NumPy reference on random inputs (float64, float32, bfloat16 with float32 norms and
softmax) with Megatron's shardings (tp, sp pipelined, dp x tp), their collectives pinned; the
gradients of the layer and of the GPT loss against central differences; a few SGD steps of the GPT
with donated parameters lower the loss.  tests/mpi/test_grad_mpi.py runs the same under mpiexec."""
from __future__ import annotations

import re

import numpy as np
import pytest

import shardfuse as sf
from test_nn import mesh_of  # (the 1-D tp mesh and the 2x2 dp x tp mesh, NumPy devices)
from shardfuse import tree
from shardfuse.transformer import (gpt_loss, gpt_reference, init_gpt, init_params, layer_reference,
                                   transformer_layer)
from cases import directional

HEADS, HIDDEN, SEQ, BATCH = 4, 16, 8, 2


CONFIGS = {  # name -> (mesh kind, keyword arguments, collectives of one forward)
    "replicated": ("1d", {}, {}),
    "tp": ("1d", {"tp": "tp"}, {"allreduce": 2}),
    "tp pipelined": ("1d", {"tp": "tp", "chunks": 2}, {"allreduce": 4}),
    # Q, K and V's GEMMs share each gathered chunk (one Allgather per chunk, not three)
    "sp": ("1d", {"tp": "tp", "sp": True, "chunks": 2}, {"allgather": 4, "reduce_scatter": 4}),
    "dp x sp": ("2d", {"tp": "tp", "sp": True, "dp": "dp", "chunks": 2}, {"allgather": 4, "reduce_scatter": 4}),
}


def _inputs(rng, dtype="float64", scale=0.3):
    return init_params(rng, HIDDEN, dtype, scale), rng.standard_normal((BATCH, SEQ, HIDDEN)).astype(dtype)


def layer_fn(config):
    kind, kw, _ = CONFIGS[config]
    return sf.jit(lambda p, x: transformer_layer(p, x, HEADS, **kw), mesh=mesh_of(kind))


@pytest.mark.parametrize("config", CONFIGS)
def test_layer_forward_float64_and_its_collectives(config):
    rng = np.random.default_rng(0)
    p, x = _inputs(rng)
    f = layer_fn(config)
    np.testing.assert_allclose(np.asarray(f(p, x)), layer_reference(p, x, HEADS), rtol=1e-12, atol=1e-12)
    assert f.lower(p, x).collectives() == CONFIGS[config][2]


@pytest.mark.parametrize("config", ["tp", "sp"])
def test_layer_with_the_exact_gelu(config):
    """approximate=False: torch.nn.GELU()'s exact erf form in the MLP (a straight port of a torch
    layer), against the reference's; it differs from the default tanh form's result."""
    kind, kw, _ = CONFIGS[config]
    p, x = _inputs(np.random.default_rng(4))
    p = {k: v * 3 if k in ("w1", "b1") else v for k, v in p.items()}  # (GELU's inputs out where the forms differ)
    f = sf.jit(lambda p, x: transformer_layer(p, x, HEADS, approximate=False, **kw), mesh=mesh_of(kind))
    exact = layer_reference(p, x, HEADS, approximate=False)
    np.testing.assert_allclose(np.asarray(f(p, x)), exact, rtol=1e-12, atol=1e-12)
    assert np.abs(exact - layer_reference(p, x, HEADS)).max() > 1e-6


@pytest.mark.parametrize("dtype, tol", [("float32", 2e-5), ("bfloat16", 3e-2)])
@pytest.mark.parametrize("config", ["tp", "sp"])
def test_layer_forward_mixed_precision(config, dtype, tol):
    """Parameters and activations in float32 or bfloat16 (GEMMs in that dtype, norms and softmax in
    float32), against the float64 reference on the same rounded inputs."""
    import ml_dtypes

    rng = np.random.default_rng(1)
    p, x = _inputs(rng, "float64")
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
    p, x = {k: v.astype(np_dtype) for k, v in p.items()}, x.astype(np_dtype)
    got = np.asarray(layer_fn(config)(p, x)).astype(np.float64)
    want = layer_reference(p, x, HEADS)
    assert got.dtype == np.float64 and np.linalg.norm(got - want) <= tol * np.linalg.norm(want)


@pytest.mark.parametrize("config", ["tp", "sp", "dp x sp"])
def test_layer_gradients_against_central_differences(config):
    kind, kw, _ = CONFIGS[config]
    rng = np.random.default_rng(2)
    p, x = _inputs(rng)
    r = rng.standard_normal(x.shape)
    grads = sf.jit(sf.grad(lambda p, x, r: (transformer_layer(p, x, HEADS, **kw) * r).sum()),
                   mesh=mesh_of(kind))(p, x, r)
    numeric, analytic = directional(lambda q: float((layer_reference(q, x, HEADS) * r).sum()), p, grads, rng)
    assert abs(numeric - analytic) <= 1e-6 * (1 + abs(numeric)), (numeric, analytic)


GPT = dict(vocab=16, hidden=HIDDEN, layers=2, seq=SEQ)


def _gpt(rng, dtype="float64", scale=0.3):
    p = init_gpt(rng, GPT["vocab"], GPT["hidden"], GPT["layers"], GPT["seq"], dtype, scale)
    ids = rng.integers(0, GPT["vocab"], (BATCH, SEQ)).astype(np.int32)
    return p, ids, np.roll(ids, -1, axis=1)  # the next token as the label


@pytest.mark.parametrize("config", ["replicated", "tp", "sp", "dp x sp"])
def test_gpt_loss_and_gradients(config):
    kind, kw, _ = CONFIGS[config]
    rng = np.random.default_rng(3)
    p, ids, labels = _gpt(rng)
    f = sf.jit(sf.value_and_grad(lambda p, i, l: gpt_loss(p, i, l, HEADS, **kw)), mesh=mesh_of(kind))
    value, grads = f(p, ids, labels)
    np.testing.assert_allclose(float(value), gpt_reference(p, ids, labels, HEADS), rtol=1e-12)
    numeric, analytic = directional(lambda q: gpt_reference(q, ids, labels, HEADS), p, grads, rng)
    assert abs(numeric - analytic) <= 1e-6 * (1 + abs(numeric)), (numeric, analytic)
    if kw.get("tp"):  # the vocabulary-parallel embedding's gradient stays sharded over the vocabulary
        assert grads["wte"].sharding.axes[0] == "tp"


def test_gpt_sgd_steps_with_donated_parameters_lower_the_loss():
    rng = np.random.default_rng(4)
    p, ids, labels = _gpt(rng, "float32", scale=0.1)
    mesh = mesh_of("1d")

    def step(p, ids, labels):
        loss, g = sf.value_and_grad(lambda p: gpt_loss(p, ids, labels, HEADS, tp="tp", sp=True, chunks=2))(p)
        return tree.tree_map(lambda w, d: w - 0.5 * d, p, g), loss
    train = sf.jit(step, mesh=mesh, donate_argnums=0)
    losses = []
    for _ in range(6):
        p, loss = train(p, ids, labels)
        losses.append(float(loss))
    assert losses[-1] < 0.8 * losses[0], losses
    text = str(train.lower(_gpt(rng, "float32")[0], ids, labels))
    updates = re.findall(r"(?:Sub|Fused) (p_\w+) <- \1, ", text)
    assert len(updates) == len(tree.leaves(p)), "every parameter updated in its own buffer"
