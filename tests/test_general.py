"""Beyond the seed: pipelined GEMM+ReduceScatter, 2-D meshes, and property-based checks."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shardfuse as sf
from cases import assert_close, natural_case, seed_case


def gemm_rs(x, w):
    """Row-parallel linear, produced chunk by chunk: each chunk's partial sums are
    reduce-scattered on its stream while the next chunk's GEMM runs."""
    x = sf.shard(x, axis=2)
    w = sf.shard(w, axis=0)
    return sf.stream(sf.shard(x @ w, axis=1), axis=0)


@pytest.mark.parametrize("d", [1, 2, 4])
@pytest.mark.parametrize("streams", [1, 3])
def test_pipelined_gemm_reduce_scatter(d, streams):
    mesh = sf.DeviceMesh(d, backend="numpy")
    f = sf.jit(gemm_rs, mesh=mesh, streams=streams)
    rng = np.random.default_rng()
    x, w = rng.standard_normal((4, 2 * d, 3 * d)), rng.standard_normal((3 * d, 5))
    plan = f.lower(sf.TensorSpec(x.shape, "float64"), sf.TensorSpec(w.shape, "float64"))
    text = str(plan)
    assert "    Matmul c_partial_i <- x_i @ w\n" in text
    # (at D = 1 the identity: a copy into the chunk of the output, no collective; passes/fold.py)
    assert ("    rs = ReduceScatter c_i <- c_partial_i, team=DIDx, axis=1\n" in text) == (d > 1)
    assert plan.collectives() == ({"reduce_scatter": 4} if d > 1 else {})
    out = f(x, w)
    assert out.sharding.placements(mesh) == ("S(1)",)
    assert_close(out.gather(), x @ w, "float64")


def test_2d_mesh_allgather_over_one_axis():
    mesh = sf.DeviceMesh((2, 2), backend="numpy")

    @sf.jit(mesh=mesh)
    def f(a, b):
        a = sf.shard(sf.shard(a, axis=1, over="DIDx"), axis=2, over="DIDy")
        return sf.stream(sf.shard(a @ b, axis=2, over="DIDy"), axis=0)

    rng = np.random.default_rng()
    a, b = rng.standard_normal((4, 2, 4, 8)), rng.standard_normal((8, 3))
    plan = f.lower(sf.TensorSpec(a.shape, "float64"), sf.TensorSpec(b.shape, "float64"))
    assert "ag = Allgather a_gathered_i <- a_i, team=DIDx, axis=1" in str(plan)
    assert plan.collectives() == {"allgather": 4}
    out = f(a, b)
    assert out.sharding.placements(mesh) == ("S(2)", "R")
    assert_close(out.gather(), a @ b, "float64")


def test_named_mesh_axes():
    mesh = sf.DeviceMesh((2, 2), ("dp", "tp"), backend="numpy")
    f = sf.jit(lambda x, w: sf.replicate(sf.shard(x, axis=0, over="dp") @ sf.shard(w, axis=1, over="tp")), mesh=mesh)
    rng = np.random.default_rng()
    x, w = rng.standard_normal((4, 3)), rng.standard_normal((3, 6))
    plan = f.lower(sf.TensorSpec(x.shape, "float64"), sf.TensorSpec(w.shape, "float64"))
    # a replicated product needs both operands whole: x gathered over dp, w over tp
    assert plan.collectives() == {"allgather": 2}
    text = str(plan)
    assert "Allgather x_gathered <- x, team=dp, axis=0" in text
    # w's columns gather into a staging buffer stored as 2 blocks of axis 1, copied into place after the Wait
    assert ("  w_gathered_staged = Allocate f64[3, 6]  (once, as 2 blocks of axis 1)\n"
            "  ag_1 = Allgather w_gathered_staged <- w, team=tp, axis=1\n  Wait ag_1\n"
            "  Copy w_gathered <- w_gathered_staged\n") in text
    assert_close(f(x, w).gather(), x @ w, "float64")


@settings(max_examples=40, deadline=None)
@given(d=st.integers(1, 4), chunks=st.integers(1, 4), streams=st.integers(1, 4), m=st.integers(1, 3),
       k=st.integers(1, 5), n=st.integers(1, 4), b_sharded=st.booleans(), natural=st.booleans(),
       dtype=st.sampled_from(["float32", "float64"]))
def test_random_shapes_meshes_annotations(d, chunks, streams, m, k, n, b_sharded, natural, dtype):
    mesh = sf.DeviceMesh(d, backend="numpy")
    case = natural_case if natural else seed_case
    case(mesh, chunks, streams, dtype, b_sharded, m=m, k=k, n=n)


def test_placements_in_dtensor_words():
    mesh = sf.DeviceMesh((2, 2), ("dp", "tp"), backend="numpy")
    x = sf.shard(np.random.default_rng().standard_normal((4, 6)), axis=1, over="tp", mesh=mesh)
    assert x.placements == (sf.Replicate(), sf.Shard(1))
    assert [str(p) for p in x.placements] == ["R", "S(1)"] and repr(sf.Shard(1)) == "Shard(dim=1)"
    f = sf.jit(lambda a: sf.shard(a, axis=1, over="tp").sum(1), mesh=mesh)
    plan = f.lower(sf.TensorSpec((4, 6), "float64"))
    partial = [i.into for i in plan.program.walk() if i.op == "sum"][0]
    from shardfuse.placements import placements_of

    assert placements_of(partial.type.layout, mesh) == (sf.Replicate(), sf.Partial())


def test_backward_propagation_splits_work_instead_of_slicing_after():
    """h is needed column-sharded by the row-parallel GEMM: it is computed sharded from a local
    slice of x, rather than computed whole and sliced afterwards."""
    mesh = sf.DeviceMesh(4, backend="numpy")

    @sf.jit(mesh=mesh)
    def f(x, w):
        h = sf.gelu(x * 2.0)
        return h @ sf.shard(w, axis=0)

    rng = np.random.default_rng()
    x, w = rng.standard_normal((8, 12)), rng.standard_normal((12, 3))
    plan = f.lower(sf.TensorSpec(x.shape, "float64"), sf.TensorSpec(w.shape, "float64"))
    lines = str(plan).splitlines()
    assert lines[2] == "  x_sliced: f64[8, 12:DIDx] = ShardSlice x, axis=1, team=DIDx"
    assert "  g = Allocate f64[8, 12:DIDx]  (once)" in lines
    assert plan.collectives() == {"allreduce": 1}
    h = 2 * x
    ref = (0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h ** 3)))) @ w
    assert_close(f(x, w).gather(), ref, "float64")


@pytest.mark.parametrize("d", [1, 2])
def test_reshape_keeps_outermost_sharding(d):
    mesh = sf.DeviceMesh(d, backend="numpy")
    rng = np.random.default_rng()
    x = rng.standard_normal((4, 6, 8))
    merge = sf.jit(lambda x: (sf.shard(x, axis=0) * 2.0).reshape(24, 8), mesh=mesh)
    out = merge(x)
    assert out.placements == (sf.Shard(0),) and merge.lower(sf.TensorSpec(x.shape, "float64")).collectives() == {}
    assert_close(out.gather(), 2 * x.reshape(24, 8), "float64")
    split = sf.jit(lambda x: sf.shard(x, axis=1).reshape(4, 2, 3, -1), mesh=mesh)
    out = split(x)
    assert out.placements == (sf.Shard(1),)
    assert_close(out.gather(), x.reshape(4, 2, 3, 8), "float64")


def test_reshape_across_a_sharded_boundary_gathers_the_cut_axis():
    """From a new-user probe: the README says a sharded axis a reshape cuts across is gathered
    first, but a reshape whose result had no annotation was refused ('crosses the boundary')."""
    mesh = sf.DeviceMesh(2, backend="numpy")
    x = np.random.default_rng(0).standard_normal((4, 6, 8))
    f = sf.jit(lambda x: sf.shard(x, axis=1).reshape(24, 8), mesh=mesh)
    assert f.lower(sf.TensorSpec((4, 6, 8), "float64")).collectives() == {"allgather": 1}
    assert_close(f(x).gather(), x.reshape(24, 8), "float64")
    mesh = sf.DeviceMesh((2, 2), ("dp", "tp"), backend="numpy")  # only the cut axis is gathered
    f = sf.jit(lambda x: sf.shard(sf.shard(x, axis=1, over="tp"), axis=2, over="dp").reshape(24, 8), mesh=mesh)
    out = f(x)
    assert out.placements == (sf.Shard(1), sf.Replicate()) and f.lower(x).collectives() == {"allgather": 1}
    assert_close(out.gather(), x.reshape(24, 8), "float64")
    loss = lambda x: (sf.shard(x, axis=1, over="tp").reshape(24, 8) ** 2).sum()
    assert_close(sf.jit(sf.grad(loss), mesh=mesh)(x).gather(), 2 * x, "float64")
    with pytest.raises(ValueError, match=r"cannot reshape \(4, 6\) \(24 elements\) to \(5, 5\)"):
        sf.jit(lambda x: x.reshape(5, 5), mesh=mesh).lower(sf.TensorSpec((4, 6)))


def test_ops_table_against_numpy():
    mesh = sf.DeviceMesh(4, backend="numpy")

    @sf.jit(mesh=mesh)
    def f(x, y, b):
        x = sf.shard(x, axis=1)
        z = sf.relu(-x) - sf.exp(x) / 2.0 + sf.tanh(x) * y + b
        return sf.replicate(z.T.T), (x * 3.0).mean(1), sf.linear(x, y.T, None).sum(0)

    rng = np.random.default_rng()
    x, y, b = rng.standard_normal((8, 12)), rng.standard_normal((8, 12)), rng.standard_normal(12)
    z, m, s = f(x, y, b)
    assert_close(z.gather(), np.maximum(-x, 0) - np.exp(x) / 2 + np.tanh(x) * y + b, "float64")
    assert_close(m.gather(), (3 * x).mean(1), "float64")
    assert_close(s.gather(), (x @ y.T).sum(0), "float64")
