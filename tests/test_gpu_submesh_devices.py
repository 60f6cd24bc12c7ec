"""A value on a sub-mesh is computed on its devices only, on the CuPy backend (issue 30, item 6;
tests/test_submesh_devices.py on NumPy devices): a two-stage pipeline on 4 virtual devices of the
GPU(s) there are, each stage's GEMM, Gelu, Sum and copies bound for its own devices (a subset of
a GPU's virtual devices: per-device calls, not the GPU's one batched GEMM), eager and graph,
against float64 NumPy; and the profile (CUDA events) shows each stage's steps on its devices.
Skipped where CuPy is missing or sees no GPU."""
from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy", reason="CuPy is not installed")

from cases import gpu_count  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_count() == 0, reason="CuPy sees no GPU")]

import shardfuse as sf  # noqa: E402
from shardfuse.dtypes import np_dtype  # noqa: E402
from shardfuse.ops import Op  # noqa: E402
from test_submesh_devices import (STAGE_STEPS, STAGES, compute_devices, each_stage_buffers_on_its_devices,  # noqa: E402
                                  fed_back_copies_no_placeholder, inputs, pipeline, reference)

TOL = {"float64": 1e-12, "float32": 2e-5, "float16": 5e-3, "bfloat16": 3e-2}


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("collective", [False, True], ids=["plain", "tensor-parallel-stage"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_each_stage_runs_on_its_devices(dtype, collective, graph):
    mesh = sf.DeviceMesh(4, backend="cupy")
    f = pipeline(mesh, collective, graph=graph)
    x, w0, w1 = (a.astype(np_dtype(dtype)) for a in inputs(np.random.default_rng(9)))
    exe = f.lower(x, w0, w1).executable
    stages = {s.devices for s in exe.steps if s.op in (Op.MATMUL, Op.GELU)}
    assert stages == set(STAGES)
    want = reference(*(a.astype(np.float64) for a in (x, w0, w1)), collective)
    for _ in range(2):
        got = np.asarray(f(x, w0, w1).gather()).astype(np.float64)
        assert np.all(np.isfinite(got)), "unwritten (poisoned) elements in the result"
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert err <= TOL[dtype], f"relative error {err:.2e}"


def test_the_profile_shows_each_stage_on_its_devices():
    mesh = sf.DeviceMesh(4, backend="cupy")
    x, w0, w1 = inputs(np.random.default_rng(10))
    plan = pipeline(mesh).lower(x, w0, w1)
    tl = plan.profile(x, w0, w1, repeat=2)
    assert compute_devices(tl) == STAGE_STEPS


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("collective", [False, True], ids=["plain", "tensor-parallel-stage"])
def test_each_stage_buffers_are_made_on_its_devices_only(collective, graph):
    """Backends' empty(devices=) on CuPy: a stage's buffers and results in one allocation per GPU for
    its virtual devices only, a one-element placeholder on the others; values against float64 NumPy."""
    made, m = each_stage_buffers_on_its_devices(sf.DeviceMesh(4, backend="cupy"), collective, graph=graph)
    assert made[0] == made[1] != made[2] == made[3] and max(made.values()) == m["persistent"]


def test_a_stage_result_fed_back_copies_no_placeholder(monkeypatch):
    fed_back_copies_no_placeholder(sf.DeviceMesh(4, backend="cupy"), monkeypatch)
