"""NumPy's unary math (shardfuse/numpy_math.py) under mpiexec: the bodies of tests/test_math_ops.py
on the NumPy-over-MPI backend, on sharded axes of 1-D and 2x2 meshes (under -n 2 each process holds
two devices), np.round(x, decimals) and np.cumsum along sharded and unsharded axes, and gradients of
sin, erf, the exact GELU, cumsum, np.logaddexp, x ** y of arrays, np.take_along_axis, np.repeat / np.tile,
np.broadcast_to and np.outer with inputs sharded.  Every rank runs
every test in the same order (same seeds), so the collectives pair up."""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import shardfuse as sf
import test_grad as tg
import test_math_ops as mo
import test_sort as ts

NPROCS = MPI.COMM_WORLD.Get_size()
SIZES = sorted({4, NPROCS})
OPS = ["np.sin", "sf.erf", "gelu exact", "np.log1p", "np.round", "np.sign", "np.isnan", "np.floor", "np.trunc"]


@pytest.fixture(params=SIZES, ids=lambda s: f"D{s}", scope="module")
def mesh(request):
    return sf.DeviceMesh(request.param)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("name", OPS)
def test_op_on_a_sharded_axis(mesh, name, axis, jit):
    spec = ("DIDx", None) if axis == 0 else (None, "DIDx")
    mo.check_math(name, mesh, spec, "float64", jit, np.random.default_rng(21))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32"])
@pytest.mark.parametrize("name", ["np.cos", "np.expm1", "np.ceil", "np.isfinite"])
def test_op_on_a_2x2_mesh(name, dtype):
    mo.check_math(name, mo.mesh_of((2, 2)), ("DIDy", "DIDx"), dtype, True, np.random.default_rng(22))


def test_halves_to_even_and_nans():
    mo.test_halves_to_even_signed_zeros_nans_and_infinities_as_numpy("float32", True)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("axis", [0, 1, None])
@pytest.mark.parametrize("spec", [("DIDx", None), (None, "DIDx")], ids=["S0", "S1"])
def test_cumsum_along_sharded_and_unsharded_axes(mesh, spec, axis, jit):
    mo.check_cumsum(mesh, spec, "float64", axis, jit, np.random.default_rng(23))


@pytest.mark.parametrize("dtype", ["float32", "int32"])
def test_cumsum_and_round_decimals_on_a_2x2_mesh(dtype):
    mo.check_cumsum(mo.mesh_of((2, 2)), ("DIDy", "DIDx"), dtype, 1, True, np.random.default_rng(24))
    mo.check_round(mo.mesh_of((2, 2)), ("DIDy", "DIDx"), dtype, -1, False, np.random.default_rng(25))
    mo.check_round(mo.mesh_of((2, 2)), ("DIDx", "DIDy"), dtype, 2, True, np.random.default_rng(26))


@pytest.mark.parametrize("name", ["sin", "erf", "gelu exact", "sign floor ceil round (no gradient)", "cumsum",
                                  "logaddexp", "power of arrays", "power by a 0-d array", "take_along_axis",
                                  "repeat and tile", "broadcast_to", "outer"])
@pytest.mark.parametrize("kind, placement", [("1d", "S0"), ("2d", "S01")])
def test_gradient_against_central_differences(name, kind, placement):
    tg.check_case(name, tg.mesh_of(kind), placement, tg.seed_of(name, kind, placement))


@pytest.mark.parametrize("axis", [0, 1, None])
@pytest.mark.parametrize("spec", [("DIDx", None), (None, "DIDx")], ids=["S0", "S1"])
def test_sort_along_sharded_and_unsharded_axes(mesh, spec, axis):
    ts.check_sort(mesh, spec, "float64", axis, True, np.random.default_rng(27))  # (seeded: one global array)
    ts.check_top_k(mesh, "float32", np.random.default_rng(28))
