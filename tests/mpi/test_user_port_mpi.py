"""The user-port fixes under mpiexec (the bodies of tests/test_user_port.py on the NumPy-over-MPI
backend, the 2x2 dp x tp mesh): np.linalg.norm / tril / triu / moveaxis / sf.linear / einsum /
tensordot / cumsum / trunc / round(x, decimals), and a Llama port's broadcast_to / repeat / tile / outer /
logaddexp / x ** y / x.mT / take_along_axis, with their sharded axes across ranks, cross-entropy with ignored labels (the kept-token count an Allreduce
over dp), a tuple of one result, and x.item() of a replicated loss (read locally on every rank).
Every rank runs every test in the same order, with the same seeds."""
from __future__ import annotations

import numpy as np
import pytest

import shardfuse as sf
import test_user_port as up


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("name", sorted(up.CASES))
def test_numpy_functions(name, jit):
    up.check(name, up.mesh_2d(), jit, np.random.default_rng(3))


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_cross_entropy_ignore_index(jit):
    up.test_cross_entropy_ignore_index_is_torchs(jit)


def test_gradients_of_norm_and_tril():
    up.test_gradients_of_norm_and_tril()


def test_a_one_tuple_result_and_item():
    up.test_a_one_tuple_result_stays_a_tuple()
    up.test_item_of_a_loss()
