"""sf.nn.attention's dropout of attention probabilities (flax.linen.dot_product_attention's dropout_rate,
dropout_rng, broadcast_dropout) against a float64 NumPy reference with the same keep mask, the same on
every mesh (heads sharded, grouped-query heads grouped or repeated), its gradient against central
differences, on sf.Arrays outside sf.jit; and the masks it refuses (an integer 0 / 1 mask, which was
added to the scores as a bias)."""
from __future__ import annotations

import numpy as np
import pytest

import shardfuse as sf
from cases import directional

B, H, S, D = 2, 4, 6, 8


def np_attention(q, k, v, keep, rate, causal):
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.where(keep, p / (1 - rate), 0) @ v


@pytest.mark.parametrize("broadcast", [True, False])
@pytest.mark.parametrize("devices", [1, 2, 4])
def test_attention_dropout_drops_the_same_probabilities_on_every_mesh(broadcast, devices):
    r = np.random.default_rng()
    q, k, v = (r.standard_normal((B, H, S, D)) for _ in range(3))
    key, rate = sf.random.key(int(r.integers(1 << 30))), 0.3
    f = sf.jit(lambda q, k, v, key: sf.nn.attention(sf.shard(q, axis=1), sf.shard(k, axis=1), sf.shard(v, axis=1),
                                                   causal=True, dropout_rate=rate, dropout_rng=key,
                                                   broadcast_dropout=broadcast), mesh=sf.DeviceMesh(devices))
    assert f.lower(q, k, v, key).collectives() == {}  # (the mask drawn where the heads lie)
    keep = np.asarray(sf.random.bernoulli(key, 1 - rate, (1, 1, S, S) if broadcast else (B, H, S, S)))
    assert 0 < keep.mean() < 1
    np.testing.assert_allclose(np.asarray(f(q, k, v, key)), np_attention(q, k, v, keep, rate, True), rtol=1e-12,
                               atol=1e-12)


def test_grouped_query_dropout_is_the_same_grouped_or_repeated():
    """Two kv heads: on one device q's heads are viewed as [kv heads, G]; over 4 devices k and v are
    repeated; the mask is drawn in q's heads either way."""
    r = np.random.default_rng()
    q, k, v = r.standard_normal((B, H, S, D)), r.standard_normal((B, 2, S, D)), r.standard_normal((B, 2, S, D))
    key = sf.random.key(7)
    outs = [np.asarray(sf.jit(lambda q, k, v, key: sf.nn.attention(sf.shard(q, axis=1), k, v, dropout_rate=0.25,
                                                                  dropout_rng=key, broadcast_dropout=False),
                              mesh=sf.DeviceMesh(n))(q, k, v, key)) for n in (1, 4)]
    keep = np.asarray(sf.random.bernoulli(key, 0.75, (B, H, S, S)))
    want = np_attention(q, np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1), keep, 0.25, False)
    for got in outs:
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_attention_dropout_gradient_and_on_sf_arrays():
    r = np.random.default_rng()
    q, k, v = (r.standard_normal((B, H, S, D)) for _ in range(3))
    key, mesh = sf.random.key(3), sf.DeviceMesh(2)
    w = r.standard_normal((B, H, S, D))

    def loss(q, k, v):
        return (sf.nn.attention(q, k, v, dropout_rate=0.4, dropout_rng=key) * w).sum()
    grads = sf.jit(sf.grad(loss, argnums=(0, 1, 2)), mesh=mesh)(q, k, v)
    keep = np.asarray(sf.random.bernoulli(key, 0.6, (1, 1, S, S)))
    for j, g in enumerate(grads):
        def ref(t, j=j):
            args = [q, k, v]
            args[j] = t
            return (np_attention(*args, keep, 0.4, False) * w).sum()
        want, got = directional(ref, [q, k, v][j], np.asarray(g), r)
        np.testing.assert_allclose(got, want, rtol=1e-6)
    placed = [sf.shard(t, axis=1, mesh=mesh) for t in (q, k, v)]
    eager = sf.nn.attention(*placed, dropout_rate=0.4, dropout_rng=key)
    np.testing.assert_allclose(np.asarray(eager), np_attention(q, k, v, keep, 0.4, False), rtol=1e-12, atol=1e-12)
    dropped = sf.nn.attention(*placed, dropout_rate=1.0, dropout_rng=key)
    np.testing.assert_array_equal(np.asarray(dropped), 0.0)


def test_attention_refuses_an_integer_mask_and_a_rate_without_a_key():
    r = np.random.default_rng()
    q, k, v = (r.standard_normal((B, H, S, D)) for _ in range(3))
    am = np.ones((B, S), np.int64)
    am[0, 4:] = 0
    mesh = sf.DeviceMesh(2)
    for causal in (False, True):
        with pytest.raises(TypeError, match=r"mask must be boolean .* got int64; .* mask != 0"):
            sf.jit(lambda q, m: sf.nn.attention(q, k, v, causal=causal, mask=m[:, None, None, :]), mesh=mesh)(q, am)
    got = sf.jit(lambda q, m: sf.nn.attention(q, k, v, mask=m[:, None, None, :] != 0), mesh=mesh)(q, am)
    keep = np.broadcast_to(am[:, None, None, :] != 0, (B, H, S, S))
    s = np.where(keep, q @ np.swapaxes(k, -1, -2) / np.sqrt(D), -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(got), p / p.sum(-1, keepdims=True) @ v, rtol=1e-12)
    with pytest.raises(TypeError, match="dropout_rate=0.1 needs a key"):
        sf.jit(lambda q: sf.nn.attention(q, k, v, dropout_rate=0.1), mesh=mesh)(q)
    with pytest.raises(ValueError, match=r"dropout_rate must be a number in \[0, 1\], got 1.5"):
        sf.jit(lambda q: sf.nn.attention(q, k, v, dropout_rate=1.5, dropout_rng=sf.random.key(0)), mesh=mesh)(q)
    with pytest.raises(TypeError, match=r"sf.nn.attention takes values inside an sf.jit function"):
        sf.nn.attention(q, k, v)  # (NumPy arrays: the public name, not a private body's)


@pytest.mark.parametrize("with_bias, with_mask, causal", [(False, False, False), (True, False, True),
                                                          (False, True, False), (True, True, True)])
def test_jax_dot_product_attention_in_jaxs_layout(with_bias, with_mask, causal):
    """jax.nn.dot_product_attention's signature and [batch, seq, heads, head_dim] layout, a bias and a
    boolean mask together, heads sharded; its keywords shardfuse lacks refused by name."""
    r = np.random.default_rng()
    q, k, v = (r.standard_normal((B, S, H, D)) for _ in range(3))
    bias = r.standard_normal((1, H, S, S)) if with_bias else None
    mask = r.random((B, 1, S, S)) > 0.3 if with_mask else None
    s = np.einsum("bqnh,bknh->bnqk", q, k) / np.sqrt(D) + (0 if bias is None else bias)
    keep = np.ones(s.shape, bool) & (True if mask is None else mask) & (np.tril(np.ones((S, S), bool)) if causal else True)
    s = np.where(keep, s, -0.7 * np.finfo(np.float64).max)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("bnqk,bknh->bqnh", p / p.sum(-1, keepdims=True), v)
    f = sf.jit(lambda q, k, v: sf.nn.dot_product_attention(sf.shard(q, axis=2), sf.shard(k, axis=2), sf.shard(v, axis=2),
                                                           bias, mask, is_causal=causal), mesh=sf.DeviceMesh(2))
    assert f.lower(q, k, v).collectives() == {}
    np.testing.assert_allclose(np.asarray(f(q, k, v)), want, rtol=1e-12, atol=1e-14)
    with pytest.raises(TypeError, match=r"sf.nn.dot_product_attention: query_seq_lengths= not supported"):
        sf.jit(lambda q: sf.nn.dot_product_attention(q, k, v, query_seq_lengths=np.array([3, 4])), mesh=sf.DeviceMesh(2))(q)
    with pytest.raises(TypeError, match=r"sf.nn.softmax\(x, axis=-1, where=None\): got an unexpected keyword argument "
                                        r"'initial'"):
        sf.jit(lambda q: sf.nn.softmax(q, initial=0.0), mesh=sf.DeviceMesh(2))(q)


@pytest.mark.parametrize("shapes", [((1, 4, S, D), (3, 2, 7, D), None),  # (grouped; q's batch of 1 broadcast)
                                    ((S, D), (4, 7, D), None),  # (q without heads beside k's)
                                    ((H, S, D), (H, 7, D), (3, H, S, 7))])  # (a mask with a batch axis more)
def test_per_element_dropout_covers_every_broadcast_axis(shapes):
    """A review: a grouped-query q whose batch broadcasts against k's failed to reshape back, and with
    broadcast_dropout=False the mask was shared along axes only k or the mask has."""
    r = np.random.default_rng()
    (qs, ks, ms), key = shapes, sf.random.key(11)
    q, k, v = r.standard_normal(qs), r.standard_normal(ks), r.standard_normal(ks)
    mask = None if ms is None else r.random(ms) > 0.2
    out = sf.jit(lambda q, k, v: sf.nn.attention(q, k, v, mask=mask, dropout_rate=0.3, dropout_rng=key,
                                                 broadcast_dropout=False), mesh=sf.DeviceMesh(1))(q, k, v)
    g = q.shape[-3] // k.shape[-3] if q.ndim == k.ndim == 4 else 1
    k, v = np.repeat(k, g, axis=-3), np.repeat(v, g, axis=-3)
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(D)
    s = s if mask is None else np.where(mask, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    keep = np.asarray(sf.random.bernoulli(key, 0.7, p.shape))
    np.testing.assert_allclose(np.asarray(out), np.where(keep, p / 0.7, 0) @ v, rtol=1e-12, atol=1e-13)


def test_dot_product_attention_takes_jaxs_none_keywords_and_casts_a_bias_to_the_operands_dtype():
    """A review: implementation=None (what JAX code passes) was refused, a float32 bias made float16
    operands' result float32 (JAX's stays float16), an int bias was refused as a mask; dropout_rate=False and
    broadcast_dropout='no' were taken."""
    r = np.random.default_rng()
    q, k, v = (r.standard_normal((2, S, H, D)).astype(np.float16) for _ in range(3))
    bias, mesh = r.standard_normal((1, H, S, S)).astype(np.float32), sf.DeviceMesh(1)
    out = sf.jit(lambda q, k, v: sf.nn.dot_product_attention(q, k, v, bias, implementation=None,
                                                             query_seq_lengths=None), mesh=mesh)(q, k, v)
    assert out.dtype == np.float16
    with pytest.raises(TypeError, match="bias must be a float array added to the scores, got int32"):
        sf.jit(lambda q: sf.nn.dot_product_attention(q, k, v, bias.astype(np.int32)), mesh=mesh)(q)
    with pytest.raises(TypeError, match="dropout_rate must be a number in \\[0, 1\\], got False"):
        sf.jit(lambda q: sf.nn.attention(q, k, v, dropout_rate=False, dropout_rng=sf.random.key(0)), mesh=mesh)(q)
    with pytest.raises(TypeError, match="broadcast_dropout takes True or False, got 'no'"):
        sf.jit(lambda q: sf.nn.attention(q, k, v, dropout_rate=0.1, dropout_rng=sf.random.key(0),
                                         broadcast_dropout="no"), mesh=mesh)(q)


def test_grouped_query_attention_of_closed_over_numpy_keys_on_more_devices_than_kv_heads():
    """Found writing this session's GPU test: with k and v NumPy arrays closed over and q's heads over 4
    devices (2 kv heads: k and v repeated), sf.repeat refused the NumPy k; sf.nn functions take NumPy arrays
    beside traced values as constants."""
    r = np.random.default_rng()
    q, k, v = r.standard_normal((B, H, S, D)), r.standard_normal((B, 2, S, D)), r.standard_normal((B, 2, S, D))
    got = sf.jit(lambda q: sf.nn.attention(sf.shard(q, axis=1), k, v), mesh=sf.DeviceMesh(4))(q)
    s = q @ np.swapaxes(np.repeat(k, 2, axis=1), -1, -2) / np.sqrt(D)
    p = np.exp(s - s.max(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(got), p / p.sum(-1, keepdims=True) @ np.repeat(v, 2, axis=1), rtol=1e-12)
