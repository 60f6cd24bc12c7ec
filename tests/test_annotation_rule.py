"""One annotation rule inside and outside sf.jit (issue 30, item 3; README, "Layout rule").

An annotation restates, for the tensor axis it names, the mesh axes that shard it; a mesh axis
shards at most one tensor axis, so naming it on another axis moves it there; every other axis
keeps its sharding; sf.stream only schedules.  Each case applies the same annotations to an
sf.Array outside jit, one call at a time, and as one chain inside a jitted function, and checks
that both give the same placements and NumPy's values.  `rule_case` runs under mpiexec too
(tests/mpi/test_cases_mpi.py).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import shardfuse as sf

R, S = sf.Replicate(), sf.Shard


def _apply(x, steps, mesh=None):
    """The annotations in `steps` on x: ("shard", axis, over) or ("replicate",).  Outside jit
    (mesh given) the first one places the NumPy array on mesh."""
    for n, (kind, *args) in enumerate(steps):
        place = {"mesh": mesh} if mesh is not None and n == 0 else {}
        x = sf.shard(x, args[0], over=args[1], **place) if kind == "shard" else sf.replicate(x, **place)
    return x


# (mesh shape, axis names, global shape, annotations, the placements they leave)
CASES = {
    "move dp from axis 0 to axis 1": ((2, 2), ("dp", "tp"), (4, 4), [("shard", 0, "dp"), ("shard", 1, "dp")],
                                      (S(1), R)),
    "(dp, tp) -> dp, no + 0.0": ((2, 2), ("dp", "tp"), (8, 4), [("shard", 0, ("dp", "tp")), ("shard", 0, "dp")],
                                 (S(0), R)),
    "other axes keep their sharding": ((2, 2), ("dp", "tp"), (4, 4), [("shard", 0, "dp"), ("shard", 1, "tp")],
                                       (S(0), S(1))),
    "tp moves off a tuple": ((2, 2), ("dp", "tp"), (8, 4), [("shard", 0, ("dp", "tp")), ("shard", 1, "tp")],
                             (S(0), S(1))),
    "the named axis is restated": ((2, 2), ("dp", "tp"), (4, 4), [("shard", 0, "dp"), ("shard", 0, "tp")], (R, S(0))),
    "inner-first tuple, dp moves": ((2, 2), ("dp", "tp"), (8, 4), [("shard", 0, ("tp", "dp")), ("shard", 1, "dp")],
                                    (S(1), S(0))),
    "a tuple takes both": ((2, 2), ("dp", "tp"), (4, 8), [("shard", 0, "dp"), ("shard", 1, ("tp", "dp"))],
                           (sf.StridedShard(1, split_factor=2), S(1))),  # (tp outermost: DTensor's _StridedShard)
    "a tuple in mesh order": ((2, 2), ("dp", "tp"), (4, 8), [("shard", 0, "tp"), ("shard", 1, ("dp", "tp"))],
                              (S(1), S(1))),
    "replicate restarts": ((2, 2), ("dp", "tp"), (4, 4),
                           [("shard", 0, "dp"), ("shard", 1, "tp"), ("replicate",), ("shard", 1, "dp")], (S(1), R)),
    "3-D over 2-D": ((2, 2), ("dp", "tp"), (2, 4, 6), [("shard", 0, "dp"), ("shard", 2, "tp"), ("shard", 1, "dp")],
                     (S(1), S(2))),
    "1-D: move": ((4,), ("DIDx",), (4, 8), [("shard", 0, "DIDx"), ("shard", 1, "DIDx")], (S(1),)),
    "1-D: same axis twice": ((4,), ("DIDx",), (4, 8), [("shard", 0, "DIDx"), ("shard", 0, "DIDx")], (S(0),)),
    "1-D: 3-D value": ((4,), ("DIDx",), (4, 4, 8), [("shard", 1, "DIDx"), ("shard", 2, "DIDx")], (S(2),)),
}


def rule_case(name, backend=None):
    """One case, outside jit and inside (on x and on x * 2.0, an op's result): same placements,
    NumPy's values."""
    shape, names, gshape, steps, want = CASES[name]
    mesh = sf.DeviceMesh(shape, names, **({"backend": backend} if backend else {}))
    x = np.arange(np.prod(gshape), dtype=np.float64).reshape(gshape)
    outside = _apply(x, steps, mesh)
    inside = sf.jit(lambda v: _apply(v, steps), mesh=mesh)(x)
    of_an_op = sf.jit(lambda v: _apply(v * 2.0, steps), mesh=mesh)(x)
    assert outside.placements == inside.placements == of_an_op.placements == want, \
        (name, outside.placements, inside.placements, of_an_op.placements)
    np.testing.assert_array_equal(outside.gather(), x)
    np.testing.assert_array_equal(inside.gather(), x)
    np.testing.assert_array_equal(of_an_op.gather(), 2.0 * x)


@pytest.mark.parametrize("name", sorted(CASES))
def test_inside_and_outside_jit_agree(name):
    rule_case(name, "numpy")


def test_a_jitted_function_states_its_layouts_whatever_its_arguments_arrive_in():
    """The first annotation inside jit starts from replicated; an argument's layout decides only
    the communication (outside jit the array's layout is what earlier annotations stated)."""
    mesh = sf.DeviceMesh((2, 2), ("dp", "tp"), backend="numpy")
    x = np.arange(32.0).reshape(8, 4)
    f = sf.jit(lambda v: sf.shard(v, 1, over="tp"), mesh=mesh)
    for arrives in (x, sf.shard(x, 0, over=("dp", "tp"), mesh=mesh), sf.distribute(x, mesh, ("tp", "dp"))):
        out = f(arrives)
        assert out.placements == (R, S(1))
        np.testing.assert_array_equal(out.gather(), x)


def test_a_move_is_one_annotation_in_the_plan():
    """(dp, tp) -> dp inside jit: one set, lowered to one Allgather over tp (the `+ 0.0` the move
    used to need is gone)."""
    mesh = sf.DeviceMesh((2, 2), ("dp", "tp"), backend="numpy")
    f = sf.jit(lambda v: sf.shard(sf.shard(v * 2.0, 0, over=("dp", "tp")) * 3.0, 0, over="dp"), mesh=mesh)
    g = sf.jit(lambda v: sf.shard(sf.shard(v * 2.0, 0, over=("dp", "tp")), 0, over="dp") * 3.0, mesh=mesh)
    x = np.arange(32.0).reshape(8, 4)
    for h in (f, g):
        np.testing.assert_array_equal(h(x).gather(), 6.0 * x)
    assert f.lower(x).collectives() == {"allgather": 1}


def test_a_placement_moves_a_streamed_axis_sharding_and_keeps_the_schedule():
    mesh = sf.DeviceMesh(4, backend="numpy")
    x, w = np.arange(64.0).reshape(8, 8), np.eye(8)
    f = sf.jit(lambda a, b: sf.shard(sf.stream(sf.shard(a @ b, 0), 0, chunks=2), 1), mesh=mesh)
    text = str(f.lower(x, w))
    assert "-> (c: f64[8, 8:DIDx])" in text and "For i in range(2):" in text, text  # DIDx on axis 1, 2 chunks
    out = f(x, w)
    assert out.placements == (S(1),)
    np.testing.assert_array_equal(out.gather(), x @ w)


def test_placements_without_mesh_put_a_chain_on_the_whole_mesh():
    """Each placement annotation in a chain says where the value lives: mesh= a sub-mesh, or the
    whole mesh without it (a chain that moved stayed on its first sub-mesh, or was refused)."""
    mesh = sf.DeviceMesh(4, backend="numpy")
    s0, s1 = mesh.submesh([0, 1]), mesh.submesh([2, 3])
    x = np.arange(32.0).reshape(4, 8)
    whole = sf.jit(lambda v: sf.shard(sf.shard(v, 0, mesh=s0), 1), mesh=mesh)(x)
    assert whole.sharding.mesh is None and whole.placements == (S(1),)
    on_s1 = sf.jit(lambda v: sf.shard(sf.shard(v, 0, mesh=s0), 1, mesh=s1), mesh=mesh)(x)
    assert on_s1.sharding.mesh == s1 and on_s1.sharding.axes == (None, "DIDx")
    for out in (whole, on_s1):
        np.testing.assert_array_equal(out.gather(), x)


def test_over_defaults_to_the_mesh_last_axis_on_named_meshes():
    """From a new-user probe: sf.shard without over= on a ("dp", "tp") mesh said "unknown mesh axis
    'DIDx'", a name the user never wrote; the default is the mesh's last axis, as DIDx is on an
    unnamed mesh."""
    m = sf.DeviceMesh((2, 2), ("dp", "tp"))
    x = np.random.default_rng(0).standard_normal((4, 4))
    assert sf.shard(x, axis=0, mesh=m).sharding.axes == ("tp", None)
    out = sf.jit(lambda x: sf.shard(x, axis=1) * 2.0, mesh=m)(x)
    assert out.sharding.axes == (None, "tp")
    np.testing.assert_array_equal(out.gather(), 2 * x)


def test_indexing_inside_jit_says_what_to_write():  # (basic indexing runs: tests/test_slicing.py)
    m = sf.DeviceMesh(2)
    with pytest.raises(TypeError, match=r"indexing x \(shape \(4, 4\), float64\) with a boolean mask .* "
                                        r"sf.where\(mask, x, 0\)"):
        sf.jit(lambda x: x[np.array([True, False, True, True])], mesh=m)(np.ones((4, 4)))


def test_an_annotated_cast_of_a_weight_places_the_weight_and_its_gradient():
    """x @ sf.shard(w.astype(bfloat16), axis=1, over="tp") with w a float32 master weight (a probe's
    first version): w arrives sharded as its copy is, and its gradient stays so (no Allgather; it was
    replicated, with the gradient gathered, and every Adam moment replicated after it)."""
    mesh = sf.DeviceMesh((2,), ("tp",), backend="numpy")
    r = np.random.default_rng()
    x, w = r.standard_normal((8, 16)).astype(np.float32), r.standard_normal((16, 32)).astype(np.float32)

    def loss(w, x):
        return (x.astype("bfloat16") @ sf.shard(w.astype("bfloat16"), axis=1, over="tp")).astype(np.float32).sum()
    fn = sf.jit(sf.grad(loss), mesh=mesh)
    plan = fn.lower(w, x)
    assert plan.input_layouts[0].axes == (None, "tp") and plan.output_layouts.axes == (None, "tp"), plan
    assert plan.collectives() == {}, plan
    xb = x.astype(ml_dtypes.bfloat16).astype(np.float64)
    np.testing.assert_allclose(np.asarray(fn(w, x)), np.repeat(xb.sum(0)[:, None], 32, 1), rtol=2 ** -7)


def test_a_cast_of_a_cast_places_the_weight_and_its_gradient_alike():
    """w.astype(float16).astype(bfloat16) annotated over tp: the input arrives sharded and its gradient
    leaves sharded (the gradient's layout looked through one cast only: replicated, and gathered)."""
    mesh = sf.DeviceMesh((2,), ("tp",), backend="numpy")
    r = np.random.default_rng()
    x, w = r.standard_normal((8, 16)).astype(np.float32), r.standard_normal((16, 32)).astype(np.float32)

    def loss(w, x):
        wb = sf.shard(w.astype("float16").astype("bfloat16"), axis=1, over="tp")
        return (x.astype("bfloat16") @ wb).astype(np.float32).sum()
    plan = sf.jit(sf.grad(loss), mesh=mesh).lower(w, x)
    assert plan.input_layouts[0].axes == (None, "tp") and plan.output_layouts.axes == (None, "tp"), plan
    assert plan.collectives() == {}, plan
