"""A new user's NumPy port on the CuPy backend (tests/test_logical.py's and tests/test_numpy_port.py's
bodies): & | ^ ~ of masks and integers and any / all (CuPy's bitwise ufuncs, bool Allreduces with
max / min through the order keys), a combined mask read by a fused where in 16-bit floats, in a
CUDA graph too; the new methods, x-shaped constants and integer-array indexing, on 1, 2 x 2 and 4
devices (virtual devices sharing a GPU where there are fewer), against NumPy.  Skipped, with one
line saying why, where CuPy is missing or sees no GPU."""
from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("SHARDFUSE_POISON", "1")

cupy = pytest.importorskip("cupy", reason="CuPy is not installed")

from cases import gpu_count  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_count() == 0, reason="CuPy sees no GPU")]

import shardfuse as sf  # noqa: E402
import test_elementwise_ops as ew  # noqa: E402
import test_logical as lg  # noqa: E402
import test_numpy_port as port  # noqa: E402
import test_user_port as up  # noqa: E402
from shardfuse.dtypes import np_dtype  # noqa: E402

def cupy_mesh(shape):
    return ew.mesh_of(shape, "cupy")


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("layout", lg.LAYOUTS)
@pytest.mark.parametrize("name", sorted(lg.CASES))
def test_logical_case(name, layout, jit):
    lg.check(name, cupy_mesh(ew.LAYOUTS[layout][0]), layout, jit, np.random.default_rng(51))


@pytest.mark.parametrize("d", [1, 4])
@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("spec", sorted(port.SPECS))
@pytest.mark.parametrize("name", sorted(port.METHODS))
def test_method(name, spec, jit, d):
    port.check_method(name, cupy_mesh(d), port.SPECS[spec], jit,
                      np.random.default_rng(52))


@pytest.mark.parametrize("how", ["numpy", "traced", "eager numpy", "eager sf"])
@pytest.mark.parametrize("spec", sorted(port.SPECS))
@pytest.mark.parametrize("name", sorted(port.INDEXES))
def test_integer_array_index(name, spec, how):
    port.check_index(name, cupy_mesh(4), port.SPECS[spec], how, np.random.default_rng(53))


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_a_combined_mask_gates_a_fused_where_in_every_float_dtype(dtype, graph):
    """(x > 0) & (y > 0) | ~(x < c): bool steps (never fused), read by where's halves, which fuse
    with the scale and the cast; any / all of the mask over the sharded axis (bool order keys)."""
    rng = np.random.default_rng(54)
    x, y = (lg.nonzero(rng, ew.SHAPE).astype(np_dtype(dtype)) for _ in range(2))
    mesh = cupy_mesh(4)

    def f(x, y):
        m = ((x > 0) & (y > 0)) | ~(x < 1.5) ^ (y > 1.9)
        return np.where(m, x * 2.0, y), m.any(0), m.all(0), np.ones_like(x) + np.zeros_like(y)
    got = sf.jit(f, mesh=mesh, graph=graph)(sf.shard(x, axis=0, mesh=mesh), y)
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    m = ((x64 > 0) & (y64 > 0)) | ~(x64 < 1.5) ^ (y64 > 1.9)
    want = (np.where(m, x64 * 2.0, y64), m.any(0), m.all(0), np.ones(ew.SHAPE))
    for k, (g, w) in enumerate(zip(got, want)):
        g = np.asarray(g.gather()).astype(np.float64 if k in (0, 3) else bool)
        np.testing.assert_allclose(g, w, rtol=ew.TOL[dtype], atol=ew.TOL[dtype], err_msg=f"output {k}")


@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_integer_bitwise_ops_in_a_graph(dtype):
    rng = np.random.default_rng(55)
    x, y = (rng.integers(-(1 << 30), 1 << 30, ew.SHAPE).astype(dtype) for _ in range(2))
    mesh = cupy_mesh(4)
    f = sf.jit(lambda a, b: ((a & b) | 0x0F0F, ~a ^ b, (a & 1).astype("bool").all(1)), mesh=mesh, graph=True)
    for _ in range(2):
        got = f(sf.shard(x, axis=1, mesh=mesh), y)
        for g, w in zip(got, ((x & y) | 0x0F0F, ~x ^ y, (x & 1).astype(bool).all(1))):
            np.testing.assert_array_equal(g.gather(), w)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_copies_constants_and_indexes_of_16_bit_values(dtype):
    rng = np.random.default_rng(56)
    x = lg.nonzero(rng, ew.SHAPE).astype(np_dtype(dtype))
    ids = np.array([3, -1, 0, 7])
    mesh = cupy_mesh(4)
    a = sf.shard(x, axis=0, mesh=mesh)
    for got, want in ((a.copy(), x), (np.full_like(a, 0.5), np.full_like(x, 0.5)), (a[ids], x[ids]),
                      (a[:, ids], x[:, ids]), (np.expand_dims(a, 1).squeeze(1), x), (a.ravel(), x.ravel())):
        assert got.dtype == want.dtype, (got.dtype, want.dtype)
        np.testing.assert_array_equal(np.asarray(got.gather()).astype(np.float64), want.astype(np.float64))


# ---- the user-port functions (tests/test_user_port.py) on the CuPy backend: np.linalg.norm,
# np.tril / triu, np.moveaxis, sf.linear, their gradients, cross_entropy(ignore_index=), item() ----
@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("name", sorted(up.CASES))
def test_user_port_functions(name, jit):
    up.check(name, sf.DeviceMesh(*up.DPTP, backend="cupy"), jit, np.random.default_rng(3))


@pytest.mark.parametrize("case", ["gradients of norm and tril", "cross_entropy ignore_index", "item"])
def test_user_port_cases(case):
    assert up.mesh_2d().backend_name == "cupy"  # (the default backend where CuPy sees a GPU)
    {"gradients of norm and tril": up.test_gradients_of_norm_and_tril,
     "cross_entropy ignore_index": lambda: up.test_cross_entropy_ignore_index_is_torchs(True),
     "item": up.test_item_of_a_loss}[case]()
