"""A call's results never alias its arguments, nor each other: writing an argument or another
result afterwards leaves them be."""
import numpy as np
import pytest

import shardfuse as sf


@pytest.mark.parametrize("fn, ref", [
    (lambda x: x, lambda x: x),
    (lambda x: sf.shard(x, axis=0), lambda x: x),   # a local shard slice of a replicated input
    (lambda x: x.T, lambda x: x.T),
    (lambda x: x.reshape(4, 16), lambda x: x.reshape(4, 16)),
])
@pytest.mark.parametrize("placed", [False, True])
def test_results_do_not_alias_arguments(fn, ref, placed):
    mesh = sf.DeviceMesh(4, backend="numpy")
    X = np.random.default_rng().standard_normal((8, 8))
    want = ref(X).copy()
    arg = sf.replicate(X.copy(), mesh=mesh) if placed else X
    out = sf.jit(fn, mesh=mesh)(arg)
    if placed:
        for s in arg.shards:
            s[...] = 7.0
    else:
        X[...] = 7.0
    np.testing.assert_array_equal(out.gather(), want)


def test_the_copy_is_in_the_printed_plan():
    mesh = sf.DeviceMesh(2, backend="numpy")
    plan = sf.jit(lambda x: x.T, mesh=mesh).lower(sf.TensorSpec((4, 6), "float64"))
    assert str(plan).splitlines()[-3:] == [
        "  x_t_copy = Allocate f64[6, 4]  (per call)",
        "  Copy x_t_copy <- x_t",
        "  return x_t_copy",
    ]


@pytest.mark.parametrize("d", [1, 4])
def test_results_do_not_alias_each_other(d):
    """`return y, y, y.T`: one value returned thrice is three buffers (the later two copies), so
    writing one result's piece (to_local gives it) leaves the others be."""
    mesh = sf.DeviceMesh(d, backend="numpy")
    X = np.random.default_rng().standard_normal((8, 8))
    f = sf.jit(lambda x: (lambda y: (y, y, y.T))(x * 2.0), mesh=mesh)
    a, b, c = f(X)
    for s in a.shards:
        s[...] = 7.0
    np.testing.assert_array_equal(b.gather(), 2 * X)
    np.testing.assert_array_equal(c.gather(), 2 * X.T)
    assert str(f.lower(X)).count("Copy") == 2
