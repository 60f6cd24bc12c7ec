"""sf.random on GPUs: the draws of tests/test_random.py on CuPy meshes (one GPU, 1 and 4 virtual
devices, sharded either way), inside sf.jit and eagerly.  bits, randint, bernoulli and uniform on
[0, 1) are integer arithmetic and one exact scaling: the same bits as the host's.  The others round
floats through log / sqrt / cos (CUDA's, not NumPy's): within a few float32 ulps."""
from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy", reason="CuPy is not installed")

import shardfuse as sf  # noqa: E402
from cases import gpu_count  # noqa: E402
from test_random import DRAWS, KEY, annotated  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_count() == 0, reason="CuPy sees no GPU")]

EXACT = {"bits", "uniform", "uniform bf16", "bernoulli", "randint", "categorical", "dropout"}
MESHES = {"1 device": ((1,), ("tp",), (None, "tp")), "D4 S0": ((4,), ("tp",), ("tp", None)),
          "D4 S1": ((4,), ("tp",), (None, "tp")), "2x2 S1 S0": ((2, 2), ("dp", "tp"), ("tp", "dp"))}


def same(got, want, name):
    got = np.asarray(got)
    if want.dtype.name == "bfloat16":
        got, want = got.view(np.uint16), want.view(np.uint16)
    assert got.shape == want.shape
    if name in EXACT:
        assert got.tobytes() == want.tobytes(), f"{name}: {(got != want).sum()} of {got.size} elements differ"
    else:
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("where", sorted(MESHES))
@pytest.mark.parametrize("name", sorted(DRAWS))
def test_a_draw_on_gpus_is_the_hosts(name, where):
    shape, names, spec = MESHES[where]
    mesh = sf.DeviceMesh(shape, names, backend="cupy")
    want = np.asarray(DRAWS[name](KEY))
    got = sf.jit(lambda key: annotated(DRAWS[name](key), spec), mesh=mesh)(KEY)
    same(got.gather(), want, name)
    if where == "1 device":  # eagerly, on a key that lives on the mesh
        same(DRAWS[name](sf.random.key(1234, mesh=mesh)).gather(), want, name)
