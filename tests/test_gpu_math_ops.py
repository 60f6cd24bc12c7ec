"""NumPy's unary math (shardfuse/numpy_math.py) on the CuPy backend: np.sin / cos / log1p / expm1,
sf.erf, the exact GELU, np.sign / floor / ceil / trunc / round / rint / x.round(), np.isnan / isinf /
isfinite and np.reciprocal, np.round(x, decimals) and np.cumsum (kernels.Kernels.cumsum: one thread
per row, strided views read in place) (tests/test_math_ops.py's bodies) on 1, 2 x 2 and 4 devices (virtual devices sharing
a GPU where there are fewer), inside sf.jit, as a CUDA graph and eagerly on sf.Arrays, in float16,
bfloat16, float32, float64, int32, int64 and bool, against NumPy in float64; chains of them fused
(one generated kernel, backends/cuda/fused.py) and unfused (SHARDFUSE_FUSE=0: CuPy's ufuncs,
kernels._FUSED's one-kernel forms, and kernels.INLINE's for bfloat16), sums of them (FusedSum), halves
to even, signed zeros, NaN and infinities, and gradients against the NumPy backend's; a Llama port's
np.broadcast_to / repeat / tile / outer / logaddexp / take_along_axis / x.mT and x ** y of two arrays
(Op.POWER: CuPy's power, kernels.INLINE's pow(a, b) fused and for bfloat16) (tests/test_broadcast_ops.py's
bodies).  Skipped, with
one line saying why, where CuPy is missing or sees no GPU."""
from __future__ import annotations

import os
from contextlib import nullcontext

import numpy as np
import pytest

os.environ.setdefault("SHARDFUSE_POISON", "1")

cupy = pytest.importorskip("cupy", reason="CuPy is not installed")

from cases import gpu_count  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_count() == 0, reason="CuPy sees no GPU")]

import shardfuse as sf  # noqa: E402
import test_elementwise_ops as ew  # noqa: E402
import test_broadcast_ops as bo  # noqa: E402
import test_math_ops as mo  # noqa: E402
from shardfuse.dtypes import np_dtype  # noqa: E402

def cupy_mesh(shape):
    return ew.mesh_of(shape, "cupy")


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("layout", ["1d R", "1d S0", "1d S1", "2d S0 S1", "2d S(0,1)"])
@pytest.mark.parametrize("name", sorted(mo.MATH))
def test_op_on_every_layout(name, layout, jit):
    shape, spec, _ = ew.LAYOUTS[layout]
    mo.check_math(name, cupy_mesh(shape), spec, "float64", jit, np.random.default_rng(31))


@pytest.mark.parametrize("graph", [False, True], ids=["stream", "graph"])
@pytest.mark.parametrize("dtype", ew.DTYPES + mo.INT_DTYPES)
@pytest.mark.parametrize("name", sorted(mo.MATH))
def test_op_in_every_dtype(name, dtype, graph):
    refused = dtype in mo.INT_DTYPES and not mo.MATH[name][3] or (dtype == "bool" and name == "np.sign")
    with pytest.raises(TypeError, match="reciprocal of|sign of the boolean") if refused else nullcontext():
        mo.check_math(name, cupy_mesh(4), ("DIDx", None), dtype, True, np.random.default_rng(32), graph=graph)


@pytest.mark.parametrize("dtype", ew.DTYPES + mo.INT_DTYPES)
@pytest.mark.parametrize("name", ["np.sin", "sf.erf", "gelu exact", "np.sign", "np.round", "np.isinf"])
def test_op_eagerly_on_a_2x2_mesh(name, dtype):
    refused = dtype == "bool" and name == "np.sign"
    with pytest.raises(TypeError, match="sign of the boolean") if refused else nullcontext():
        mo.check_math(name, cupy_mesh((2, 2)), ("DIDy", "DIDx"), dtype, False, np.random.default_rng(33))


@pytest.mark.parametrize("graph", [False, True], ids=["stream", "graph"])
@pytest.mark.parametrize("dtype", ew.DTYPES)
def test_halves_to_even_signed_zeros_nans_and_infinities(dtype, graph):
    """NumPy's values (bfloat16: its float32 values rounded), zeros with NumPy's sign (-0.0 from
    round / floor / ceil of -0.5 and -0.0; +0.0 from sign), NaN where NumPy has NaN."""
    mesh = cupy_mesh(4)
    x = mo.SPECIAL.astype(np_dtype(dtype))
    fns = (np.round, np.rint, np.floor, np.ceil, np.trunc, np.sign, np.isnan, np.isinf, np.isfinite,
           lambda v: v.round())
    # (replicated, then read; gather() of the sharded value keeps -0.0 too, tests/test_numpy.py)
    f = sf.jit(lambda v: tuple(sf.replicate(fn(v)) for fn in fns), mesh=mesh, graph=graph)
    for k, (fn, g) in enumerate(zip(fns, f(sf.shard(x, axis=0, mesh=mesh)))):
        got = np.asarray(g.gather())
        want = fn(x.astype(np.float32)).astype(got.dtype) if dtype == "bfloat16" else fn(x)
        assert got.dtype == want.dtype, (k, got.dtype, want.dtype)
        if got.dtype.kind in "fV":  # (floats as float64, exactly: NaN of ml_dtypes' bfloat16 is not equal to NaN)
            got, want = got.astype(np.float64), want.astype(np.float64)
            np.testing.assert_array_equal(np.signbit(got[got == 0]), np.signbit(want[want == 0]), err_msg=f"{k}")
        np.testing.assert_array_equal(got, want, err_msg=f"function {k} {dtype}")


@pytest.mark.parametrize("graph", [False, True], ids=["stream", "graph"])
@pytest.mark.parametrize("dtype", ew.DTYPES)
def test_erf_and_the_exact_gelu_at_the_extremes(dtype, graph):
    mesh = cupy_mesh(4)
    x = mo.SPECIAL.astype(np_dtype(dtype))
    f = sf.jit(lambda v: (sf.erf(v), sf.gelu(v, approximate=False), sf.gelu(v)), mesh=mesh, graph=graph)
    erf, exact, tanh = (np.asarray(g.gather()).astype(np.float64) for g in f(sf.shard(x, axis=0, mesh=mesh)))
    x64 = x.astype(np.float64)
    tol = mo.TOL[dtype]
    np.testing.assert_allclose(erf, mo.np_erf(x64), rtol=tol, atol=tol)
    with np.errstate(invalid="ignore", over="ignore"):
        np.testing.assert_allclose(exact, mo.np_gelu_exact(x64), rtol=tol, atol=tol)  # (NaN at -inf, as NumPy's)
        want = 0.5 * x64 * (1 + np.tanh(np.sqrt(2 / np.pi) * (x64 + 0.044715 * x64 ** 3)))
    finite = np.isfinite(x64)
    np.testing.assert_allclose(tanh[finite], want[finite], rtol=tol, atol=tol)  # (the default: the tanh form)


def _check_chains(dtype, mesh, graph):
    rng = np.random.default_rng(34)
    x, b = mo.chain_inputs(rng, dtype)
    xa = sf.shard(x, axis=0, mesh=mesh)
    got = sf.jit(mo.chain, mesh=mesh, graph=graph)(xa, b)
    x64, b64 = x.astype(np.float64), b.astype(np.float64)
    tol = mo.CHAIN_TOL[dtype]
    np.testing.assert_allclose(np.asarray(got.gather()).astype(np.float64), mo.chain_ref(x64, b64), rtol=tol, atol=tol)
    more = sf.jit(mo.more_chain, mesh=mesh, graph=graph)(xa, b)  # (ops.MORE_MATH: C's asin, acosh, cbrt, ...)
    np.testing.assert_allclose(np.asarray(more.gather()).astype(np.float64), mo.more_chain_ref(x64, b64),
                               rtol=tol, atol=tol)
    rows, cols = sf.jit(mo.fused_sum, mesh=mesh, graph=graph)(xa, b)
    terms = np.sin(x64) * mo.np_erf(x64 * 0.5) * b64, np.expm1(x64) * 0.5
    for g, t, axis in ((rows, terms[0], -1), (cols, terms[1], 0)):
        bound = tol * (1 + np.abs(t).sum(axis))  # (16-bit terms rounded each, summed in float32)
        assert np.all(np.abs(np.asarray(g.gather()).astype(np.float64) - t.sum(axis)) <= bound), (axis, dtype)


@pytest.mark.parametrize("graph", [False, True], ids=["stream", "graph"])
@pytest.mark.parametrize("dtype", ew.DTYPES)
def test_chains_fused_into_generated_kernels(dtype, graph, monkeypatch):
    monkeypatch.delenv("SHARDFUSE_FUSE", raising=False)  # (fusion is what this checks: on in the unfused run too)
    mesh = cupy_mesh(4)
    x, b = mo.chain_inputs(np.random.default_rng(35), dtype)
    plan = sf.jit(mo.chain, mesh=mesh).lower(sf.shard(x, axis=0, mesh=mesh), b)
    exprs = " ".join(str(i.attrs["expr"]) for i in plan.program.instrs if "expr" in i.attrs)
    assert all(f"{op}(" in exprs for op in mo.CHAIN_OPS), exprs  # (each op's INLINE form in a kernel)
    _check_chains(dtype, mesh, graph)


@pytest.mark.parametrize("graph", [False, True], ids=["stream", "graph"])
@pytest.mark.parametrize("dtype", ew.DTYPES)
def test_chains_unfused_one_step_per_op(dtype, graph, monkeypatch):
    monkeypatch.setenv("SHARDFUSE_FUSE", "0")
    mesh = cupy_mesh(4)
    x, b = mo.chain_inputs(np.random.default_rng(36), dtype)
    plan = sf.jit(mo.chain, mesh=mesh).lower(sf.shard(x, axis=0, mesh=mesh), b)
    assert "Fused" not in str(plan) and "Gelu_erf" in str(plan), plan
    _check_chains(dtype, mesh, graph)


def _loss(x, b):
    y = sf.gelu(np.sin(x) * 2.0 + b, approximate=False) + sf.erf(x) * np.cos(x)
    return (y + np.log1p(x * x) + np.expm1(x * 0.5) * np.floor(x * 4.0) + np.reciprocal(x * x + 1.0)).sum()


@pytest.mark.parametrize("fuse", ["fused", "unfused"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_gradients_match_the_numpy_backends(dtype, fuse, monkeypatch):
    """sf.grad of sin, cos, log1p, expm1, erf, the exact GELU (and floor's zero) on GPUs, x sharded,
    against the NumPy backend's float64 gradients (which tests/test_grad.py checks against central
    differences)."""
    if fuse == "unfused":
        monkeypatch.setenv("SHARDFUSE_FUSE", "0")
    rng = np.random.default_rng(37)
    x, b = rng.standard_normal((8, 16)), rng.standard_normal(16)
    ref_mesh = mo.mesh_of(4)
    want = sf.jit(sf.grad(_loss, argnums=(0, 1)), mesh=ref_mesh)(sf.shard(x, axis=0, mesh=ref_mesh), b)
    mesh = cupy_mesh(4)
    xd, bd = x.astype(np_dtype(dtype)), b.astype(np_dtype(dtype))
    got = sf.jit(sf.grad(_loss, argnums=(0, 1)), mesh=mesh)(sf.shard(xd, axis=0, mesh=mesh), bd)
    tol = 1e-10 if dtype == "float64" else 1e-4
    for g, w in zip(got, want):
        assert g.dtype == np_dtype(dtype)
        np.testing.assert_allclose(np.asarray(g.gather()).astype(np.float64), np.asarray(w.gather()), rtol=tol,
                                   atol=tol)


@pytest.mark.parametrize("graph", [False, True], ids=["stream", "graph"])
@pytest.mark.parametrize("dtype", ew.DTYPES + ("int32", "int64"))
@pytest.mark.parametrize("decimals", [2, -1])
def test_round_with_decimals_bit_for_bit(decimals, dtype, graph):
    mo.check_round(cupy_mesh(4), ("DIDx", None), dtype, decimals, True, np.random.default_rng(38), graph=graph)
    mo.check_round(cupy_mesh((2, 2)), ("DIDy", "DIDx"), dtype, decimals, False, np.random.default_rng(39))


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("axis", [0, 1, None])
@pytest.mark.parametrize("layout", ["1d R", "1d S0", "1d S1", "2d S0 S1", "2d S(0,1)"])
def test_cumsum_on_every_layout(layout, axis, jit):
    """Along axis 0 the Cumsum step reads a transposed (strided) view of each device's piece."""
    shape, spec, _ = ew.LAYOUTS[layout]
    mo.check_cumsum(cupy_mesh(shape), spec, "float64", axis, jit, np.random.default_rng(40))


@pytest.mark.parametrize("graph", [False, True], ids=["stream", "graph"])
@pytest.mark.parametrize("dtype", ew.DTYPES + mo.INT_DTYPES)
@pytest.mark.parametrize("axis", [0, 1])
def test_cumsum_in_every_dtype(axis, dtype, graph):
    mo.check_cumsum(cupy_mesh(4), ("DIDx", None), dtype, axis, True, np.random.default_rng(41), graph=graph)
    mo.check_cumsum(cupy_mesh(4), (None, "DIDx", None), dtype, axis, True, np.random.default_rng(42),
                    shape=(4, 8, 6), graph=graph)


def test_cumsum_gradient_matches_the_numpy_backends():
    rng = np.random.default_rng(43)
    x, r = rng.standard_normal((8, 16)), rng.standard_normal((8, 16))
    loss = lambda v: (np.cumsum(v, 0) * r + np.cumsum(v, 1) * r).sum()  # noqa: E731
    want = sf.jit(sf.grad(loss), mesh=mo.mesh_of(4))(sf.shard(x, axis=0, mesh=mo.mesh_of(4)))
    got = sf.jit(sf.grad(loss), mesh=cupy_mesh(4))(sf.shard(x, axis=0, mesh=cupy_mesh(4)))
    np.testing.assert_allclose(np.asarray(got.gather()), np.asarray(want.gather()), rtol=1e-12, atol=1e-12)


# ---- a Llama port's functions (tests/test_broadcast_ops.py's bodies) ----------------------------------------
@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("layout", ["1d R", "1d first", "2d first two"])
@pytest.mark.parametrize("name", sorted(bo.CASES))
def test_broadcast_ops_on_every_layout(name, layout, jit):
    shape, spec_of = bo.LAYOUTS[layout]
    bo.check(name, cupy_mesh(shape), spec_of, jit, np.random.default_rng(41))


@pytest.mark.parametrize("dtype", bo.DTYPES)
@pytest.mark.parametrize("name", sorted(bo.DTYPE_CASES))
def test_broadcast_ops_in_every_dtype(name, dtype):
    bo.check_dtype_or_refusal(name, dtype, cupy_mesh(4))


@pytest.mark.parametrize("dtype", ew.DTYPES)
def test_power_and_logaddexp_fused_and_unfused(dtype, monkeypatch):
    bo.check_fused(dtype, cupy_mesh(4), monkeypatch)


@pytest.mark.parametrize("name", ["power of arrays", "power by a 0-d array", "logaddexp", "take_along_axis",
                                  "repeat and tile", "broadcast_to", "outer"])
def test_broadcast_ops_gradients_match_the_numpy_backends(name):
    import test_grad as tg

    fn, gens, argnums = tg.CASES[name]
    rng = np.random.default_rng(42)
    xs = [g(rng, s) for s, g in gens]
    r = rng.standard_normal(np.shape(np.asarray(sf.jit(fn, mesh=cupy_mesh(4))(*xs))))
    grads = [sf.jit(sf.grad(tg.loss_of(fn), argnums=argnums), mesh=m)(*xs, r) for m in (cupy_mesh(4), mo.mesh_of(4))]
    for g, want in zip(*(g if isinstance(g, tuple) else (g,) for g in grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(want), rtol=1e-12, atol=1e-13)
