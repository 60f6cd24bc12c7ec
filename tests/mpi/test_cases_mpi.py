"""The shared case bodies (tests/cases.py), run inside `mpiexec -n P` ranks on the MPI backend.

Meshes: sf.DeviceMesh(4) (under -n 2 each process owns 2 devices, under -n 4 one) and
sf.DeviceMesh(P) (one device per process); 2-D meshes for the team sub-communicators.
Every rank runs every test in the same order, so the collectives pair up.
"""
from __future__ import annotations

import time

import numpy as np
import pytest
from mpi4py import MPI

import cases
import shardfuse as sf
import test_annotation_rule as annotation_rule
import test_moves_between_meshes as moves
from shardfuse.backends.protocol import MAIN, Ref, contiguous_strides
from shardfuse.runtime import backend_of

COMM = MPI.COMM_WORLD
RANK, NPROCS = COMM.Get_rank(), COMM.Get_size()
SIZES = sorted({4, NPROCS})
DTYPES = ("float32", "float64")


def _mesh(size):
    mesh = sf.DeviceMesh(size)
    assert mesh.nprocs == NPROCS and len(mesh.local_devices) == size // NPROCS
    assert type(backend_of(mesh)).__name__ == "NumpyMPIBackend"
    return mesh


@pytest.fixture(params=SIZES, ids=lambda s: f"D{s}")
def mesh(request):
    return _mesh(request.param)


def test_world():
    assert NPROCS > 1, "run under mpiexec -n P with P > 1"
    assert COMM.allgather(RANK) == list(range(NPROCS))


# ---- the shared bodies -------------------------------------------------------------------
@pytest.mark.parametrize("b_sharded", [False, True], ids=["bR", "bS"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("streams", [1, 2, 4])
@pytest.mark.parametrize("chunks", [1, 2, 4, 8])
def test_seed(mesh, chunks, streams, dtype, b_sharded):
    cases.seed_case(mesh, chunks, streams, dtype, b_sharded)


@pytest.mark.parametrize("b_sharded", [False, True], ids=["bR", "bS"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunks,streams", [(1, 1), (2, 2), (4, 4), (4, 1)])
def test_natural(mesh, chunks, streams, dtype, b_sharded):
    cases.natural_case(mesh, chunks, streams, dtype, b_sharded)


@pytest.mark.parametrize("dtype", DTYPES)
def test_unpipelined(mesh, dtype):
    cases.unpipelined_case(mesh, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("axis", [0, 1])
def test_allgather(mesh, axis, dtype):
    cases.allgather_case(mesh, axis, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_allreduce(mesh, dtype):
    cases.allreduce_case(mesh, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_scatter(mesh, dtype):
    cases.reduce_scatter_case(mesh, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_slice(mesh, dtype):
    cases.slice_case(mesh, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_from_local(mesh, dtype):
    cases.from_local_case(mesh, dtype)


@pytest.mark.parametrize("over", ["dp", "tp"])
def test_from_local_on_a_2d_mesh(over):
    cases.from_local_2d_case(sf.DeviceMesh((2, 2), ("dp", "tp")), over)


def test_from_local_where_processes_hold_different_counts_of_positions():
    """A (3, 4) mesh cut by process boundaries: under -n 4 rank 0 holds one dp position and the
    others two (every rank refuses, naming each rank's count); under -n 2 both hold two (1 of
    them shared), which places the value (no plan runs on it: its dp teams are split unevenly
    over the processes, which the MPI backend refuses, README)."""
    mesh = sf.DeviceMesh((3, 4), ("dp", "tp"))
    counts = COMM.allgather(len({mesh.coords(d)[0] for d in mesh.local_devices}))
    if len(set(counts)) > 1:
        with pytest.raises(ValueError, match=r"hold different numbers of positions along 'dp'.*positions=1"):
            sf.from_local(np.ones((2, 3)), axis=0, over="dp", mesh=mesh)
    else:
        cases.from_local_2d_case(mesh, "dp", run_plan=False)


@pytest.mark.parametrize("case", list(cases.FROM_LOCAL_2AXES))
def test_from_local_on_two_tensor_axes(case):
    """Under -n 2 a rank holds (dp, tp0) and (dp, tp1): two blocks along tp (or, tp outermost, the
    blocks dp and dp + 2 of one axis); under -n 4 one block each."""
    cases.from_local_2axes_case(sf.DeviceMesh((2, 2), ("dp", "tp")), case)


def test_from_local_partial_sums_are_refused_and_the_way_round_works():
    cases.from_local_partial_sums_case(sf.DeviceMesh((2, 2), ("dp", "tp")))


def test_from_local_where_a_process_holds_no_box_of_blocks():
    """A (3, 4) mesh cut by process boundaries, both axes sharded: a rank's devices hold blocks that
    are no box of them (under -n 2: dp 0 whole and half of dp 1); every rank refuses alike."""
    mesh = sf.DeviceMesh((3, 4), ("dp", "tp"))
    with pytest.raises(ValueError, match=r"not a box|different numbers of positions along 'dp', 'tp'"):
        sf.from_local(np.ones((4, 8)), axis=(0, 1), over=("dp", "tp"), mesh=mesh)


def test_repeated_calls_reuse_the_binding(mesh):
    """One plan called several times (persistent staging buffers, fresh requests each call)."""
    for _ in range(3):
        cases.seed_case(mesh, 4, 2, "float32")
        cases.reduce_scatter_case(mesh)
        cases.allreduce_case(mesh)


# ---- half precision: gathers as uint16 bits, reductions in float32 ---------------------------
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision(mesh, dtype):
    from shardfuse.dtypes import np_dtype

    dt, d = np_dtype(dtype), mesh.size
    rng = cases.fresh_rng(mesh)
    x = rng.standard_normal((2 * d, 3)).astype(dt)
    f = sf.jit(lambda x: sf.replicate(sf.shard(x, axis=0)), mesh=mesh)
    got = f(sf.shard(x, axis=0, mesh=mesh)).gather()
    assert got.dtype == dt and np.array_equal(got.view(np.uint16), x.view(np.uint16))  # bit-exact
    g = sf.jit(lambda x: sf.shard(x, axis=1).sum(1), mesh=mesh)
    y = rng.standard_normal((4, 2 * d)).astype(dt)
    ref = y.astype(np.float64).sum(1)
    err = np.abs(np.asarray(g(y).gather(), np.float64) - ref).max()
    assert err <= 0.05 * np.abs(y.astype(np.float64)).sum(1).max(), err


# ---- 2-D meshes: per-axis team communicators ------------------------------------------------
MESHES_2D = [(2, 2), (2, 4), (4, 2), (1, 4), (4, 1)]


@pytest.mark.parametrize("shape", MESHES_2D, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("over", ["DIDy", "DIDx"])
def test_2d_mesh_collectives(shape, over):
    if np.prod(shape) % NPROCS:
        pytest.skip(f"a mesh of {shape} cannot be split over {NPROCS} processes")
    mesh = sf.DeviceMesh(shape)  # (under -n 2 a process' devices may lie in several teams of `over`)
    rng = cases.fresh_rng(mesh)
    n = mesh.axis_size(over)
    x = rng.standard_normal((2 * n, 3 * n, 2))
    w = rng.standard_normal((3 * n, 4))

    gather = sf.jit(lambda x: sf.replicate(sf.shard(x, axis=1, over=over)), mesh=mesh)
    reduce = sf.jit(lambda x: sf.shard(x, axis=1, over=over).sum(1), mesh=mesh)

    @sf.jit(mesh=mesh)
    def row_parallel(x, w):
        return sf.shard(sf.shard(x, axis=1, over=over) @ sf.shard(w, axis=0, over=over), axis=0, over=over)

    x2 = x[..., 0]
    runs = [
        (lambda: gather(sf.shard(x, axis=1, over=over, mesh=mesh)), x),
        (lambda: reduce(x2), x2.sum(1)),
        (lambda: row_parallel(x2, w), x2 @ w),
    ]
    for run, ref in runs:
        cases.assert_close(run().gather(), ref, "float64")
    assert all(COMM.allgather(True))  # every rank got here: nothing was left half-sent


def test_2d_mesh_both_axes():
    """Gathers over both mesh axes in one program (two team communicators)."""
    shape = (2, NPROCS // 2) if NPROCS >= 4 else (NPROCS, 1)
    mesh = sf.DeviceMesh(shape)
    rng = cases.fresh_rng(mesh)
    x = rng.standard_normal((4 * shape[0], 4 * shape[1]))
    f = sf.jit(lambda x: sf.replicate(sf.shard(sf.shard(x, axis=0, over="DIDy"), axis=1, over="DIDx")), mesh=mesh)
    # at -n 2 the DIDx axis has one device: its gather folds into a view (passes/fold.py)
    want = {"allgather": 2} if shape[1] > 1 else {"allgather": 1}
    assert f.lower(sf.TensorSpec(x.shape, "float64")).collectives() == want
    cases.assert_close(f(x).gather(), x, "float64")


@pytest.mark.parametrize("name", sorted(annotation_rule.CASES))
def test_annotation_rule(name):
    """One annotation rule inside and outside sf.jit (issue 30): same placements, NumPy's values."""
    annotation_rule.rule_case(name)


# ---- start really is non-blocking -------------------------------------------------------------
def _token_ring(start, wait, bufs):
    """Rank r > 0 starts only after rank r-1 has returned from its start (a token): if start
    blocked until every rank joined the collective, rank 0 would never send the token."""
    if RANK > 0:
        req = COMM.irecv(source=RANK - 1, tag=77)
        deadline = time.monotonic() + 10
        while True:
            done, _ = req.test()
            if done:
                break
            assert time.monotonic() < deadline, "start() blocked: no token from the previous rank in 10 s"
            time.sleep(0.001)
    start(bufs)
    if RANK + 1 < NPROCS:
        COMM.send(True, dest=RANK + 1, tag=77)
    wait(bufs)


def _ref(slot, shape, dtype, L):
    return Ref(slot, (0,) * L, tuple(shape), contiguous_strides(tuple(shape)), dtype)


@pytest.mark.parametrize("op", ["allgather", "allreduce", "reduce_scatter"])
def test_start_is_nonblocking(mesh, op):
    be, L, D = backend_of(mesh), len(mesh.local_devices), mesh.size
    s = (3, 2)
    rows = {"allgather": ((s, (D,) + s)), "allreduce": (s, s), "reduce_scatter": ((D,) + s, s)}
    sshape, rshape = rows[op]
    send, recv = _ref(0, sshape, "float64", L), _ref(1, rshape, "float64", L)
    start, wait = getattr(be, f"bind_{op}")(send, recv, "DIDx", MAIN)
    assert wait is not None, "the MPI backend must split start and wait"
    sends = [np.full(sshape, float(d + 1)) for d in mesh.local_devices]
    recvs = [np.full(rshape, np.nan) for _ in mesh.local_devices]
    _token_ring(start, wait, [sends, recvs])
    total = D * (D + 1) / 2
    for j, d in enumerate(mesh.local_devices):
        if op == "allgather":
            expect = np.arange(1, D + 1, dtype=float)[:, None, None] * np.ones(s)
        elif op == "allreduce":
            expect = np.full(s, total)
        else:
            expect = np.full(s, total)  # every block of every device is the same sum here
        np.testing.assert_array_equal(recvs[j], expect)


# ---- bad input is raised before communication, on every rank --------------------------------
def test_shape_error_at_lower_is_raised_on_every_rank(mesh):
    d = mesh.size

    @sf.jit(mesh=mesh, streams=2)
    def ag_matmul(a, b):
        return sf.stream(sf.shard(a, axis=1, over="DIDx") @ b, axis=0)

    with pytest.raises(ValueError, match="contraction sizes differ"):
        ag_matmul.lower(sf.TensorSpec((2, d, 4, 8)), sf.TensorSpec((9, 8)))
    with pytest.raises(ValueError, match="cannot shard axis"):
        ag_matmul.lower(sf.TensorSpec((2, d + 1, 4, 8)), sf.TensorSpec((8, 8)))
    assert COMM.allgather("raised") == ["raised"] * NPROCS  # every rank raised, none is stuck
    cases.seed_case(mesh, 2, 2, "float32")  # and the next collectives still pair up


def test_wrong_argument_shape_at_call_is_raised_on_every_rank(mesh):
    d = mesh.size
    f = sf.jit(lambda x: sf.replicate(sf.shard(x, axis=0)), mesh=mesh)
    plan = f.lower(sf.TensorSpec((2 * d, 3), "float64"))
    with pytest.raises(ValueError, match="expected shape"):
        plan(np.zeros((2 * d, 4)))
    assert COMM.allgather("raised") == ["raised"] * NPROCS
    cases.allgather_case(mesh, 0)


# ---- replicated results: every local device's copy is written ----------------------------------
def _all_replicas(out, ref):
    """gather() reads one replica per replicated mesh axis; check every local device's copy."""
    for j, shard in enumerate(out.shards):
        got = np.asarray(shard, np.float64)
        assert np.all(np.isfinite(got)), f"local device {j}: unwritten (poisoned) elements"
        np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12, err_msg=f"local device {j}")


@pytest.mark.parametrize("axis", [0, 1])
def test_allgather_replicas(mesh, axis):
    d = mesh.size
    x = cases.randn(cases.fresh_rng(mesh), (2 * d, 3 * d), "float64")
    f = sf.jit(lambda x: sf.replicate(sf.shard(x, axis=axis)), mesh=mesh)
    _all_replicas(f(sf.shard(x, axis=axis, mesh=mesh)), x)


def test_allreduce_replicas(mesh):
    d = mesh.size
    x = cases.randn(cases.fresh_rng(mesh), (5, 2 * d), "float64")
    f = sf.jit(lambda x: sf.shard(x, axis=1).sum(1), mesh=mesh)
    _all_replicas(f(x), x.sum(1))


def test_pipelined_replicas(mesh):
    d = mesh.size
    rng = cases.fresh_rng(mesh)
    a, b = cases.randn(rng, (4, d, 2, 8), "float64"), cases.randn(rng, (8, 3), "float64")

    @sf.jit(mesh=mesh, streams=2)
    def ag_matmul(a, b):
        return sf.stream(sf.shard(a, axis=1, over="DIDx") @ b, axis=0)

    _all_replicas(ag_matmul(sf.shard(a, axis=1, over="DIDx", mesh=mesh), b), a @ b)


# ---- beyond the seed (as in tests/test_general.py), across processes ---------------------------
@pytest.mark.parametrize("streams", [1, 3])
def test_pipelined_gemm_reduce_scatter(mesh, streams):
    """Each chunk's partial sums are reduce-scattered (Ireduce_scatter_block) while the next GEMM runs."""
    d = mesh.size

    @sf.jit(mesh=mesh, streams=streams)
    def gemm_rs(x, w):
        x = sf.shard(x, axis=2)
        w = sf.shard(w, axis=0)
        return sf.stream(sf.shard(x @ w, axis=1), axis=0)

    rng = cases.fresh_rng(mesh)
    x, w = rng.standard_normal((4, 2 * d, 3 * d)), rng.standard_normal((3 * d, 5))
    plan = gemm_rs.lower(sf.TensorSpec(x.shape, "float64"), sf.TensorSpec(w.shape, "float64"))
    assert plan.collectives() == {"reduce_scatter": 4}
    out = gemm_rs(x, w)
    assert out.sharding.placements(mesh) == ("S(1)",)
    cases.assert_close(out.gather(), x @ w, "float64")


def test_2d_mesh_pipelined_allgather_over_one_axis():
    mesh = sf.DeviceMesh((2, 2))  # DIDx teams are mesh rows: under -n 2 each process owns one

    @sf.jit(mesh=mesh)
    def f(a, b):
        a = sf.shard(sf.shard(a, axis=1, over="DIDx"), axis=2, over="DIDy")
        return sf.stream(sf.shard(a @ b, axis=2, over="DIDy"), axis=0)

    rng = cases.fresh_rng(mesh)
    a, b = rng.standard_normal((4, 2, 4, 8)), rng.standard_normal((8, 3))
    assert f.lower(sf.TensorSpec(a.shape, "float64"), sf.TensorSpec(b.shape, "float64")).collectives() == \
        {"allgather": 4}
    out = f(a, b)
    assert out.sharding.placements(mesh) == ("S(2)", "R")
    cases.assert_close(out.gather(), a @ b, "float64")


def test_named_mesh_axes():
    mesh = sf.DeviceMesh((2, 2), ("dp", "tp"))
    f = sf.jit(lambda x, w: sf.replicate(sf.shard(x, axis=0, over="dp") @ sf.shard(w, axis=1, over="tp")),
               mesh=mesh)
    rng = cases.fresh_rng(mesh)
    x, w = rng.standard_normal((4, 3)), rng.standard_normal((3, 6))
    # (under -n 2 process 0 owns devices 0, 1, which are in two different dp teams)
    cases.assert_close(f(x, w).gather(), x @ w, "float64")
    assert all(COMM.allgather(True))


# ---- the tensor-parallel MLP block (shardfuse/mlp.py), across processes ----------------------
def _specs(args):
    return [sf.TensorSpec(a.shape, a.dtype.name) for a in args]


@pytest.mark.parametrize("chunks", [1, 2])
@pytest.mark.parametrize("mode", ["tp", "sp"])
def test_mlp_1d(mesh, mode, chunks):
    from shardfuse.mlp import mlp_block, mlp_inputs, mlp_reference

    d = mesh.size
    f = mlp_block(mesh, mode, chunks=chunks, streams=2)
    args = mlp_inputs(cases.fresh_rng(mesh), tokens=4 * d * chunks, hidden=2 * d)
    expected = {"allgather": chunks, "reduce_scatter": chunks} if mode == "sp" else {"allreduce": chunks}
    assert f.lower(*_specs(args)).collectives() == expected
    out = f(*args)
    assert out.sharding.placements(mesh) == (("S(0)",) if mode == "sp" else ("R",))
    cases.assert_close(out.gather(), mlp_reference(*args), "float64")


@pytest.mark.parametrize("mode", ["tp", "sp"])
def test_mlp_2d_data_and_tensor_parallel(mode):
    """dp x tp: tp teams are mesh rows (under -n 2 one process each), dp needs no communication."""
    from shardfuse.mlp import mlp_block, mlp_inputs, mlp_reference

    mesh = sf.DeviceMesh((2, 2), ("dp", "tp"))
    f = mlp_block(mesh, mode, chunks=2, dp="dp")
    args = mlp_inputs(cases.fresh_rng(mesh), tokens=8, hidden=4, batch=2)
    out = f(*args)
    assert out.sharding.placements(mesh) == (("S(0)", "S(1)") if mode == "sp" else ("S(0)", "R"))
    cases.assert_close(out.gather(), mlp_reference(*args), "float64")


# ---- the resharding table and the ring, across processes -----------------------------------
@pytest.mark.parametrize("entry", sorted(cases.RESHARD_TABLE))
def test_reshard_table(mesh, entry):
    cases.reshard_case(mesh, entry)


@pytest.mark.parametrize("layout", ["seed", "natural"])
def test_ring(mesh, layout):
    d = mesh.size
    rng = cases.fresh_rng(mesh)
    if layout == "seed":
        f = sf.jit(lambda a, b: sf.stream(sf.shard(a, axis=1) @ b, axis=1, algorithm="ring"), mesh=mesh)
        a = rng.standard_normal((3, d, 4, 8))
    else:
        f = sf.jit(lambda a, b: sf.stream(sf.shard(a, axis=0) @ b, axis=0, algorithm="ring"), mesh=mesh)
        a = rng.standard_normal((4 * d, 8))
    b = rng.standard_normal((8, 5))
    cases.assert_close(f(a, b).gather(), a @ b, "float64")


# ---- moves between meshes (pipeline stages) ------------------------------------------------
@pytest.mark.parametrize("entry", sorted(cases.MOVES))
def test_move_between_meshes(entry):
    cases.move_case(_mesh(4), entry)


def test_two_stage_pipeline():
    cases.pipeline_case(_mesh(4))


def test_collectives_inside_a_stage():
    cases.stage_collectives_case(_mesh(4))  # (under -n 2: two devices of a process in one stage's team)


def test_profile_gathers_every_ranks_steps():
    """plan.profile under mpiexec: every rank's steps, on every rank, with its devices."""
    mesh = sf.DeviceMesh(NPROCS)
    f = sf.jit(lambda a, b: sf.stream(sf.shard(a, axis=1) @ b, axis=0), mesh=mesh, streams=2)
    a, b = np.ones((2, NPROCS, 4, 8)), np.ones((8, 4))
    plan = f.lower(sf.TensorSpec(a.shape, "float64"), sf.TensorSpec(b.shape, "float64"))
    tl = plan.profile(a, b, repeat=2)
    assert len(tl) == NPROCS * 2 * len(plan.executable.steps)
    assert {e.rank for e in tl.events} == set(range(NPROCS))
    assert {e.devices for e in tl.events if e.rank == mesh.rank} == {tuple(mesh.local_devices)}
    assert len(COMM.allgather(len(tl))) == NPROCS and len(set(COMM.allgather(len(tl)))) == 1


def test_array_ops_outside_jit(mesh):
    """Operators, reductions and indexing on sf.Arrays (one-op plans) are collective and agree
    with NumPy on every rank."""
    rng = np.random.default_rng(COMM.bcast(int(time.time_ns() % 2**31)))  # the same inputs on every rank
    a, b, w = rng.standard_normal((8, 6)), rng.standard_normal((8, 6)), rng.standard_normal((6, 3))
    x, y = sf.shard(a, axis=0, mesh=mesh), sf.replicate(b, mesh=mesh)
    for got, ref in ((x + y, a + b), (2.0 - x, 2.0 - a), (abs(x), np.abs(a)), (x @ w, a @ w), (np.exp(x), np.exp(a)),
                     (x.sum(0), a.sum(0)), (x.mean(), a.mean()), (x[3], a[3]), (x[2:6], a[2:6]), (x[..., 1], a[..., 1])):
        np.testing.assert_allclose(got.gather(), ref, rtol=1e-12, atol=1e-12)
    assert len(x) == 8 and x[..., 1].placements == (sf.Shard(0),)


# ---- issue 30: moves between meshes, reshapes and streams on sub-meshes, 0-d and empty values ----
@pytest.mark.parametrize("body,args", [
    (moves.partly_sharded_to_sub_mesh, (2,)), (moves.partly_sharded_to_sub_mesh, (4,)),
    (moves.sub_mesh_to_partly_sharded, ()),
    (moves.tuple_in_non_mesh_order_and_sub_mesh, ([0, 1, 2, 3],)),
    (moves.tuple_in_non_mesh_order_and_sub_mesh, ([3, 1, 2, 0],)),
    (moves.two_sharded_axes_to_sub_mesh, ()), (moves.reshape_on_a_sub_mesh, ()),
    (moves.reshape_on_a_sub_mesh_larger_than_the_mesh_axis, ()),
    (moves.stream_a_value_moved_to_a_sub_mesh_and_back, ()), (moves.zero_d_on_a_mesh, ()), (moves.empty_values, ()),
    (moves.pending_sum_moved_to_another_sub_mesh, ()), (moves.reshape_on_a_larger_sub_mesh_than_its_input, ()),
], ids=lambda v: getattr(v, "__name__", str(v)))
def test_moves_between_meshes(body, args):
    body(sf.DeviceMesh, *args)
