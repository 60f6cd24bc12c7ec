"""sf.scatter_add(ids, values, size) (Op.SCATTER_ADD, issue 32) and the embedding's gradient, which is
one: values against np.add.at in float64 (repeated ids accumulating, negative ids from the end and
out-of-range ones dropped, as JAX's .at[].add) on replicated, vocab-sharded and position-sharded layouts, in and outside
jit, 16-bit values summed in float32; its collectives (none for a vocab-sharded result, one
Allreduce over a data-parallel axis); the gradient of sf.take exact against the same reference,
and its plan holding no [tokens, vocab] buffer (the one-hot GEMM it replaces did, pinned below
with plan.memory()).  The case bodies run under mpiexec too (tests/mpi/test_gather_mpi.py)."""
from __future__ import annotations

import ml_dtypes  # noqa: F401 (bfloat16)
import numpy as np
import pytest

import shardfuse as sf
from shardfuse.ops import Op

V, H = 16, 4


def np_scatter_add(ids, values, n, clamped=False):
    """The reference, np.add.at in float64: ids outside [-n, n) dropped, as sf.scatter_add's and JAX's
    .at[].add (a MoE probe: they were clamped into the last row); clamped, as sf.take's, for take's gradient."""
    g = np.where(ids < 0, ids + n, ids).reshape(-1)
    values = np.asarray(values, np.float64).reshape((g.size,) + values.shape[ids.ndim:])
    if clamped:
        g = np.clip(g, 0, n - 1)
    else:
        values, g = values[(g >= 0) & (g < n)], g[(g >= 0) & (g < n)]
    out = np.zeros((n,) + values.shape[1:])
    np.add.at(out, g, values)
    return out


def ids_with_repeats(rng, shape, dtype="int32"):
    """Random ids in [-V, V) with repeats forced (the first id thrice) and two out of range."""
    ids = rng.integers(-V, V, shape).astype(dtype)
    flat = ids.reshape(-1)
    flat[1] = flat[2] = flat[0]
    flat[-1], flat[-2] = 3 * V, -5 * V
    return ids


MESHES = {"1d": ((4,), ("tp",)), "2d": ((2, 2), ("dp", "tp"))}
# (ids spec, result spec): replicated, positions over dp, the result's rows over tp (vocab-parallel),
# both, and sequence parallel (positions and rows over the same mesh axis: positions gathered)
LAYOUTS = {"replicated": (None, None), "positions-dp": ("dp", None), "positions-tp": ("tp", None),
           "rows-tp": (None, "tp"), "positions-dp-rows-tp": ("dp", "tp"), "positions-tp-rows-tp": ("tp", "tp")}


def scatter_fn(ids_over, rows_over):
    def f(ids, values):
        if ids_over:
            ids, values = sf.shard(ids, axis=0, over=ids_over), sf.shard(values, axis=0, over=ids_over)
        out = sf.scatter_add(ids, values, V)
        return sf.shard(out, axis=0, over=rows_over) if rows_over else out
    return f


def check_scatter(mesh, layout, dtype, rng, ids_shape=(4, 6), jit=True):
    ids_over, rows_over = (a if a in mesh.axis_names else None for a in LAYOUTS[layout])
    ids = ids_with_repeats(rng, ids_shape)
    values = (rng.standard_normal(ids_shape + (H,)) * 3).astype(dtype)
    if jit:
        got = sf.jit(scatter_fn(ids_over, rows_over), mesh=mesh)(ids, values)
    else:  # on sf.Arrays: a one-op plan
        got = sf.scatter_add(sf.distribute(ids, mesh, (ids_over,) + (None,) * (ids.ndim - 1)),
                             sf.distribute(values, mesh, (ids_over,) + (None,) * (values.ndim - 1)), V)
    assert got.shape == (V, H) and got.dtype == np.dtype(dtype).name
    want = np_scatter_add(ids, values, V)
    if dtype == "float64":
        np.testing.assert_allclose(got.gather(), want, rtol=1e-14, atol=1e-14)
    else:  # summed in float32, rounded once per device: where positions are sharded each device's
        # partial is rounded before the partials are summed, so the bound scales with the rows' sum
        # of |values| (an H200 run: a bfloat16 partial of ~9 one ulp off), not with the result
        f32 = np.asarray(np_scatter_add(ids, values.astype(np.float32), V).astype(np.float32).astype(dtype),
                         np.float64)
        absum = np_scatter_add(ids, np.abs(values.astype(np.float64)), V)
        tol = {"float32": 1e-6, "float16": 1e-3, "bfloat16": 8e-3}[dtype]
        np.testing.assert_array_less(np.abs(np.asarray(got.gather(), np.float64) - f32), tol * (np.abs(f32) + 4 + absum))
    return got


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("mesh_kind", sorted(MESHES))
def test_values_as_np_add_at(mesh_kind, layout, jit):
    check_scatter(sf.DeviceMesh(*MESHES[mesh_kind]), layout, "float64", np.random.default_rng(0), jit=jit)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_16_bit_values_accumulate_in_float32(dtype):
    check_scatter(sf.DeviceMesh(*MESHES["2d"]), "positions-dp-rows-tp", dtype, np.random.default_rng(1))


def test_repeated_ids_accumulate_exactly():
    """Every position on one id: its row is the sum of all of them, the rest zeros (poisoned buffers
    would show NaN where a row is not written)."""
    mesh, rng = sf.DeviceMesh(*MESHES["1d"]), np.random.default_rng(2)
    ids, values = np.full((3, 5), 6, np.int64), rng.standard_normal((3, 5, H))
    got = sf.jit(scatter_fn(None, "tp"), mesh=mesh)(ids, values).gather()
    want = np.zeros((V, H))
    want[6] = values.reshape(-1, H).sum(0)
    np.testing.assert_allclose(got, want, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("shape", [(), (7,), (2, 3, 2)], ids=str)
def test_ids_of_any_shape_and_scalar_values(shape):
    rng = np.random.default_rng(3)
    ids, values = rng.integers(-V, V, shape).astype(np.int32), rng.standard_normal(shape)
    got = sf.jit(lambda i, v: sf.scatter_add(i, v, V), mesh=sf.DeviceMesh(4))(ids, values)
    assert got.shape == (V,)
    np.testing.assert_allclose(got.gather(), np_scatter_add(ids, values, V), rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("layout, collectives", [("rows-tp", {}), ("replicated", {}),
                                                 ("positions-dp", {"allreduce": 1}),
                                                 ("positions-dp-rows-tp", {"allreduce": 1})])
def test_collectives(layout, collectives):
    """Rows sharded: each device adds the ids in its own rows, nothing communicated; positions over
    dp: one Allreduce of the result (a data-parallel gradient's)."""
    mesh = sf.DeviceMesh(*MESHES["2d"])
    plan = sf.jit(scatter_fn(*LAYOUTS[layout]), mesh=mesh).lower(sf.TensorSpec((4, 6), "int32"),
                                                                 sf.TensorSpec((4, 6, H), "float32"))
    assert plan.collectives() == collectives, plan
    assert "ScatterAdd" in str(plan), plan


def test_refusals():
    mesh = sf.DeviceMesh(2)
    f = lambda size: sf.jit(lambda i, v: sf.scatter_add(i, v, size), mesh=mesh)  # noqa: E731
    i, v = sf.TensorSpec((3,), "int32"), sf.TensorSpec((3, 2), "float32")
    with pytest.raises(TypeError, match="ids must be an integer array"):
        f(4).lower(sf.TensorSpec((3,), "float32"), v)
    with pytest.raises(TypeError, match="values must be floats"):
        f(4).lower(i, sf.TensorSpec((3, 2), "int32"))
    with pytest.raises(ValueError, match="must start with the ids' shape"):
        f(4).lower(i, sf.TensorSpec((2, 3), "float32"))
    with pytest.raises(TypeError, match="size must be a positive int"):
        f(0).lower(i, v)
    with pytest.raises(TypeError, match="sf.scatter_add takes values inside an sf.jit function or sf.Arrays"):
        sf.scatter_add(np.zeros(3, int), np.ones(3), 4)


# ---- the embedding's gradient: a scatter-add ------------------------------------------------------

def embed_grad(table_over, ids_over, mesh):
    def loss(t, i, r):
        t = sf.shard(t, axis=0, over=table_over) if table_over else t
        i = sf.shard(i, axis=0, over=ids_over) if ids_over else i
        return (sf.take(t, i) * r).sum()
    return sf.jit(sf.grad(loss), mesh=mesh)


def check_embed_grad(mesh, table_over, ids_over, rng):
    """d sum(take(t, ids) * r) / dt = scatter_add(ids, r): exact, repeated ids accumulating, in the
    table's layout; a scatter-add step, no GEMM."""
    table, ids = rng.standard_normal((V, H)), ids_with_repeats(rng, (4, 6))
    r = rng.standard_normal((4, 6, H))
    f = embed_grad(table_over, ids_over, mesh)
    g = f(table, ids, r)
    np.testing.assert_allclose(np.asarray(g.gather()), np_scatter_add(ids, r, V, clamped=True), rtol=1e-14, atol=1e-14)
    steps = [i.op for i in f.lower(table, ids, r).program.instrs]
    assert Op.SCATTER_ADD in steps and Op.MATMUL not in steps


@pytest.mark.parametrize("table_over, ids_over", [(None, None), ("tp", None), (None, "dp"), ("tp", "dp"),
                                                  ("tp", "tp"), (("dp", "tp"), None)], ids=str)
def test_take_gradient_is_the_scatter_add(table_over, ids_over):
    """The table vocab-sharded, the tokens sharded (data parallel, or over tp as well: sequence
    parallel), both, neither."""
    check_embed_grad(sf.DeviceMesh(*MESHES["2d"]), table_over, ids_over, np.random.default_rng(4))


def test_vocab_parallel_gradient_scatters_locally():
    """Table over tp, tokens over dp: each device scatters its tokens into its rows, the gradient's
    one collective the data-parallel Allreduce (of [vocab / tp, hidden]), no gather of anything."""
    spec = (sf.TensorSpec((V, H), "float32"), sf.TensorSpec((4, 6), "int32"), sf.TensorSpec((4, 6, H), "float32"))
    text = str(embed_grad("tp", "dp", sf.DeviceMesh(*MESHES["2d"])).lower(*spec))
    assert "scattered_partial = Allocate f32[16:tp, 4] partial(dp)" in text, text
    # (the only Allreduce: the loss, never returned by sf.grad, is not reduced for its gradient's seed)
    assert "ar = Allreduce scattered <- scattered_partial, team=dp" in text and text.count("Allreduce") == 1, text
    assert "Allgather" not in text, text


VOCAB, TOKENS, HIDDEN = 32000, 2048, 256


def test_no_tokens_by_vocabulary_buffer_in_the_gradient_plan():
    """The embedding's gradient at vocab 32000, 2048 tokens, hidden 256 (planned on NumPy devices,
    not run): the one-hot GEMM it replaces held [tokens, vocab] buffers (the comparison and its
    float cast): 439.5 MiB made once on one device, 111.4 MiB per device with the vocabulary over
    4.  Now 2.0 and 4.0 MiB: the [tokens, hidden] cotangent (replicated over tp, where the lookup's
    output was Allreduced) and its partner; the gradient itself is an output (per call)."""
    for d, over in ((1, None), (4, "tp")):
        mesh = sf.DeviceMesh((d,), ("tp",), backend="numpy")

        def loss(t, i, r):
            return (sf.take(sf.shard(t, axis=0, over=over) if over else t, i) * r).sum()
        plan = sf.jit(sf.grad(loss), mesh=mesh).lower(
            sf.TensorSpec((VOCAB, HIDDEN), "float32"), sf.TensorSpec((4, TOKENS // 4), "int32"),
            sf.TensorSpec((4, TOKENS // 4, HIDDEN), "float32"))
        sizes = [i.outs[0].type.shape for i in plan.program.instrs if i.op == Op.ALLOCATE]
        assert not [s for s in sizes if VOCAB in s and TOKENS // 4 in s], sizes
        mib = plan.memory()["persistent"] / 2**20
        assert mib <= 4.5, (d, plan.memory())


def test_streaming_the_rows_of_a_scatter_add_is_refused_clearly():
    """(a review found an internal resharding error here) Streaming along the scattered rows is
    refused with what to write; along the hidden axis it streams, as NumPy's."""
    mesh = sf.DeviceMesh((2, 2), ("dp", "tp"), backend="numpy")
    rng = np.random.default_rng(3)
    ids, v = rng.integers(0, 8, (4, 6)).astype(np.int32), rng.standard_normal((4, 6, 4))
    rows = sf.jit(lambda i, x: sf.stream(sf.scatter_add(i, x, 8), axis=0, chunks=2), mesh=mesh)
    with pytest.raises(ValueError, match="scatter_add, along its rows is not supported"):
        rows(ids, v)
    hidden = sf.jit(lambda i, x: sf.stream(sf.scatter_add(i, x, 8), axis=1, chunks=2), mesh=mesh)
    want = np.zeros((8, 4))
    np.add.at(want, ids, v)
    np.testing.assert_allclose(hidden(ids, v).gather(), want, rtol=1e-12, atol=1e-12)
