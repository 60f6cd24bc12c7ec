"""Issue 31's shape ops under mpiexec (the bodies of tests/test_slicing.py and tests/test_split_concat.py
on the MPI backend): basic indexing, split, concatenate, stack, the fused QKV split, broadcast matmul
and the ring with a bias.  Every rank runs every test in the same order (same seeds), so the
collectives pair up."""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import shardfuse as sf
import test_slicing as sl
import test_split_concat as sc
from test_elementwise_ops import compare

NPROCS = MPI.COMM_WORLD.Get_size()
SIZES = sorted({4, NPROCS})
SPECS = {"S0": ("DIDx",), "S1": (None, "DIDx"), "R": ()}


@pytest.fixture(params=SIZES, ids=lambda s: f"D{s}", scope="module")
def mesh(request):
    return sf.DeviceMesh(request.param)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("spec", ["S0", "S1"])
@pytest.mark.parametrize("name", ["x[3]", "x[..., 1]", "x[:, -5:-1]", "x[None, 1:3]", "x[::2, 1:11:3]", "x[1, 2, 3]",
                                  "x[::-1]", "x[5:1:-2]", "x[..., ::-1]", "x[::-3, 10:2:-4, ::-1]"])
def test_index(mesh, name, spec, jit):
    sl.check_index(name, mesh, SPECS[spec], "float32", jit, np.random.default_rng(0))


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("spec", ["S0", "S1"])
@pytest.mark.parametrize("name", ["sf.split(x, 2)", "sf.split(x, 3, axis=1)", "sf.split(x, [3, -2], axis=1)"])
def test_split(mesh, name, spec, jit):
    sc.check_split(name, mesh, SPECS[spec], "float64", jit, np.random.default_rng(1))


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("spec", ["S0", "S1"])
@pytest.mark.parametrize("name", ["concatenate axis 0", "concatenate axis 1", "concatenate axis None", "stack axis 1"])
def test_join(mesh, name, spec, jit):
    sc.check_join(name, mesh, SPECS[spec], "float64", jit, np.random.default_rng(2), y_spec=SPECS[spec][:1])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_qkv_split(mesh, dtype):
    sc.check_qkv(mesh, dtype, np.random.default_rng(3))


@pytest.mark.parametrize("name", ["(2,3) @ (4,3,5)", "(m,k) @ (b,k,n) b sharded", "(b,1,m,k) @ (1,h,k,n)",
                                  "(b,1,m,k) @ (b,h,k,n)", "(k,) @ (b,k,n)"])
def test_broadcast_matmul(mesh, name):
    sl.check_matmul(name, mesh, "float64", True, np.random.default_rng(4))


def test_ring_with_a_bias(mesh):
    d = len(mesh.devices)
    rng = np.random.default_rng(5)
    x, w, b = rng.standard_normal((2 * d, 8)), rng.standard_normal((6, 8)), rng.standard_normal(6)
    f = sf.jit(lambda x, w, b: sf.stream(sf.shard(x, axis=0) @ w.T + b, axis=0, algorithm="ring"), mesh=mesh)
    assert f.lower(x, w, b).collectives() == {"sendrecv": d - 1}
    compare(f(x, w, b).gather(), x @ w.T + b, "float64")
