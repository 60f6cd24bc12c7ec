"""passes/fuse.py's FusedSum on the CuPy backend (run on the GPU machine by `pytest -m gpu`): each
step is one generated cupy.ReductionKernel (backends/cuda/fused.py), the chain evaluated per
element with every node rounded to its dtype, summed in float32 (float64 for float64) and scaled
there.  tests/test_fused_sum.py's cases (keepdims, broadcast operands, a mean's scale, a first
axis, a sharded summed axis, softmax's and layer_norm's backward) in float32, float16, bfloat16
and float64, against the unfused plan (SHARDFUSE_FUSE=0: the chain written, then the backend's
sum) and against float64 NumPy; long rows (seq 2048: many threads per row) and graph capture too.
Buffers are poisoned (conftest): an unwritten element fails.  Written on a machine without a GPU:
the kernels' sources were compiled with NVRTC 13.5 for sm_90 there, never run."""
from __future__ import annotations

import numpy as np
import pytest

from cases import gpu_count

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_count() == 0, reason="CuPy sees no GPU")]

import shardfuse as sf  # noqa: E402
import test_fused_sum as tfs  # noqa: E402
from shardfuse.ops import Op  # noqa: E402

DTYPES = ["float32", "float16", "bfloat16", "float64"]
# relative (norm) error: about 3x the worst NumPy's fused steps showed against float64 over 20 seeds
TOL = {"float64": 1e-13, "float32": 2e-6, "float16": 3e-3, "bfloat16": 2e-2}
_MESHES: dict = {}


def cupy_mesh(d):
    """One CuPy mesh of d devices per size (virtual devices of one GPU where there is one)."""
    if d not in _MESHES:
        _MESHES[d] = sf.DeviceMesh((d,), ("tp",), backend="cupy")
    return _MESHES[d]


def rel(got, want) -> float:
    """The relative error of got in the 2-norm, in float64."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def check(fn, args, mesh, dtype, seed, monkeypatch, **jit):
    """fn fused on the GPU: a FusedSum in its plan, every element written, near the unfused plan's
    result and float64 NumPy's."""
    monkeypatch.setenv("SHARDFUSE_FUSE", "1")
    fused = sf.jit(fn, mesh=mesh, **jit)
    plan = fused.lower(*args)
    assert any(tfs.summed(i) for i in plan.program.instrs), plan  # (a FusedSum, or a row group summing)
    got = tfs.leaves(fused(*args))
    monkeypatch.setenv("SHARDFUSE_FUSE", "0")
    want = tfs.leaves(sf.jit(fn, mesh=mesh, **jit)(*args))
    ref = tfs.leaves(sf.jit(fn, mesh=tfs.MESH)(*[np.asarray(a, np.float64) for a in args]))
    for g, w, r in zip(got, want, ref):
        assert np.all(np.isfinite(g.astype(np.float64))), f"seed {seed}: unwritten (poisoned) elements"
        assert rel(g, w) <= TOL[dtype], f"seed {seed}: {rel(g, w):.2e} from the unfused plan ({dtype})"
        assert rel(g, r) <= TOL[dtype], f"seed {seed}: {rel(g, r):.2e} from float64 NumPy ({dtype})"


@pytest.mark.parametrize("d", [1, 4])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", tfs.CASES)
def test_fused_sums_against_the_unfused_plan_and_float64(name, dtype, d, monkeypatch):
    fn, make = tfs.CASES[name]
    r, seed = tfs.fresh_rng()
    check(fn, make(r, dtype), cupy_mesh(d), dtype, seed, monkeypatch)


@pytest.mark.parametrize("dtype", DTYPES)
def test_long_rows_softmax_backward_means_and_one_operand(dtype, monkeypatch):
    """Rows of 2048 (the layer's attention rows): a block of threads shares each row's sum.  With
    one operand over the contiguous last axis CuPy takes its CUB path, which renames the kernel's
    parameters in its expressions (backends/cuda/fused.py): x * x summed, a layer norm's means."""
    r, seed = tfs.fresh_rng()
    x, g = tfs.randn(r, (16, 2048), dtype), tfs.randn(r, (16, 2048), dtype)
    one = cupy_mesh(1)
    check(tfs.CASES["softmax backward, rows sharded"][0], (x, g), one, dtype, seed, monkeypatch)
    check(lambda x, g: ((x - g) * (x + 1.0)).mean(-1, keepdims=True), (x, g), one, dtype, seed, monkeypatch)
    check(lambda x: (x * x).sum(-1), (x,), one, dtype, seed, monkeypatch)
    check(lambda x: sf.nn.layer_norm(x, None, None), (x,), one, dtype, seed, monkeypatch)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_sums_in_a_captured_graph(dtype, monkeypatch):
    """graph=True: the reduction kernel is captured (no temporaries: CuPy's own kernel, no CUB)."""
    r, seed = tfs.fresh_rng()
    fn, make = tfs.CASES["softmax backward, rows sharded"]
    check(fn, make(r, dtype), cupy_mesh(4), dtype, seed, monkeypatch, graph=True)
