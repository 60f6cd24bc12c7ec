"""Issue 31's elementwise ops and reductions under mpiexec (the bodies of tests/test_elementwise_ops.py
on the MPI backend), and int32 / bool arrays through the MPI collectives.  Every rank runs every
test in the same order (same seeds), so the collectives pair up."""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import shardfuse as sf
import test_elementwise_ops as ew

NPROCS = MPI.COMM_WORLD.Get_size()
SIZES = sorted({4, NPROCS})


@pytest.fixture(params=SIZES, ids=lambda s: f"D{s}", scope="module")
def mesh(request):
    return sf.DeviceMesh(request.param)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("layout", ["1d S0", "1d S1", "1d S0 row"])
@pytest.mark.parametrize("name", sorted(ew.OPS))
def test_op(mesh, name, layout, jit):
    _, lx, ly = ew.LAYOUTS[layout]
    ew.check_op(name, mesh, lx, ly, "float32", jit, np.random.default_rng(0), row=ly == "row")


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("layout", ["1d S0", "1d S1"])
@pytest.mark.parametrize("name", ["max 0 keepdims=True", "min -1 keepdims=False", "max None keepdims=False",
                                  "sum (0, 1) keepdims=True", "mean -1 keepdims=True", "np.amax"])
def test_reduction(mesh, name, layout, jit):
    ew.check_reduction(name, mesh, ew.LAYOUTS[layout][1], "float64", jit, np.random.default_rng(1))


@pytest.mark.parametrize("dtype", ["int32", "int64", "bool"])
def test_integer_and_bool_arrays_sharded_and_gathered(mesh, dtype):
    ids = np.random.default_rng(2).integers(0, 1000, (8, 12)).astype(dtype)
    for axis in (0, 1):
        a = sf.shard(ids, axis=axis, mesh=mesh)
        np.testing.assert_array_equal(a.gather(), ids)
        np.testing.assert_array_equal(sf.replicate(a).gather(), ids)  # an Allgather of int / bool pieces
        np.testing.assert_array_equal(a.max(axis).gather(), ids.max(axis))  # gathered first
        np.testing.assert_array_equal((a == ids[0, 0]).gather(), ids == ids[0, 0])
    if dtype != "bool":
        a = sf.shard(ids, axis=1, mesh=mesh)
        np.testing.assert_array_equal(a.sum(1).gather(), ids.sum(1))  # int64 partial sums all-reduced
        np.testing.assert_array_equal(np.where(a > 500, a, -1).gather(), np.where(ids > 500, ids, -1))
