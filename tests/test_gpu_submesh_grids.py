"""Pipeline stages of several mesh axes (pp x dp x tp) on the CuPy backend: tests/test_submesh_grids.py's
bodies on 8 virtual devices of the GPU(s) there are (each stage a (2, 2) grid, its buffers on its own
devices), values and gradients against float64 NumPy.  Skipped where CuPy is missing or sees no GPU."""
from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy", reason="CuPy is not installed")

from cases import gpu_count  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_count() == 0, reason="CuPy sees no GPU")]

import shardfuse as sf  # noqa: E402
import test_submesh_grids as grids  # noqa: E402


@pytest.fixture
def mesh():
    return sf.DeviceMesh((2, 2, 2), ("pp", "dp", "tp"), backend="cupy")


@pytest.mark.parametrize("cut", sorted(grids.CUTS))
def test_a_value_cut_on_two_axes_moves_between_stages(mesh, cut):
    grids.test_a_value_cut_on_two_axes_moves_between_stages(mesh, cut, np.random.default_rng(21))


def test_a_dp_tp_stage_feeds_a_one_axis_stage_and_back(mesh):
    grids.test_a_dp_tp_stage_feeds_a_one_axis_stage_and_back(mesh, np.random.default_rng(22))


def test_adamw_over_a_pp_dp_tp_pipeline(mesh):
    grids.test_adamw_over_a_pp_dp_tp_pipeline(mesh, np.random.default_rng(23))


def test_an_embeddings_gradient_comes_back_by_its_rows(mesh):
    grids.test_an_embeddings_gradient_comes_back_by_its_rows(mesh, np.random.default_rng(24))
