"""& | ^ ~, any / all, the new array methods, integer-array indexing and NumPy's functions on sf.Arrays
under mpiexec (the bodies of tests/test_logical.py and tests/test_numpy_port.py on the MPI backend):
any / all over an axis sharded across ranks are Allreduces with max / min that cross processes, and
a NumPy function shardfuse lacks is refused on every rank before any communication (it used to
gather, a collective hidden in np.cumsum(x), which now runs as shardfuse's op).  Every rank runs
every test in the same order (same seeds), so the collectives pair up."""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import shardfuse as sf
import test_logical as lg
import test_numpy_port as port

NPROCS = MPI.COMM_WORLD.Get_size()


@pytest.fixture(params=sorted({4, NPROCS}), ids=lambda s: f"D{s}", scope="module")
def mesh(request):
    return sf.DeviceMesh(request.param)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("layout", ["1d S0", "1d S1"])
@pytest.mark.parametrize("name", ["mask & np.tril", "False | mask", "~mask", "np.logical_or of floats", "~int64",
                                  "mask & 1 (int64)", "x.any(0)", "x.any(1) keepdims", "np.all((0, 1))", "x.all of ints"])
def test_logical_case(mesh, name, layout, jit):
    lg.check(name, mesh, layout, jit, np.random.default_rng(41))


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("name", ["x.any()", "x.all(1)", "x.ravel()", "x.copy()", "x[0].dot(x[1])", "np.transpose axes",
                                  "np.expand_dims -1", "np.ones_like", "np.dot 1-D"])
def test_method(mesh, name, jit):
    port.check_method(name, mesh, ("DIDx", None), jit, np.random.default_rng(42))


@pytest.mark.parametrize("how", ["numpy", "traced", "eager numpy", "eager sf"])
@pytest.mark.parametrize("name", ["x[ids]", "x[:, ids]", "x[2:6, ids]"])
def test_integer_array_index(mesh, name, how):
    port.check_index(name, mesh, ("DIDx", None), how, np.random.default_rng(43))
    port.check_index(name, mesh, (None, "DIDx"), how, np.random.default_rng(44))


def test_an_unsupported_numpy_function_is_refused_on_every_rank_without_communicating(mesh):
    a = sf.shard(np.arange(96.0).reshape(8, 12) + 1, axis=0, mesh=mesh)
    for f in (lambda v: np.bincount(v[0].astype("int64")), np.linalg.det, lambda v: np.kron(v, v)):
        with pytest.raises(TypeError, match=r"is not supported on sf.Arrays"):
            f(a)
    np.testing.assert_array_equal(np.kron(a.gather(), 2.0), np.kron(np.arange(96.0).reshape(8, 12) + 1, 2.0))  # (then a
    # collective: paired)
