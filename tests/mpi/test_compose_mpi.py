"""NumPy's functions built as compositions (shardfuse/numpy_compose.py, numpy_stats.py) under mpiexec:
the bodies of tests/test_numpy_compose.py on the NumPy-over-MPI backend, on 1-D meshes of 4 and of
the process count and a 2x2 mesh, with the operand sharded on its first or last axis (under -n 2
each process holds two devices); NumPy's dtypes; gradients.  Every rank runs every test in the same
order with the same seeds, so the collectives pair up."""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import shardfuse as sf
import test_numpy_compose as nc
from test_einsum import LAYOUTS

NPROCS = MPI.COMM_WORLD.Get_size()
NAMES = ["prod axis 0", "cumprod axis 0", "pad reflect", "diff n=2 axis 0", "nanmean", "nanmax", "median axis 1", "interp",
         "searchsorted right, NaN", "digitize both ways",
         "quantile linear", "average returned", "trace", "hstack vstack", "unstack", "fmax fmin"]


@pytest.fixture(params=sorted({4, NPROCS}), ids=lambda s: f"D{s}", scope="module")
def mesh(request):
    return sf.DeviceMesh(request.param)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("layout", ["1d first", "1d last"])
@pytest.mark.parametrize("name", NAMES)
def test_against_numpy_on_a_sharded_axis(mesh, name, layout, jit):
    nc.check(name, mesh, LAYOUTS[layout][1], jit, np.random.default_rng(51))


@pytest.mark.parametrize("name", ["median", "nanstd", "prod", "pad reflect", "quantile"])
def test_on_a_2x2_mesh_in_bfloat16(name):
    nc.check_dtype(name, "bfloat16", sf.DeviceMesh((2, 2)), np.random.default_rng(52))


@pytest.mark.parametrize("name", sorted(nc.GRADIENTS))
def test_gradients(mesh, name):
    nc.check_gradient(name, mesh, np.random.default_rng(53))
