"""Runs inside the ranks of `mpiexec -n P python -m pytest --with-mpi tests/mpi/`, launched by
tests/test_mpi.py::test_mpi_cases (P = 2 and 4).

Marked @pytest.mark.mpi(min_size=2): without --with-mpi, pytest-mpi skips them.  That skip is
fine only because the launcher test above always runs them, under real MPI ranks, from the one
test command (`python -m pytest`); the outer run never collects this folder anyway
(tests/conftest.py), and tests/mpi/conftest.py aborts the whole job when a test fails on any rank.

Every rank runs every test in the same order, so the collectives (and the plan checks) pair up.
"""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import cases
import shardfuse as sf
from shardfuse import faults
from shardfuse.runtime import backend_of

COMM = MPI.COMM_WORLD
RANK, NPROCS = COMM.Get_rank(), COMM.Get_size()
BAD = 1  # the rank that does something else

pytestmark = pytest.mark.mpi(min_size=2)


def test_fault_handling_is_installed():
    sf.DeviceMesh(NPROCS)  # shardfuse touched MPI: the hooks are in
    assert faults.active()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_seed_case_against_a_float64_product(dtype):
    """nvFuser's seed layout a[S, D, m, K] on the NumPy-over-MPI backend, against NumPy float64."""
    mesh = sf.DeviceMesh(4)
    assert type(backend_of(mesh)).__name__ == "NumpyMPIBackend"
    rng = np.random.default_rng(7)  # the same inputs on every rank: they are global arrays
    a, b = rng.standard_normal((8, 4, 16, 32)).astype(dtype), rng.standard_normal((32, 24)).astype(dtype)

    @sf.jit(mesh=mesh, streams=4)
    def ag_matmul(a, b):
        return sf.stream(sf.shard(a, axis=1, over="DIDx") @ b, axis=0)

    got = ag_matmul(sf.shard(a, axis=1, over="DIDx", mesh=mesh), b).gather()
    ref = a.astype(np.float64) @ b.astype(np.float64)
    tol = 1e-4 if dtype == "float32" else 1e-12
    assert got.shape == ref.shape and np.abs(got - ref).max() <= tol * np.abs(ref).max()


def test_gather_returns_the_global_value_on_every_rank():
    mesh = sf.DeviceMesh(4)
    x = np.arange(8.0 * 8).reshape(8, 8)
    f = sf.jit(lambda x: sf.shard(x, axis=1) * 2.0, mesh=mesh)
    out = f(sf.shard(x, axis=1, mesh=mesh))
    got = out.gather()
    np.testing.assert_array_equal(got, 2 * x)
    assert all(np.array_equal(g, 2 * x) for g in COMM.allgather(got))


# ---- the plan check: every rank raises the same RankMismatchError, before any collective ---------
def _natural(mesh, chunks=2, algorithm="collective", dtype="float64", rows=8, scale=None):
    def f(x, w):
        y = sf.stream(sf.shard(x, axis=0) @ w, axis=0, chunks=None if algorithm == "ring" else chunks,
                      algorithm=algorithm)
        return y * scale if scale is not None else y
    return sf.jit(f, mesh=mesh), np.ones((rows, 6), dtype), np.ones((6, 3), dtype)


def _variant(kind):
    """(jitted, x, w): the same on every rank but BAD, where `kind` differs."""
    bad = RANK == BAD
    mesh = sf.DeviceMesh((2, 2) if bad and kind == "mesh" else 4)
    if kind == "shape":
        return _natural(mesh, rows=16 if bad else 8)
    if kind == "dtype":
        return _natural(mesh, dtype="float32" if bad else "float64")
    if kind == "chunks":
        return _natural(mesh, chunks=1 if bad else 2)
    if kind == "function":
        return _natural(mesh, scale=3.0 if bad else None)
    if kind == "algorithm":
        return _natural(mesh, algorithm="ring" if bad else "collective", rows=16)
    if kind == "mesh":
        f = sf.jit(lambda x, w: sf.replicate(sf.shard(x, axis=0, over=mesh.axis_names[-1]) @ w), mesh=mesh)
        return f, np.ones((8, 6)), np.ones((6, 3))
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["shape", "dtype", "chunks", "function", "algorithm", "mesh"])
def test_ranks_running_different_plans_all_raise_the_same_error(kind):
    f, x, w = _variant(kind)
    with pytest.raises(sf.RankMismatchError) as err:
        f(x, w)
    msg = str(err.value)
    assert COMM.allgather(msg) == [msg] * NPROCS, "every rank must raise the very same message"
    assert f"version B on rank(s) {BAD}" in msg and "first difference between rank 0 and rank 1" in msg, msg
    assert "  rank 0: " in msg and f"  rank {BAD}: " in msg, msg
    # nothing was left half-sent: the next plan, the same on every rank, runs
    g, x, w = _natural(sf.DeviceMesh(4))
    np.testing.assert_allclose(g(x, w).gather(), x @ w)


def test_a_rank_calling_another_compiled_plan_raises_at_that_call():
    """Both plans are compiled and checked on every rank; then rank BAD passes the other shape (a
    short last batch, say): MPI would pair the two plans' collectives silently, so the check
    runs at every call and every rank raises before communicating."""
    f, x8, w = _natural(sf.DeviceMesh(4))
    x16 = np.ones((16, 6))
    f(x8, w), f(x16, w)
    with pytest.raises(sf.RankMismatchError) as err:
        f(x16 if RANK == BAD else x8, w)
    assert COMM.allgather(str(err.value)) == [str(err.value)] * NPROCS
    np.testing.assert_allclose(f(x8, w).gather(), x8 @ w)  # nothing half-sent: the next call runs


def test_a_short_last_batch_on_one_rank_names_the_inputs_that_differ():
    """The README's case: every rank has the plan for 16 rows; then rank BAD passes 8 (a short
    last batch) and compiles a new plan while the others call the cached one.  The message said
    only "rank(s) 0 at plan 'f' (a call); rank(s) 1 at plan 'f'"; now it names the difference, as
    when every rank compiles afresh."""
    others = ", ".join(str(r) for r in range(NPROCS) if r != BAD)
    f, x16, w = _natural(sf.DeviceMesh(4), rows=16)
    f(x16, w)
    for fresh in (False, True):
        if fresh:  # a new function: every rank compiles its plan at this call
            f, x16, w = _natural(sf.DeviceMesh(4), rows=16)
        with pytest.raises(sf.RankMismatchError) as err:
            f(x16[:8] if RANK == BAD else x16, w)
        msg = str(err.value)
        assert COMM.allgather(msg) == [msg] * NPROCS, "every rank must raise the very same message"
        assert f"the inputs differ: x: f64[16:DIDx, 6] on rank 0, f64[8:DIDx, 6] on rank {BAD}" in msg, msg
        assert f"  rank {BAD}: plan f(x: f64[8:DIDx, 6], w: f64[6, 3])" in msg, msg
        if not fresh:
            assert (f"plan 'f' differs between the ranks at this call (found before its first collective): rank(s) "
                    f"{others} call the plan compiled at an earlier call; rank(s) {BAD} compile a new plan for this "
                    "call") in msg, msg
        np.testing.assert_allclose(f(x16, w).gather(), x16 @ w)  # nothing half-sent: the next call runs


def test_ranks_at_different_steps_of_gather_from_local_and_profile_raise_the_same_error():
    mesh = sf.DeviceMesh(4)
    piece = np.arange(4.0 * 4).reshape(4, 4)
    with pytest.raises(ValueError, match=r"sf.from_local: .*different axis=/over=.*rank 0: .* axis=0"):
        sf.from_local(piece, axis=1 if RANK == BAD else 0, mesh=mesh)  # each would build another array
    f, x, w = _natural(mesh)
    plan = f.lower(x, w)
    with pytest.raises(sf.RankMismatchError, match="gathering the profile"):  # paired its data with a plan's
        plan.profile(x, w, repeat=2 if RANK == 0 else 1)
    c = sf.shard(f(x, w), axis=0)  # (sharded: its gather is collective; a replicated value's is read locally)
    with pytest.raises(sf.RankMismatchError, match=r"gather\(\) of an sf.Array"):
        c.gather() if RANK == BAD else f(x, w)
    np.testing.assert_allclose(c.gather(), x @ w)


def test_a_plan_is_bound_once():
    mesh = sf.DeviceMesh(4)
    f, x, w = _natural(mesh)
    plan = f.lower(sf.TensorSpec(x.shape, "float64"), sf.TensorSpec(w.shape, "float64"))
    exe = plan.executable
    for _ in range(3):
        f(x, w)
    assert plan.executable is exe  # bound (and checked) once


def test_waits_are_named_after_the_plan_and_step():
    mesh = sf.DeviceMesh(NPROCS)
    with faults.binding("p"):
        first = faults.step_name("allgather", "DIDx")
        second = faults.step_name("allreduce", (mesh.submesh([0, 1]), "DIDx"))
    assert first == "allgather #1 of plan 'p' over DIDx", first
    assert second == "allreduce #2 of plan 'p' over DIDx of sub-mesh devices (0, 1)", second
    assert faults.step_name("allgather", "DIDx") == "allgather over DIDx"


def test_a_request_waited_with_the_deadline_completes():
    req = COMM.Ibarrier()
    faults.wait(req, "a test barrier", COMM)
    got = faults.allgather_object({"rank": RANK}, "a test allgather")
    assert got == [{"rank": r} for r in range(NPROCS)]


def test_calls_from_a_second_thread_are_refused_before_they_communicate():
    """Ranks pair collectives in the order each issues them: a second thread's calls would pair
    with whatever the other ranks' threads issued (mixing calls' data silently), so they raise on
    their rank before communicating, and the first thread's calls go on."""
    import threading

    mesh = sf.DeviceMesh(4)
    f = sf.jit(lambda x: sf.replicate(sf.shard(x, axis=0)), mesh=mesh)
    g = sf.jit(lambda x: sf.replicate(sf.shard(x, axis=0) * 2.0), mesh=mesh)  # a plan not yet checked
    x = np.arange(8.0)
    assert np.array_equal(f(x).gather(), x)
    caught = []

    def other_thread():
        for call in (lambda: f(x), lambda: g(x)):
            try:
                call()
            except RuntimeError as e:
                caught.append(str(e))

    t = threading.Thread(target=other_thread, name="worker")
    t.start()
    t.join()
    assert len(caught) == 2 and all("must come from one thread per process" in m for m in caught), caught
    assert all("the check of plan" in m for m in caught)
    assert np.array_equal(f(x).gather(), x) and np.array_equal(g(x).gather(), 2 * x)  # this thread goes on


def test_ops_on_an_array_placed_on_a_sub_mesh_are_refused_on_every_rank():
    """Outside sf.jit an op on such an array ran a plan traced on the sub-mesh with the root
    mesh's backend: IndexError on the ranks holding none of it, and the job aborted."""
    mesh = sf.DeviceMesh(4)
    a = sf.shard(np.arange(24.0).reshape(4, 6), axis=0, mesh=mesh.submesh([0, 1]))
    np.testing.assert_array_equal(a.gather(), np.arange(24.0).reshape(4, 6))
    for op in (lambda: a * 2.0, lambda: a.sum(0), lambda: a[1]):
        with pytest.raises(NotImplementedError, match="on the sub-mesh .* under MPI"):
            op()
    np.testing.assert_array_equal((sf.replicate(np.ones(4), mesh=mesh) * 2.0).gather(), 2 * np.ones(4))


@pytest.mark.parametrize("case", ["stream_rep", "shard_then_stream", "stream_then_shard"])
def test_a_streamed_move_off_a_sub_mesh_sends_strided_chunks(case):
    """A chunk of a move between meshes is a strided view: sent and received through contiguous
    staging (MPI asserted 'buffer ... is not contiguous' on every rank at -n 4)."""
    mesh = sf.DeviceMesh(4)
    sub = mesh.submesh([2, 3])
    x = np.random.default_rng(0).standard_normal((8, 8))  # the same on every rank

    def y_of(v):
        return sf.shard(v, 0, mesh=sub) * 2.0
    fn = {"stream_rep": lambda v: sf.stream(sf.replicate(y_of(v)), axis=1, chunks=2),
          "shard_then_stream": lambda v: sf.stream(sf.shard(y_of(v), axis=1), axis=0, chunks=2),
          "stream_then_shard": lambda v: sf.shard(sf.stream(y_of(v), axis=0, chunks=2), axis=1)}[case]
    out = sf.jit(fn, mesh=mesh)(x)
    assert out.sharding.mesh is None  # (the placement without mesh=: the whole mesh, in either order)
    np.testing.assert_allclose(out.gather(), 2 * x, rtol=1e-12)


def test_a_plan_bound_before_its_first_call_still_checks_that_call():
    """Binding checks the plan; each call checks again (labelled apart), so ranks that then call
    different plans raise instead of pairing their collectives."""
    mesh = sf.DeviceMesh(4)
    x = np.arange(8.0).reshape(4, 2)
    f = sf.jit(lambda a: sf.replicate(sf.shard(a, 0) * 2.0), mesh=mesh)
    g = sf.jit(lambda a: sf.replicate(sf.shard(a, 0) * 3.0), mesh=mesh)
    g(x)
    plan = f.lower(x)
    plan.executable  # bound on every rank
    with pytest.raises(sf.RankMismatchError, match="a call"):
        plan(x) if RANK == BAD else g(x)
    np.testing.assert_array_equal(plan(x).gather(), 2 * x)


def test_ranks_passing_different_global_arrays_all_raise_naming_the_argument(monkeypatch):
    """A probe's silent blend: each rank drew x and w from its own seed, and sf.jit took rows 0-3
    from rank 0's x and 4-7 from rank 1's, each rank with its own w.  Now every rank raises the same
    RankMismatchError naming the argument, before any collective; the same arrays run; the check
    off (SHARDFUSE_CHECK_INPUTS=0), the blend is the user's choice."""
    f, x, w = _natural(sf.DeviceMesh(4))
    mine = np.random.default_rng(100 + RANK).standard_normal(w.shape)
    with pytest.raises(sf.RankMismatchError) as err:
        f(x, mine)
    msg = str(err.value)
    assert COMM.allgather(msg) == [msg] * NPROCS, "every rank must raise the very same message"
    assert "argument w differs between the ranks" in msg and "sf.from_local" in msg, msg
    with pytest.raises(sf.RankMismatchError, match="argument x differs"):
        f(x * (RANK + 1), w)
    np.testing.assert_allclose(f(x, w).gather(), x @ w)  # nothing half-sent: the next call runs
    monkeypatch.setenv("SHARDFUSE_CHECK_INPUTS", "0")
    f(x, mine)


def test_equal_arguments_written_differently_pass_and_unequal_numbers_do_not():
    """A review's cases: the same values in another byte order, with -0.0 for 0.0, another NaN's
    payload, a Python float for a NumPy one, or as np.matrix, pass the input check; numbers whose
    digits only regroup across arguments (1, 23 against 12, 3) do not."""
    mesh = sf.DeviceMesh(4)
    g = sf.jit(lambda a, s, t: sf.shard(a, axis=0) * s + t, mesh=mesh)
    x = np.arange(8.0).reshape(8, 1) - 3.0
    x[0, 0] = np.nan
    other = x.astype(">f8") if RANK == BAD else x
    if RANK == BAD:
        other = other.copy()
        other[3, 0] = -0.0
        other[0, 0] = -np.nan
    got = g(other, np.float64(0.5) if RANK == BAD else 0.5, 1.0).gather()
    np.testing.assert_array_equal(got[1:], x[1:] * 0.5 + 1.0)
    np.testing.assert_array_equal(g(np.matrix(x), 0.5, 1.0).gather()[1:], x[1:] * 0.5 + 1.0)
    with pytest.raises(sf.RankMismatchError, match="argument"):
        g(x, 12 if RANK == BAD else 1, 3 if RANK == BAD else 23)


def test_ranks_placing_different_global_arrays_all_raise():
    """sf.shard / sf.replicate / sf.distribute of a host array outside a call compare it across the
    ranks as a call does (a probe: sf.distribute of each rank's own initial weights, silently a
    blend); the same arrays place as before."""
    mesh = sf.DeviceMesh(4)
    x = np.random.default_rng(3).standard_normal((8, 4))
    mine = x + RANK
    for place in (lambda a: sf.shard(a, axis=0, mesh=mesh), lambda a: sf.replicate(a, mesh=mesh),
                  lambda a: sf.distribute(a, mesh, ("DIDx", None))):
        with pytest.raises(sf.RankMismatchError, match="argument x differs between the ranks"):
            place(mine)
        np.testing.assert_array_equal(place(x).gather(), x)


def test_cpu_torch_tensors_that_differ_between_ranks_are_refused_as_numpy_arrays_are():
    """A DTensor probe: CPU torch tensors were not compared (only NumPy arrays), so each rank's own batch
    passed to a call, sf.torch_function or sf.shard ran as a silent blend; now refused alike, and bf16
    tensors (no NumPy dtype in torch) compared too."""
    torch = pytest.importorskip("torch", reason="the test extra's torch (CPU wheel) is not installed")
    mesh = sf.DeviceMesh(4)
    f, x, w = _natural(mesh)
    mine = torch.from_numpy(np.random.default_rng(100 + RANK).standard_normal(w.shape))
    with pytest.raises(sf.RankMismatchError, match="argument w differs between the ranks"):
        f(torch.from_numpy(x), mine)
    with pytest.raises(sf.RankMismatchError, match="argument x differs between the ranks"):
        sf.shard(mine.to(torch.bfloat16), axis=0, mesh=mesh)
    if NPROCS == 4:  # (one device a process: ranks 0, 1 hold dp block 0; under -n 2 a rank holds both replicas)
        with pytest.raises(ValueError, match="passed different data"):
            sf.from_local(torch.full((2, 3), float(RANK)), axis=0, over="dp", mesh=sf.DeviceMesh((2, 2), ("dp", "tp")))
    np.testing.assert_allclose(f(torch.from_numpy(x), torch.from_numpy(w)).gather(), x @ w)


def test_placing_from_a_prefetch_thread_or_with_the_check_off_communicates_nothing(monkeypatch):
    """A review: the check made every placement a collective, so a prefetch thread placing batches
    beside the calls was refused; only the main thread's placements are compared, and with
    SHARDFUSE_CHECK_INPUTS=0 none (each rank then places its own array, as asked)."""
    import threading
    mesh = sf.DeviceMesh(4)
    x = np.random.default_rng(4).standard_normal((8, 4))
    sf.shard(x, axis=0, mesh=mesh)  # (the main thread first: it binds the mesh's MPI backend, a collective)
    got = []
    t = threading.Thread(target=lambda: got.append(sf.shard(x, axis=0, mesh=mesh)), name="prefetch")
    t.start()
    t.join()
    np.testing.assert_array_equal(got[0].gather(), x)
    monkeypatch.setenv("SHARDFUSE_CHECK_INPUTS", "0")
    mine = sf.replicate(x + RANK, mesh=mesh)
    np.testing.assert_array_equal(mine.to_local(), x + RANK)


def test_replicas_passing_different_pieces_to_from_local_all_raise():
    """sf.from_local on a dp x tp mesh: the ranks along tp hold the same dp block and must pass the
    same batch.  Each drawing its own (seeded by rank, as a DDP sampler is) is refused on every
    rank with the same error, naming the block; seeded by the dp position it places as before."""
    mesh = sf.DeviceMesh((2, 2), ("dp", "tp"))
    dp = mesh.coords(mesh.local_devices[0])[mesh.axis_index("dp")]
    if NPROCS == 4:  # (one device a process: ranks 0, 1 hold dp block 0; under -n 2 a rank holds both tp replicas)
        with pytest.raises(ValueError, match=r"same block \(0,\) of the value passed different data") as err:
            sf.from_local(np.random.default_rng(RANK).standard_normal((2, 3)), axis=0, over="dp", mesh=mesh)
        msg = str(err.value)
        assert COMM.allgather(msg) == [msg] * NPROCS
    piece = np.random.default_rng(dp).standard_normal((2, 3))
    got = sf.from_local(piece, axis=0, over="dp", mesh=mesh).gather()
    np.testing.assert_array_equal(got, np.concatenate([np.random.default_rng(d).standard_normal((2, 3)) for d in (0, 1)]))


def test_a_per_rank_checkpoint_round_trips_through_addressable_shards():
    """An MPI probe: to_local() refused a bias sharded over (tp, dp) whose pieces on one process tile no
    box, and nothing took addressable_shards back.  sf.make_array_from_single_device_arrays (JAX's)
    rebuilds the value from this process' pieces, checking each against its box."""
    mesh = sf.DeviceMesh((2, 2), ("dp", "tp"))
    b = np.random.default_rng(5).standard_normal(16)
    x = sf.distribute(b, mesh, (("tp", "dp"),))
    saved = [np.array(s.data) for s in x.addressable_shards]
    back = sf.make_array_from_single_device_arrays(x.shape, x.sharding, saved, mesh=mesh)
    assert back.sharding == x.sharding
    np.testing.assert_array_equal(back.gather(), b)
    with pytest.raises(ValueError, match="its box of"):
        sf.make_array_from_single_device_arrays(x.shape, x.sharding, [s[:1] for s in saved], mesh=mesh)
