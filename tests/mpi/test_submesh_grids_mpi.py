"""tests/test_submesh_grids.py's stages of dp x tp (a pp x dp x tp mesh of 8 devices) with each
stage on its own ranks: values cut on two axes moved between ranks, their gradients, AdamW."""
from __future__ import annotations

import numpy as np
import pytest

import shardfuse as sf
import test_submesh_grids as tg


@pytest.mark.parametrize("cut", sorted(tg.CUTS))
def test_moves_of_values_cut_on_two_axes_across_ranks(cut):
    tg.test_a_value_cut_on_two_axes_moves_between_stages(tg.pp_dp_tp(), cut, np.random.default_rng(11))


def test_one_axis_stage_and_adamw_across_ranks():
    tg.test_a_dp_tp_stage_feeds_a_one_axis_stage_and_back(tg.pp_dp_tp(), np.random.default_rng(12))
    tg.test_adamw_over_a_pp_dp_tp_pipeline(tg.pp_dp_tp(), np.random.default_rng(13))
    tg.test_the_cotangent_goes_back_to_the_stage_whatever_the_operands_order(tg.pp_dp_tp(), np.random.default_rng(14))
    tg.test_an_embeddings_gradient_comes_back_by_its_rows(tg.pp_dp_tp(), np.random.default_rng(15))
