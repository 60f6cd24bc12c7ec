"""sf.grad(remat="keep") under mpiexec (the checks of tests/test_remat.py on the NumPy-over-MPI
backend): keep's gradients equal regather's bit for bit and central differences, with one Allgather
fewer; the MLP block and the transformer layer, sequence parallel (data parallel too under -n 4).
Every rank runs every test in the same order, with the same seeds."""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import test_remat as tr

NPROCS = MPI.COMM_WORLD.Get_size()


@pytest.mark.parametrize("name", list(tr.CASES))
def test_keep_and_regather_agree(name):
    tr.check_case(name, tr.mesh_of("1d"), np.random.default_rng(7))


@pytest.mark.parametrize("name", ["sp rows", "over batch"])
def test_keep_has_one_allgather_fewer(name):
    tr.test_keep_has_one_allgather_fewer_and_the_forward_stays_pipelined(name)


def test_mlp_block_sequence_parallel():
    tr.test_mlp_block_sequence_parallel(2)


@pytest.mark.parametrize("config", ["sp"] + (["dp x sp"] if NPROCS == 4 else []))
def test_transformer_layer_sequence_parallel(config):
    tr.test_transformer_layer_sequence_parallel(config)
