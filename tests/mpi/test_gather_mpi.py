"""Max / min over a sharded axis (an Allreduce with MPI.MAX / MIN of order keys), take and the
vocab-parallel embedding, scatter_add and the embedding's gradient, constants and cross-entropy
under mpiexec: the case bodies of tests/test_extrema.py, test_take.py, test_scatter_add.py,
test_constants.py and test_cross_entropy.py on the MPI backend.  Every rank runs every test in the same order (same seeds), so the collectives pair up."""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import shardfuse as sf
import test_extrema as ex

NPROCS = MPI.COMM_WORLD.Get_size()


@pytest.fixture(params=sorted({4, NPROCS}), ids=lambda s: f"D{s}", scope="module")
def mesh(request):
    return sf.DeviceMesh(request.param)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("layout", ["replicated", "positions-tp", "rows-tp", "positions-tp-rows-tp"])
@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_scatter_add(mesh, layout, dtype, jit):
    import test_scatter_add as sa
    sa.check_scatter(sf.DeviceMesh(mesh.size, "tp"), layout, dtype, np.random.default_rng(1), jit=jit)


@pytest.mark.parametrize("table_over, ids_over", [(None, "tp"), ("tp", None), ("tp", "tp")], ids=str)
def test_embedding_gradient_is_a_scatter_add(mesh, table_over, ids_over):
    import test_scatter_add as sa
    sa.check_embed_grad(sf.DeviceMesh(mesh.size, "tp"), table_over, ids_over, np.random.default_rng(4))


def test_embedding_gradient_data_parallel_vocab_parallel():
    import test_scatter_add as sa
    sa.check_embed_grad(sf.DeviceMesh((2, 2), ("dp", "tp")), "tp", "dp", np.random.default_rng(4))


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16", "int32"])
@pytest.mark.parametrize("kind", ["max", "min"])
@pytest.mark.parametrize("nans", [(), ((0, 0),), ((3, 7),), ((1, 2), (4, 6))], ids=str)
def test_max_min_over_the_sharded_axis(mesh, kind, dtype, nans, jit):
    nans = () if dtype == "int32" else nans
    got = ex.check_max(mesh, kind, dtype, 1, False, nans, np.random.default_rng(5), jit)
    if nans:  # a NaN on any rank's device gives NaN on every rank, whichever holds it
        assert np.isnan(np.asarray(got.gather(), np.float64)[[r for r, _ in nans]]).all()


def test_max_plan_is_one_allreduce(mesh):
    plan = ex.plan_of(mesh, "max", 1)
    assert plan.collectives() == {"allreduce": 1} and "op=max" in str(plan), plan


def test_constants_closed_over(mesh):
    import test_constants as ct
    ct.check_closed_over(mesh, np.random.default_rng(0))


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("layout", ["vocab", "hidden", "replicated"])
@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_take_vocab_parallel(mesh, layout, dtype, jit):
    import test_take as tk
    mesh1 = sf.DeviceMesh(mesh.size, "tp")
    tk.check_take(mesh1, layout, dtype, "int64", np.random.default_rng(1), jit)


def test_take_vocab_parallel_on_a_2d_mesh():
    import test_take as tk
    mesh = sf.DeviceMesh((2, 2), ("dp", "tp"))
    for layout in ("vocab-batch-dp", "vocab-both"):  # (under -n 2 a process' devices lie in two dp teams)
        tk.check_take(mesh, layout, "float32", "int32", np.random.default_rng(2))


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_cross_entropy_vocab_parallel(mesh, dtype, jit):
    import test_cross_entropy as ce
    ce.check_cross_entropy(sf.DeviceMesh(mesh.size, "tp"), "vocab", dtype, np.random.default_rng(3), jit)


def test_cross_entropy_tokens_over_dp_vocab_over_tp():
    import test_cross_entropy as ce
    ce.check_cross_entropy(sf.DeviceMesh((2, 2), ("dp", "tp")), "tokens-dp-vocab-tp", "float32",
                           np.random.default_rng(4))
