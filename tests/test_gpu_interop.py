"""The GPU path as users call it: CuPy, torch and JAX arrays in and out with no host copies, and
calls ordered with the caller's stream.  Against float64 NumPy on fresh random inputs; buffers
are poisoned (SHARDFUSE_POISON=1), so an unwritten element fails.

Skipped, with the reason, where CuPy is missing or sees no GPU (and the torch / JAX tests where
those libraries are missing or see no GPU).
"""
import os

import numpy as np
import pytest

os.environ.setdefault("SHARDFUSE_POISON", "1")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX must not take the GPU's memory

cupy = pytest.importorskip("cupy", reason="CuPy is not installed")


import shardfuse as sf  # noqa: E402
from cases import gpu_count  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_count() == 0, reason="CuPy sees no GPU")]


TOL = {"float64": 1e-12, "float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}


def _torch():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no GPU")
    return torch


def _jax():
    jax = pytest.importorskip("jax", reason="JAX is not installed")
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if not gpus:
        pytest.skip("JAX sees no GPU")
    return jax


@pytest.fixture(scope="module", params=[1, 2, 4])
def mesh(request):
    return sf.DeviceMesh(request.param, backend="cupy")


def rng():
    return np.random.default_rng(int.from_bytes(os.urandom(4), "little"))


def check(got, ref, dtype):
    got = np.asarray(got, dtype=np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert np.all(np.isfinite(got)), "unwritten (poisoned) elements in the result"
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert err <= TOL[dtype], f"relative error {err:.3e} > {TOL[dtype]:.0e} ({dtype})"


def seed(mesh, streams=2, chunks=2, graph=False):
    @sf.jit(mesh=mesh, streams=streams, graph=graph)
    def ag_matmul(a, b):
        return sf.stream(sf.shard(a, axis=0) @ b, axis=0, chunks=chunks)

    return ag_matmul


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_cupy_arrays_in_device_arrays_out(mesh, dtype):
    d = mesh.size
    r = rng()
    a = r.standard_normal((16 * d, 64)).astype(dtype)
    b = r.standard_normal((64, 32)).astype(dtype)
    a_dev, b_dev = cupy.asarray(a), cupy.asarray(b)
    w = sf.replicate(b_dev, mesh=mesh)
    f = seed(mesh)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    for a_in in (a_dev, sf.shard(a_dev, axis=0, mesh=mesh)):
        for b_in in (b_dev, w):
            out = f(a_in, b_in)
            assert all(isinstance(s.data, cupy.ndarray) for s in out.addressable_shards)
            check(out.gather(), ref, dtype)
            full = out.full_array()
            assert full.placements == (sf.Replicate(),)
            for s in full.addressable_shards:
                check(cupy.asnumpy(s.data), ref, dtype)


def test_pieces_are_zero_copy_views_where_the_layout_allows(mesh):
    d = mesh.size
    x = cupy.asarray(rng().standard_normal((8 * d, 16)).astype(np.float32))
    rows = sf.shard(x, axis=0, mesh=mesh)
    base = x.data.ptr
    for s in rows.addressable_shards:  # a row block of a C-contiguous array is contiguous: a view
        assert s.data.data.ptr == base + s.index[0].start * 16 * 4
    w = sf.replicate(x, mesh=mesh)
    assert all(s.data.data.ptr == base for s in w.addressable_shards)
    cols = sf.shard(x, axis=1, mesh=mesh)  # column blocks: copied on the device, never via the host
    for s in cols.addressable_shards:
        assert isinstance(s.data, cupy.ndarray) and s.data.flags.c_contiguous
        assert bool(cupy.all(s.data == x[s.index]))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_torch_tensors_in_and_out(mesh, dtype):
    torch = _torch()
    d = mesh.size
    tdt = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(int(rng().integers(1 << 30)))
    a = torch.randn((16 * d, 64), device="cuda", dtype=tdt, generator=g)
    b = torch.randn((64, 32), device="cuda", dtype=tdt, generator=g)

    @sf.jit(mesh=mesh, streams=2)
    def ag_then_matmul(a, b):
        return sf.replicate(sf.stream(sf.shard(a, axis=0) @ b, axis=0, chunks=2))

    out = ag_then_matmul(a, sf.replicate(b, mesh=mesh))
    ref = a.double().cpu().numpy() @ b.double().cpu().numpy()
    t = torch.from_dlpack(out)  # replicated: this process holds the whole value (a replica at D > 1)
    assert t.dtype == tdt and t.device.type == "cuda"
    check(t.double().cpu().numpy(), ref, dtype)
    check(out.gather().astype(np.float64), ref, dtype)
    if d > 1:  # a sharded value is not exported whole
        with pytest.raises(ValueError, match="not held whole"):
            torch.from_dlpack(sf.shard(a, axis=0, mesh=mesh))
    sh = sf.shard(a, axis=0, mesh=mesh)  # torch in, pieces are views of the tensor's memory
    assert sh.addressable_shards[0].data.data.ptr == a.data_ptr()


def test_jax_arrays_in(mesh):
    jax = _jax()
    import jax.numpy as jnp

    d = mesh.size
    r = rng()
    a, b = r.standard_normal((16 * d, 64)).astype(np.float32), r.standard_normal((64, 32)).astype(np.float32)
    gpu = jax.devices("gpu")[0]
    ja, jb = jax.device_put(jnp.asarray(a), gpu), jax.device_put(jnp.asarray(b), gpu)
    check(seed(mesh)(ja, jb).gather(), a.astype(np.float64) @ b, "float32")
    jbf = jax.device_put(jnp.asarray(b, dtype=jnp.bfloat16), gpu)  # bfloat16 through a device bitcast
    out = seed(mesh)(jax.device_put(jnp.asarray(a, dtype=jnp.bfloat16), gpu), jbf)
    check(out.gather().astype(np.float64), a.astype(np.float64) @ b, "bfloat16")


_SPIN_FILL = r"""
extern "C" __global__ void spin_fill(float* x, float v, long long n, long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)blockDim.x * gridDim.x)
        x[i] = v;
}
"""


def _spin_fill(x, value, stream, ms=50):
    """Write `value` into x on `stream`, after ~ms of spinning: a late producer."""
    kern = cupy.RawKernel(_SPIN_FILL, "spin_fill")
    rate = cupy.cuda.Device().attributes["ClockRate"]  # kHz
    with stream:
        kern((64,), (256,), (x, np.float32(value), np.int64(x.size), np.int64(rate * ms)))


def _check_rowsums(pieces, value, b):
    """Each piece of value * ones @ b: every row is value times b's column sums (float64)."""
    ref = value * np.asarray(b, dtype=np.float64).sum(axis=0)
    for piece in pieces:
        assert np.all(np.isfinite(piece)), "the plan or the caller read unwritten data"
        np.testing.assert_allclose(piece, np.broadcast_to(ref, piece.shape), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("graph", [False, True])
def test_call_is_ordered_with_the_callers_stream(mesh, graph):
    """The input is written late on the caller's non-blocking stream, and the output is read on
    it right after the call: without the fences the plan reads unwritten input (poisoned NaN) and
    the caller reads the output before the plan wrote it."""
    d = mesh.size
    f = seed(mesh, graph=graph)
    b = rng().standard_normal((64, 32)).astype(np.float32)
    w = sf.replicate(cupy.asarray(b), mesh=mesh)
    caller = cupy.cuda.Stream(non_blocking=True)
    for value in (1.5, -0.75, 2.25):
        with caller:
            a = cupy.full((16 * d, 64), np.nan, np.float32)
        _spin_fill(a, value, caller)
        with caller:  # CuPy's current stream is the caller's: the default for stream=
            out = f(a, w)
            got = [s.data.copy() for s in out.addressable_shards]  # read on the caller's stream
        caller.synchronize()
        _check_rowsums([cupy.asnumpy(p).astype(np.float64) for p in got], value, b)


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("reader", ["the caller's stream", "another stream"])
def test_an_exported_result_is_ordered_after_its_call(graph, reader):
    """The input is written late on the caller's stream; the result is exported with
    cupy.from_dlpack and copied at once on `reader`.  The call's own fence orders the caller's
    stream (its export is not fenced again: the result remembers that stream); another stream
    is fenced by the export (DLPack's stream argument).  Unordered, the copy reads the poisoned
    output before the plan wrote it."""
    mesh = sf.DeviceMesh(1, backend="cupy")
    f = seed(mesh, graph=graph)
    b = rng().standard_normal((64, 32)).astype(np.float32)
    w = sf.replicate(cupy.asarray(b), mesh=mesh)
    caller, other = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    for value in (1.5, -0.75):
        with caller:
            a = cupy.full((16, 64), np.nan, np.float32)
        _spin_fill(a, value, caller)
        out = f(a, w, stream=caller)
        assert out.fenced.covers(caller.ptr) and not out.fenced.covers(other.ptr)
        s = caller if reader == "the caller's stream" else other
        with s:
            got = cupy.from_dlpack(out).copy()
        s.synchronize()
        _check_rowsums([cupy.asnumpy(got).astype(np.float64)], value, b)


def test_an_export_makes_no_other_stream_wait():
    """cupy.from_dlpack of a result on a non-default stream S orders S after the plan and nothing
    else: the legacy default stream stays free while S is held up by a late kernel.  (The piece's
    own DLPack export, asked with no stream, once made the legacy stream wait for CuPy's current
    one: a device-side sync the consumer never asked for.)"""
    mesh = sf.DeviceMesh(1, backend="cupy")
    f = seed(mesh)
    b = rng().standard_normal((64, 32)).astype(np.float32)
    w = sf.replicate(cupy.asarray(b), mesh=mesh)
    a = cupy.ones((16, 64), np.float32)
    s = cupy.cuda.Stream(non_blocking=True)
    out = f(a, w, stream=s)
    _spin_fill(cupy.empty(1, np.float32), 1.0, s, ms=500)  # S busy for about half a second
    with s:
        got = cupy.from_dlpack(out)
    free = cupy.cuda.Event(disable_timing=True)
    free.record(cupy.cuda.Stream.null)
    free.synchronize()
    assert not s.done, "the legacy default stream waited for the consumer's stream"
    s.synchronize()
    _check_rowsums([cupy.asnumpy(got).astype(np.float64)], 1.0, b)


def test_a_graph_result_exported_after_the_next_call_waits_for_it():
    """Graph mode: the next call overwrites a call's outputs.  Call 1 on stream S, call 2 on
    stream T with its input written late on T, then call 1's result exported on S: S must wait
    for call 2 (the export fences again, as the result's call is no longer the plan's last), so
    it reads call 2's values, whole, never a mix."""
    mesh = sf.DeviceMesh(1, backend="cupy")
    f = seed(mesh, graph=True)
    b = rng().standard_normal((64, 32)).astype(np.float32)
    w = sf.replicate(cupy.asarray(b), mesh=mesh)
    s, t = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    with s:
        a1 = cupy.full((16, 64), 1.5, np.float32)
    with t:
        a2 = cupy.full((16, 64), np.nan, np.float32)
    s.synchronize()
    t.synchronize()
    out1 = f(a1, w, stream=s)
    _spin_fill(a2, -0.75, t)
    f(a2, w, stream=t)
    with s:
        got = cupy.from_dlpack(out1).copy()
    s.synchronize()
    _check_rowsums([cupy.asnumpy(got).astype(np.float64)], -0.75, b)


@pytest.mark.parametrize("how", ["stream=", "torch's current stream"])
def test_late_producer_on_a_torch_stream(mesh, how):
    """A tensor written late on a torch side stream.  "stream=": passed as a CuPy view with
    stream=s, so only the call's fence orders the read.  "torch's current stream": passed as the
    tensor itself inside `torch.cuda.stream(s)` with no stream=; the call fences CuPy's current
    stream, so only the adoption of the tensor (which waits for torch's current stream, as
    DLPack does) orders the read after the write."""
    torch = _torch()
    d = mesh.size
    f = seed(mesh)
    b = torch.randn((64, 32), device="cuda")
    w = sf.replicate(b, mesh=mesh)
    s = torch.cuda.Stream()
    a = torch.full((16 * d, 64), float("nan"), device="cuda")
    s.wait_stream(torch.cuda.current_stream())  # a is allocated and poisoned on the default stream
    with torch.cuda.stream(s):
        torch.cuda._sleep(50_000_000)  # a late producer on the torch stream
        a.fill_(0.5)
        out = f(a, w) if how != "stream=" else None
    if how == "stream=":
        out = f(cupy.from_dlpack(a), w, stream=s)
        with torch.cuda.stream(s):  # read on s right after the call: s waits for the outputs
            got = [torch.from_dlpack(p.data).double().cpu().numpy() for p in out.addressable_shards]
    else:
        got = [cupy.asnumpy(p.data).astype(np.float64) for p in out.addressable_shards]
    _check_rowsums(got, 0.5, b.double().cpu().numpy())


def test_bad_device_inputs_fail_before_any_work():
    torch = _torch()
    mesh = sf.DeviceMesh(1, backend="cupy")
    f = seed(mesh)
    a = torch.randn((32, 64), device="cuda")
    b = torch.randn((64, 16), device="cuda")
    with pytest.raises(ValueError, match=r"non-contiguous torch array .*x.contiguous\(\)"):
        f(a, b.t().contiguous().t())
    with pytest.raises(ValueError, match=r"non-contiguous"):
        sf.shard(a.t(), axis=0, mesh=mesh)
    plan = f.lower(sf.TensorSpec((32, 64), "float32"), sf.TensorSpec((64, 16), "float32"))
    with pytest.raises(ValueError, match=r"expected shape \(64, 16\) and dtype float32, got a torch array float16"):
        plan(a, b.half())
    with pytest.raises(TypeError, match="unsupported dtype 'int16'"):
        sf.shard(torch.ones((4, 4), dtype=torch.int16, device="cuda"), axis=0, mesh=mesh)
    from shardfuse.interop import array_info, check_input

    class OtherGPUs:  # a backend whose devices are on GPU 1 only
        ordinals = [1]

    with pytest.raises(ValueError, match=r"on GPU 0, but this process' devices are on GPUs \[1\]"):
        check_input(array_info(a), OtherGPUs(), "a")


def test_to_local_of_several_pieces_is_their_box_on_the_gpu(mesh):
    """Pieces of several virtual devices: to_local assembles the box they tile in a new CuPy array
    (what sf.from_local takes back); one piece is returned as it is."""
    x = cupy.asarray(rng().standard_normal((8 * mesh.size, 6)).astype(np.float32))
    arr = sf.shard(x, axis=0, mesh=mesh)
    local = arr.to_local()
    assert isinstance(local, cupy.ndarray)
    np.testing.assert_array_equal(cupy.asnumpy(local), cupy.asnumpy(x))
    assert (local.data.ptr == arr.addressable_shards[0].data.data.ptr) == (mesh.size == 1)
    back = sf.from_local(local, axis=0, mesh=mesh)
    np.testing.assert_array_equal(back.gather(), cupy.asnumpy(x))


def test_pieces_of_one_copy_give_their_addresses_without_views():
    # sf.shard on virtual devices of one GPU along an inner axis: the graph's key reads the pieces'
    # addresses (pointers()) without making a CuPy view each; they are the views' own addresses,
    # and a replay on them computes what the eager plan does
    mesh = sf.DeviceMesh(4, backend="cupy")
    x = cupy.asarray(np.random.default_rng(9).standard_normal((2, 8, 16)).astype(np.float32))
    w = cupy.asarray(np.random.default_rng(10).standard_normal((16, 4)).astype(np.float32))
    placed = sf.shard(x, axis=1, mesh=mesh)
    pointers = placed.shards.pointers()
    assert pointers == [p.data.ptr for p in placed.shards]
    f = sf.jit(lambda a, b: sf.shard(a, axis=1) @ b, mesh=mesh, graph=True)
    for _ in range(2):
        got = f(sf.shard(x, axis=1, mesh=mesh), w).gather()
        np.testing.assert_allclose(got, cupy.asnumpy(x) @ cupy.asnumpy(w), rtol=1e-5, atol=1e-5)
