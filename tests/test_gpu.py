"""The CuPy + NCCL + cuBLAS backend on the GPUs this process sees, against float64 NumPy.

Every test that takes `mesh` runs at D = 1, 2, 4 and 8 local devices, on the GPUs there are:
with fewer GPUs than devices, blocks of devices are virtual devices sharing a GPU (their
collectives are device copies), so the whole file runs on one GPU.  The heaviest
parametrizations run at fewer sizes (their `mesh` parameter says which).  Skipped, with one
line saying why, where CuPy is missing or sees no GPU.  Buffers are poisoned with NaN
(SHARDFUSE_POISON=1, set in conftest), so an unwritten element fails.
"""
import os

import numpy as np
import pytest

os.environ.setdefault("SHARDFUSE_POISON", "1")

cupy = pytest.importorskip("cupy", reason="CuPy is not installed")


from cases import gpu_count  # noqa: E402

NGPU = gpu_count()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(NGPU == 0, reason="CuPy sees no GPU")]

import shardfuse as sf  # noqa: E402
from shardfuse.backends.cuda import copies  # noqa: E402
from shardfuse.backends.protocol import MAIN, Ref, Stream, contiguous_strides  # noqa: E402
from shardfuse.dtypes import np_dtype  # noqa: E402
from shardfuse.runtime import backend_of  # noqa: E402

DTYPES = ["float16", "bfloat16", "float32", "float64"]
# relative error of a product against float64 on rounded inputs: output rounding dominates
TOL = {"float64": 1e-12, "float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}


SIZES = (1, 2, 4, 8)
_MESHES: dict = {}


@pytest.fixture(scope="module", params=SIZES, ids=lambda d: f"D{d}")
def mesh(request):
    """One mesh (and backend) per size, shared by every test of that size; tests override the
    sizes with @pytest.mark.parametrize("mesh", [...], indirect=True)."""
    d = request.param
    if d not in _MESHES:
        _MESHES[d] = sf.DeviceMesh(d, backend="cupy")
    return _MESHES[d]


def rng():
    return np.random.default_rng(int.from_bytes(os.urandom(4), "little"))


def randn(r, shape, dtype):
    return r.standard_normal(shape).astype(np_dtype(dtype))


def check(got, ref, dtype):
    got = np.asarray(got).astype(np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert np.all(np.isfinite(got)), "unwritten (poisoned) elements in the result"
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert err <= TOL[dtype], f"relative error {err:.3e} > {TOL[dtype]:.0e} ({dtype})"


def f64(x):
    return np.asarray(x).astype(np.float64)


def seed_fns(mesh, streams, graph=False):
    @sf.jit(mesh=mesh, streams=streams, graph=graph)
    def ag_matmul(a, b):
        a = sf.shard(a, axis=1, over=mesh.axis_names[-1])
        return sf.stream(a @ b, axis=0)

    return ag_matmul


def test_backend_is_cupy(mesh):
    be, d = backend_of(mesh), mesh.size
    assert be.name == "cupy"
    assert all(not s.ptr == 0 for s in be.main)  # never the legacy null stream
    # device j on GPU j when there are enough, else blocks of virtual devices per GPU
    assert be.ordinals == (list(range(d)) if d <= NGPU else [j * NGPU // d for j in range(d)])
    assert len(be.main) == d and all(be.stream(j) is be.main[j] for j in range(d))
    assert len({id(s) for s in be.main}) == len(set(be.ordinals))  # one main stream per GPU


def _seed(mesh, chunks, streams, dtype):
    d = mesh.size
    r = rng()
    a, b = randn(r, (chunks, d, 16, 64), dtype), randn(r, (64, 48), dtype)
    f = seed_fns(mesh, streams)
    c = f(sf.shard(a, axis=1, over="DIDx", mesh=mesh), b)
    check(c.gather(), f64(a) @ f64(b), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunks, streams", [(c, s) for c in (1, 2, 4, 8) for s in (1, 2, 4)])
@pytest.mark.parametrize("mesh", [1], indirect=True)
def test_seed_pipelined(mesh, chunks, streams, dtype):
    _seed(mesh, chunks, streams, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunks, streams", [(1, 1), (2, 4), (4, 2), (8, 4)])
@pytest.mark.parametrize("mesh", [2, 4, 8], indirect=True)
def test_seed_pipelined_more_devices(mesh, chunks, streams, dtype):
    _seed(mesh, chunks, streams, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_unpipelined_and_large(mesh, dtype):
    """One Allgather + one big GEMM (fills the GPU), against float64."""
    d = mesh.size
    r = rng()
    a, b = randn(r, (1, d, 512, 1024), dtype), randn(r, (1024, 768), dtype)

    @sf.jit(mesh=mesh)
    def ag_then_matmul(a, b):
        return sf.replicate(sf.shard(a, axis=1, over="DIDx") @ b)

    check(ag_then_matmul(a, b).gather(), f64(a) @ f64(b), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bit_identical_across_stream_counts(mesh, dtype):
    d = mesh.size
    r = rng()
    a, b = randn(r, (4, d, 64, 256), dtype), randn(r, (256, 128), dtype)
    a_sh = sf.shard(a, axis=1, over="DIDx", mesh=mesh)
    outs = [seed_fns(mesh, s)(a_sh, b).gather() for s in (1, 2, 3, 4)]
    check(outs[0], f64(a) @ f64(b), dtype)
    for o in outs[1:]:
        assert o.tobytes() == outs[0].tobytes()


def _dev_rand(be, shape, dtype, seed):
    """A random device array (stored dtype) and its float64 copy, made on the plan's main stream."""
    with be.stream(0):
        cupy.random.seed(seed)
        x = cupy.random.standard_normal(shape, dtype=np.float32)
        if dtype == "bfloat16":
            x = (x.view(np.uint32) >> 16).astype(np.uint16)
            return x, (x.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        x = x.astype(np_dtype(dtype))
        return x, x.astype(np.float64)


def _device_input(mesh, x, dtype, axis):
    """A CuPy array (bfloat16 as its uint16 bits) placed on mesh through the public API, zero
    copy: sharded on `axis` over DIDx, or replicated (axis None).  CuPy has no bfloat16, so a
    bfloat16 array goes in as a torch bfloat16 view of the same memory."""
    if dtype == "bfloat16":
        torch = pytest.importorskip("torch", reason="bfloat16 device arrays go in through torch")
        x = torch.from_dlpack(x.view(cupy.int16)).view(torch.bfloat16)
    return sf.replicate(x, mesh=mesh) if axis is None else sf.shard(x, axis=axis, over="DIDx", mesh=mesh)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("mesh", [1], indirect=True)
def test_no_early_reuse_of_buffers_read_by_other_streams(mesh, dtype):
    """Many calls in a row with no synchronisation, each on a fresh device input that is dropped
    right after the call while worker streams still read it (the GPU runs behind the host), so
    the pool could hand its memory to the next input early: every result must still be right."""
    be = backend_of(mesh)
    f = seed_fns(mesh, 4)
    b, b64 = _dev_rand(be, (2048, 4096), dtype, 1)
    b_arr = _device_input(mesh, b, dtype, None)
    seeds = [int(s) for s in rng().integers(1, 2**31, 24)]
    refs, outs = [], []
    for s in seeds:
        a, a64 = _dev_rand(be, (8, 1, 512, 2048), dtype, s)
        refs.append(a64)
        outs.append(f(_device_input(mesh, a, dtype, 1), b_arr))
        del a  # freed now; the plan's worker streams may still be reading it
    with be.stream(0):
        for a64, c in zip(refs, outs):
            ref = cupy.matmul(a64, b64)
            got = c.to_local()
            got = (got.astype(np.uint32) << 16).view(np.float32) if dtype == "bfloat16" else got
            got = got.astype(np.float64)
            assert bool(cupy.all(cupy.isfinite(got)))
            err = float(cupy.linalg.norm(got - ref) / cupy.linalg.norm(ref))
            assert err <= TOL[dtype], err


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunks", [1, 4, 8])
def test_graph_equals_eager(mesh, chunks, dtype):
    d = mesh.size
    r = rng()
    eager, graph = seed_fns(mesh, 4), seed_fns(mesh, 4, graph=True)
    for _ in range(3):  # graph outputs are the plan's buffers: each call overwrites them
        a, b = randn(r, (chunks, d, 32, 128), dtype), randn(r, (128, 64), dtype)
        a_sh = sf.shard(a, axis=1, over="DIDx", mesh=mesh)
        ce = eager(a_sh, b).gather()
        cg = graph(a_sh, b).gather()
        check(cg, f64(a) @ f64(b), dtype)
        assert cg.tobytes() == ce.tobytes()


@pytest.mark.parametrize("mesh", [1, 4], indirect=True)
def test_graph_reads_the_callers_buffers(mesh):
    """Two sets of input buffers, alternating: one graph each, captured on first use and replayed
    after, reading the caller's buffers in place (nothing is copied in)."""
    d, dtype = mesh.size, "float16"
    r = rng()
    g = seed_fns(mesh, 2, graph=True)
    sets = []
    for _ in range(2):
        a, b = randn(r, (4, d, 32, 64), dtype), randn(r, (64, 32), dtype)
        sets.append((sf.shard(a, axis=1, over="DIDx", mesh=mesh), sf.replicate(b, mesh=mesh), f64(a) @ f64(b)))
    for _ in range(3):
        for a_arr, b_arr, ref in sets:
            check(g(a_arr, b_arr).gather(), ref, dtype)
    gp = g.lower(sets[0][0].spec, sets[0][1].spec).executable.graph
    assert gp.captures == 2 and len(gp.graphs) == 2


@pytest.mark.parametrize("mesh", [1], indirect=True)
def test_graph_cache_is_bounded(mesh):
    """More input sets than the cache holds: the least recently used graph is dropped (and
    captured again when its buffers come back); every result is right."""
    d, dtype = mesh.size, "float32"
    r = rng()
    g = seed_fns(mesh, 2, graph=True)
    b = sf.replicate(randn(r, (64, 32), dtype), mesh=mesh)
    b64 = f64(b.gather())
    sets = []
    for _ in range(10):
        a = randn(r, (2, d, 16, 64), dtype)
        sets.append((sf.shard(a, axis=1, over="DIDx", mesh=mesh), f64(a) @ b64))
    for a_arr, ref in sets:
        check(g(a_arr, b).gather(), ref, dtype)
    gp = g.lower(sets[0][0].spec, b.spec).executable.graph
    assert len(gp.graphs) == gp.MAX_GRAPHS == 8 and gp.captures == 10
    check(g(sets[0][0], b).gather(), sets[0][1], dtype)  # dropped earlier: captured again
    assert gp.captures == 11 and len(gp.graphs) == 8


# ---- the shared case bodies (float32 without TF32, float64), on the GPU mesh -------------------
def _cases():
    import cases

    return cases


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("b_sharded", [False, True])
@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_cases_seed_and_natural(mesh, chunks, b_sharded, dtype):
    c = _cases()
    c.seed_case(mesh, chunks, 2, dtype, b_sharded)
    c.natural_case(mesh, chunks, 2, dtype, b_sharded)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_cases_collectives(mesh, dtype):
    c = _cases()
    c.unpipelined_case(mesh, dtype)
    for axis in (0, 1):
        c.allgather_case(mesh, axis, dtype)
    c.allreduce_case(mesh, dtype)
    c.reduce_scatter_case(mesh, dtype)
    c.slice_case(mesh, dtype)


# ---- elementwise and sum, every dtype (bfloat16 through the backend's own kernels) ----------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_elementwise_and_sum(mesh, dtype):
    r = rng()
    x, y = randn(r, (6, 40), dtype), randn(r, (6, 40), dtype)
    add = sf.jit(lambda a, b: a + b, mesh=mesh)
    mul = sf.jit(lambda a, b: a * b, mesh=mesh)
    tot = sf.jit(lambda a: a.sum(1), mesh=mesh)
    tol = {"float64": 1e-15, "float32": 1e-7, "float16": 1e-3, "bfloat16": 8e-3}[dtype]
    for got, ref in ((add(x, y), f64(x) + f64(y)), (mul(x, y), f64(x) * f64(y)), (tot(x), f64(x).sum(1))):
        got = f64(got.gather())
        assert np.all(np.isfinite(got))
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) <= tol * (8 if ref.ndim == 1 else 1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_means_whose_sums_overflow_and_division_by_small_scalars(mesh, dtype):
    # a mean is one scaled sum (float16's sum of these overflows, its mean does not); x / c divides
    r = rng()
    xs = (30 + r.random((8, 4096))).astype(np_dtype(dtype))
    for f in (lambda a: a.mean(1), lambda a: sf.shard(a, 1).mean(1)):
        got = f64(sf.jit(f, mesh=mesh)(xs).gather())
        np.testing.assert_allclose(got, f64(xs).mean(1), rtol=8e-3)
    small = (0.1 + 0.4 * r.random((4, 8))).astype(xs.dtype)
    got = f64(sf.jit(lambda a: a / 1e-5, mesh=mesh)(small).gather())
    np.testing.assert_allclose(got, f64(small) / 1e-5, rtol=8e-3)


@pytest.mark.parametrize("dtype", DTYPES + ["int32", "int64"])
def test_floor_divide_mod_argmax_var_clip(mesh, dtype):
    # // and % run as CuPy's floor_divide and remainder (never fused; bfloat16 through float32 scratch),
    # argmax over a sharded axis as an Allreduce-max then an Allreduce-min of int64 indices
    r = rng()
    ints = dtype.startswith("int")
    x = (r.integers(1, 50, (8, 48)) * r.choice([-1, 1], (8, 48))).astype(dtype) if ints else \
        (r.uniform(0.25, 4.0, (8, 48)) * r.choice([-1.0, 1.0], (8, 48))).astype(np_dtype(dtype))
    y = ((np.abs(x) // 3 + 1 if ints else np.abs(x) + 0.5) * np.sign(x)[:, ::-1]).astype(x.dtype)  # (never zero)
    xa, ya = (sf.shard(v, axis=1, mesh=mesh) for v in (x, y))
    fd, md = sf.jit(lambda a, b: (a // b, a % 3), mesh=mesh)(xa, ya)
    xf, yf = f64(x), f64(y)
    if ints:
        np.testing.assert_array_equal(np.asarray(fd.gather()), x // y)
        np.testing.assert_array_equal(np.asarray(md.gather()), x % 3)
    else:  # (in 16 bits a quotient near an integer may round across it: off by one, rarely)
        got = f64(fd.gather())
        assert np.all(np.abs(got - xf // yf) <= 1) and np.mean(got == xf // yf) > 0.95
        np.testing.assert_allclose(f64(md.gather()), xf % 3, atol=8 * TOL[dtype] * 4)
    am = sf.jit(lambda a: (a.argmax(1), np.argmin(a, axis=1)), mesh=mesh)(xa)
    np.testing.assert_array_equal(np.asarray(am[0].gather()), x.argmax(1))
    np.testing.assert_array_equal(np.asarray(am[1].gather()), x.argmin(1))
    if not ints:
        v, c = sf.jit(lambda a: (a.var(1, ddof=1), np.clip(a, -1.0, 2.0)), mesh=mesh)(xa)
        np.testing.assert_allclose(f64(v.gather()), xf.var(1, ddof=1), rtol=TOL[dtype] * 10)
        np.testing.assert_array_equal(f64(c.gather()), np.clip(xf, -1.0, 2.0))


# ---- the backend's GEMM binding on strided views: transposes, batches, broadcast -------------------
def _strided(shape, order):
    st, acc = [0] * len(shape), 1
    for o in reversed(order):
        st[o] = acc
        acc *= shape[o]
    return tuple(st)


GEMM_VIEWS = [
    # (a shape, a order, b shape, b order, out shape, out order)
    ((96, 80), (0, 1), (80, 72), (0, 1), (96, 72), (0, 1)),
    ((96, 80), (1, 0), (80, 72), (0, 1), (96, 72), (0, 1)),  # a transposed in memory
    ((96, 80), (0, 1), (80, 72), (1, 0), (96, 72), (1, 0)),  # b and out column-major
    ((3, 40, 80), (0, 1, 2), (80, 72), (0, 1), (3, 40, 72), (0, 1, 2)),  # folds into one GEMM
    ((3, 40, 80), (0, 1, 2), (3, 80, 72), (0, 1, 2), (3, 40, 72), (0, 1, 2)),  # strided batch
    ((2, 3, 16, 80), (0, 1, 2, 3), (3, 80, 24), (0, 1, 2), (2, 3, 16, 24), (0, 1, 2, 3)),  # 2 batch dims
    ((2, 3, 16, 80), (1, 0, 2, 3), (2, 3, 80, 24), (0, 1, 3, 2), (2, 3, 16, 24), (1, 0, 2, 3)),
    ((2, 3, 16, 80), (0, 3, 1, 2), (80, 24), (0, 1), (2, 3, 16, 24), (0, 1, 2, 3)),  # staged through scratch
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", range(len(GEMM_VIEWS)))
@pytest.mark.parametrize("mesh", [1, 4], indirect=True)
def test_gemm_views(mesh, case, dtype):
    be = backend_of(mesh)
    ash, ao, bsh, bo, osh, oo = GEMM_VIEWS[case]
    r = rng()
    a, b = randn(r, ash, dtype), randn(r, bsh, dtype)
    nd = len(be.local_devices)

    def placed(x, order):  # x stored with the given axis order; Ref reads it back in logical order
        phys = np.ascontiguousarray(np.transpose(x, order))
        return be.to_device([phys] * nd)[0:nd]

    ra = Ref(0, (0,) * nd, ash, _strided(ash, ao), dtype)
    rb = Ref(1, (0,) * nd, bsh, _strided(bsh, bo), dtype)
    rc = Ref(2, (0,) * nd, osh, _strided(osh, oo), dtype)
    out = be.empty((int(np.prod(osh)),), dtype)
    bufs = [placed(a, ao), placed(b, bo), out]
    step = be.bind_matmul(ra, rb, rc, MAIN)
    step(bufs)
    for j in range(nd):  # at D = 4 on one GPU the devices' GEMMs may be one batched call: every one
        check(be.to_host([be.view(bufs, rc, j)])[0], np.matmul(f64(a), f64(b)), dtype)


def test_bench_runs_on_the_gpu():
    import json
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "shardfuse", "bench", "--backend", "cupy", "--m", "512", "--k", "256",
                        "--n", "256", "--chunks", "1,2,4", "--repeat", "3", "--warmup", "1", "--growth-calls", "20",
                        "--dtype", "float16,bfloat16", "--graph", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    names = {row["name"] for row in out["rows"]}
    assert {"unpipelined", "pipelined (eager)", "allgather alone", "gemm alone (plan)"} <= names
    for m in out["memory"]:
        if "pool_growth_bytes" in m:
            assert m["pool_growth_bytes"] == 0, m


def _nccl_mesh():
    """A one-device mesh whose one-device teams use NCCL (a one-rank communicator, as with
    SHARDFUSE_COLLECTIVES=nccl) instead of a copy: the NCCL path on a machine with one GPU."""
    mesh = sf.DeviceMesh(1, backend="cupy")
    backend_of(mesh).one_device_nccl = True
    return mesh


def test_nccl_error_aborts_and_names_the_step():
    """A failing NCCL call (here: on a communicator already aborted) aborts the team's
    communicators and raises an error that names the failed step; the next binding gets new ones."""
    be = backend_of(_nccl_mesh())
    send = Ref(0, (0,), (4, 8), (8, 1), "float32")
    recv = Ref(1, (0,), (1, 4, 8), (32, 8, 1), "float32")
    start, wait = be.bind_allgather(send, recv, "DIDx", Stream(0))
    assert wait is None  # issued on the step's own stream: the stream order is the wait
    x = randn(rng(), (4, 8), "float32")
    bufs = [be.to_device([x]), be.empty((1, 4, 8), "float32")]
    start(bufs)  # works
    be.synchronize()
    assert list(be._comms) == [(0,)]  # keyed by the team's devices
    for c in be._comms[(0,)].values():
        c.abort()
    with pytest.raises(RuntimeError, match="NCCL allgather on team 'DIDx'"):
        start(bufs)
    assert not be._comms
    start, _ = be.bind_allgather(send, recv, "DIDx", Stream(0))
    bufs[1] = be.empty((1, 4, 8), "float32")
    start(bufs)
    be.synchronize()
    assert be.to_host(bufs[1])[0][0].tobytes() == x.tobytes()


# ---- collectives called directly: copies on one GPU (D > 1) and NCCL (one-device teams) ------------
# kind: (send shape, recv shape, what rank r of a team receives from the team's sends s)
COLLECTIVES = {
    "allgather": (lambda d: (3, 5), lambda d: (d, 3, 5), lambda s, r: np.stack(s)),
    "allreduce": (lambda d: (3, 5), lambda d: (3, 5), lambda s, r: sum(s[1:], s[0])),
    "reduce_scatter": (lambda d: (d, 3, 5), lambda d: (3, 5), lambda s, r: sum(s[1:], s[0])[r]),
    "alltoall": (lambda d: (d, 3, 5), lambda d: (d, 3, 5), lambda s, r: np.stack([x[r] for x in s])),
    "sendrecv": (lambda d: (3, 5), lambda d: (3, 5), lambda s, r: s[(r - 1) % len(s)]),  # shift 1
}


def _run_collective(mesh, kind, dtype, axis):
    """Run one collective over mesh axis `axis` on random sends; compare every device's result
    with numpy_local's semantics (copies bit for bit, sums against float64)."""
    be = backend_of(mesh)
    nd, d = len(be.local_devices), mesh.axis_size(axis)
    send_shape, recv_shape, want = COLLECTIVES[kind]
    sshape, rshape = send_shape(d), recv_shape(d)
    r = rng()
    sends = [randn(r, sshape, dtype) for _ in range(nd)]
    sref = Ref(0, (0,) * nd, sshape, contiguous_strides(sshape), dtype)
    rref = Ref(1, (0,) * nd, rshape, contiguous_strides(rshape), dtype)
    bufs = [be.to_device(sends), be.empty(rshape, dtype)]
    bind = getattr(be, f"bind_{kind}")
    start, wait = bind(sref, rref, axis, 1, Stream(0)) if kind == "sendrecv" else bind(sref, rref, axis, Stream(0))
    assert wait is None
    start(bufs)  # on worker stream 0
    be.synchronize()
    got = be.to_host(bufs[1])
    for team in mesh.teams(axis):
        for rank, dev in enumerate(team):
            if kind in ("allreduce", "reduce_scatter"):
                check(got[dev], want([f64(sends[q]) for q in team], rank), dtype)
            else:
                assert got[dev].tobytes() == want([sends[q] for q in team], rank).tobytes(), (kind, team, rank)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", sorted(COLLECTIVES))
def test_collectives_direct(mesh, kind, dtype):
    _run_collective(mesh, kind, dtype, "DIDx")


@pytest.mark.parametrize("axis", ["DIDy", "DIDx"])
@pytest.mark.parametrize("kind", sorted(COLLECTIVES))
def test_collectives_on_a_2d_mesh(kind, axis):
    """Several teams per collective (2 x 2 and 2 x 4 meshes), each run on its own."""
    for shape in ((2, 2), (2, 4)):
        _run_collective(sf.DeviceMesh(shape, backend="cupy"), kind, "float32", axis)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", sorted(COLLECTIVES))
def test_collectives_nccl_one_device_team(kind, dtype):
    _run_collective(_nccl_mesh(), kind, dtype, "DIDx")


def test_mixed_team_is_refused():
    """A team of two devices on one GPU and one on another cannot run: refused at bind time."""
    if NGPU < 2:
        pytest.skip("needs two GPUs (a mesh of 3 devices on 2 GPUs puts two on one)")
    mesh = sf.DeviceMesh(3, backend="cupy")
    send = Ref(0, (0,) * 3, (4,), (1,), "float32")
    recv = Ref(1, (0,) * 3, (3, 4), (4, 1), "float32")
    with pytest.raises(NotImplementedError, match=r"team \(0, 1, 2\) of mesh axis 'DIDx' has devices on GPUs"):
        backend_of(mesh).bind_allgather(send, recv, "DIDx", Stream(0))


# ---- the caller's arrays: adopt and piece -------------------------------------------------------
@pytest.mark.parametrize("mesh", [1, 4], indirect=True)
def test_adopt_and_piece(mesh):
    be = backend_of(mesh)
    x = randn(rng(), (8, 6), "bfloat16")
    g = be.adopt(x)  # a host array: copied to the first GPU, bfloat16 as its uint16 bits
    assert isinstance(g, cupy.ndarray) and g.dtype == np.uint16 and g.device.id == be.gpus[0]
    be.synchronize()
    assert cupy.asnumpy(g).tobytes() == x.tobytes()
    y = cupy.arange(12, dtype=np.float32)
    assert be.adopt(y) is y  # a CuPy array of this process: itself
    for j, o in enumerate(be.ordinals):
        p = be.piece(g, j)
        assert (p is g) == (o == g.device.id) and p.device.id == o
        cols = be.piece(g[:, 2:4], j)  # not contiguous: a device-side copy on device j's GPU
        assert cols.flags.c_contiguous and cols.device.id == o
        be.synchronize()
        assert cupy.asnumpy(cols).tobytes() == np.ascontiguousarray(x[:, 2:4]).tobytes()


@pytest.mark.parametrize("mesh", [1, 2], indirect=True)
def test_piece_of_strided_blocks(mesh):
    """Pieces made of equal contiguous blocks a pitch apart (one 2-D copy), of blocks at two
    strides (one pre-bound kernel: 16-byte units or bytes) and of anything else (CuPy's copy
    kernel), against NumPy; a short copy would leave the fresh buffers' garbage."""
    be = backend_of(mesh)
    x = rng().standard_normal((4, 3, 5, 6)).astype(np.float32)
    g = cupy.asarray(x)
    views = [lambda a, idx=idx: a[idx] for idx in [
        (slice(None), 1), (slice(None), slice(1, 2)), (slice(1, 3), 0, slice(None), slice(2, 4)),
        (slice(None, None, 2), 2), (1, slice(None), slice(None), slice(None, None, -1))]]
    # the seed layout's piece moved outermost ([S, D, m, K] -> [D, S, m, K]), at a 16-byte width and not
    views += [lambda a: a.reshape(2, 2, 3, 30).transpose(1, 0, 2, 3), lambda a: a.reshape(5, 9, 8).transpose(1, 0, 2),
              lambda a: a.reshape(4, 3, 30)[:, :, 4:8].transpose(1, 0, 2)]
    for view in views:
        assert (copies.two_strides(view(g)) is not None) == (view in views[-3:] or view is views[2])
        for j in range(len(be.ordinals)):
            p = be.piece(view(g), j)
            be.synchronize()
            assert p.flags.c_contiguous and p.device.id == be.ordinals[j]
            np.testing.assert_array_equal(cupy.asnumpy(p), view(x))
    # (the [9, 5, 8] float32 view's blocks, strides and start are 16-byte multiples; the others' are not)
    assert {k[2] for k in be.kernels.cache if k[0] == "strided_blocks" and len(k) == 3} == {True, False}


# ---- the general compiler's lowerings on the GPU (issue 4), at whatever D this machine has ----------
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_cases_reshard_table(mesh, dtype):
    c = _cases()
    for entry in sorted(c.RESHARD_TABLE):
        c.reshard_case(mesh, entry, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_pipelined_gemm_reduce_scatter(mesh, chunks, dtype):
    d = mesh.size
    f = sf.jit(lambda x, w: sf.stream(sf.shard(sf.shard(x, axis=1) @ sf.shard(w, axis=0), axis=0), axis=0,
                                      chunks=chunks), mesh=mesh, streams=2)
    r = rng()
    x, w = randn(r, (16 * d * chunks, 32 * d), dtype), randn(r, (32 * d, 48), dtype)
    plan = f.lower(sf.TensorSpec(x.shape, dtype), sf.TensorSpec(w.shape, dtype))
    assert plan.collectives() == ({"reduce_scatter": chunks} if d > 1 else {})  # (D = 1: device copies)
    check(f(x, w).gather(), f64(x) @ f64(w), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["tp", "sp"])
def test_mlp_block(mesh, mode, dtype):
    from shardfuse.mlp import mlp_block, mlp_inputs, mlp_reference

    d = mesh.size
    f = mlp_block(mesh, mode, chunks=2)
    args = [a.astype(np_dtype(dtype)) for a in mlp_inputs(rng(), tokens=32 * d, hidden=16 * d)]
    out = f(*args)
    tol = {"float64": 1e-12, "float32": 1e-5, "float16": 5e-3, "bfloat16": 3e-2}[dtype]
    ref = mlp_reference(*[f64(a) for a in args])
    got = f64(out.gather())
    assert np.all(np.isfinite(got))
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) <= tol


@pytest.mark.parametrize("dtype", DTYPES)
def test_ring_variant(mesh, dtype):
    d = mesh.size
    f = sf.jit(lambda x, w: sf.stream(sf.shard(x, axis=0) @ w, axis=0, algorithm="ring"), mesh=mesh)
    r = rng()
    x, w = randn(r, (32 * d, 64), dtype), randn(r, (64, 48), dtype)
    check(f(x, w).gather(), f64(x) @ f64(w), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_general_elementwise_ops(mesh, dtype):
    f = sf.jit(lambda x, b: sf.replicate(sf.gelu(sf.shard(x, axis=1) * 0.5 + b) - sf.relu(-x) / 2.0 + sf.tanh(x)),
               mesh=mesh)
    r = rng()
    d = mesh.size
    x, b = randn(r, (8, 16 * d), dtype), randn(r, (16 * d,), dtype)
    got = f64(f(x, b).gather())
    xx, bb = f64(x), f64(b)
    h = 0.5 * xx + bb
    ref = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h ** 3))) - np.maximum(-xx, 0) / 2 + np.tanh(xx)
    tol = {"float64": 1e-12, "float32": 1e-5, "float16": 5e-3, "bfloat16": 3e-2}[dtype]
    assert np.all(np.isfinite(got)) and np.linalg.norm(got - ref) / np.linalg.norm(ref) <= tol


# ---- sub-meshes (pipeline stages): moves between them and collectives within one ------------------
@pytest.mark.parametrize("entry", sorted(_cases().MOVES))
@pytest.mark.parametrize("mesh", [4, 8], indirect=True)
def test_moves_between_submeshes(mesh, entry):
    _cases().move_case(mesh, entry)


@pytest.mark.parametrize("mesh", [4, 8], indirect=True)
def test_two_stage_pipeline(mesh):
    _cases().pipeline_case(mesh)


@pytest.mark.parametrize("mesh", [2, 4, 8], indirect=True)
def test_collectives_inside_a_stage(mesh):
    _cases().stage_collectives_case(mesh)


# ---- layouts that must never be wrong (tests/test_layouts.py's cases on the GPU) -----------------
@pytest.mark.parametrize("shape", [(2, 2), (2, 4)])
def test_every_2d_reshard_on_gpus(shape):
    """Every pair of placements of a 2-D value on a 2-D mesh (a tensor axis over one or both
    mesh axes, in both orders), through NCCL or one-GPU device copies."""
    from test_layouts import placer, layout_specs

    mesh = sf.DeviceMesh(shape, backend="cupy")
    X = rng().standard_normal((16, 16))
    specs = layout_specs(mesh, 2)
    placed = {s: sf.jit(placer(s), mesh=mesh)(X) for s in specs}
    for src in specs:
        for dst in specs:
            out = sf.jit(placer(dst), mesh=mesh)(placed[src])
            np.testing.assert_array_equal(out.gather(), X, err_msg=f"{src} -> {dst}")


@pytest.mark.parametrize("mesh", [4], indirect=True)
def test_stream_axis_an_input_shards_without_chunks(mesh):
    r = rng()
    x, w = randn(r, (32, 16), "float32"), randn(r, (16, 8), "float32")
    out = sf.jit(lambda x, w: sf.stream(sf.shard(x, axis=0) @ w, axis=0), mesh=mesh)(x, w)
    check(out.gather(), f64(x) @ f64(w), "float32")


@pytest.mark.skipif(NGPU != 1, reason="batching is for the virtual devices of one GPU (this machine has several)")
@pytest.mark.parametrize("mesh", [4], indirect=True)
def test_virtual_devices_gemms_are_one_batched_call_where_evenly_spaced(mesh):
    """Issue 14: the D GEMMs of a step on one GPU are one strided-batched cuBLASLt call when the
    devices' operands are evenly spaced (as placed by sf.shard), else one call per device."""
    lt = backend_of(mesh).gemms.lt_lib()
    real, calls = lt.MatmulPrebound, []
    lt.MatmulPrebound = lambda *args: calls.append(1) or real(*args)  # read when a plan binds
    try:
        r = rng()
        a, b = randn(r, (8, 4, 16, 64), "float16"), randn(r, (64, 48), "float16")
        f, placed = seed_fns(mesh, 4), sf.shard(a, axis=1, over="DIDx", mesh=mesh)
        f(placed, b)  # the first call binds the batched call
        calls.clear()
        check(f(placed, b).gather(), f64(a) @ f64(b), "float16")
        assert len(calls) == 8  # one per chunk for the 4 devices
        x = randn(r, (4 * 32, 64), "float16")
        rows = sf.shard(x, axis=0, mesh=mesh)
        gaps = cupy.full((6,) + rows.shards[0].shape, np.nan, rows.shards[0].dtype)
        for j, piece in zip((0, 1, 3, 5), rows.shards):
            gaps[j] = piece
        uneven = sf.Array(mesh, rows.shape, rows.dtype_name, rows.sharding, [gaps[j] for j in (0, 1, 3, 5)])
        g = sf.jit(lambda x, w: x @ w, mesh=mesh)
        calls.clear()
        batched = g(rows, b).gather()
        assert len(calls) == 1  # rows: blocks of one copy, evenly spaced
        calls.clear()
        each = g(uneven, b).gather()
        assert len(calls) == 4  # the pieces are not evenly spaced: each device's own call
        check(each, f64(x) @ f64(b), "float16")
        assert each.tobytes() == batched.tobytes()  # the batch runs the per-device algorithm
    finally:
        lt.MatmulPrebound = real


@pytest.mark.skipif(NGPU != 1, reason="batching is for the virtual devices of one GPU (this machine has several)")
@pytest.mark.parametrize("mesh", [4, 8], indirect=True)
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_natural_layout_gemms_are_one_batched_call_per_chunk(mesh, dtype):
    """Issue 29: x [rows, K] sharded on rows and streamed in S chunks (the README's layout): each
    chunk's GEMM is a strided batch of D blocks on every device; the D devices of one GPU lie one
    whole batch apart (gathered chunks and output packed in one allocation), so one
    cublasGemmStridedBatchedEx runs D * D GEMMs, once per chunk, not once per device and chunk."""
    cb = backend_of(mesh).gemms.lib()
    real, calls = cb.gemm_batched_prebound, []

    def counting(*args):
        calls.append(args[-3].value)  # the batch count (a ctypes int, built at bind time)
        return real(*args)

    cb.gemm_batched_prebound = counting  # read when a plan binds
    try:
        r, d, s = rng(), mesh.size, 4
        x, w = randn(r, (d * s * 16, 64), dtype), randn(r, (64, 48), dtype)
        f = sf.jit(lambda x, w: sf.stream(sf.shard(x, axis=0) @ w, axis=0, chunks=s), mesh=mesh, streams=2)
        placed = sf.shard(x, axis=0, mesh=mesh)
        f(placed, w)  # binds
        calls.clear()
        check(f(placed, w).gather(), f64(x) @ f64(w), dtype)
        assert calls == [d * d] * s  # one call per chunk, every device's D blocks
    finally:
        cb.gemm_batched_prebound = real


@pytest.mark.parametrize("mesh", [1, 4], indirect=True)
def test_results_do_not_alias_device_arguments(mesh):
    X = cupy.asarray(rng().standard_normal((8, 8)))
    want = cupy.asnumpy(X.T)
    out = sf.jit(lambda x: x.T, mesh=mesh)(X)
    X[...] = 7.0
    np.testing.assert_array_equal(out.gather(), want)


@pytest.mark.parametrize("mesh", [1, 4], indirect=True)
def test_one_jitted_function_from_four_threads_on_gpus(mesh):
    import threading

    f = sf.jit(lambda a, b: sf.stream(sf.shard(a, axis=0) @ b, axis=0, chunks=2), mesh=mesh, streams=2)
    wrong, errors = [0] * 4, []

    def work(t):
        r = np.random.default_rng(t)
        try:
            for _ in range(50):
                a, b = r.standard_normal((16, 8)), r.standard_normal((8, 4))
                if not np.allclose(f(a, b).gather(), a @ b, rtol=1e-10, atol=1e-10):
                    wrong[t] += 1
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and wrong == [0, 0, 0, 0]


@pytest.mark.parametrize("d", [1, 2])
def test_profile_on_the_gpu_from_cuda_events(d, tmp_path):
    """plan.profile on GPUs: a pair of CUDA events around each step on its own stream, so the
    timeline shows what the device did (GEMMs take time, worker streams overlap)."""
    mesh = sf.DeviceMesh(d, backend="cupy")
    f = sf.jit(lambda a, b: sf.stream(sf.shard(a, axis=1) @ b, axis=0), mesh=mesh, streams=2)
    rng = np.random.default_rng()
    a, b = rng.standard_normal((4, d, 256, 512)).astype(np.float32), rng.standard_normal((512, 256)).astype(np.float32)
    plan = f.lower(a, b)
    tl = plan.profile(a, b, repeat=2)
    assert len(tl) == 2 * len(plan.executable.steps)  # one GPU: one event pair per step and call
    assert all(0 <= e.start <= e.end for e in tl.events)
    gemms = [e for e in tl.events if e.kind == "gemm"]
    assert len(gemms) == 2 * 4 and all(e.duration > 0 for e in gemms)
    assert {e.stream for e in gemms} == {"0", "1"}  # chunks on the two worker streams
    assert tl.summary()["gemm_s"] > 0 and tl.summary()["overlap_efficiency"] <= 1.0
    # every call's times from one reference: the second call starts after the first has ended
    assert min(e.start for e in tl.events if e.call == 1) >= max(e.end for e in tl.events if e.call == 0)
    tl.to_chrome_trace(tmp_path / "t.json")
    np.testing.assert_allclose(plan(a, b).gather(), np.einsum("sdmk,kn->sdmn", a.astype(np.float64), b),
                               rtol=1e-4, atol=1e-3)


def test_profile_nvtx_ranges_on_the_gpu(monkeypatch):
    """plan.profile(nvtx=True) on GPUs: per call a range named after the plan, inside it one per
    step named as its timeline line (around its CUDA events), balanced; the events unchanged."""
    import sys
    import types

    mesh = sf.DeviceMesh(2, backend="cupy")
    f = sf.jit(lambda a, b: sf.stream(sf.shard(a, axis=1) @ b, axis=0), mesh=mesh, streams=2)
    a, b = np.ones((4, 2, 64, 32), np.float32), np.ones((32, 16), np.float32)
    plan = f.lower(a, b)
    log = []
    monkeypatch.setitem(sys.modules, "nvtx", types.SimpleNamespace(
        push_range=lambda message=None, **kw: log.append(("push", message)), pop_range=lambda **kw: log.append(("pop", None))))
    tl = plan.profile(a, b, repeat=2, nvtx=True)
    labels = [s.text for s in plan.executable.steps]
    one_call = [("push", plan.program.name)] + [x for t in labels for x in (("push", t), ("pop", None))] + [("pop", None)]
    assert log == one_call * 2
    # each step once per call and GPU (two GPUs: two event pairs), under its label
    steps = plan.executable.steps  # (numbered as the plan's steps: a GPU binds no step for a Wait)
    assert sorted({(e.call, e.step, e.text) for e in tl.events}) == [(c, s.index, s.text) for c in range(2) for s in steps]


def test_calibrate_on_the_gpu(tmp_path, monkeypatch):
    """`shardfuse calibrate` on D = 2: finite, positive figures, the pipelined fits inside their
    ranges (on one GPU the virtual devices' collective latency and chunk-GEMM bandwidth; on two,
    the GEMM slowdown), and a cache that the model then reads back."""
    from shardfuse import calibrate, rates

    monkeypatch.setenv("SHARDFUSE_CACHE_DIR", str(tmp_path))
    mesh = sf.DeviceMesh(2, backend="cupy")
    r, path, measured = calibrate.ensure(mesh, force=True, repeat=2, log=lambda msg: None)
    assert measured and path.exists() and rates.load(rates.machine_key(mesh)) == r
    assert all(v > 0 for v in r.gemm_flops.values()) and 1e11 < r.gemm_bw < 2e13 and r.mem_bw > 1e11
    assert 0 < r.step_s < 1e-3 and 0 <= r.call_s < 1e-2
    if rates.engines(mesh)[1] > 1:
        assert 0 <= r.comm_latency_s < 1e-3
    else:
        assert 1.0 <= r.gemm_slowdown < 2.0


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])  # (CuPy has no bfloat16 arrays to offset)
@pytest.mark.parametrize("k", [41, 48])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("mesh", [1, 2, 4], indirect=True)
def test_odd_sizes_and_arrays_that_start_anywhere(mesh, graph, k, dtype):
    """Chunks at byte offsets that are not multiples of 256 (odd sizes), and device arrays that
    start one element into an allocation (plain, and placed by sf.from_local's zero-copy views):
    cuBLASLt and the virtual devices' gather kernel must not assume an alignment they were not
    given (a misaligned load is a fatal CUDA error).  k = 48: the gathered chunks are 16-byte
    multiples, so there only the base pointers are not aligned."""
    d, chunks = mesh.size, 4
    r = rng()
    x, w = randn(r, (5 * chunks * d, k), dtype), randn(r, (k, 23), dtype)
    f = sf.jit(lambda x, w: sf.stream(sf.shard(x, axis=0) @ w, axis=0, chunks=chunks), mesh=mesh, graph=graph)

    def one_element_in(a):
        store = cupy.empty(a.size + 1, a.dtype)
        v = store[1:].reshape(a.shape)
        v[...] = cupy.asarray(a)
        return v

    ref = f64(x) @ f64(w)
    placed = sf.from_local(one_element_in(x), axis=0, mesh=mesh)
    assert placed.shards[0].data.ptr % 16  # zero-copy views of the offset array
    for xa, wa in ((x, w), (one_element_in(x), one_element_in(w)), (placed, one_element_in(w))):
        check(f(xa, wa).gather(), ref, dtype)
    # a GEMM that reads the pieces themselves (no gather in between): on virtual devices of one
    # GPU, pieces 5 x k elements apart, so device 0 may be aligned while the spacing is not (the
    # batched call's spacing check), at every offset above
    g = sf.jit(lambda x, w: sf.shard(x, axis=0) @ w, mesh=mesh, graph=graph)
    y = randn(r, (5 * d, k), dtype)
    for ya, wa in ((y, w), (one_element_in(y), one_element_in(w)), (sf.from_local(one_element_in(y), axis=0, mesh=mesh), w)):
        check(g(ya, wa).gather(), f64(y) @ f64(w), dtype)


# ---- issue 31: the elementwise ops and reductions on the CuPy backend (tests/test_elementwise_ops.py's bodies) ----
import test_elementwise_ops as ew  # noqa: E402


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("name", sorted(ew.OPS))
@pytest.mark.parametrize("mesh", [1, 4], indirect=True)
def test_issue31_elementwise_op(mesh, name, jit, dtype):
    ew.check_op(name, mesh, ("DIDx", None), ("DIDx", None), dtype, jit, np.random.default_rng(0))


@pytest.mark.parametrize("name", sorted(ew.OPS))
@pytest.mark.parametrize("mesh", [4], indirect=True)
def test_issue31_elementwise_op_broadcast_and_replicated(mesh, name):
    ew.check_op(name, mesh, (None, "DIDx"), (None, None), "float32", True, np.random.default_rng(1))
    ew.check_op(name, mesh, ("DIDx", None), None, "bfloat16", True, np.random.default_rng(2), row=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["max 0 keepdims=True", "max -1 keepdims=False", "min (0, 1) keepdims=True",
                                  "min None keepdims=False", "sum -1 keepdims=True", "mean (0, 1) keepdims=False",
                                  "np.amax"])
@pytest.mark.parametrize("layout", [("DIDx", None), (None, "DIDx")], ids=["S0", "S1"])
@pytest.mark.parametrize("mesh", [1, 4], indirect=True)
def test_issue31_reductions(mesh, layout, name, dtype):
    ew.check_reduction(name, mesh, layout, dtype, True, np.random.default_rng(3))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mesh", [1, 4], indirect=True)
def test_issue31_astype_round_trips(mesh, dtype):
    """Casts between every float dtype, int32 and bool, bit for bit as NumPy / ml_dtypes (bfloat16
    through float32 scratch: float64 -> bfloat16 rounds twice, as ml_dtypes does)."""
    x = np.random.default_rng(4).standard_normal((8, 12)) * 3
    xs = sf.shard(x, axis=0, mesh=mesh)
    for fn in (lambda v: v.astype(dtype), lambda v: v.astype(dtype).astype(np.float64),
               lambda v: v.astype(dtype).astype(np.int32), lambda v: v.astype(dtype).astype(bool),
               lambda v: v.astype(np.int64).astype(dtype), lambda v: (v > 0).astype(dtype),
               lambda v: v.astype(np.float32).astype(dtype)):
        want = fn(x)  # (NumPy casts through the same chain of dtypes)
        for got in (fn(xs), sf.jit(fn, mesh=mesh)(xs)):
            assert got.dtype == want.dtype, (dtype, got.dtype, want.dtype)
            np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))


@pytest.mark.parametrize("mesh", [1, 2, 4], indirect=True)
def test_issue31_integer_and_bool_arrays(mesh):
    """int32 / int64 / bool buffers, their Allgather (NCCL types or device copies) and Allreduce."""
    ids = np.random.default_rng(5).integers(1, 1000, (8, 12)).astype(np.int32)
    a = sf.shard(ids, axis=1, mesh=mesh)
    np.testing.assert_array_equal(sf.replicate(a).gather(), ids)
    np.testing.assert_array_equal(sf.replicate(a > 500).gather(), ids > 500)
    np.testing.assert_array_equal(a.sum(1).gather(), ids.sum(1))  # int64 partial sums all-reduced
    np.testing.assert_array_equal(a.max(1).gather(), ids.max(1))
    np.testing.assert_array_equal(np.where(a > 500, a, -1).gather(), np.where(ids > 500, ids, -1))
    np.testing.assert_array_equal((a.astype(np.int64) * 3).gather(), ids.astype(np.int64) * 3)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mesh", [1, 4], indirect=True)
def test_issue31_pending_sum_sqrt_and_causal_softmax(mesh, dtype):
    rng = np.random.default_rng(6)
    x, w = (rng.uniform(0.5, 1.0, s).astype(np_dtype(dtype)) for s in ((8, 16), (16, 12)))
    f = sf.jit(lambda x, w: np.sqrt(sf.shard(x, axis=1) @ sf.shard(w, axis=0)), mesh=mesh)
    check(f(x, w).gather(), np.sqrt(f64(x) @ f64(w)), dtype)
    scores = rng.standard_normal((4, 8, 8)).astype(np_dtype(dtype))
    mask = np.tril(np.ones((8, 8), bool))

    def softmax(s):
        e = np.exp(s - s.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    want = softmax(np.where(mask, f64(scores), -np.inf))
    s = sf.shard(scores, axis=0, mesh=mesh)
    check(sf.jit(lambda s, m: softmax(sf.where(m, s, -np.inf)), mesh=mesh)(s, mask).gather(), want, dtype)
    check(softmax(sf.where(mask, s, -np.inf)).gather(), want, dtype)


# ---- issue 31: max / min over a sharded axis (Allreduce with ncclMax / ncclMin of order keys), take and the
# vocab-parallel embedding, constants, cross-entropy (the bodies of tests/test_extrema.py, test_take.py,
# test_constants.py, test_cross_entropy.py) --------------------------------------------------------------
import test_constants as ct  # noqa: E402
import test_cross_entropy as ce  # noqa: E402
import test_extrema as ex  # noqa: E402
import test_take as tk  # noqa: E402


def _tp_mesh(d, shape=None):
    """A cupy mesh of d devices whose axes are named as the take / cross-entropy cases name them."""
    key = ("tp", d, shape)
    if key not in _MESHES:
        _MESHES[key] = sf.DeviceMesh(shape or d, ("dp", "tp") if shape else "tp", backend="cupy")
    return _MESHES[key]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64", "int32"])
@pytest.mark.parametrize("kind", ["max", "min"])
@pytest.mark.parametrize("nans", [(), ((0, 0),), ((3, 7), (5, 1))], ids=str)
@pytest.mark.parametrize("mesh", [1, 2, 4], indirect=True)
def test_issue31_max_min_over_a_sharded_axis(mesh, kind, dtype, nans):
    nans = () if dtype == "int32" else nans
    got = ex.check_max(mesh, kind, dtype, 1, False, nans, np.random.default_rng(7))
    if nans:
        assert np.isnan(np.asarray(got.gather(), np.float64)[[r for r, _ in nans]]).all()
    assert ex.plan_of(mesh, kind, 1).collectives() == ({"allreduce": 1} if mesh.size > 1 else {})


@pytest.mark.parametrize("kind", ["max", "min"])
def test_issue31_max_min_through_nccl_and_graphs(kind):
    """The one-device NCCL path (a one-rank ncclMax / ncclMin of int keys) and a captured graph."""
    x = np.random.default_rng(8).standard_normal((6, 8)).astype(np.float32)
    x[2, 3] = np.nan
    want = getattr(x.astype(np.float64), kind)(1)
    for mesh, graph in ((_nccl_mesh(), False), (sf.DeviceMesh(4, backend="cupy"), True)):
        f = sf.jit(lambda v: getattr(sf.shard(v, axis=1), kind)(1), mesh=mesh, graph=graph)
        for _ in range(2):  # (a graph: captured at the first call, replayed at the second)
            np.testing.assert_array_equal(np.asarray(f(x).gather(), np.float64), want)


@pytest.mark.parametrize("dtype", ["int32", "int64"])
@pytest.mark.parametrize("op", ["max", "min"])
@pytest.mark.parametrize("mesh", [2, 4], indirect=True)
def test_issue31_allreduce_max_min_called_directly(mesh, op, dtype):
    be = backend_of(mesh)
    nd = len(be.local_devices)
    sends = [np.random.default_rng(9 + j).integers(-10**6, 10**6, (3, 5)).astype(dtype) for j in range(nd)]
    sref = Ref(0, (0,) * nd, (3, 5), contiguous_strides((3, 5)), dtype)
    rref = Ref(1, (0,) * nd, (3, 5), contiguous_strides((3, 5)), dtype)
    bufs = [be.to_device(sends), be.empty((3, 5), dtype)]
    start, _ = be.bind_allreduce(sref, rref, "DIDx", Stream(0), op=op)
    start(bufs)
    be.synchronize()
    want = (np.maximum if op == "max" else np.minimum).reduce(sends)
    for got in be.to_host(bufs[1]):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("layout", ["vocab", "hidden", "replicated"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
@pytest.mark.parametrize("d", [1, 4])
def test_issue31_take_vocab_parallel(d, layout, dtype):
    tk.check_take(_tp_mesh(d), layout, dtype, "int64", np.random.default_rng(10))
    tk.check_take(_tp_mesh(d), layout, dtype, "int32", np.random.default_rng(11), jit=False)


def test_issue31_take_on_a_2d_mesh_and_in_a_graph():
    mesh = _tp_mesh(4, (2, 2))
    for layout in ("vocab-batch-dp", "vocab-both"):
        tk.check_take(mesh, layout, "float32", "int32", np.random.default_rng(12))
    rng = np.random.default_rng(13)
    table, ids = rng.standard_normal((tk.V, tk.H)).astype(np.float32), tk.ids_of(rng, (4, 6), out_of_range=True)
    f = sf.jit(lambda t, i: sf.take(sf.shard(t, axis=0, over="tp"), i), mesh=mesh, graph=True)
    for _ in range(2):
        np.testing.assert_array_equal(f(table, ids).gather(), tk.np_lookup(table, ids))


@pytest.mark.parametrize("mesh", [1, 4], indirect=True)
def test_issue31_constants_and_causal_attention(mesh):
    ct.check_closed_over(mesh, np.random.default_rng(14))
    q, k, v = (np.random.default_rng(15 + j).standard_normal((2, 4, 8, 8)) for j in range(3))
    f = sf.jit(lambda q, k, v: sf.nn.attention(sf.shard(q, axis=1), k, v, causal=True), mesh=mesh)
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(8) + np.where(np.tril(np.ones((8, 8), bool)), 0, -np.inf)
    e = np.exp(s - s.max(-1, keepdims=True))
    np.testing.assert_allclose(f(q, k, v).gather(), (e / e.sum(-1, keepdims=True)) @ v, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
@pytest.mark.parametrize("d", [1, 4])
def test_issue31_cross_entropy_vocab_parallel(d, dtype):
    ce.check_cross_entropy(_tp_mesh(d), "vocab", dtype, np.random.default_rng(16))
    ce.check_cross_entropy(_tp_mesh(d), "vocab", dtype, np.random.default_rng(17), jit=False)
    if d == 4:
        ce.check_cross_entropy(_tp_mesh(4, (2, 2)), "tokens-dp-vocab-tp", dtype, np.random.default_rng(18))


# ---- issue 31, item 3: shapes on the CuPy backend (tests/test_slicing.py's and test_split_concat.py's bodies) ----
import test_slicing as sl  # noqa: E402
import test_split_concat as sc  # noqa: E402

SPECS31 = {"S0": ("DIDx",), "S1": (None, "DIDx"), "S2": (None, None, "DIDx"), "R": ()}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("spec", sorted(SPECS31))
@pytest.mark.parametrize("name", sorted(sl.INDEXES))
@pytest.mark.parametrize("mesh", [1, 4], indirect=True)
def test_issue31_index(mesh, name, spec, jit, dtype):
    """Boxes at offsets, strided boxes (steps) and new axes as views of CuPy pieces."""
    sl.check_index(name, mesh, SPECS31[spec], dtype, jit, np.random.default_rng(0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spec", ["S0", "S1", "R"])
@pytest.mark.parametrize("mesh", [1, 2, 4], indirect=True)
def test_issue31_split_and_join(mesh, spec, dtype):
    """Copies into boxes of one buffer (DMA where the box is rows at a pitch, else a kernel)."""
    for name in sorted(sc.SPLITS):
        sc.check_split(name, mesh, SPECS31[spec], dtype, True, np.random.default_rng(1))
    for name in sorted(sc.JOINS):
        sc.check_join(name, mesh, SPECS31[spec], dtype, True, np.random.default_rng(2), y_spec=SPECS31[spec][:1])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mesh", [1, 2, 4], indirect=True)
def test_issue31_fused_qkv_split(mesh, dtype):
    sc.check_qkv(mesh, dtype, np.random.default_rng(3))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(sl.MATMULS))
@pytest.mark.parametrize("mesh", [1, 4], indirect=True)
def test_issue31_broadcast_matmul(mesh, name, dtype):
    """Transposed and merged views around one cuBLAS GEMM (staged where cuBLAS cannot read a view)."""
    sl.check_matmul(name, mesh, dtype, True, np.random.default_rng(4))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mesh", [1, 2, 4], indirect=True)
def test_issue31_strided_box_into_a_gemm_and_the_ring_with_a_bias(mesh, dtype):
    d, rng = len(mesh.devices), np.random.default_rng(5)
    x, w, b = randn(rng, (4 * d, 16), dtype), randn(rng, (6, 8), dtype), randn(rng, (6,), dtype)
    f = sf.jit(lambda x, w: sf.shard(x, axis=0)[:, 1::2] @ w.T, mesh=mesh)  # a column stride of 2 into cuBLAS
    check(f(x, w).gather(), f64(x)[:, 1::2] @ f64(w).T, dtype)
    g = sf.jit(lambda x, w, b: sf.stream(sf.shard(x, axis=0)[:, :8] @ w.T + b, axis=0, algorithm="ring"), mesh=mesh)
    check(g(x, w, b).gather(), f64(x)[:, :8] @ f64(w).T + f64(b), dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16_bit_sums_in_float32_rounded_once(mesh, dtype):
    """traced._reduce's 16-bit sums: float32 until the end (Sum of a 16-bit input into float32: bfloat16
    read through its bits, never summed as uint16), over a sharded axis and several axes, means scaled
    in float32; against NumPy's float32 sum rounded once, within one 16-bit ulp (the float32 sums' orders
    differ: a tie of the rounding may fall either way), never a sum of the bits."""
    import ml_dtypes

    d = len(mesh.devices)
    np16 = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
    x = (rng().standard_normal((4 * d, 6)) * 50).astype(np16)
    x32 = x.astype(np.float32)
    cases = [(lambda a: sf.shard(a, axis=0).sum(), x32.sum()), (lambda a: sf.shard(a, axis=0).sum(0), x32.sum(0)),
             (lambda a: sf.shard(a, axis=0).mean(), x32.mean()), (lambda a: (sf.shard(a, axis=0) * 2).sum(1), (x32 * 2).sum(1)),
             (lambda a: a.sum(), x32.sum()), (lambda a: a.mean(1), x32.mean(1))]
    for f, want in cases:
        got = sf.jit(f, mesh=mesh)(x)
        assert got.dtype == np.dtype(np16)
        ulp = 2.0 ** (-7 if dtype == "bfloat16" else -10)
        np.testing.assert_allclose(np.asarray(got).astype(np.float32), np.asarray(want, np.float32), rtol=ulp,
                                   atol=1e-5 * float(np.abs(x32).sum()))
