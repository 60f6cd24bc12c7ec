"""This session's CPU-tested features on the CuPy backend (4 virtual devices of the GPU there is), each
against the same program on NumPy devices (float64, fresh random inputs): attention-probability dropout
(grouped-query, causal), .set at repeated traced ids (the last write), NumPy's advanced indexing,
sf.Array x[:, t] as one plan, softmax where=, top_k's NaN first, a cond branch reading a value twice.
Skipped where CuPy is missing or sees no GPU."""
from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy", reason="CuPy is not installed")

from cases import gpu_count  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_count() == 0, reason="CuPy sees no GPU")]

import shardfuse as sf  # noqa: E402


def both(fn, *args):
    """fn jitted on 4 CuPy virtual devices and on 4 NumPy devices, called on args: (GPU's, NumPy's)."""
    out = []
    for backend in ("cupy", "numpy"):
        got = sf.jit(fn, mesh=sf.DeviceMesh(4, backend=backend))(*args)
        out.append([np.asarray(g.gather() if hasattr(g, "gather") else g) for g in sf.tree.leaves(got)])
    return out


def close(a, b, rtol=1e-12):
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=1e-13)


@pytest.mark.parametrize("broadcast", [True, False])
def test_attention_dropout_grouped_and_causal(broadcast):
    r = np.random.default_rng()
    q, k, v = r.standard_normal((2, 4, 8, 16)), r.standard_normal((2, 2, 8, 16)), r.standard_normal((2, 2, 8, 16))
    key = sf.random.key(5)
    close(*both(lambda q, k, v: sf.nn.attention(sf.shard(q, axis=1), k, v, causal=True, dropout_rate=0.3,
                                                dropout_rng=key, broadcast_dropout=broadcast), q, k, v))
    w = r.standard_normal((2, 4, 8, 16))
    close(*both(sf.grad(lambda q: (sf.nn.attention(q, k, v, dropout_rate=0.3, dropout_rng=key) * w).sum()), q))


def test_set_at_repeated_traced_ids_advanced_indexing_and_softmax_where():
    r = np.random.default_rng()
    x, ids, u = r.standard_normal((8, 8)), np.array([5, 2, 5, -3, 11, 2, 0]), r.standard_normal(7)
    close(*both(lambda a, i, w: sf.shard(a, axis=0).at[i, 1].set(w), x, ids, u))
    rows, last = np.arange(8), r.integers(0, 8, 8)
    close(*both(lambda a, j: (a[rows, j], a[3, j], a[j % 8, 2]), x, last))
    mask = r.random((8, 8)) > 0.3
    close(*both(lambda a: (sf.nn.softmax(sf.shard(a, axis=1), where=mask), sf.nn.log_softmax(a, where=mask)), x))


def test_an_arrays_int_index_and_top_k_and_a_cond_read_twice():
    r = np.random.default_rng()
    x = r.standard_normal((4, 6, 2))
    placed = sf.shard(x, axis=1, mesh=sf.DeviceMesh(2, backend="cupy"))
    for t in range(-2, 3):
        np.testing.assert_array_equal(np.asarray(placed[:, t % 6].gather()), x[:, t % 6])
        np.testing.assert_array_equal(np.asarray(placed[t].gather()), x[t])
    y = np.array([[1.0, np.nan, 3.0, -np.inf], [np.inf, 0.0, 2.0, 5.0]])
    (gv, gi), (nv, ni) = both(lambda a: sf.top_k(a, 3), y)
    np.testing.assert_array_equal(gi, ni)
    np.testing.assert_array_equal(gv, nv)
    z = r.standard_normal(4) + 0.1
    close(*both(sf.grad(lambda a: sf.lax.cond(a.sum() > -1e9, lambda v: v * v, np.sin, a).sum()), z))
