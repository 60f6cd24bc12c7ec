"""The CuPy + NCCL + cuBLAS backend on the GPUs this process sees, against float64 NumPy.

Skipped, with one line saying why, where CuPy is missing or sees no GPU.  Buffers are
poisoned with NaN (SHARDFUSE_POISON=1, set in conftest), so an unwritten element fails.
"""
import os

import numpy as np
import pytest

os.environ.setdefault("SHARDFUSE_POISON", "1")

cupy = pytest.importorskip("cupy", reason="CuPy is not installed")


def _gpus():
    try:
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


NGPU = _gpus()
pytestmark = pytest.mark.skipif(NGPU == 0, reason="CuPy sees no GPU")

import shardfuse as sf  # noqa: E402
from shardfuse.executor import Ref  # noqa: E402
from shardfuse.trace import np_dtype  # noqa: E402

DTYPES = ["float16", "bfloat16", "float32", "float64"]
# relative error of a product against float64 on rounded inputs: output rounding dominates
TOL = {"float64": 1e-12, "float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}


@pytest.fixture(scope="module")
def mesh():
    return sf.DeviceMesh(NGPU, backend="cupy")


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
    assert mesh.backend.name == "cupy"
    assert all(not s.ptr == 0 for s in mesh.backend.main)  # never the legacy null stream


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("streams", [1, 2, 4])
@pytest.mark.parametrize("chunks", [1, 2, 4, 8])
def test_seed_pipelined(mesh, chunks, streams, dtype):
    d = mesh.size
    r = rng()
    a, b = randn(r, (chunks, d, 16, 64), dtype), randn(r, (64, 48), dtype)
    f = seed_fns(mesh, streams)
    c = f(sf.shard(a, axis=1, over="DIDx", mesh=mesh), b)
    check(c.gather(), f64(a) @ f64(b), dtype)


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


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_no_early_reuse_of_buffers_read_by_other_streams(mesh, dtype):
    """Many calls in a row with no synchronisation, each on a fresh device input that is dropped
    right after the call while worker streams still read it (the GPU runs behind the host), so
    the pool could hand its memory to the next input early: every result must still be right."""
    if mesh.size != 1:
        pytest.skip("single-GPU check (inputs are device arrays of one GPU)")
    be = mesh.backend
    f = seed_fns(mesh, 4)
    lay = sf.Layout.replicated(4).with_axis(1, "DIDx")
    b, b64 = _dev_rand(be, (2048, 4096), dtype, 1)
    b_arr = sf.Array(mesh, b.shape, dtype, sf.Layout.replicated(2), [b])
    seeds = [int(s) for s in rng().integers(1, 2**31, 24)]
    refs, outs = [], []
    for s in seeds:
        a, a64 = _dev_rand(be, (8, 1, 512, 2048), dtype, s)
        refs.append(a64)
        outs.append(f(sf.Array(mesh, a.shape, dtype, lay, [a]), b_arr))
        del a  # freed now; the plan's worker streams may still be reading it
    with be.stream(0):
        for a64, c in zip(refs, outs):
            ref = cupy.matmul(a64, b64)
            got = c.shards[0]
            got = (got.astype(np.uint32) << 16).view(np.float32) if dtype == "bfloat16" else got
            got = got.astype(np.float64)
            assert bool(cupy.all(cupy.isfinite(got)))
            err = float(cupy.linalg.norm(got - ref) / cupy.linalg.norm(ref))
            assert err <= TOL[dtype], err


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunks", [1, 4, 8])
def test_graph_equals_eager(mesh, chunks, dtype):
    if len(mesh.local_devices) != 1:
        pytest.skip("graph mode needs one local device per process")
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


def test_graph_static_inputs_skip_the_copy(mesh):
    if len(mesh.local_devices) != 1:
        pytest.skip("graph mode needs one local device per process")
    d, dtype = mesh.size, "float16"
    r = rng()
    g = seed_fns(mesh, 2, graph=True)
    a, b = randn(r, (4, d, 32, 64), dtype), randn(r, (64, 32), dtype)
    plan = g.lower(sf.TensorSpec(a.shape, dtype), sf.TensorSpec(b.shape, dtype))
    exe = plan.executable
    static = exe.graph.inputs
    be = mesh.backend
    with be.stream(0):
        static[0][0][...] = cupy.asarray(a[:, :1])
        static[1][0][...] = cupy.asarray(b)
    lay_a = sf.Layout.replicated(4).with_axis(1, "DIDx")
    a_arr = sf.Array(mesh, a.shape, dtype, lay_a, [static[0][0]])
    b_arr = sf.Array(mesh, b.shape, dtype, sf.Layout.replicated(2), [static[1][0]])
    check(exe(a_arr, b_arr).gather(), f64(a) @ f64(b), dtype)


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
def test_gemm_views(mesh, case, dtype):
    be = mesh.backend
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
    step = be.bind_matmul(ra, rb, rc, "main")
    step(bufs)
    got = be.to_host([be.view(bufs, rc, 0)])[0]
    check(got, np.matmul(f64(a), f64(b)), dtype)


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


def test_nccl_error_aborts_and_names_the_step(mesh):
    """A failing NCCL call (here: on a communicator already aborted) aborts the team's
    communicators and raises an error that names the failed step; the next plan gets new ones."""
    be = mesh.backend
    d, team = mesh.size, mesh.axis_names[-1]
    nd = len(be.local_devices)
    send = Ref(0, (0,) * nd, (4, 8), (8, 1), "float32")
    recv = Ref(1, (0,) * nd, (d, 4, 8), (32, 8, 1), "float32")
    start, wait = be.bind_allgather(send, recv, team, 0)
    assert wait is None  # issued on the step's own stream: the stream order is the wait
    bufs = [be.empty((4, 8), "float32"), be.empty((d, 4, 8), "float32")]
    start(bufs)  # works
    be.synchronize()
    for c in be._comms[team]:
        c.abort()
    with pytest.raises(RuntimeError, match="NCCL allgather on team"):
        start(bufs)
    assert team not in be._comms
    a = randn(rng(), (2, d, 4, 8), "float32")
    b = randn(rng(), (8, 8), "float32")
    check(seed_fns(mesh, 2)(sf.shard(a, axis=1, over="DIDx", mesh=mesh), b).gather(), f64(a) @ f64(b), "float32")


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
    assert plan.collectives() == {"reduce_scatter": chunks}
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
