"""sf.random under mpiexec (the bodies of tests/test_random.py on the NumPy-over-MPI backend): each
rank's pieces of a draw, inside sf.jit sharded every way and eagerly on a key's mesh, equal the
one-process values computed on the host, bit for bit, with no communication for the draw itself;
keys split and folded inside jit with a traced step are the host's.  Every rank runs every test in
the same order, so the collectives (the gathers of the checks) pair up."""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import shardfuse as sf
import test_random as tr

NPROCS = MPI.COMM_WORLD.Get_size()
LAYOUTS = {  # (mesh shape, axis names, one mesh axis (or None) per tensor axis): 2 or 4 devices
    "D4 S1": ((4,), ("tp",), (None, "tp")),
    "P S0": ((NPROCS,), ("tp",), ("tp", None)),
    "2x2 S1 S0": ((2, 2), ("dp", "tp"), ("tp", "dp")),
}
DRAWS = ["bits", "uniform bf16", "normal", "randint", "categorical", "dropout"]  # (the draws of tests/test_random.py)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", DRAWS)
def test_each_ranks_pieces_are_the_one_process_values(name, layout):
    shape, names, spec = LAYOUTS[layout]
    tr.check_draw(name, tr.mesh_of(shape, names), spec, eager=layout == "D4 S1")


def test_a_sharded_draw_plans_no_collective():
    mesh = tr.mesh_of((2, 2), ("dp", "tp"))
    f = sf.jit(lambda key: sf.shard(sf.random.normal(key, (4, 16)), axis=1, over="tp"), mesh=mesh)
    assert f.lower(tr.KEY).collectives() == {}
    got = f(tr.KEY)
    assert mesh.nprocs == NPROCS and len(got.addressable_shards) == 4 // NPROCS  # (this rank's devices only)
    tr.check_pieces(got, np.asarray(sf.random.normal(tr.KEY, (4, 16))))


def test_keys_split_and_folded_inside_jit_with_a_traced_step():
    tr.check_keys_inside_jit(tr.mesh_of((4,), ("tp",)))


def test_a_per_rank_key_differs_between_ranks():
    mine = sf.random.fold_in(tr.KEY, MPI.COMM_WORLD.Get_rank())
    every = MPI.COMM_WORLD.allgather(tuple(int(w) for w in mine))
    assert len(set(every)) == NPROCS
