"""Every collective of the MPI backend over each axis of 2x2, 2x4 and 4x2 ("dp", "tp") meshes, where
a process may own devices of several teams of an axis (under -n 2, process 0 owns (dp0, tp0) and
(dp0, tp1): two dp teams; on 2x4, four), bound straight on the backend and checked against NumPy
float64 references on random inputs; 16-bit floats moved bit for bit by the gathers and summed in
float32 by the reductions.  backends/mpi_teams.py says which layouts are supported; an uneven one
(a 3x2 mesh under -n 2, whose dp teams hold 2 devices of process 0 and 1 of process 1) is refused
on every rank with its own message, before anything is sent.  Every rank runs every test in the
same order with the same seeds, so the collectives pair up."""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import cases
import shardfuse as sf
from shardfuse.backends.protocol import MAIN, Ref, contiguous_strides
from shardfuse.dtypes import np_dtype
from shardfuse.ops import Reduce
from shardfuse.runtime import backend_of

COMM = MPI.COMM_WORLD
NPROCS = COMM.Get_size()
SHAPES = [s for s in [(2, 2), (2, 4), (4, 2)] if (s[0] * s[1]) % NPROCS == 0]
AXES = ["dp", "tp"]
MOVES = ["float64", "float32", "bfloat16", "float16"]  # moved bit for bit
SUMS = {"float64": 1e-13, "float32": 1e-5, "bfloat16": 2e-2, "float16": 2e-3}  # relative to the sum of |x|
BLOCK = (3, 2)


def _mesh(shape):
    return sf.DeviceMesh(shape, ("dp", "tp"), backend="numpy")


def _ref(slot, shape, dtype, ndev, offsets=None):
    shape = tuple(shape)
    return Ref(slot, offsets or (0,) * ndev, shape, contiguous_strides(shape), dtype)


def _inputs(mesh, shape, dtype, seed):
    """One random (never zero) array per global device, the same on every rank."""
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(shape) + 3.0 * rng.choice([-1, 1], shape)).astype(np_dtype(dtype))
            for _ in range(mesh.size)]


def _run(mesh, name, send_shape, recv_shape, xs, dtype, axis, **kw):
    """Bind `op` on the backend, run start and wait; every local device's recv buffer (NaN-poisoned
    first, so an unwritten element shows)."""
    be, local = backend_of(mesh), mesh.local_devices
    send, recv = _ref(0, send_shape, dtype, len(local)), _ref(1, recv_shape, dtype, len(local))
    start, wait = getattr(be, f"bind_{name}")(send, recv, axis, MAIN, **kw)
    poison = np.nan if np_dtype(dtype).kind == "f" else 7  # (integers: a value no test expects)
    bufs = [[xs[d].copy() for d in local], [np.full(recv_shape, poison, np_dtype(dtype)) for _ in local]]
    start(bufs)
    if wait is not None:
        wait(bufs)
    return dict(zip(local, bufs[1]))


def _team_of(mesh, axis):
    return {d: (t, k) for t in mesh.teams(axis) for k, d in enumerate(t)}


def _bits(a):
    return a.view(np.uint16) if a.dtype.itemsize == 2 else a


CASES = [(s, a) for s in SHAPES for a in AXES]
IDS = [f"{s[0]}x{s[1]}-{a}" for s, a in CASES]


@pytest.mark.parametrize("dtype", MOVES)
@pytest.mark.parametrize("shape, axis", CASES, ids=IDS)
def test_allgather(shape, axis, dtype):
    mesh = _mesh(shape)
    n = mesh.axis_size(axis)
    xs = _inputs(mesh, BLOCK, dtype, 1)
    got = _run(mesh, "allgather", BLOCK, (n,) + BLOCK, xs, dtype, axis)
    for d, (team, _) in ((d, _team_of(mesh, axis)[d]) for d in got):
        want = np.stack([xs[q] for q in team])
        assert np.array_equal(_bits(got[d]), _bits(want)), (d, team)


@pytest.mark.parametrize("shape, axis", CASES, ids=IDS)
def test_allgather_in_place(shape, axis):
    """send is this device's own block of recv (the plan's in-place gather): IN_PLACE, or the
    block copied onto itself."""
    mesh = _mesh(shape)
    be, local, n = backend_of(mesh), mesh.local_devices, mesh.axis_size(axis)
    xs = _inputs(mesh, BLOCK, "float64", 2)
    pos = _team_of(mesh, axis)
    size = int(np.prod(BLOCK))
    recv = _ref(0, (n,) + BLOCK, "float64", len(local))
    send = _ref(0, BLOCK, "float64", len(local), tuple(pos[d][1] * size for d in local))
    start, wait = be.bind_allgather(send, recv, axis, MAIN)
    bufs = [[np.full((n,) + BLOCK, np.nan) for _ in local]]
    for j, d in enumerate(local):
        bufs[0][j][pos[d][1]] = xs[d]
    start(bufs)
    wait(bufs)
    for j, d in enumerate(local):
        np.testing.assert_array_equal(bufs[0][j], np.stack([xs[q] for q in pos[d][0]]))


@pytest.mark.parametrize("dtype", list(SUMS))
@pytest.mark.parametrize("shape, axis", CASES, ids=IDS)
def test_allreduce_sum(shape, axis, dtype):
    mesh = _mesh(shape)
    xs = _inputs(mesh, BLOCK, dtype, 3)
    got = _run(mesh, "allreduce", BLOCK, BLOCK, xs, dtype, axis, op=Reduce.SUM)
    for d in got:
        team = _team_of(mesh, axis)[d][0]
        want = sum(xs[q].astype(np.float64) for q in team)
        scale = sum(np.abs(xs[q].astype(np.float64)) for q in team).max()
        assert np.abs(got[d].astype(np.float64) - want).max() <= SUMS[dtype] * scale, (d, team)


@pytest.mark.parametrize("kind", ["max", "min"])
@pytest.mark.parametrize("dtype", ["int32", "int64"])  # floats travel as these order keys (backends/extrema.py)
@pytest.mark.parametrize("shape, axis", CASES, ids=IDS)
def test_allreduce_max_min_of_order_keys(shape, axis, dtype, kind):
    mesh = _mesh(shape)
    rng = np.random.default_rng(4)
    info = np.iinfo(dtype)
    xs = [rng.integers(info.min, info.max, BLOCK, dtype=dtype) for _ in range(mesh.size)]
    op = Reduce.MAX if kind == "max" else Reduce.MIN
    got = _run(mesh, "allreduce", BLOCK, BLOCK, xs, dtype, axis, op=op)
    for d in got:
        team = _team_of(mesh, axis)[d][0]
        want = (np.maximum if kind == "max" else np.minimum).reduce([xs[q] for q in team])
        np.testing.assert_array_equal(got[d], want)


@pytest.mark.parametrize("dtype", list(SUMS))
@pytest.mark.parametrize("shape, axis", CASES, ids=IDS)
def test_reduce_scatter(shape, axis, dtype):
    mesh = _mesh(shape)
    n = mesh.axis_size(axis)
    xs = _inputs(mesh, (n,) + BLOCK, dtype, 5)
    got = _run(mesh, "reduce_scatter", (n,) + BLOCK, BLOCK, xs, dtype, axis)
    for d in got:
        team, k = _team_of(mesh, axis)[d]
        want = sum(xs[q][k].astype(np.float64) for q in team)
        scale = sum(np.abs(xs[q][k].astype(np.float64)) for q in team).max()
        assert np.abs(got[d].astype(np.float64) - want).max() <= SUMS[dtype] * scale, (d, team)


@pytest.mark.parametrize("dtype", MOVES)
@pytest.mark.parametrize("shape, axis", CASES, ids=IDS)
def test_alltoall(shape, axis, dtype):
    mesh = _mesh(shape)
    n = mesh.axis_size(axis)
    xs = _inputs(mesh, (n,) + BLOCK, dtype, 6)
    got = _run(mesh, "alltoall", (n,) + BLOCK, (n,) + BLOCK, xs, dtype, axis)
    for d in got:
        team, k = _team_of(mesh, axis)[d]
        want = np.stack([xs[q][k] for q in team])  # block k of every peer, in team order
        assert np.array_equal(_bits(got[d]), _bits(want)), (d, team)


@pytest.mark.parametrize("shift", [1, -1, 2])
@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
@pytest.mark.parametrize("shape, axis", CASES, ids=IDS)
def test_sendrecv(shape, axis, dtype, shift):
    mesh = _mesh(shape)
    be, local = backend_of(mesh), mesh.local_devices
    xs = _inputs(mesh, BLOCK, dtype, 7)
    send, recv = _ref(0, BLOCK, dtype, len(local)), _ref(1, BLOCK, dtype, len(local))
    start, wait = be.bind_sendrecv(send, recv, axis, shift, MAIN)
    bufs = [[xs[d].copy() for d in local], [np.full(BLOCK, np.nan, np_dtype(dtype)) for _ in local]]
    start(bufs)
    wait(bufs)
    for j, d in enumerate(local):
        team, k = _team_of(mesh, axis)[d]
        assert np.array_equal(_bits(bufs[1][j]), _bits(xs[team[(k - shift) % len(team)]])), (d, team)


# ---- through sf.jit: the old refusal is gone ------------------------------------------------
@pytest.mark.parametrize("shape, axis", CASES, ids=IDS)
def test_jitted_collectives_over_each_axis(shape, axis):
    """Allgather, Allreduce and ReduceScatter planned by sf.jit over `axis` (under -n 2 on dp, a
    process' devices lie in several teams: these raised NotImplementedError before)."""
    mesh = _mesh(shape)
    n = mesh.axis_size(axis)
    rng = cases.fresh_rng(mesh)
    x, w = rng.standard_normal((2 * n, 3 * n)), rng.standard_normal((3 * n, 4))
    gather = sf.jit(lambda x: sf.replicate(sf.shard(x, axis=1, over=axis)), mesh=mesh)
    reduce = sf.jit(lambda x: sf.shard(x, axis=1, over=axis).sum(1), mesh=mesh)
    scatter = sf.jit(lambda x, w: sf.shard(sf.shard(x, axis=1, over=axis) @ sf.shard(w, axis=0, over=axis),
                                            axis=0, over=axis), mesh=mesh)
    cases.assert_close(gather(sf.shard(x, axis=1, over=axis, mesh=mesh)).gather(), x, "float64")
    cases.assert_close(reduce(x).gather(), x.sum(1), "float64")
    cases.assert_close(scatter(x, w).gather(), x @ w, "float64")


@pytest.mark.skipif(NPROCS != 2, reason="a 3x2 mesh needs a process count dividing 6")
def test_uneven_team_is_refused_on_every_rank_with_its_reason():
    mesh = sf.DeviceMesh((3, 2), ("dp", "tp"), backend="numpy")  # dp teams (0, 2, 4), (1, 3, 5)
    x = np.random.default_rng(8).standard_normal((4, 6))
    f = sf.jit(lambda x: sf.shard(x, axis=1, over="dp").sum(1), mesh=mesh)
    with pytest.raises(NotImplementedError, match=r"split unevenly over the processes \(process 0: 2, process 1: 1\)"):
        f(x)
    g = sf.jit(lambda x: sf.shard(x, axis=1, over="tp").sum(1), mesh=mesh)  # tp teams are even
    cases.assert_close(g(x).gather(), x.sum(1), "float64")
    assert all(COMM.allgather(True))


def test_old_refusal_is_gone():
    """The dp x tp examples of the README: no 'lie in ... different teams' refusal at any -n."""
    mesh = _mesh((2, 2))
    f = sf.jit(lambda x, w: sf.replicate(sf.shard(x, axis=0, over="dp") @ sf.shard(w, axis=1, over="tp")), mesh=mesh)
    rng = cases.fresh_rng(mesh)
    x, w = rng.standard_normal((4, 3)), rng.standard_normal((3, 6))
    try:
        got = f(x, w).gather()
    except NotImplementedError as e:  # pragma: no cover (the failure this test is about)
        pytest.fail(f"refused: {e}")
    cases.assert_close(got, x @ w, "float64")


# ---- the dp x tp transformer layer (shardfuse/transformer.py) ---------------------------------
LAYERS = {"dp x tp": {"tp": "tp", "dp": "dp"}, "dp x sp": {"tp": "tp", "sp": True, "dp": "dp", "chunks": 2}}


@pytest.mark.parametrize("config", LAYERS)
def test_dp_x_tp_transformer_layer_forward_and_gradients(config):
    """Forward and gradients of the layer on the 2x2 ("dp", "tp") mesh (under -n 2 the dp gradient
    buckets' Allreduce runs once per dp team a process owns devices of) equal the one-process
    computation: the layer unsharded (every device computes all of it, no communication) on the
    same ranks, and the float64 NumPy reference."""
    import test_transformer as tt
    from shardfuse.transformer import init_params, layer_reference, transformer_layer

    rng = np.random.default_rng(11)
    p = init_params(rng, tt.HIDDEN, "float64", 0.3)
    x = rng.standard_normal((tt.BATCH, tt.SEQ, tt.HIDDEN))
    r = rng.standard_normal(x.shape)
    kw, mesh = LAYERS[config], _mesh((2, 2))
    out = sf.jit(lambda p, x: transformer_layer(p, x, tt.HEADS, **kw), mesh=mesh)(p, x)
    np.testing.assert_allclose(np.asarray(out), layer_reference(p, x, tt.HEADS), rtol=1e-12, atol=1e-12)

    def loss(kw):
        return sf.grad(lambda p, x, r: (transformer_layer(p, x, tt.HEADS, **kw) * r).sum(), argnums=(0, 1))

    grad = sf.jit(loss(kw), mesh=mesh)
    text = str(grad.lower(p, x, r))
    assert "team=dp, bucket=" in text, text  # the gradient buckets' Allreduce over dp
    got_p, got_x = grad(p, x, r)
    want_p, want_x = sf.jit(loss({}), mesh=sf.DeviceMesh(4, "tp", backend="numpy"))(p, x, r)
    for k in want_p:
        np.testing.assert_allclose(np.asarray(got_p[k]), np.asarray(want_p[k]), rtol=1e-11, atol=1e-12, err_msg=k)
    np.testing.assert_allclose(np.asarray(got_x), np.asarray(want_x), rtol=1e-11, atol=1e-12)
    numeric, analytic = cases.directional(lambda q: float((layer_reference(q, x, tt.HEADS) * r).sum()), p, got_p, rng)
    assert abs(numeric - analytic) <= 1e-6 * (1 + abs(numeric)), (numeric, analytic)
