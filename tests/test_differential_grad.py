"""The differential property test for gradients (issue 32 item 6): random programs of
tests/test_differential.py (annotations, ops, matmuls, reshapes, moves between meshes, on 1-D
and 2-D meshes), each differentiated by sf.grad with respect to every input and checked against
float64 central differences of the same source run as plain NumPy (annotations as identities).

The contract, per program of float64 inputs:

  EITHER  lowering the gradient refuses with a clear, deliberate error (as the forward's net),
  OR      for two random directions v, the sum over inputs of <grad_k, v_k> equals the central
          difference of the NumPy reference along v (relative 1e-6), no gradient element is
          unwritten (poisoned NaN), and each gradient has its input's layout.

As the forward's test, it fails when too few programs ran (the net cannot pass vacuously).
"""
from __future__ import annotations

from collections import Counter

import numpy as np
from hypothesis import assume, event, given, note
from hypothesis import strategies as st

import shardfuse as sf
import test_differential as td

MIN_RAN = 0.6
STATS: dict = {}
EPS = 1e-6


def _loss(fn, n, mesh):
    def loss(*args):
        xs, rs = args[:n], args[n:]
        outs = td.as_tuple(fn(*xs))
        total = None
        for o, r in zip(outs, rs):  # (an output on a sub-mesh moves to the mesh: that move is differentiated too)
            term = (sf.to_mesh(o, mesh) * r).sum()
            total = term if total is None else total + term
        return total
    loss.__name__ = "loss"
    return loss


def run_gradient(prog: td.Prog, seed: int, stats: Counter):
    src = prog.source()
    note(prog.repro(seed))
    subs = {f"S{k}": m for k, m in enumerate(td.SUBS[prog.mesh_key])}
    ns_sf, ns_np = {"sf": sf, "np": np, **subs}, {"sf": td.NumpySF, "np": np, **subs}
    exec(src, ns_sf)
    exec(src, ns_np)
    fn, ref_fn = ns_sf["f"], ns_np["f"]
    inputs = prog.make_inputs(seed)
    rng = np.random.default_rng(seed + 7)
    try:
        with np.errstate(all="ignore"):
            outs = td.as_tuple(ref_fn(*inputs))
    except Exception:  # noqa: BLE001 (NumPy rejects it: the forward's net checks the refusal)
        assume(False)
    assume(all(np.all(np.isfinite(o)) and np.abs(o).max(initial=0) < 1e6 for o in outs))
    rs = [rng.standard_normal(np.shape(o)) for o in outs]

    def ref_loss(xs):
        with np.errstate(all="ignore"):
            return sum(float(np.sum(np.asarray(o, np.float64) * r)) for o, r in zip(td.as_tuple(ref_fn(*xs)), rs))

    n = len(inputs)
    try:  # a program whose forward is refused is the forward net's business (tests/test_differential.py)
        sf.jit(fn, mesh=prog.mesh, streams=prog.streams).lower(*[a.spec if isinstance(a, sf.Array) else
                                                                 sf.TensorSpec(np.shape(a), "float64")
                                                                 for a in prog.place(inputs)])
    except Exception:  # noqa: BLE001
        stats["forward refused"] += 1
        return
    grad = sf.jit(sf.grad(_loss(fn, n, prog.mesh), argnums=tuple(range(n))), mesh=prog.mesh, streams=prog.streams)
    args = prog.place(inputs) + rs
    specs = [a.spec if isinstance(a, sf.Array) else sf.TensorSpec(np.shape(a), "float64") for a in args]
    try:
        plan = grad.lower(*specs)
    except Exception as e:  # noqa: BLE001
        if not td.deliberate(e):
            raise AssertionError(f"lowering the gradient raised {type(e).__name__}, not a clear refusal: {e}") from e
        stats["refused"] += 1
        stats[f"refused: {td.category(e)}"] += 1
        event(f"gradient refused: {td.category(e)}")
        return
    td.check_lives_apart(plan.program)  # no slab holds two values live at once (passes/reuse.py)
    grads = td.as_tuple(grad(*args))
    stats["ran"] += 1
    event("gradient ran")
    for k, (g, a) in enumerate(zip(grads, args)):
        got = np.asarray(g.gather(), np.float64)
        assert got.shape == inputs[k].shape, f"gradient {k}: shape {got.shape}, its input's {inputs[k].shape}"
        assert np.all(np.isfinite(got)), f"gradient {k}: unwritten (poisoned) elements"
        if isinstance(a, sf.Array):
            assert g.sharding == a.sharding, \
                f"gradient {k}: layout {g.sharding}, its input's {a.sharding}"
    for _ in range(2):
        vs = [rng.standard_normal(x.shape) for x in inputs]
        hi = ref_loss([x + EPS * v for x, v in zip(inputs, vs)])
        lo = ref_loss([x - EPS * v for x, v in zip(inputs, vs)])
        numeric = (hi - lo) / (2 * EPS)
        terms = [np.asarray(g.gather(), np.float64) * v for g, v in zip(grads, vs)]
        analytic = float(sum(t.sum() for t in terms))
        scale = 1 + sum(float(np.abs(t).sum()) for t in terms)
        assert abs(numeric - analytic) <= 1e-6 * scale, \
            f"directional derivative {analytic!r}, central difference {numeric!r} (scale {scale:.3g})"


def _drive(prop, name):
    stats = STATS[name] = Counter()
    prop()
    total = stats["ran"] + stats["refused"]
    summary = "".join(f"\n  {v:5d}  {k}" for k, v in stats.most_common() if k.startswith("refused:"))
    print(f"\n[{name}] {total} gradients: {stats['ran']} ran, {stats['refused']} refused{summary} "
          f"({stats['forward refused']} programs whose forward is refused left out)")
    assert total > 0, "no program got as far as shardfuse"
    assert stats["ran"] / total >= MIN_RAN, f"only {stats['ran']} of {total} gradients ran: {summary}"


def _program(data, meshes, kinds, first):
    mesh_key, streams, _, seed = td.common_draws(data, meshes)
    g = td.Gen(data, mesh_key, "float64", streams)
    prog = first(g, kinds)
    return prog, seed


@td.PROFILE
@given(data=st.data())
def _matmul_gradients(data):
    def first(g, kinds):
        x = g.maybe_annotate(g.new_input(g.shape(g.pick([2, 3]))), 50)
        return g.body(g.matmul(x), kinds, g.draw(st.integers(0, 4), label="steps"))
    prog, seed = _program(data, td.ALL_MESHES, ["annotate", "matmul", "unary", "binary", "reduce", "transpose"],
                          first)
    run_gradient(prog, seed, STATS["matmul"])


@td.PROFILE
@given(data=st.data())
def _mixed_gradients(data):
    def first(g, kinds):
        x = g.new_input(g.shape(g.pick([2, 3, 1])))
        return g.body(x, kinds, g.draw(st.integers(1, 6), label="steps"), branch=20, two_outputs=20)
    prog, seed = _program(data, td.ALL_MESHES, list(td.Gen.STEPS) + ["annotate", "matmul"], first)
    run_gradient(prog, seed, STATS["mixed"])


def test_matmul_chain_gradients():
    _drive(_matmul_gradients, "matmul")


def test_mixed_program_gradients():
    _drive(_mixed_gradients, "mixed")


@td.PROFILE
@given(data=st.data())
def _moves_gradients(data):
    """Values moved between the mesh and its sub-meshes: each move's cotangent moves back."""
    def first(g, kinds):
        x = g.new_input(g.shape(g.pick([2, 3])), placed=g.chance(70))
        return g.body(g.move(g.maybe_annotate(x, 50)), kinds, g.draw(st.integers(0, 5), label="steps"), branch=10)
    prog, seed = _program(data, ["2x2", "4", "2x4", "2"],
                          ["move", "annotate", "unary", "reshape", "move", "matmul", "binary", "reduce", "transpose"],
                          first)
    run_gradient(prog, seed, STATS["moves"])


def test_moves_between_meshes_gradients():
    _drive(_moves_gradients, "moves")
