"""NumPy's functions built as compositions (shardfuse/numpy_compose.py, numpy_stats.py) on the CuPy
backend: the bodies of tests/test_numpy_compose.py (every case on every layout, jit and eager; NumPy's
dtypes in float16, bfloat16, float32, int32 and bool; gradients against finite differences) on 1, 4 and
2 x 2 devices (virtual devices sharing a GPU where there are fewer).  Skipped, with one line saying
why, where CuPy is missing or sees no GPU."""
from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("SHARDFUSE_POISON", "1")

cupy = pytest.importorskip("cupy", reason="CuPy is not installed")

from cases import gpu_count  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_count() == 0, reason="CuPy sees no GPU")]

import test_elementwise_ops as ew  # noqa: E402
import test_numpy_compose as nc  # noqa: E402
from test_einsum import LAYOUTS  # noqa: E402


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", sorted(nc.CASES))
def test_against_numpy_on_every_layout(name, layout, jit):
    mesh_shape, spec_of = LAYOUTS[layout]
    nc.check(name, ew.mesh_of(mesh_shape, "cupy"), spec_of, jit, np.random.default_rng(61))


@pytest.mark.parametrize("dtype", nc.DTYPES)
@pytest.mark.parametrize("name", sorted(nc.DTYPE_CASES))
def test_numpys_result_dtypes(name, dtype):
    nc.check_dtype_or_refusal(name, dtype, ew.mesh_of(4, "cupy"))


@pytest.mark.parametrize("name", sorted(nc.GRADIENTS))
def test_gradients_against_finite_differences(name):
    nc.check_gradient(name, ew.mesh_of(4, "cupy"), np.random.default_rng(62))
