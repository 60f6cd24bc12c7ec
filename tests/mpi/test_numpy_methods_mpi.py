"""var / std, clip, argmax / argmin, // and % under mpiexec (the bodies of tests/test_numpy_methods.py
on the MPI backend): the reduced axis sharded across ranks, so argmax's two Allreduces (max of the
values, min of the indices) and var's sums cross processes.  Every rank runs every test in the same
order (same seeds), so the collectives pair up."""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import shardfuse as sf
import test_numpy_methods as nm

NPROCS = MPI.COMM_WORLD.Get_size()


@pytest.fixture(params=sorted({4, NPROCS}), ids=lambda s: f"D{s}", scope="module")
def mesh(request):
    return sf.DeviceMesh(request.param)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("layout", ["1d S0", "1d S1"])
@pytest.mark.parametrize("name", ["x.var 1", "np.var 0 ddof=1", "x.std -1 ddof=1 keepdims", "np.clip arrays",
                                  "x.argmax 1", "x.argmax ties 1", "np.argmin ties 0", "np.argmax ties None keepdims",
                                  "x.argmax of ints", "x // y", "3.0 % x", "ints % -3", "7 // ints"])
def test_case(mesh, name, layout, jit):
    nm.check(name, mesh, layout, jit, np.random.default_rng(7))


def test_argmax_finds_the_first_nan_across_ranks(mesh):
    x = nm.nonzero(np.random.default_rng(9), (8, 12))
    x[2, 7], x[2, 9], x[5, 1] = np.nan, np.nan, np.nan
    for axis in (0, 1):
        xa = sf.shard(x, axis=axis, mesh=mesh)
        np.testing.assert_array_equal(xa.argmax(axis).gather(), x.argmax(axis))
        np.testing.assert_array_equal(xa.argmin(axis).gather(), x.argmin(axis))


def test_integer_sums_across_ranks_are_exact(mesh):
    nm.check_integer_sums(mesh)
