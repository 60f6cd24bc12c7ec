"""This session's CPU-tested changes that touch the CuPy backend (4 virtual devices of the GPU there is),
against the same program on NumPy devices: the sharded take's rows not held filled with -0.0 (its
kernel's new `zero` argument; a gathered -0.0 keeps its sign, bfloat16 by its bits), as a stream and as a
CUDA graph; the new elementwise ops in one fused chain and unfused; np.prod / np.cumprod / np.median /
np.interp of sharded values; a KV cache sharded over its sequence axis written in place (at_sharded.py).  Skipped where CuPy is missing or sees no GPU."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

cupy = pytest.importorskip("cupy", reason="CuPy is not installed")

from cases import gpu_count  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_count() == 0, reason="CuPy sees no GPU")]

import shardfuse as sf  # noqa: E402


def both(fn, *args, graph=False):
    """fn jitted on 4 CuPy virtual devices and on 4 NumPy devices, its first argument sharded on axis 0."""
    out = []
    for backend in ("cupy", "numpy"):
        mesh = sf.DeviceMesh(4, backend=backend)
        got = sf.jit(fn, mesh=mesh, graph=graph)(sf.shard(args[0], axis=0, mesh=mesh), *args[1:])
        out.append(np.asarray(got.gather()))
    return out


@pytest.mark.parametrize("graph", [False, True], ids=["stream", "graph"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64", "int32"])
def test_a_gathered_minus_zero_keeps_its_sign(dtype, graph):
    z = np.array([-0.0, 1.0, -0.0, 3.0, 2.0, -0.0, 5.0, -4.0]).astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    ids = np.array([0, 2, 5, 1, 7, 0])
    gpu, cpu = both(lambda v, i: v[i], z, ids, graph=graph)
    np.testing.assert_array_equal(gpu.view(np.uint8), cpu.view(np.uint8))  # (bit for bit: -0.0 is not +0.0)
    np.testing.assert_array_equal(cpu.view(np.uint8), z[ids].view(np.uint8))


def test_the_new_math_in_a_fused_chain():
    x = np.random.default_rng().uniform(0.2, 0.8, (8, 16))
    fn = lambda v: (np.arcsin(v) + np.arctan2(v, 0.5) * np.hypot(v, 2.0) - np.copysign(np.cbrt(v), -1.0)  # noqa: E731
                    + np.log2(v) * np.exp2(v) + np.arccosh(v + 1.0) - np.tan(v) * np.sinh(v))
    gpu, cpu = both(fn, x)
    np.testing.assert_allclose(gpu, cpu, rtol=1e-12, atol=1e-13)


def test_products_quantiles_and_interp():
    r = np.random.default_rng()
    x = r.uniform(0.5, 1.5, (8, 12)) * r.choice([-1.0, 1.0], (8, 12))
    xp, fp = np.sort(r.uniform(-1.2, 1.2, 6)), r.standard_normal(6)
    for fn in (lambda v: np.prod(v, axis=0), lambda v: np.cumprod(v, axis=1), lambda v: np.median(v, axis=0),
               lambda v: np.quantile(v, [0.1, 0.9], axis=1), lambda v: np.interp(v, xp, fp)):
        gpu, cpu = both(fn, x)
        np.testing.assert_allclose(gpu, cpu, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", ["seq over tp2", "dp2 x seq over tp2"])
def test_a_sequence_sharded_cache_written_in_place(layout, dtype):
    import test_update_slice as us
    us.check_sequence_sharded_writes(layout, dtype, np.random.default_rng(7), backend="cupy")
