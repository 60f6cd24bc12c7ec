"""sf.dynamic_update_slice / sf.dynamic_slice / x.at[] under mpiexec (the bodies of
tests/test_update_slice.py on the MPI backend): a KV cache with heads over tp (and batch over dp)
written at a traced t, the donated decode loop keeping its buffers, gradients.  Every rank runs every
test in the same order (same seeds), so the collectives pair up."""
from __future__ import annotations

import math

import numpy as np
import pytest
from mpi4py import MPI

import test_update_slice as us

# the layouts whose meshes this many processes can share (a 2-device mesh cannot be split over 4)
HERE = sorted(k for k, (shape, _, _) in us.LAYOUTS.items() if math.prod(shape) % MPI.COMM_WORLD.Get_size() == 0)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("t", [0, us.M + 5, -1])
@pytest.mark.parametrize("layout", HERE)
def test_update(layout, t, jit):
    us.check_update(layout, "float64", "int64", t, jit, np.random.default_rng(t + 10), backend=None)


def test_update_bfloat16_int32_starts():
    us.check_update("dp2xtp2", "bfloat16", "int32", 2, True, np.random.default_rng(1), backend=None)


@pytest.mark.parametrize("layout", HERE)
def test_slice_and_at(layout):
    us.check_slice_and_at(layout, "float64", 4, True, np.random.default_rng(2), backend=None)


@pytest.mark.parametrize("layout", HERE)
def test_decode_loop_donated(layout):
    us.check_decode_loop(layout, np.random.default_rng(4), backend=None)


def test_grad():
    us.check_grad("dp2xtp2", np.random.default_rng(5), backend=None)


@pytest.mark.parametrize("layout", sorted(k for k, (shape, _, _) in us.SEQ_LAYOUTS.items()
                                          if math.prod(shape) % MPI.COMM_WORLD.Get_size() == 0))
def test_sequence_sharded_writes(layout):
    us.check_sequence_sharded_writes(layout, "float64", np.random.default_rng(5), backend=None)
