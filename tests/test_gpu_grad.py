"""Gradients and donation on the CuPy backend (issue 32; run on the GPU machine by
`pytest -m gpu`): the per-op gradients of tests/test_grad.py against central differences, the MLP
block's and the seed's backward (pipelined) against NumPy's analytic gradients at D = 1, 2, 4, 8
virtual devices, an SGD step written into the donated weights' GPU buffers, a data-parallel step
whose gradient buckets run on their own stream (eager and as a CUDA graph), and the scatter-add
(the embedding's gradient: atomicAdd kernels, not run on a GPU when written) against NumPy's."""
from __future__ import annotations

import numpy as np
import pytest

from cases import gpu_count

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_count() == 0, reason="CuPy sees no GPU")]

import shardfuse as sf  # noqa: E402
import test_grad as tg  # noqa: E402
from shardfuse.mlp import mlp_inputs  # noqa: E402

_MESHES: dict = {}


def cupy_mesh(d, names=("tp",)):
    key = (d, names)
    if key not in _MESHES:
        _MESHES[key] = sf.DeviceMesh((d,) if len(names) == 1 else (2, d // 2), names, backend="cupy")
    return _MESHES[key]


OPS = ["gelu", "silu", "rsqrt", "log", "where", "mul broadcast", "maximum", "max first keepdims", "mean",
       "astype", "transpose", "matmul batch @ 2-D", "softmax", "layer_norm", "rms_norm", "attention",
       "take vocab-parallel", "take repeated ids", "scatter_add"]


@pytest.mark.parametrize("placement", ["R", "S0"])
@pytest.mark.parametrize("name", OPS)
def test_gradient_against_central_differences(name, placement):
    tg.check_case(name, cupy_mesh(4), placement, tg.seed_of(name, placement, "gpu"))


@pytest.mark.parametrize("d", [1, 2, 4])
@pytest.mark.parametrize("mode", ["sp", "tp"])
def test_mlp_block_gradients(d, mode):
    tg.check_mlp(cupy_mesh(d), mode, 2, np.random.default_rng(d))


def test_mlp_block_gradients_data_parallel():
    tg.check_mlp(cupy_mesh(4, ("dp", "tp")), "sp", 2, np.random.default_rng(7), dp="dp")


@pytest.mark.parametrize("d", [2, 4, 8])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_seed_backward_exact(d, dtype):
    """The seed's pipelined AllGather+GEMM, differentiated: da and db against NumPy's."""
    mesh = cupy_mesh(d, ("DIDx",))
    rng = np.random.default_rng(d)
    a = rng.standard_normal((4, d, 8, 16)).astype(dtype)
    b = rng.standard_normal((16, 12)).astype(dtype)
    r = rng.standard_normal((4, d, 8, 12)).astype(dtype)

    def loss(a, b, r):
        return (sf.stream(sf.shard(a, axis=1) @ b, axis=0, chunks=2) * r).sum()
    da, db = sf.jit(sf.grad(loss, argnums=(0, 1)), mesh=mesh)(a, b, r)
    a64, b64, r64 = (x.astype(np.float64) for x in (a, b, r))
    tol = 1e-12 if dtype == "float64" else 1e-5
    for got, want in ((da, r64 @ b64.T), (db, np.einsum("sdmk,sdmn->kn", a64, r64))):
        got = np.asarray(got).astype(np.float64)
        assert np.linalg.norm(got - want) <= tol * np.linalg.norm(want)


def test_sgd_step_writes_the_donated_gpu_buffers():
    import cupy

    mesh = cupy_mesh(2)
    rng = np.random.default_rng(3)
    w0, x = rng.standard_normal((8, 4)).astype(np.float32), rng.standard_normal((16, 8)).astype(np.float32)

    def step(w, x):
        return w - 0.1 * sf.grad(lambda w, x: ((sf.shard(x, axis=0) @ w) ** 2).mean())(w, x)
    jstep = sf.jit(step, mesh=mesh, donate_argnums=0)
    w, want = jstep(w0, x), w0.astype(np.float64)
    want = want - 0.1 * (2 * x.T @ (x @ want) / 64)
    for _ in range(3):
        pieces = [p.data.ptr for p in w.shards]
        assert all(isinstance(p, cupy.ndarray) for p in w.shards)
        w_next = jstep(w, x)
        assert [p.data.ptr for p in w_next.shards] == pieces
        w = w_next
        want = want - 0.1 * (2 * x.T @ (x @ want) / 64)
    np.testing.assert_allclose(np.asarray(w), want, rtol=1e-4, atol=1e-5)


def dp_sgd_step(p, x, r):
    """A data-parallel training step: the layer's gradients (summed over dp in buckets), then SGD."""
    from shardfuse.transformer import transformer_layer

    g = sf.grad(lambda p, x, r: (transformer_layer(p, x, 4, dp="dp") * r).sum())(p, x, r)
    return {k: p[k] - 0.1 * g[k] for k in p}


@pytest.mark.parametrize("graph", [False, True])
def test_data_parallel_step_with_buckets_on_their_stream(graph):
    """The step on 2 virtual devices, its gradient buckets' Allreduces on a stream of their own
    (passes/bucket.py, issue 32: forked from main after the last copy in, joined back before the
    copies out), against the same step on NumPy devices; eager, and captured as a CUDA graph (the
    fork joined back to main before the capture ends), replayed."""
    from shardfuse.transformer import init_params

    rng = np.random.default_rng(11)
    p = init_params(rng, 16, "float64", 0.3)
    x, r = rng.standard_normal((4, 8, 16)), rng.standard_normal((4, 8, 16))
    want = sf.jit(dp_sgd_step, mesh=sf.DeviceMesh((2,), ("dp",), backend="numpy"))(p, x, r)
    f = sf.jit(dp_sgd_step, mesh=cupy_mesh(2, ("dp",)), graph=graph)
    text = str(f.lower(p, x, r))
    assert "bucket=" in text and "SetCurrentStream Stream(4)" in text and "Synchronize Stream(4)" in text, text
    for _ in range(2):  # (graph: captured, then replayed)
        got = f(p, x, r)
        for k in p:
            np.testing.assert_allclose(got[k].gather(), want[k].gather(), rtol=1e-10, atol=1e-12, err_msg=k)


def test_torch_function_on_cuda_tensors_matches_torch_autograd():
    """sf.torch_function on CUDA tensors (read on torch's stream, results through DLPack) against
    torch's own autograd of the same MLP block, float32."""
    torch = pytest.importorskip("torch", reason="torch is not installed on this GPU machine")
    from shardfuse.mlp import mlp_block

    dev = torch.device("cuda")
    g = torch.Generator(device="cpu").manual_seed(0)
    shapes = [(16, 8), (8, 32), (32,), (32, 8), (8,)]
    ours = [torch.randn(s, generator=g).to(dev).requires_grad_() for s in shapes]
    theirs = [t.detach().clone().requires_grad_() for t in ours]
    y = sf.torch_function(mlp_block(cupy_mesh(2), "sp", chunks=2))(*ours)
    x, w1, b1, w2, b2 = theirs
    z = torch.nn.functional.gelu(x @ w1 + b1, approximate="tanh") @ w2 + b2
    assert y.is_cuda
    torch.testing.assert_close(y, z, rtol=1e-4, atol=1e-4)
    (y * y).sum().backward()
    (z * z).sum().backward()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64"])
@pytest.mark.parametrize("name", ["softmax", "gelu and norm arithmetic"])
def test_fused_kernels_against_the_unfused_plan(name, dtype, monkeypatch):
    """passes/fuse.py's steps as one generated CuPy kernel each, against the unfused plan's result
    (the same ops in the same dtypes: equal up to the kernels' own rounding, an ulp or so)."""
    import test_fusion as tf

    fn, make = tf.CASES[name]
    args = make(np.random.default_rng(3), dtype)
    mesh = cupy_mesh(2)
    monkeypatch.setenv("SHARDFUSE_FUSE", "1")
    got = np.asarray(sf.jit(fn, mesh=mesh)(*args)).astype(np.float64)
    assert "Fused" in str(sf.jit(fn, mesh=mesh).lower(*args))  # (a Fused or, over rows, a FusedRows step)
    monkeypatch.setenv("SHARDFUSE_FUSE", "0")
    want = np.asarray(sf.jit(fn, mesh=mesh)(*args)).astype(np.float64)
    # (the softmax case computes in float32 whatever its input: a row group sums in its own order, so
    # float32's tolerance holds there; the other chains keep their dtype)
    tol = {"float64": 1e-14 if name != "softmax" else 1e-6, "float32": 1e-6, "float16": 2e-3, "bfloat16": 1e-2}[dtype]
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("layout", ["replicated", "rows-tp", "positions-tp", "positions-tp-rows-tp"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64"])
@pytest.mark.parametrize("d", [1, 2, 4])
def test_scatter_add_matches_numpy(d, dtype, layout):
    """backends/cuda/kernels.py's scatter-add (atomicAdd into float32, float64 for float64; 16-bit
    rounded once) against the NumPy backend's on the same inputs, repeated and out-of-range ids
    included, and against float64 (test_scatter_add.check_scatter); poisoned buffers (conftest)
    fail where a row is left unwritten.  The order of the atomic adds is the GPU's: float32 sums
    agree to rounding, not bit for bit."""
    import test_scatter_add as sa
    from shardfuse.dtypes import np_dtype

    sa.check_scatter(cupy_mesh(d), layout, dtype, np.random.default_rng(d), ids_shape=(8, 16))
    rng = np.random.default_rng(d + 10)
    ids = sa.ids_with_repeats(rng, (8, 16))
    values = (rng.standard_normal((8, 16, sa.H)) * 3).astype(np_dtype(dtype))
    f = sa.scatter_fn(*(a if a == "tp" else None for a in sa.LAYOUTS[layout]))
    got = np.asarray(sf.jit(f, mesh=cupy_mesh(d))(ids, values).gather(), np.float64)
    want = np.asarray(sf.jit(f, mesh=sf.DeviceMesh(d, "tp", backend="numpy"))(ids, values).gather(), np.float64)
    # each device's partial sum is rounded to the dtype before partials are combined (a pending sum
    # over the positions' mesh axis), and the GPU's atomic order may round a partial the other way
    # (an H200 run: one bfloat16 partial of ~9 off by its ulp): the bound scales with the rows' sum
    # of |values|, not with the result
    absum = np.asarray(sf.jit(f, mesh=sf.DeviceMesh(d, "tp", backend="numpy"))(ids, np.abs(values)).gather(),
                       np.float64)
    tol = {"float64": 1e-14, "float32": 1e-6, "float16": 1e-3, "bfloat16": 8e-3}[dtype]
    np.testing.assert_array_less(np.abs(got - want), tol * (np.abs(want) + 4 + absum))


@pytest.mark.parametrize("table_over, ids_over", [("tp", None), ("tp", "tp"), (None, "tp")], ids=str)
def test_embedding_gradient_is_a_scatter_add(table_over, ids_over):
    import test_scatter_add as sa
    sa.check_embed_grad(cupy_mesh(4), table_over, ids_over, np.random.default_rng(5))


@pytest.mark.parametrize("d", [1, 2])
def test_checkpointed_gpt_step_matches_numpy(d):
    """sf.checkpoint on the GPU: a sequence-parallel GPT's value_and_grad with each layer recomputed
    in the backward, against the same step on NumPy devices (float64)."""
    from shardfuse import tree
    from shardfuse.transformer import gpt_loss

    import test_checkpoint as tc
    params, ids, labels = tc.gpt_case(np.random.default_rng(7))
    kw = {"tp": "tp", "sp": True, "chunks": 2} if d > 1 else {}
    got = tc.checkpointed_step(cupy_mesh(d), True, **kw)(params, ids, labels)
    want = sf.jit(sf.value_and_grad(lambda p, i, t: gpt_loss(p, i, t, 4, **kw)),
                  mesh=sf.DeviceMesh((d,), ("tp",), backend="numpy"))(params, ids, labels)
    for a, b in zip(tree.leaves(got), tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a.gather()), np.asarray(b.gather()), rtol=1e-10, atol=1e-12)
