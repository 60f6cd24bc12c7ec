"""sf.grad / sf.value_and_grad take keyword arguments, as JAX's do (a new user's Llama port:
`sf.value_and_grad(loss)(params, ids=i, targets=t)` raised "_Grad.__call__() got an unexpected
keyword argument 'ids'").  Keywords are passed to the function and never differentiated; argnums
index the positional arguments, so a parameter in argnums given by keyword is refused with JAX's
TypeError.  Gradients against float64 central differences and a closed form, inside sf.jit and
outside it, on a 1-D and a 2-D mesh."""
from __future__ import annotations

import numpy as np
import pytest

import shardfuse as sf
from cases import central_differences
from test_nn import mesh_of

RNG = np.random.default_rng(23)
W, X, T = RNG.standard_normal((6, 4)), RNG.standard_normal((8, 6)), RNG.standard_normal((8, 4))


def loss(w, x, t, scale=1.0):
    return (((x @ w) - t) ** 2).sum() * scale


def closed_form(w, x, t, scale=1.0):  # d loss / d w
    return 2.0 * scale * x.T @ (x @ w - t)


def tanh_loss(w, *, x, heads):  # keyword-only parameters; heads must stay a Python int (a shape)
    assert type(heads) is int, type(heads)
    return (np.tanh(x @ w).reshape((heads, 32 // heads)) ** 2).sum()


def np_tanh_loss(w, x, heads):
    return float((np.tanh(x @ w).reshape((heads, 32 // heads)) ** 2).sum())


@pytest.mark.parametrize("kind", ["1d", "2d"])
def test_keywords_outside_jit_are_passed_and_never_differentiated(kind):
    mesh = mesh_of(kind)
    w = sf.replicate(W, mesh=mesh)
    value, g = sf.value_and_grad(loss)(w, x=sf.shard(X, axis=0, over=mesh.axis_names[0], mesh=mesh), t=T)
    np.testing.assert_allclose(float(value), loss(W, X, T), rtol=1e-12)
    np.testing.assert_allclose(np.asarray(g), closed_form(W, X, T), rtol=1e-12)
    assert g.sharding == w.sharding
    g2 = sf.grad(loss)(w, X, t=T, scale=2.5)  # a Python float by keyword: a Python value
    np.testing.assert_allclose(np.asarray(g2), closed_form(W, X, T, 2.5), rtol=1e-12)
    for heads in (2, 4):  # keyword-only parameters; a Python int stays one (one plan per value)
        got = sf.grad(tanh_loss)(w, x=X, heads=heads)
        want = central_differences(lambda v: np_tanh_loss(v, X, heads), W)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-7, atol=1e-9)


def test_argnums_index_positional_arguments_only():
    mesh = mesh_of("1d")
    w, x = sf.replicate(W, mesh=mesh), sf.replicate(X, mesh=mesh)
    gw, gx = sf.grad(loss, argnums=(0, 1))(w, x, t=T, scale=0.5)
    np.testing.assert_allclose(np.asarray(gw), closed_form(W, X, T, 0.5), rtol=1e-12)
    np.testing.assert_allclose(np.asarray(gx), 2.0 * 0.5 * (X @ W - T) @ W.T, rtol=1e-12)


def test_keywords_inside_jit():
    mesh = mesh_of("2d")

    def step(w, x, t):
        value, g = sf.value_and_grad(loss)(w, x=sf.shard(x, axis=0, over="dp"), t=t, scale=3.0)
        (v2, aux), g2 = sf.value_and_grad(lambda w, *, x, t: (loss(w, x, t), x.sum()), has_aux=True)(w, x=x, t=t)
        return value, g, g2, aux
    value, g, g2, aux = sf.jit(step, mesh=mesh)(W, X, T)
    np.testing.assert_allclose(float(value), 3.0 * loss(W, X, T), rtol=1e-12)
    np.testing.assert_allclose(np.asarray(g), closed_form(W, X, T, 3.0), rtol=1e-12)
    np.testing.assert_allclose(np.asarray(g2), closed_form(W, X, T), rtol=1e-12)
    np.testing.assert_allclose(float(aux), X.sum(), rtol=1e-12)
    # sf.jit of the gradient function binds keywords as Python does (here: x and t positionally)
    v3, g3 = sf.jit(sf.value_and_grad(loss), mesh=mesh)(W, x=X, t=T)
    np.testing.assert_allclose(np.asarray(g3), closed_form(W, X, T), rtol=1e-12)
    g4 = sf.jit(lambda w: sf.grad(tanh_loss)(w, x=X * 1.0, heads=4), mesh=mesh)(W)
    np.testing.assert_allclose(np.asarray(g4), central_differences(lambda v: np_tanh_loss(v, X, 4), W),
                               rtol=1e-7, atol=1e-9)


def test_a_keyword_holding_the_primal_is_a_constant():
    """grad of f(x, y=x) differentiates x only (y is held constant), as JAX's closes over y."""
    mesh = mesh_of("1d")

    def f(x, y):
        return (x * y).sum()
    xs = sf.replicate(X, mesh=mesh)
    np.testing.assert_allclose(np.asarray(sf.grad(f)(xs, y=xs)), X, rtol=1e-15)
    np.testing.assert_allclose(np.asarray(sf.jit(lambda x: sf.grad(f)(x, y=x), mesh=mesh)(X)), X, rtol=1e-15)


JAX_MESSAGE = r"requires at least 1 positional arguments to be passed by the caller, but got only 0"


def test_a_differentiated_parameter_given_by_keyword_is_refused():
    mesh = mesh_of("1d")
    w = sf.replicate(W, mesh=mesh)
    with pytest.raises(TypeError, match=JAX_MESSAGE + r".*w given by keyword: pass it positionally") as e:
        sf.value_and_grad(loss)(w=w, x=X, t=T)
    assert "_Grad" not in str(e.value)
    with pytest.raises(TypeError, match=JAX_MESSAGE):  # inside a traced function
        sf.jit(lambda w, x, t: sf.grad(loss)(w=w, x=x, t=t), mesh=mesh)(W, X, T)
    with pytest.raises(TypeError, match=r"grad_loss\(\): 'w' parameter is positional only"):  # sf.jit binding it
        sf.jit(sf.grad(loss), mesh=mesh)(w=W, x=X, t=T)
    with pytest.raises(TypeError, match=r"requires at least 2 positional arguments.*x given by keyword"):
        sf.grad(loss, argnums=1)(w, x=X, t=T)


def test_a_wrong_call_says_what_python_says():
    mesh = mesh_of("1d")
    w = sf.replicate(W, mesh=mesh)
    with pytest.raises(TypeError, match=r"^grad_loss\(\): multiple values for argument 'x'$"):
        sf.grad(loss)(w, X, T, x=X)
    with pytest.raises(TypeError, match=r"^grad_loss\(\): got an unexpected keyword argument 'ids'$"):
        sf.grad(loss)(w, X, T, ids=X)
    assert repr(sf.value_and_grad(loss, argnums=(0, 1))) == "sf.value_and_grad(loss, argnums=(0, 1))"


def test_python_numbers_returned_come_back_as_0d_arrays():
    """A jitted function (or has_aux's aux) returning a Python or NumPy number gives a 0-d array of
    it, as JAX returns one (a learning rate reported beside the loss)."""
    mesh = sf.DeviceMesh(2, backend="numpy")
    x = np.random.default_rng(5).standard_normal((4, 2))
    total, lr, step, flag = sf.jit(lambda x: (sf.shard(x, 0).sum(), 0.1, 3, np.float32(2.5)), mesh=mesh)(x)
    np.testing.assert_allclose(float(total), x.sum(), rtol=1e-13)
    assert (float(lr), int(step), float(flag)) == (0.1, 3, 2.5)
    assert (lr.dtype_name, step.dtype_name, flag.dtype_name) == ("float64", "int64", "float32")
    f = sf.jit(sf.value_and_grad(lambda x: ((sf.shard(x, 0) ** 2).sum(), {"lr": 0.1}), has_aux=True), mesh=mesh)
    (value, aux), g = f(x)
    assert float(aux["lr"]) == 0.1
    np.testing.assert_allclose(g.gather(), 2 * x, rtol=1e-13)
