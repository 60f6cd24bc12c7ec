"""np.sort, np.argsort and sf.top_k on the CuPy backend (run on the GPU machine by `pytest -m gpu`):
tests/test_sort.py's case bodies on virtual GPU devices, every layout and dtype (bfloat16 through
float32 scratch); CuPy's argsort is stable, as the order NumPy's kind="stable" gives; graph=True is
refused (CuPy's argsort allocates and synchronises its stream).  Written on a machine without a GPU (2026-12-06): not yet run on one."""
from __future__ import annotations

import numpy as np
import pytest

from cases import gpu_count

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_count() == 0, reason="CuPy sees no GPU")]

import test_elementwise_ops as ew  # noqa: E402
import test_sort as ts  # noqa: E402
from test_gpu_math_ops import cupy_mesh  # noqa: E402 (meshes of DIDx, DIDy)
from test_math_ops import INT_DTYPES  # noqa: E402


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("axis", [0, 1, None])
@pytest.mark.parametrize("layout", ts.LAYOUTS)
def test_sort_on_every_layout(layout, axis, jit):
    shape, spec, _ = ew.LAYOUTS[layout]
    ts.check_sort(cupy_mesh(shape), spec, "float64", axis, jit, np.random.default_rng())


@pytest.mark.parametrize("dtype", ew.DTYPES + INT_DTYPES)
def test_sort_and_top_k_in_every_dtype(dtype):
    ts.check_sort(cupy_mesh(4), ("DIDx", None), dtype, 1, True, np.random.default_rng())
    ts.check_sort(cupy_mesh(4), (None, "DIDx", None), dtype, 2, True, np.random.default_rng(), shape=(4, 8, 6))
    ts.check_top_k(cupy_mesh(4), dtype, np.random.default_rng())


def test_a_graph_is_refused_before_any_work():
    """cupy.argsort allocates and synchronises its stream, which a capture refuses: graph=True says so
    when the plan is bound, before anything runs."""
    with pytest.raises(NotImplementedError, match="do not run in a CUDA graph"):
        ts.check_sort(cupy_mesh(4), ("DIDx", None), "float32", 1, True, np.random.default_rng(), graph=True)
