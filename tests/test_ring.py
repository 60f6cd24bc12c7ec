"""The ring variant of the pipelined AllGather+GEMM: Send/Recv around the mesh axis, S = D."""
import numpy as np
import pytest

import shardfuse as sf
from cases import assert_close, fresh_rng


def ring_seed(a, b):
    return sf.stream(sf.shard(a, axis=1) @ b, axis=1, algorithm="ring")


def ring_natural(x, w):
    return sf.stream(sf.shard(x, axis=0) @ w, axis=0, algorithm="ring")


@pytest.mark.parametrize("streams", [1, 2])
@pytest.mark.parametrize("d", [1, 2, 3, 4])
def test_ring_seed_layout(d, streams):
    mesh = sf.DeviceMesh(d, backend="numpy")
    f = sf.jit(ring_seed, mesh=mesh, streams=streams)
    rng = fresh_rng(mesh)
    a, b = rng.standard_normal((3, d, 4, 8)), rng.standard_normal((8, 5))
    plan = f.lower(sf.TensorSpec(a.shape, "float64"), sf.TensorSpec(b.shape, "float64"))
    assert plan.collectives() == ({"sendrecv": d - 1} if d > 1 else {})
    assert "allgather" not in str(plan).lower()
    assert_close(f(a, b).gather(), a @ b, "float64")


@pytest.mark.parametrize("d", [1, 2, 4])
def test_ring_natural_layout(d):
    mesh = sf.DeviceMesh(d, backend="numpy")
    f = sf.jit(ring_natural, mesh=mesh)
    rng = fresh_rng(mesh)
    x, w = rng.standard_normal((4 * d, 8)).astype("float32"), rng.standard_normal((8, 5)).astype("float32")
    out = f(x, w)
    assert out.sharding.placements(mesh) == ("R",)
    assert_close(out.gather(), x.astype(np.float64) @ w, "float32")


def test_ring_plan_text():
    mesh = sf.DeviceMesh(4, backend="numpy")
    text = str(sf.jit(ring_natural, mesh=mesh).lower(sf.TensorSpec((16, 8), "float64"), sf.TensorSpec((8, 5), "float64")))
    body = [line.strip() for line in text.splitlines() if line.startswith("    ")]
    assert body == [
        "SetCurrentStream Stream(0)",
        "WaitEvent entry",
        "[i > 0] WaitEvent done[i - 1]",
        "x_split_i: f64[1, 4, 8] = Select x_split_ring, index=i % 2",
        "x_split_next: f64[1, 4, 8] = Select x_split_ring, index=(i + 1) % 2",
        "[i < 3] sr = SendRecv x_split_next <- x_split_i, team=DIDx, shift=1",
        "[i < 3] Wait sr",
        "arrived[i] = RecordEvent Stream(0)",
        "SetCurrentStream Stream(1)",
        "WaitEvent entry",
        "[i > 0] WaitEvent arrived[i - 1]",
        "c_split_i: f64[1, 4, 5] = Slice c_split, axis=0, index=(rank(DIDx) - i) % 4",
        "Matmul c_split_i <- x_split_i @ w",
        "done[i] = RecordEvent Stream(1)",
        "SetCurrentStream main",
        "Synchronize Stream(0)",
        "Synchronize Stream(1)",
    ]


def test_ring_needs_a_sharded_stream_axis():
    mesh = sf.DeviceMesh(2, backend="numpy")
    f = sf.jit(lambda x, w: sf.stream(x @ w, axis=0, algorithm="ring"), mesh=mesh)
    with pytest.raises(ValueError, match="algorithm='ring' streams c along axis 0, but no input shards that axis"):
        f.lower(sf.TensorSpec((8, 4)), sf.TensorSpec((4, 4)))


@pytest.mark.parametrize("chunks", [None, 4])
def test_ring_chunks_are_the_devices(chunks):
    mesh, rng = sf.DeviceMesh(4, backend="numpy"), np.random.default_rng()
    f = sf.jit(lambda x, w: sf.stream(sf.shard(x, axis=0) @ w, axis=0, chunks=chunks, algorithm="ring"), mesh=mesh)
    x, w = rng.standard_normal((16, 8)), rng.standard_normal((8, 4))
    np.testing.assert_allclose(f(x, w).gather(), x @ w, rtol=1e-12, atol=1e-12)


def test_ring_refuses_other_chunks():
    mesh = sf.DeviceMesh(2, backend="numpy")
    f = sf.jit(lambda x, w: sf.stream(sf.shard(x, axis=0) @ w, axis=0, chunks=4, algorithm="ring"), mesh=mesh)
    with pytest.raises(ValueError, match=r"chunks must be 2 \(or omitted\), got 4"):
        f.lower(sf.TensorSpec((8, 4)), sf.TensorSpec((4, 4)))


def test_unknown_algorithm():
    f = sf.jit(lambda x: sf.stream(x, axis=0, algorithm="tree"), mesh=sf.DeviceMesh(2, backend="numpy"))
    with pytest.raises(ValueError, match=r"algorithm must be one of \('collective', 'ring'\), got 'tree'"):
        f.lower(sf.TensorSpec((8, 4)))


def ring_with_bias(x, w, b):
    return sf.stream(sf.shard(x, axis=0) @ w.T + b, axis=0, algorithm="ring")


@pytest.mark.parametrize("d", [1, 2, 4])
def test_ring_with_a_bias_inside_the_stream(d):
    """sf.stream(x @ w.T + b, axis=0, algorithm="ring") (issue 31): the ring streams the product and
    the bias is added to the whole result after it, as algorithm="collective" gives (its values)."""
    mesh = sf.DeviceMesh(d, backend="numpy")
    rng = fresh_rng(mesh)
    x, w, b = rng.standard_normal((4 * d, 8)), rng.standard_normal((6, 8)), rng.standard_normal(6)
    f = sf.jit(ring_with_bias, mesh=mesh)
    plan = f.lower(x, w, b)
    assert plan.collectives() == ({"sendrecv": d - 1} if d > 1 else {})
    out = f(x, w, b)
    assert out.sharding.placements(mesh) == ("R",)
    assert_close(out.gather(), x @ w.T + b, "float64")
    g = sf.jit(lambda x, w, b: sf.stream(sf.gelu(sf.shard(x, axis=0) @ w + b) * 2.0 - x[:, :1], axis=0,
                                         algorithm="ring"), mesh=mesh)
    h = x @ w.T + b
    want = h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h ** 3))) - x[:, :1]
    assert_close(g(x, w.T.copy(), b).gather(), want, "float64")


def test_ring_of_a_sum_of_two_products_is_refused():
    f = sf.jit(lambda x, w: sf.stream(sf.shard(x, axis=0) @ w + sf.shard(x, axis=0) @ w, axis=0, algorithm="ring"),
               mesh=sf.DeviceMesh(2, backend="numpy"))
    with pytest.raises(ValueError, match=r"algorithm='ring' streams the result of a matmul .* is no such result"):
        f.lower(sf.TensorSpec((8, 4)), sf.TensorSpec((4, 4)))
