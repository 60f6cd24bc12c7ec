"""A new user porting from NumPy / JAX (probe): the array methods that map onto shardfuse's ops
(x.any / all / ravel / flatten / squeeze / copy / dot, sf.Array.size), a NumPy method shardfuse lacks
saying what there is instead; integer-array indexing as np.take (x[ids], x[:, ids], x[..., ids] with
a NumPy, traced or sf.Array index, inside sf.jit and out); NumPy's functions on an sf.Array outside
jit returning sharded sf.Arrays where shardfuse has the op (np.transpose, np.reshape, np.expand_dims,
np.ones_like, np.dot, ...) and refused otherwise, never silently gathered; and the wording of two
refusals.  Against NumPy in float64 on fresh random non-zero inputs.

The case bodies (METHODS, INDEXES, check_method, check_index) are shared with
tests/test_gpu_numpy_port.py and tests/mpi/test_logical_mpi.py.
"""
from __future__ import annotations

import numpy as np
import pytest

import shardfuse as sf
import test_elementwise_ops as ew


def nonzero(rng, shape):
    return rng.uniform(0.25, 2.0, shape) * rng.choice([-1.0, 1.0], shape)


# name -> (fn(x) on a traced value or an sf.Array, its NumPy reference); x: ew.SHAPE (8, 12)
METHODS = {
    "x.any()": (lambda x: (x > 1.8).any(), lambda x: (x > 1.8).any()),
    "x.all(1)": (lambda x: (x > -1.8).all(1), lambda x: (x > -1.8).all(1)),
    "x.ravel()": (lambda x: x.ravel(), lambda x: x.ravel()),
    "x.flatten() * 2": (lambda x: x.flatten() * 2, lambda x: x.flatten() * 2),
    "x[:, None].squeeze()": (lambda x: x[:, None].squeeze(), lambda x: x[:, None].squeeze()),
    "x[None, :, None].squeeze(0)": (lambda x: x[None, :, None].squeeze(0), lambda x: x[None, :, None].squeeze(0)),
    "x.copy()": (lambda x: x.copy(), lambda x: x.copy()),
    "x.dot(x.T)": (lambda x: x.dot(x.T), lambda x: x.dot(x.T)),
    "x[0].dot(x[1])": (lambda x: x[0].dot(x[1]), lambda x: x[0].dot(x[1])),
    "x * x.size": (lambda x: x * x.size, lambda x: x * x.size),
    "np.transpose axes": (lambda x: np.transpose(x, (1, 0)), lambda x: np.transpose(x, (1, 0))),
    "np.reshape": (lambda x: np.reshape(x, (4, 24)), lambda x: np.reshape(x, (4, 24))),
    "np.expand_dims": (lambda x: np.expand_dims(x, 0), lambda x: np.expand_dims(x, 0)),
    "np.expand_dims -1": (lambda x: np.expand_dims(x, -1), lambda x: np.expand_dims(x, -1)),
    "np.squeeze": (lambda x: np.squeeze(np.expand_dims(x, 1)), lambda x: np.squeeze(np.expand_dims(x, 1))),
    "np.ravel": (lambda x: np.ravel(x), lambda x: np.ravel(x)),
    "np.ones_like": (lambda x: np.ones_like(x), lambda x: np.ones_like(x)),
    "np.zeros_like int32": (lambda x: np.zeros_like(x, dtype=np.int32), lambda x: np.zeros_like(x, dtype=np.int32)),
    "np.full_like": (lambda x: np.full_like(x, -1.5) + x, lambda x: np.full_like(x, -1.5) + x),
    "np.copy": (lambda x: np.copy(x), lambda x: np.copy(x)),
    "np.dot 1-D": (lambda x: np.dot(x[:, 0], x[:, 1]), lambda x: np.dot(x[:, 0], x[:, 1])),
    "np.dot 2-D 1-D": (lambda x: np.dot(x, x[0]), lambda x: np.dot(x, x[0])),
    "np.any": (lambda x: np.any(x > 1.5, axis=0), lambda x: np.any(x > 1.5, axis=0)),
}


def check_method(name, mesh, spec, jit, rng):
    """METHODS[name] on x placed with spec (a spec per axis), in sf.jit or outside: an sf.Array with
    NumPy's values and dtype."""
    fn, ref = METHODS[name]
    x = nonzero(rng, ew.SHAPE)
    xa = sf.distribute(x, mesh, spec)
    got = sf.jit(fn, mesh=mesh)(xa) if jit else fn(xa)
    want = np.asarray(ref(x))
    assert isinstance(got, sf.Array), (name, type(got))
    assert got.dtype == want.dtype, (name, got.dtype, want.dtype)
    ew.compare(got.gather(), want, "float64", name)


SPECS = {"R": (None, None), "S0": ("DIDx", None), "S1": (None, "DIDx")}


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("spec", sorted(SPECS))
@pytest.mark.parametrize("name", sorted(METHODS))
def test_method(name, spec, jit):
    check_method(name, ew.mesh_of(4), SPECS[spec], jit, np.random.default_rng(31))


def test_numpy_functions_on_an_sf_array_keep_it_sharded():
    """Outside jit, as the methods: np.transpose of an S(0) array is S(1), np.ones_like keeps S(0),
    np.reshape / np.expand_dims keep the rows sharded; none of them communicates."""
    mesh = ew.mesh_of(4)
    a = sf.shard(nonzero(np.random.default_rng(32), ew.SHAPE), axis=0, mesh=mesh)
    assert np.transpose(a).placements == (sf.Shard(1),)
    assert np.transpose(a, (1, 0)).placements == (sf.Shard(1),)
    for f in (np.ones_like, np.zeros_like, np.copy, lambda v: np.full_like(v, 2), lambda v: np.reshape(v, (8, 3, 4))):
        assert f(a).placements == (sf.Shard(0),), f
    assert np.expand_dims(a, -1).placements == (sf.Shard(0),)
    assert np.shape(a) == (8, 12) and np.ndim(a) == 2 and np.size(a) == 96 and a.size == 96


@pytest.mark.parametrize("fn, name", [
    (lambda a: np.kron(a, a), "np.kron"), (lambda a: np.bincount(a[0].astype("int64")), "np.bincount"),
    (lambda a: np.convolve(a[0], a[1]), "np.convolve"), (lambda a: np.linalg.det(a), "np.linalg.det"),
    (lambda a: np.unique(a), "np.unique"), (lambda a: np.partition(a, 2), "np.partition"),
])
def test_numpy_functions_shardfuse_lacks_are_refused_never_gathered(fn, name):
    a = sf.shard(nonzero(np.random.default_rng(33), ew.SHAPE), axis=0, mesh=ew.mesh_of(4))
    with pytest.raises(TypeError, match=rf"^{name} is not supported on sf.Arrays: .*the README's list.*; for "
                                        rf"NumPy's result on the global value write {name}\(np.asarray\(x\), ...\)"):
        fn(a)


def test_a_tests_comparisons_read_the_global_values():
    """A DTensor-port probe: np.allclose(sf_array, ref) was refused with a list of every supported function;
    np.allclose / array_equal / array_equiv / isclose compare the gathered values, as of jax.Arrays."""
    x = nonzero(np.random.default_rng(), ew.SHAPE)
    a = sf.shard(x, axis=0, mesh=ew.mesh_of(4))
    assert np.allclose(a, x) and np.array_equal(a, x) and np.array_equiv(x, a) and not np.allclose(a, x + 1)
    assert np.isclose(a, x).all() and isinstance(np.isclose(a, x), np.ndarray)


def test_explicit_conversions_still_gather():
    x = nonzero(np.random.default_rng(34), ew.SHAPE)
    a = sf.shard(x, axis=0, mesh=ew.mesh_of(4))
    for got in (np.asarray(a), np.array(a), np.asarray(a, dtype=np.float32), a.gather(), np.cumprod(np.asarray(a))):
        assert type(got) is np.ndarray
    np.testing.assert_array_equal(np.asarray(a), x)
    np.testing.assert_array_equal(np.linalg.norm(a.gather()), np.linalg.norm(x))


def test_a_copy_survives_the_donation_of_its_original():
    mesh = ew.mesh_of(4)
    x = nonzero(np.random.default_rng(35), ew.SHAPE)
    a = sf.shard(x, axis=0, mesh=mesh) * 1.0  # (a plan's result: donatable)
    b, c = a.copy(), np.copy(a)
    out = sf.jit(lambda v: v * 2.0, mesh=mesh, donate_argnums=0)(a)
    np.testing.assert_array_equal(out.gather(), 2 * x)
    np.testing.assert_array_equal(b.gather(), x)
    np.testing.assert_array_equal(c.gather(), x)


def test_numpy_methods_shardfuse_lacks_say_what_there_is():
    mesh = ew.mesh_of(4)
    a = sf.shard(nonzero(np.random.default_rng(36), ew.SHAPE), axis=0, mesh=mesh)
    with pytest.raises(AttributeError, match=r"'Array' object has no attribute 'nonzero': NumPy's x.nonzero "
                                             r"is not supported on sf.Arrays; .*np.asarray\(x\).nonzero .*Supported: "
                                             r".*any / all"):
        a.nonzero()
    with pytest.raises(AttributeError, match=r"'Traced' object has no attribute 'nonzero': .*inside sf.jit.*Supported"):
        sf.jit(lambda v: v.nonzero(), mesh=mesh)(a)
    with pytest.raises(AttributeError, match=r"^'Array' object has no attribute 'no_such_thing'$"):
        a.no_such_thing  # noqa: B018 (not NumPy's: Python's own error)
    with pytest.raises(AttributeError, match=r"lives in host memory"):  # (a property's own AttributeError kept)
        a.__cuda_array_interface__  # noqa: B018
    assert not hasattr(a, "one_op_of_nothing") and hasattr(a, "one_op")


# name -> (fn(x, ids) with a NumPy / traced / sf.Array index, NumPy's, ids shape, the indexed axis); x: (8, 12)
INDEXES = {
    "x[ids]": (lambda x, i: x[i], lambda x, i: x[i], (5,), 0),
    "x[ids 2-D]": (lambda x, i: x[i], lambda x, i: x[i], (2, 3), 0),
    "x[:, ids]": (lambda x, i: x[:, i], lambda x, i: x[:, i], (7,), 1),
    "x[..., ids]": (lambda x, i: x[..., i], lambda x, i: x[..., i], (3,), 1),
    "x[2:6, ids]": (lambda x, i: x[2:6, i], lambda x, i: x[2:6, i], (4,), 1),
    "x[ids, ::2]": (lambda x, i: x[i, ::2], lambda x, i: x[i, ::2], (4,), 0),
    "x[ids 0-d]": (lambda x, i: x[i], lambda x, i: x[i], (), 0),
}


def ids_for(rng, name, dtype="int64"):
    """Valid ids (negative ones too: from the end, as NumPy's) along the case's indexed axis."""
    _, _, shape, axis = INDEXES[name]
    n = ew.SHAPE[axis]
    return rng.integers(-n, n, shape).astype(dtype)


def check_index(name, mesh, spec, how, rng):
    """INDEXES[name]: ids a NumPy constant inside jit ("numpy"), a traced argument ("traced"), or
    outside jit a NumPy array ("eager numpy") or an sf.Array ("eager sf")."""
    fn, ref, _, _ = INDEXES[name]
    x, ids = nonzero(rng, ew.SHAPE), ids_for(rng, name)
    xa = sf.distribute(x, mesh, spec)
    if how == "numpy":
        got = sf.jit(lambda v: fn(v, ids), mesh=mesh)(xa)
    elif how == "traced":
        got = sf.jit(fn, mesh=mesh)(xa, ids)
    else:
        got = fn(xa, ids if how == "eager numpy" else sf.replicate(ids, mesh=mesh))
    assert isinstance(got, sf.Array), (name, how, type(got))
    np.testing.assert_array_equal(got.gather(), ref(x, ids), err_msg=f"{name} {how}")


@pytest.mark.parametrize("how", ["numpy", "traced", "eager numpy", "eager sf"])
@pytest.mark.parametrize("spec", sorted(SPECS))
@pytest.mark.parametrize("name", sorted(INDEXES))
def test_integer_array_index(name, spec, how):
    check_index(name, ew.mesh_of(4), SPECS[spec], how, np.random.default_rng(37))


def test_the_gradient_of_an_integer_array_index_is_a_scatter_add():
    rng = np.random.default_rng(38)
    x, w = nonzero(rng, ew.SHAPE), nonzero(rng, (8, 5))
    ids = np.array([3, -1, 3, 0, 7])

    def loss(x, w):
        return ((x[:, ids] * w) ** 2).sum()
    g = sf.jit(sf.grad(loss), mesh=ew.mesh_of(4))(sf.shard(x, axis=1, mesh=ew.mesh_of(4)), w)
    want = np.zeros_like(x)
    np.add.at(want.T, ids, (2 * x[:, ids] * w * w).T)
    np.testing.assert_allclose(g.gather(), want, rtol=1e-12)
    eps, d = 1e-6, rng.standard_normal(x.shape)
    central = (loss(x + eps * d, w) - loss(x - eps * d, w)) / (2 * eps)
    np.testing.assert_allclose((g.gather() * d).sum(), central, rtol=1e-6)


def test_several_index_arrays_and_ints_index_as_numpys():
    """A serving probe: x[np.arange(B), lens - 1] (each sequence's last token) was refused, though
    x.at[...].get() computes it: NumPy's advanced indexing, the arrays broadcast together, inside sf.jit
    (NumPy and traced ids) and on sf.Arrays."""
    mesh, r = ew.mesh_of(4), np.random.default_rng()
    x = r.standard_normal((3, 5, 8))
    rows, last = np.arange(3), r.integers(0, 5, 3)
    cols = r.integers(0, 8, (2, 1))  # (broadcast against the rows: [2, 3] ids)
    for index in (lambda i: (rows, i), lambda i: (1, i), lambda i: (rows, slice(None), (i + cols) % 8),
                  lambda i: (i[:, None] % 3, i)):
        want = x[index(last)]
        np.testing.assert_array_equal(np.asarray(sf.jit(lambda v, i: v[index(i)], mesh=mesh)(x, last)), want)
        np.testing.assert_array_equal(np.asarray(sf.jit(lambda v: v[index(last)], mesh=mesh)(x)), want)
        np.testing.assert_array_equal(np.asarray(sf.shard(x, axis=2, mesh=mesh)[index(last)]), want)
    for bad in ((3, last), (-4, last), (Ellipsis, last, 8)):  # (a review: an int beside arrays clamped; NumPy raises)
        with pytest.raises(IndexError, match="out of bounds for axis"):
            sf.jit(lambda v: v[bad], mesh=mesh)(x)
    with pytest.raises(TypeError, match=r"indexing .*a boolean mask .* write sf.where\(mask, x, 0\)"):
        sf.jit(lambda v: v[0, v[0, 0] > 0], mesh=mesh)(x)  # (a read's advice, not .at's write advice)


@pytest.mark.parametrize("index, error, message", [
    (lambda i: (i, slice(1, None), i), TypeError, r"alone or beside slices and '...' .*x.at\[...\].get\(\)'s\), not "
     r"beside None or a partial slice; index in two steps .*sf.take\(x, ids, axis=...\)"),
    (lambda i: (None, i), TypeError, r"not beside None"),
    (lambda i: i > 0, TypeError, r"with a boolean mask .*sf.where\(mask, x, 0\)"),
    (lambda i: [0, 1], TypeError, r"write a list of indices as an array, np.array"),
    (lambda i: (slice(None), slice(None), i), IndexError, r"too many indices"),
    (lambda i: i.astype("float64"), TypeError, r"ids must be an integer array"),
])
def test_index_refusals_say_what_is_supported(index, error, message):
    mesh, x, ids = ew.mesh_of(4), np.ones(ew.SHAPE), np.array([0, 3])
    with pytest.raises(error, match=message):  # a NumPy index inside jit
        sf.jit(lambda v: v[index(ids)], mesh=mesh)(x)
    if not isinstance(index(ids), list):
        with pytest.raises(error, match=message):  # a traced one
            sf.jit(lambda v, i: v[index(i)], mesh=mesh)(x, ids)
    with pytest.raises(error, match=message):  # outside jit
        sf.replicate(x, mesh=mesh)[index(ids)]
    with pytest.raises(TypeError) as e:  # (outside jit the message speaks of no traced value)
        sf.replicate(x, mesh=mesh)[1.5]
    assert "traced" not in str(e.value), e.value


def test_a_traced_int_used_as_a_shape_says_to_make_it_static():
    mesh, x = ew.mesh_of(4), np.ones(ew.SHAPE)
    with pytest.raises(TypeError, match=r"an extent must be an int, got Traced\(n: i64\[\] \?\) \(Traced\); a Python "
                                        r"int passed to a jitted function is traced .*static_argnums=.*static_argnames="):
        sf.jit(lambda v, n: v.reshape(n, -1), mesh=mesh)(x, 4)
    np.testing.assert_array_equal(sf.jit(lambda v, n: v.reshape(n, -1), mesh=mesh, static_argnums=1)(x, 4).gather(),
                                  x.reshape(4, -1))


def test_x_to_an_array_power_runs_on_both_sides_of_jit():
    """x ** y of two arrays is NumPy's power (a negative base with an integral exponent too); two integer
    arrays are refused, worded alike inside and outside jit."""
    mesh, x = ew.mesh_of(4), nonzero(np.random.default_rng(39), ew.SHAPE)
    y = np.round(x * 2)
    np.testing.assert_allclose(np.asarray(sf.jit(lambda v, w: v ** w, mesh=mesh)(x, y)), x ** y, rtol=1e-15)
    a = sf.shard(x, axis=0, mesh=mesh)
    np.testing.assert_allclose(np.asarray(np.abs(a) ** a), np.abs(x) ** x, rtol=1e-15)
    message = r"^x \*\* y of .*int64\) and the array .*: shardfuse's power of two arrays is of floats"
    with pytest.raises(TypeError, match=message):
        sf.jit(lambda v: v ** v, mesh=mesh)(y.astype(np.int64))
    with pytest.raises(TypeError, match=message):
        a.astype("int64") ** a.astype("int64")


@pytest.mark.parametrize("shift, axis", [(1, 0), (-2, 1), (3, None), ((1, 2), (0, 2)), (9, -1), (0, 1), (2, (1, 2))])
def test_roll_as_numpys(shift, axis):
    """np.roll (a review: a fori_loop over np.roll of its carry met "np.roll is not supported"): two slices
    joined, inside sf.jit with the rolled axis sharded and on sf.Arrays; its gradient rolls back."""
    mesh, r = sf.DeviceMesh((2, 2), ("dp", "tp"), backend="numpy"), np.random.default_rng()
    x = r.standard_normal((4, 6, 8))
    got = sf.jit(lambda x: np.roll(sf.shard(x, axis=2, over="tp"), shift, axis), mesh=mesh)(x)
    np.testing.assert_array_equal(np.asarray(got), np.roll(x, shift, axis))
    np.testing.assert_array_equal(np.asarray(np.roll(sf.shard(x, axis=1, over="dp", mesh=mesh), shift, axis)),
                                  np.roll(x, shift, axis))
    w = r.standard_normal(x.shape)
    g = sf.jit(sf.grad(lambda x: (np.roll(x, shift, axis) * w).sum()), mesh=mesh)(x)
    back = np.roll(w, tuple(-np.asarray(shift)) if isinstance(shift, tuple) else -shift, axis)
    np.testing.assert_array_equal(np.asarray(g), back)


def test_a_0_d_arrays_format_spec_and_comparisons_with_keywords():
    """f"{loss:.4f}" raised (no __format__: an MPI probe's training-log line); np.isclose(x, b=A) with an
    sf.Array keyword recursed (a review)."""
    mesh = ew.mesh_of(4)
    x = np.arange(8.0)
    a = sf.shard(x, axis=0, mesh=mesh)
    loss = (a * 0.5).sum()
    assert f"{loss:.4f}" == "14.0000" and f"{loss}" == "14.0" and "14." in repr(loss)  # (NumPy's 0-d array's)
    with pytest.raises(TypeError, match=r"a spec formats a 0-d value every process holds, got shape \(8,\)"):
        f"{a:.2f}"
    assert np.isclose(x, b=a).all() and np.allclose(a, b=x)
