"""sf.checkpoint (jax.checkpoint): the backward traces a function again instead of keeping its
intermediates; gradients are the same numbers, the plan holds less memory with several layers,
reshardings are done again (never shared with the forward's), and the forward alone is unchanged."""
from __future__ import annotations

import functools

import numpy as np
import pytest

import shardfuse as sf
from shardfuse import tree
from shardfuse.transformer import gpt_loss, gpt_reference, init_gpt
from test_nn import mesh_of  # (the 1-D tp mesh and the 2x2 dp x tp mesh, NumPy devices)


def gpt_case(rng, layers=3):  # (also tests/test_gpu_grad.py's)
    vocab, hidden, seq, batch = 32, 16, 8, 2
    params = init_gpt(rng, vocab, hidden, layers, seq, "float64", 0.3)
    ids = rng.integers(0, vocab, (batch, seq)).astype(np.int32)
    labels = rng.integers(0, vocab, (batch, seq)).astype(np.int32)
    return params, ids, labels


def checkpointed_step(mesh, checkpoint, **kw):
    return sf.jit(sf.value_and_grad(lambda p, i, t: gpt_loss(p, i, t, 4, checkpoint=checkpoint, **kw)), mesh=mesh)


@pytest.mark.parametrize("kind, kw", [("1d", {}), ("1d", {"tp": "tp", "sp": True, "chunks": 2}),
                                      ("2d", {"tp": "tp", "sp": True, "chunks": 2, "dp": "dp"})])
def test_gradients_are_the_same_numbers(kind, kw):
    mesh = mesh_of(kind)
    params, ids, labels = gpt_case(np.random.default_rng(1))
    (v0, g0), (v1, g1) = (checkpointed_step(mesh, ck, **kw)(params, ids, labels) for ck in (False, True))
    np.testing.assert_allclose(float(v1), gpt_reference(params, ids, labels, 4), rtol=1e-12)
    assert float(v0) == float(v1)
    for a, b in zip(tree.leaves(g0), tree.leaves(g1)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-12, atol=1e-15)
        assert a.sharding == b.sharding


def test_the_backward_traces_each_layer_again_and_gathers_again():
    """Sequence parallel: each layer's GEMMs and AllGathers appear again in the backward (the
    recomputed reshardings are not shared with the forward's, JAX's prevent_cse)."""
    mesh = mesh_of("1d")
    params, ids, labels = gpt_case(np.random.default_rng(2))
    kw = {"tp": "tp", "sp": True, "chunks": 2}
    plain, again = (checkpointed_step(mesh, ck, **kw).lower(params, ids, labels) for ck in (False, True))
    count = lambda p, word: str(p).count(f"= {word}") + str(p).count(f" {word} ")  # noqa: E731
    assert count(again, "Matmul") > count(plain, "Matmul")
    assert again.collectives()["allgather"] > plain.collectives()["allgather"]


def test_a_gather_of_an_input_is_done_again_not_kept():
    """A layer that gathers its sharded input: the backward gathers it again (a shared gather
    would keep the gathered input alive from the forward into the backward)."""
    mesh = mesh_of("1d")
    rng = np.random.default_rng(6)
    x, w = sf.shard(rng.standard_normal((8, 6)), axis=0, mesh=mesh), rng.standard_normal((6, 6))

    def layer(w, x):
        return np.tanh(sf.replicate(x) @ w)
    counts = [sf.jit(sf.grad(lambda w, x: (f(w, x) ** 2).sum()), mesh=mesh).lower(w, x).collectives()["allgather"]
              for f in (layer, sf.checkpoint(layer))]
    assert counts[1] == counts[0] + 1, counts


def test_several_layers_hold_less_memory():
    """A 4-layer GPT's training step (hidden 64, seq 64): with each layer checkpointed the plan
    keeps one layer's activations at a time."""
    mesh = sf.DeviceMesh(1, backend="numpy")
    rng = np.random.default_rng(3)
    params = init_gpt(rng, 64, 64, 4, 64, "float32")
    ids = rng.integers(0, 64, (4, 64)).astype(np.int32)
    step = lambda ck: sf.jit(sf.grad(lambda p, i, t: gpt_loss(p, i, t, 4, checkpoint=ck)), mesh=mesh)  # noqa: E731
    plain, again = (step(ck).lower(params, ids, ids).memory()["persistent"] for ck in (False, True))
    assert again < 0.6 * plain, (plain, again)


def test_the_forward_alone_is_the_function():
    mesh = mesh_of("1d")
    params, ids, labels = gpt_case(np.random.default_rng(4))
    texts = [str(sf.jit(lambda p, i, t: gpt_loss(p, i, t, 4, checkpoint=ck), mesh=mesh).lower(params, ids, labels))
             for ck in (False, True)]
    assert texts[0] == texts[1]


def test_outside_jit_an_argument_twice_and_kwargs():
    mesh = mesh_of("1d")
    rng = np.random.default_rng(5)
    ws, xs = rng.standard_normal((6, 6)), rng.standard_normal((8, 6))

    @sf.checkpoint
    def layer(w, x, v, scale=1.0):
        return np.tanh(x @ w) * v * scale
    g = sf.grad(lambda w, x: layer(w, x, x, scale=2.0).sum(), argnums=(0, 1))(
        sf.replicate(ws, mesh=mesh), sf.shard(xs, axis=0, mesh=mesh))
    t = np.tanh(xs @ ws)
    dz = 2.0 * xs * (1 - t * t)
    np.testing.assert_allclose(np.asarray(g[0]), xs.T @ dz, rtol=1e-12)
    np.testing.assert_allclose(np.asarray(g[1]), dz @ ws.T + 2.0 * t, rtol=1e-12)


def test_refusals():
    mesh = mesh_of("1d")
    with pytest.raises(TypeError, match="wraps a function"):
        sf.checkpoint(3)
    f = sf.checkpoint(lambda x: (x.sum(), 3))
    with pytest.raises(TypeError, match="must return arrays"):
        sf.jit(sf.grad(lambda x: f(x)[0]), mesh=mesh).lower(sf.TensorSpec((4, 4), "float64"))


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_values_the_function_closes_over_get_their_gradient(jit):
    """A block that reads its weight from the enclosing scope (`@sf.checkpoint def block(x): return x @ w`)
    gave the weight a zero gradient, silently; jax.checkpoint differentiates closed-over values, and so
    does sf.checkpoint now: the same gradients as without it, the weight sharded over tp."""
    mesh = mesh_of("2d")
    r = np.random.default_rng(31)
    w1, w2, x = r.standard_normal((6, 8)), r.standard_normal((8, 6)), r.standard_normal((4, 6))

    def loss(w1, w2, x, remat):
        def block(h):
            return np.tanh(h @ sf.shard(w1, axis=1, over="tp")) @ w2
        return (sf.checkpoint(block)(x) if remat else block(x)).sum() ** 2
    grads = [sf.grad(functools.partial(loss, remat=remat), argnums=(0, 1, 2)) for remat in (True, False)]
    if jit:
        grads = [sf.jit(g, mesh=mesh) for g in grads]
        args = (w1, w2, x)
    else:
        args = tuple(sf.distribute(a, mesh, ()) for a in (w1, w2, x))
    for got, want in zip(grads[0](*args), grads[1](*args)):
        assert np.abs(np.asarray(want)).max() > 1e-3
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-12, atol=1e-12)
