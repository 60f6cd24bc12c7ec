"""An sf.Array a jitted function closes over is a constant input of the program with its own
layout (JAX captures closed-over arrays as constants): no gather where its layout fits, ops on it
inside the function traced, gradients held constant through it.  A new-user probe found
`W = sf.replicate(w, mesh=mesh); sf.jit(lambda x: x @ W, mesh=mesh)(x)` refused ("both operands
must be values of the traced function, got Array"), after `W * 2` in the body had run eagerly
as a plan of its own.  `check_weights` runs on NumPy devices here and under mpiexec
(tests/mpi/test_replicated_mpi.py)."""
from __future__ import annotations

import numpy as np
import pytest

import shardfuse as sf
from shardfuse import array_ops

RNG = np.random.default_rng

LAYOUTS = {"replicated": None, "rows": 0, "columns": 1}


def place(w, mesh, axis):
    return sf.replicate(w, mesh=mesh) if axis is None else sf.shard(w, axis=axis, mesh=mesh)


def check_weights(mesh, rng, axis):
    """x @ W, ops on W inside the body, W beside a NumPy constant: against float64 NumPy."""
    x, w, b = rng.standard_normal((8, 4)), rng.standard_normal((4, 8)), rng.standard_normal(8)
    W = place(w, mesh, axis)

    def f(x):
        y = x @ W
        return y, x @ (W * 2) + np.exp(W).sum(axis=0) * b, sf.concatenate([W, W[:, :4].T @ W], axis=0)
    got = sf.jit(f, mesh=mesh)(x)
    want = (x @ w, x @ (w * 2) + np.exp(w).sum(axis=0) * b, np.concatenate([w, w[:, :4].T @ w], axis=0))
    for g, r in zip(got, want):
        np.testing.assert_allclose(g.gather(), r, rtol=1e-12, atol=1e-12)
    return got


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_closed_over_array_computes_as_numpy(layout):
    mesh = sf.DeviceMesh(4, backend="numpy")
    check_weights(mesh, RNG(), LAYOUTS[layout])


def test_its_layout_is_the_plans_input_and_nothing_gathers_it():
    """W column-sharded, x replicated: x @ W is each device's columns, no collective; W row-sharded
    beside x sharded on columns: local products and one Allreduce of the partial sums, no gather."""
    mesh = sf.DeviceMesh(4, backend="numpy")
    rng = RNG()
    x, w = rng.standard_normal((8, 4)), rng.standard_normal((4, 8))
    cols, rows = sf.shard(w, axis=1, mesh=mesh), sf.shard(w, axis=0, mesh=mesh)
    f = sf.jit(lambda x: x @ cols, mesh=mesh)
    plan = f.lower(x)
    assert plan.collectives() == {}, plan
    text = str(plan)
    assert "const: f64[4, 8:DIDx]" in text and "# constants: const (arrays captured when traced" in text, text
    out = f(x)
    assert out.placements == (sf.Shard(1),)
    np.testing.assert_allclose(out.gather(), x @ w, rtol=1e-12)
    g = sf.jit(lambda x: sf.shard(x, axis=1) @ rows, mesh=mesh)
    assert g.lower(x).collectives() == {"allreduce": 1}, g.lower(x)
    np.testing.assert_allclose(g(x).gather(), x @ w, rtol=1e-12)
    np.testing.assert_allclose(f(2 * x).gather(), 2 * x @ w, rtol=1e-12)  # (bound again at the next call)


def test_ops_on_it_inside_the_body_are_traced_not_run():
    mesh = sf.DeviceMesh(4, backend="numpy")
    rng = RNG()
    x, w = rng.standard_normal((8, 4)), rng.standard_normal((4, 8))
    W = sf.shard(w, axis=1, mesh=mesh)
    before = array_ops.cache_info()
    f = sf.jit(lambda x: x @ (W * 2) + np.tanh(W).T.sum(axis=1) - W[0], mesh=mesh)
    prog = f.trace(x)
    assert array_ops.cache_info() == before, "an op on W ran as a one-op plan while traced"
    assert {i.op for i in prog.instrs} >= {"scale", "matmul"}, prog
    np.testing.assert_allclose(f(x).gather(), x @ (w * 2) + np.tanh(w).T.sum(axis=1) - w[0], rtol=1e-12)
    assert array_ops.cache_info()["compiled"] == before["compiled"]
    np.testing.assert_allclose((W * 2).gather(), w * 2)  # outside jit: still a one-op plan of its own


def test_gradients_flow_through_it_to_the_arguments():
    mesh = sf.DeviceMesh(4, backend="numpy")
    rng = RNG()
    x, w = rng.standard_normal((8, 4)), rng.standard_normal((4, 8))
    W = sf.shard(w, axis=1, mesh=mesh)

    def ref(x):
        return float((np.tanh(x @ w) ** 2).sum())
    num = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        d = np.zeros_like(x)
        d[i] = 1e-6
        num[i] = (ref(x + d) - ref(x - d)) / 2e-6
    loss = lambda x: (np.tanh(x @ W) ** 2).sum()  # noqa: E731
    g_in_jit = sf.jit(sf.grad(loss), mesh=mesh)(x)
    value, g_outside = sf.value_and_grad(loss)(sf.replicate(x, mesh=mesh))
    for g in (g_in_jit, g_outside):
        np.testing.assert_allclose(g.gather(), num, rtol=1e-6, atol=1e-8)
    assert abs(float(value) - ref(x)) <= 1e-12 * abs(ref(x))


def test_inlined_calls_and_other_meshes():
    """A jitted function called inside another on a closed-over array takes it as a constant of
    the caller; an array on another mesh is refused, naming both."""
    mesh = sf.DeviceMesh(4, backend="numpy")
    rng = RNG()
    x, w = rng.standard_normal((8, 4)), rng.standard_normal((4, 4))
    W = sf.replicate(w, mesh=mesh)
    inner = sf.jit(lambda a, b: a @ b, mesh=mesh)
    np.testing.assert_allclose(sf.jit(lambda x: inner(x, W), mesh=mesh)(x).gather(), x @ w, rtol=1e-12)
    elsewhere = sf.replicate(w, mesh=sf.DeviceMesh(2, backend="numpy"))
    for f in (lambda x: x @ elsewhere, lambda x: elsewhere * 2 + x[:4]):
        with pytest.raises(ValueError, match=r"a function traced for DeviceMesh\(DIDx=4.* uses an sf.Array of shape "
                                             r"\(4, 4\) on DeviceMesh\(DIDx=2.*only on the program's mesh"):
            sf.jit(f, mesh=mesh)(x)
