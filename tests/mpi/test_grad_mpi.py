"""sf.grad under mpiexec (the checks of tests/test_grad.py on the NumPy-over-MPI backend): a
gradient per kind of op against central differences with inputs replicated and sharded, the MLP
block's gradients against NumPy's analytic ones (tensor and sequence parallel; data parallel on
the 2x2 mesh, where under -n 2 each process' two devices lie in two dp teams), gradients in their
primals' layouts, keyword arguments (never differentiated), sf.vjp outside jit, sf.checkpoint and sf.custom_vjp (nondiff_argnums too),
closed-over values through checkpoint and a traced cond / switch, and JAX's tie rule of max / min over sharded axes.  Every rank runs every test in the same order, with the same seeds."""
from __future__ import annotations

import numpy as np
import pytest

import test_grad as tg
import test_grad_keywords as tk

KINDS = ["1d", "2d"]
OPS = ["gelu", "log", "where", "mul broadcast", "max first keepdims", "mean", "reshape", "transpose",
       "matmul batch @ 2-D", "softmax", "layer_norm", "attention", "take vocab-parallel", "take repeated ids",
       "scatter_add"]
CASES = [(name, kind, p) for name in OPS for kind in KINDS for p in tg.PLACEMENTS[kind]]


@pytest.mark.parametrize("name, kind, placement", CASES, ids=[f"{n}-{k}-{p}" for n, k, p in CASES])
def test_gradient_against_central_differences(name, kind, placement):
    tg.check_case(name, tg.mesh_of(kind), placement, tg.seed_of(name, kind, placement))


@pytest.mark.parametrize("mode", ["sp", "tp"])
def test_mlp_block_gradients_exact(mode):
    tg.check_mlp(tg.mesh_of("1d"), mode, 2, np.random.default_rng(3))


def test_mlp_block_gradients_data_parallel():
    tg.check_mlp(tg.mesh_of("2d"), "sp", 2, np.random.default_rng(4), dp="dp")


def test_gradient_has_its_primals_layout():
    tg.test_gradient_has_its_primals_layout()


@pytest.mark.parametrize("kind", KINDS)
def test_keywords_are_passed_and_never_differentiated(kind):
    tk.test_keywords_outside_jit_are_passed_and_never_differentiated(kind)


def test_keywords_inside_jit():
    tk.test_keywords_inside_jit()
    tk.test_a_keyword_holding_the_primal_is_a_constant()


def test_vjp_inside_and_outside_jit():
    tg.test_vjp_inside_and_outside_jit()


def test_grad_outside_jit_on_sf_arrays_and_of_a_jitted_function():
    tg.test_grad_outside_jit_on_sf_arrays_and_of_a_jitted_function()


@pytest.mark.parametrize("config", ["tp", "sp", "dp x sp"])
def test_transformer_layer_gradients(config):
    import test_transformer as tt

    tt.test_layer_gradients_against_central_differences(config)


@pytest.mark.parametrize("config", ["tp", "sp", "dp x sp"])
def test_gpt_loss_and_gradients(config):
    import test_transformer as tt

    tt.test_gpt_loss_and_gradients(config)


def test_gpt_sgd_steps_with_donated_parameters():
    import test_transformer as tt

    tt.test_gpt_sgd_steps_with_donated_parameters_lower_the_loss()


def test_tokens_over_dp_and_tp():
    import test_dp_tp_propagation as t

    t.test_tokens_over_dp_and_tp_communicate_over_tp_only()


@pytest.mark.parametrize("kind, kw", [("1d", {"tp": "tp", "sp": True, "chunks": 2}),
                                      ("2d", {"tp": "tp", "sp": True, "chunks": 2, "dp": "dp"})])
def test_checkpointed_gpt_gradients_are_the_same_numbers(kind, kw):
    import test_checkpoint as tc
    tc.test_gradients_are_the_same_numbers(kind, kw)


@pytest.mark.parametrize("kind, axes", [("1d", ("tp", None)), ("2d", ("dp", "tp"))])
def test_custom_vjp_rule_is_what_grad_uses(kind, axes):
    import test_custom_vjp as tcv
    tcv.test_the_rule_is_what_grad_uses(kind, axes)


@pytest.mark.parametrize("where", ["jit", "outside jit"])
def test_custom_vjp_nondiff_argnums(where):
    import test_custom_vjp as tcv
    tcv.test_nondiff_callable_and_scale_gradients_against_central_differences(np.tanh, 0.5, where)
    tcv.test_nondiff_numpy_array_gets_no_cotangent_and_a_traced_one_is_refused()
    tcv.test_nondiff_in_the_middle_with_pytrees()


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_checkpoint_differentiates_the_values_it_closes_over(jit):
    import test_checkpoint as tc
    tc.test_values_the_function_closes_over_get_their_gradient(jit)


def test_cond_and_switch_take_the_selected_branchs_gradient_for_closures_too():
    import test_lax as tl
    tl.test_values_the_branches_close_over_get_the_selected_branchs_gradient_only()
    tl.test_a_switch_of_one_branch_with_a_traced_index()


def test_custom_vjp_closures_refused_only_where_a_gradient_reaches_them():
    import test_custom_vjp as tcv
    tcv.test_a_rule_closing_over_a_value_being_differentiated_is_refused()
    tcv.test_closing_over_values_no_gradient_reaches_is_fine()


@pytest.mark.parametrize("kind", ["max", "min"])
def test_ties_over_several_sharded_axes_share_the_gradient(kind):
    import shardfuse as sf
    import test_extrema as te
    mesh = tg.mesh_of("2d")
    x = np.random.default_rng(51).integers(-2, 2, (4, 6)).astype(np.float64)  # (ties everywhere)
    for axis in (None, (0, 1)):
        g = sf.jit(sf.grad(lambda v: getattr(v, kind)(axis) * 3.0), mesh=mesh)(sf.distribute(x, mesh, ("dp", "tp")))
        np.testing.assert_allclose(np.asarray(g.gather()), 3.0 * te.tie_share(x, kind, axis, True), rtol=1e-14)
