"""Under mpiexec: reading a replicated value is local (JAX's `if jax.process_index() == 0:
print(float(loss))`), closed-over sf.Arrays are constants of the plan (tests/test_closed_over_arrays.py's
body), and a Python int argument out of int32 bounds is refused on every rank before anything is
sent.  Launched by tests/test_mpi.py::test_mpi_cases (P = 2 and 4); every rank runs every test in
the same order (same seeds), so the collectives pair up."""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import shardfuse as sf
import test_closed_over_arrays as closed

COMM = MPI.COMM_WORLD
RANK, NPROCS = COMM.Get_rank(), COMM.Get_size()

pytestmark = pytest.mark.mpi(min_size=2)


def test_rank_0_alone_reads_a_replicated_loss():
    """float(loss) on rank 0 only was a collective gather: rank 0 waited for the others, who had
    gone on (RankLeftError, the job aborted).  Now it reads its own piece; the next calls pair."""
    mesh = sf.DeviceMesh(4)
    rng = np.random.default_rng(11)  # the same inputs on every rank: they are global arrays
    x, w = rng.standard_normal((8, 6)), rng.standard_normal((6, 3))
    step = sf.jit(lambda x, w: ((sf.shard(x, axis=0) @ w) ** 2).mean(), mesh=mesh)
    rows = sf.jit(lambda x, w: sf.replicate(sf.shard(x, axis=0) @ w), mesh=mesh)
    for k in range(3):
        loss, y = step(x * (k + 1), w), rows(x * (k + 1), w)
        assert loss.placements == (sf.Replicate(),) and y.placements == (sf.Replicate(),)
        ref, y_ref = (((x * (k + 1)) @ w) ** 2).mean(), (x * (k + 1)) @ w
        if RANK == k % NPROCS:  # one rank alone reads them, as process_index() == 0 does
            assert abs(float(loss) - ref) <= 1e-12 * ref
            assert np.asarray(loss).shape == () and bool(loss) and int(loss) == int(ref)
            np.testing.assert_allclose(np.asarray(y), y_ref, rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(y.gather(), y_ref, rtol=1e-12, atol=1e-12)
    got = COMM.allgather(float(step(x, w)))  # every rank, after: nothing was left half-paired
    assert got == [got[0]] * NPROCS and abs(got[0] - ((x @ w) ** 2).mean()) <= 1e-12 * got[0]


def test_a_value_not_held_by_every_process_is_still_gathered_collectively():
    """Sharded, or replicated on a sub-mesh some process holds no device of: every rank calls
    gather() (a rank reading locally there would leave the others waiting)."""
    mesh = sf.DeviceMesh(4)
    x = np.random.default_rng(3).standard_normal((8, 4))
    for a in (sf.shard(x, axis=0, mesh=mesh), sf.replicate(x, mesh=mesh.submesh([0, 1])),
              sf.replicate(x, mesh=mesh.submesh([3]))):
        np.testing.assert_array_equal(a.gather(), x)
        np.testing.assert_array_equal(np.asarray(a), x)


@pytest.mark.parametrize("layout", closed.LAYOUTS)
def test_closed_over_arrays(layout):
    closed.check_weights(sf.DeviceMesh(4), np.random.default_rng(5), closed.LAYOUTS[layout])


def test_a_python_int_out_of_bounds_is_refused_on_every_rank():
    mesh = sf.DeviceMesh(4)
    f = sf.jit(lambda x, s: x + s, mesh=mesh)
    x = np.arange(1, 9, dtype=np.int32)
    with pytest.raises(OverflowError, match="argument s is the Python int 2147483653, out of bounds for int32") as err:
        f(x, 2**31 + 5)
    assert COMM.allgather(str(err.value)) == [str(err.value)] * NPROCS
    np.testing.assert_array_equal(f(x, 5).gather(), x + 5)  # nothing was half-sent: the next call runs
