"""A slice of tests/test_scalar_promotion.py's table under mpiexec (the same bodies, one device per
rank): NumPy 2's dtypes and values of operators with a scalar or a 0-d array on either side, and
NumPy's refusals raised while tracing on every rank alike, before any communication (the next
case's collectives still pair up).  Every rank runs every case in the same order, same seeds."""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import shardfuse as sf
import test_scalar_promotion as sp

NPROCS = MPI.COMM_WORLD.Get_size()
OPS = ["-", "/", "//", "**", "<", "&"]
SCALARS = ["float", "bool", "np.float64", "0-d int32"]
CASES = [(op, s, dt, left) for op in OPS for s in SCALARS for dt in ("int32", "bool", "bfloat16") for left in (True, False)]


@pytest.fixture(scope="module")
def mesh():
    return sf.DeviceMesh(NPROCS)


@pytest.mark.parametrize("op, scalar, dtype, left", CASES,
                         ids=[f"{'s' if left else 'x'}{op}{'x' if left else 's'}-{s}-{dt}" for op, s, dt, left in CASES])
def test_operator_with_a_scalar_on_either_side(mesh, op, scalar, dtype, left):
    sp.check(op, sp.OPS[op], sp.SCALARS[scalar], dtype, left, np.random.default_rng(len(op) + 7 * left), mesh)


def test_the_hugging_face_additive_mask(mesh):
    mask = np.array([[0, 1, 1, 1], [1, 1, 1, 1]] * NPROCS, bool)
    got = sf.jit(lambda m: (1.0 - sf.shard(m, axis=0)) * -1e9, mesh=mesh)(mask)
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got.gather(), (1.0 - mask) * -1e9)
