"""sf.jit(in_shardings=, out_shardings=): JAX's arguments, placing a jitted function's arguments and
results as sf.distribute does inside it (a Llama probe: `jit() got an unexpected keyword argument
'out_shardings'`)."""
from __future__ import annotations

import numpy as np
import pytest

import shardfuse as sf


def mesh():
    return sf.DeviceMesh((2, 2), ("dp", "tp"), backend="numpy")


def test_arguments_and_result_placed_as_stated():
    m = mesh()
    r = np.random.default_rng()
    x, w = r.standard_normal((8, 6)), r.standard_normal((6, 4))
    f = sf.jit(lambda x, w: x @ w, mesh=m, in_shardings=(("dp", None), (None, "tp")), out_shardings=("dp", "tp"))
    plan = f.lower(x, w)
    assert plan.collectives() == {}  # (x's rows over dp, w's columns over tp: the product needs nothing)
    out = f(x, w)
    assert out.placements == (sf.Shard(0), sf.Shard(1))
    np.testing.assert_allclose(np.asarray(out), x @ w, rtol=1e-13)
    plain = sf.jit(lambda x, w: x @ w, mesh=m)(x, w)
    assert plain.placements == (sf.Replicate(), sf.Replicate())


def test_pytrees_none_entries_decorator_and_gradients():
    m = mesh()
    r = np.random.default_rng()
    x, w = r.standard_normal((8, 6)), r.standard_normal((6, 4))

    @sf.jit(mesh=m, out_shardings={"a": ("dp", None), "b": None})
    def g(x):
        return {"a": x * 2.0, "b": x.sum()}
    o = g(x)
    assert o["a"].placements == (sf.Shard(0), sf.Replicate())
    np.testing.assert_allclose(np.asarray(o["b"]), x.sum(), rtol=1e-13)
    # an argument placed by in_shardings: its gradient lives there too (an annotation of the input)
    dw = sf.jit(sf.grad(lambda w, x: (x @ w).sum()), mesh=m, in_shardings=((None, "tp"), ("dp", None)))(w, x)
    assert dw.placements == (sf.Replicate(), sf.Shard(1))
    np.testing.assert_allclose(np.asarray(dw), x.sum(0)[:, None] * np.ones((1, 4)), rtol=1e-12, atol=1e-12)


def test_in_shardings_count_the_arguments_that_are_not_static_and_one_sharding_serves_all():
    """JAX's rules (a review): static arguments take no entry; arguments after the entries (given by
    keyword too) come as they are; one Layout or placements list places every argument; more
    entries than arguments, or something that is no sharding, is refused."""
    m = mesh()
    r = np.random.default_rng()
    x, w = r.standard_normal((8, 6)), r.standard_normal((6, 4))
    f = sf.jit(lambda x, scale, w: (x * scale) @ w, mesh=m, static_argnums=1, in_shardings=(("dp", None), None))
    assert f.lower(x, 2.0, w).input_layouts[0].axes == ("dp", None)
    np.testing.assert_allclose(np.asarray(f(x, 2.0, w)), 2.0 * x @ w, rtol=1e-13)
    g = sf.jit(lambda x, w: x @ w, mesh=m, in_shardings=(("dp", None),))
    np.testing.assert_allclose(np.asarray(g(x, w=w)), x @ w, rtol=1e-13)
    both = sf.jit(lambda a, b: a + b, mesh=m, in_shardings=[sf.Shard(0), sf.Replicate()])
    assert both.lower(x, x).input_layouts == (both.lower(x, x).input_layouts[0],) * 2
    assert both.lower(x, x).input_layouts[0].axes == ("dp", None)
    with pytest.raises(TypeError, match="in_shardings has 3 entries for 2 positional arguments"):
        sf.jit(lambda x, w: x @ w, mesh=m, in_shardings=(None, None, None))(x, w)
    with pytest.raises(TypeError, match="one entry per positional argument"):
        sf.jit(lambda x: x, mesh=m, in_shardings=sf.Shard(0))


def test_eval_shape_gives_each_results_spec_without_running():
    """sf.eval_shape (jax.eval_shape): shapes, dtypes and layouts in the result's structure, from
    arrays or specs, nothing run (an argument given only as a spec could not run)."""
    m = mesh()
    out = sf.eval_shape(lambda x, w: {"y": sf.shard(x, axis=0, over="dp") @ w, "n": x.sum()},
                        np.ones((8, 4), np.float32), sf.TensorSpec((4, 6), "float32"), mesh=m)
    assert out["y"].shape == (8, 6) and out["y"].dtype == "float32" and out["y"].layout.axes == ("dp", None)
    assert out["n"].shape == () and out["n"].dtype == "float32"
    assert sf.eval_shape(lambda x: x * 2, np.ones(3)).shape == (3,)
    assert sf.eval_shape(lambda s: s + 1, 0).weak  # (a Python scalar's result stays weak, as JAX's)
    step = sf.jit(lambda x, w: sf.shard(x, axis=0, over="dp") @ w, mesh=m)  # (a jitted function: its own mesh)
    assert sf.eval_shape(step, np.ones((8, 4)), w=np.ones((4, 2))).layout.axes == ("dp", None)
    assert step.lower(np.ones((8, 4)), w=np.ones((4, 2))).collectives() == {}  # (lower by keyword, as calls)


def test_a_pytree_of_shardings_may_be_a_prefix_with_none_subtrees():
    """JAX's prefix rule (a JAX-port probe): (params_specs, None) for an argument (params, opt_state)
    places the parameters and leaves the optimizer state as it comes; a mismatch names where."""
    from collections import namedtuple
    m = mesh()
    state = namedtuple("State", "count mu")
    arg = ({"w": np.ones((4, 4)), "b": np.ones(4)}, (state(np.int32(0), {"w": np.ones((4, 4))}),))
    placed = sf.distribute(arg, m, ({"w": (None, "tp"), "b": ("tp",)}, None))
    assert placed[0]["w"].placements == (sf.Replicate(), sf.Shard(1)) and type(placed[1][0]).__name__ == "State"
    f = sf.jit(lambda st, x: st[0]["w"] @ x + st[1][0].mu["w"] @ x, mesh=m,
               in_shardings=(({"w": (None, "tp"), "b": ("tp",)}, None), None))
    assert f.lower(arg, np.ones((4, 2))).input_layouts[0][0]["w"].axes == (None, "tp")
    np.testing.assert_allclose(np.asarray(f(arg, np.ones((4, 2)))), np.full((4, 2), 8.0))
    with pytest.raises(ValueError, match=r"placements at \[0\] have keys \['w'\], the value \['b', 'w'\]"):
        sf.distribute(arg, m, ({"w": (None, "tp")}, None))


def test_out_shardings_place_returned_numpy_arrays_and_lower_takes_static_keywords():
    """A review: jit(opt.init, out_shardings=...) refused the count's NumPy zeros once out_shardings placed
    it; lower(x, n=3) of a keyword-only static parameter was refused though the call took it."""
    from shardfuse import optim
    m = mesh()
    p, ps = {"w": np.ones((4, 4)), "b": np.ones(4)}, {"w": (None, "tp"), "b": ("tp",)}
    init = sf.jit(optim.adam(1e-3).init, mesh=m, in_shardings=(ps,),
                  out_shardings=(optim.ScaleByAdamState(count=(), mu=ps, nu=ps), optim.EmptyState()))
    state = init(p)
    assert int(state[0].count) == 0 and state[0].nu["w"].placements == (sf.Replicate(), sf.Shard(1))
    j = sf.jit(lambda x, *, n: x * n, mesh=m, static_argnames="n")
    np.testing.assert_array_equal(np.asarray(j(np.ones(4), n=3)), np.full(4, 3.0))
    assert j.lower(np.ones(4), n=3).collectives() == {} and sf.eval_shape(j, np.ones(4), n=3).shape == (4,)


def test_partition_spec_tells_a_spec_from_a_pytree_of_nones():
    """sf.P (JAX's PartitionSpec): `(None, None)` over a pair of arrays is two leaves as they come
    (JAX's reading; it replicated both), `sf.P(None, None)` one replicated spec; one P in
    in_shardings places every argument, as one JAX sharding does; P pickles and prints as itself."""
    import copy
    import pickle
    m = mesh()
    r = np.random.default_rng()
    x, y = r.standard_normal((8, 4)), r.standard_normal((8, 4))
    pair = (sf.shard(x, axis=0, over="dp", mesh=m), sf.shard(y, axis=1, over="tp", mesh=m))
    kept = sf.distribute(pair, m, (None, None))
    assert [v.placements for v in kept] == [v.placements for v in pair]
    whole = sf.distribute(pair, m, sf.P(None, None))
    assert [v.placements for v in whole] == [(sf.Replicate(), sf.Replicate())] * 2
    np.testing.assert_array_equal(np.asarray(whole[1]), y)
    f = sf.jit(lambda a, b: a + b, mesh=m, in_shardings=sf.P("dp", "tp"))
    assert f.lower(x, y).input_layouts[0].axes == ("dp", "tp") == f.lower(x, y).input_layouts[1].axes
    np.testing.assert_allclose(np.asarray(f(x, y)), x + y, rtol=1e-15)
    spec = sf.P(("dp", "tp"), None)
    assert repr(spec) == "P(('dp', 'tp'), None)" and spec == (("dp", "tp"), None)
    assert pickle.loads(pickle.dumps(spec)) == spec and type(copy.deepcopy(spec)) is sf.P
    assert sf.distribute(x, m, spec).placements == (sf.Shard(0), sf.Shard(0))


def test_a_tuple_of_partition_specs_is_one_per_leaf():
    """A review: (P('dp'), P('tp')) over a pair was read as one spec (('dp',), ('tp',)) for every leaf (each P
    a tuple of names); each P is a leaf's spec, as JAX's, in distribute and out_shardings alike."""
    m = mesh()
    a, b = np.ones((4, 4)), np.ones((4, 4))
    d = sf.distribute((a, b), m, (sf.P("dp"), sf.P("tp")))
    assert [v.sharding.axes for v in d] == [("dp", None), ("tp", None)]
    d = sf.distribute((a, b), m, (sf.P("dp"), None))
    assert d[0].sharding.axes == ("dp", None) and d[1] is b
    o = sf.jit(lambda x: (x * 2, x + 1), mesh=m, out_shardings=(sf.P("dp"), sf.P("tp")))(a)
    assert [v.sharding.axes for v in o] == [("dp", None), ("tp", None)]
    assert sf.distribute(a, m, (("dp", "tp"), None)).sharding.axes == (("dp", "tp"), None)  # (a plain tuple entry)


def test_a_plain_tuple_of_leaf_specs_over_a_pair_is_one_per_leaf():
    """A README probe: out_shardings=(None, ("dp", "tp")) for a function's two results placed both by one
    spec (None, ("dp", "tp")); a plain tuple of None and specs over a tuple of as many values is a pytree, as
    JAX reads it; a bare mesh axis name in it still makes it one spec for every leaf."""
    m = mesh()
    f = sf.jit(lambda x, y: (x * 2, y + 1), mesh=m, out_shardings=(None, ("dp", "tp")))
    a, b = f(np.ones((4, 4)), np.ones((4, 4)))
    assert a.sharding.axes == (None, None) and b.sharding.axes == ("dp", "tp")
    both = sf.distribute((np.ones((4, 4)), np.ones((4, 4))), m, ("dp", None))
    assert [v.sharding.axes for v in both] == [("dp", None), ("dp", None)]
