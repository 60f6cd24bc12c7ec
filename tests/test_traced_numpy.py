"""Traced values say so (issue 30, item 4).

Python asking a traced value for its numbers (bool(), int(), float(), np.asarray, a loop) raises
sf.ConcretizationError naming the value and what to write instead; and every NumPy function or
ufunc that reaches a traced value either runs as the shardfuse op it names (NumPy's float64
values) or is refused with what to write: never a wrong value, never an ndarray made silently.
"""
from __future__ import annotations

import operator

import numpy as np
import pytest

import shardfuse as sf
from shardfuse.traced import NUMPY, Traced

MESH = sf.DeviceMesh(4, backend="numpy")
RNG = np.random.default_rng(30)
X, Y, W = RNG.standard_normal((8, 6)), RNG.standard_normal((8, 6)), RNG.standard_normal((6, 4))


def _on_traced(fn):
    """fn(x, y, w) inside sf.jit, x sharded on rows: its result must be a traced value (or a tuple of them:
    np.broadcast_arrays, np.unstack)."""
    def body(x, y, w):
        out = fn(sf.shard(x, axis=0), y, w)
        assert all(isinstance(v, Traced) for v in (out if isinstance(out, tuple) else (out,))), \
            f"returned a {type(out).__name__}, not a traced value"
        return out
    return sf.jit(body, mesh=MESH)


def _refused(excinfo):
    """A refusal of shardfuse's own that says what to write."""
    msg = str(excinfo.value)  # (a ConcretizationError says what to write after its "; ")
    instead = "supported:" in msg or "write" in msg or isinstance(excinfo.value, sf.ConcretizationError)
    assert "inside sf.jit" in msg and instead, msg


# NumPy calls shardfuse runs (compared with NumPy in float64)
RUNS = {
    "np.power of arrays": lambda x, y, w: np.power(np.abs(x), y),
    "np.dot 2-D": lambda x, y, w: np.dot(x, w),
    "np.dot scalar": lambda x, y, w: np.dot(x, 2.0),
    "np.matmul": lambda x, y, w: np.matmul(x, w),
    "np.transpose": lambda x, y, w: np.transpose(x),
    "np.transpose axes": lambda x, y, w: np.transpose(x, (1, 0)),
    "np.permute_dims": lambda x, y, w: np.permute_dims(x, (1, 0)),
    "np.swapaxes": lambda x, y, w: np.swapaxes(x, 0, -1),
    "np.reshape": lambda x, y, w: np.reshape(x, (4, 12)),
    "np.reshape -1": lambda x, y, w: np.reshape(x, (-1, 3)),
    "np.sum": lambda x, y, w: np.sum(x),
    "np.sum axis": lambda x, y, w: np.sum(x, axis=0),
    "np.sum tuple": lambda x, y, w: np.sum(x, axis=(1, 0)),
    "np.mean": lambda x, y, w: np.mean(x),
    "np.mean axis": lambda x, y, w: np.mean(x, 1),
    "np.exp": lambda x, y, w: np.exp(x),
    "np.tanh": lambda x, y, w: np.tanh(x),
    "np.abs": lambda x, y, w: np.abs(x),
    "abs()": lambda x, y, w: abs(x),
    "np.negative": lambda x, y, w: np.negative(x),
    "np.add": lambda x, y, w: np.add(x, y),
    "np.subtract scalar left": lambda x, y, w: np.subtract(np.float64(1.5), x),
    "np.multiply": lambda x, y, w: np.multiply(x, y),
    "np.divide": lambda x, y, w: np.divide(x, 4.0),
    "np.float64 * x": lambda x, y, w: np.float64(3.0) * x,
    "x.sum()": lambda x, y, w: x.sum(),
    "x.mean((0, 1))": lambda x, y, w: x.mean((0, 1)),
    # issue 31
    "np.where": lambda x, y, w: np.where(x > y, x, y),
    "np.sqrt": lambda x, y, w: np.sqrt(np.abs(x)),
    "np.log": lambda x, y, w: np.log(np.abs(x)),
    "np.maximum": lambda x, y, w: np.maximum(x, y),
    "np.max": lambda x, y, w: np.max(x),
    "np.square": lambda x, y, w: np.square(x),
    "np.power": lambda x, y, w: np.power(x, 2),
    "np.sum keepdims": lambda x, y, w: np.sum(x, axis=0, keepdims=True),
    "np.concatenate": lambda x, y, w: np.concatenate([x, y], axis=-1),
    "np.stack": lambda x, y, w: np.stack([x, y], axis=1),
    "np.split": lambda x, y, w: np.split(x, [1, 4], axis=1)[1],
    # a new-user probe: np.dot of 1-D operands (NumPy's: their matmul), x-shaped constants, copies
    "np.dot 1-D": lambda x, y, w: np.dot(np.sum(x, 0), w),
    "np.dot 1-D 1-D": lambda x, y, w: np.dot(np.sum(x, 0), np.sum(y, 0)),
    "np.dot 2-D 1-D": lambda x, y, w: np.dot(x, w[:, 1]),
    "np.zeros_like": lambda x, y, w: np.zeros_like(x),
    "np.ones_like": lambda x, y, w: np.ones_like(x) + x,
    "np.full_like": lambda x, y, w: np.full_like(x, 2.5) * y,
    "np.copy": lambda x, y, w: np.copy(x),
    "np.expand_dims": lambda x, y, w: np.expand_dims(x, (0, -1)),
    "np.squeeze": lambda x, y, w: np.squeeze(x[None, :, None], axis=(0, 2)),
    "np.ravel": lambda x, y, w: np.ravel(x),
    # what a torch / JAX port met as missing (tests/test_einsum.py, tests/test_math_ops.py)
    "np.einsum": lambda x, y, w: np.einsum("ij,jk->ik", x, w),
    "np.tensordot": lambda x, y, w: np.tensordot(x, w, 1),
    "np.cumsum": lambda x, y, w: np.cumsum(x, 0),
    "np.trunc": lambda x, y, w: np.trunc(x * 3.0),
    "np.round decimals": lambda x, y, w: np.round(x, 3),
}

# NumPy calls shardfuse refuses (each with what to write instead)
REFUSED = {
    "np.dot 3-D": lambda x, y, w: np.dot(np.reshape(x, (2, 4, 6)), w),
    "np.where one argument": lambda x, y, w: np.where(x > 0),
    "np.concatenate dtype=": lambda x, y, w: np.concatenate([x, y], dtype=np.float32),
    "np.fmod": lambda x, y, w: np.fmod(x, 2.0),
    "np.max out=": lambda x, y, w: np.max(x, out=x),
    "np.linalg.det": lambda x, y, w: np.linalg.det(x),
    "np.kron": lambda x, y, w: np.kron(x, w),
    "np.power of int arrays": lambda x, y, w: np.power(x.astype("int32"), y.astype("int32")),
    "np.bincount": lambda x, y, w: np.bincount(x[0].astype("int64")),
    "np.zeros_like shape=": lambda x, y, w: np.zeros_like(x, shape=(2, 3)),
    "np.prod out=": lambda x, y, w: np.prod(x, out=x),
    "np.add.reduce": lambda x, y, w: np.add.reduce(x),
    "np.add out=": lambda x, y, w: np.add(x, y, out=x),
    "np.max out=": lambda x, y, w: np.max(x, out=x),
    "np.reshape order F": lambda x, y, w: np.reshape(x, (4, 12), order="F"),
}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_a_numpy_function_shardfuse_has_runs_as_its_op(name):
    got = _on_traced(RUNS[name])(X, Y, W).gather()
    np.testing.assert_allclose(got, RUNS[name](X, Y, W), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_any_other_numpy_function_is_refused_with_what_to_write(name):
    with pytest.raises(TypeError) as e:
        _on_traced(REFUSED[name])(X, Y, W)
    _refused(e)


def test_the_refusals_name_the_function_and_the_supported_ones():
    with pytest.raises(TypeError, match=r"^np\.kron is not supported on traced shardfuse values \(inside "
                                        r"sf\.jit\); supported: .*np\.clip.*np\.concatenate.*np\.cumsum.*np\.dot.*"
                                        r"np\.einsum.*np\.sum.*np\.tensordot"):
        _on_traced(lambda x, y, w: np.kron(x, w))(X, Y, W)
    with pytest.raises(TypeError, match=r"^np\.linalg\.det is not supported"):
        _on_traced(lambda x, y, w: np.linalg.det(x))(X, Y, W)
    with pytest.raises(TypeError, match=r"np\.dot of \w+ \(shape \(2, 4, 6\), float64\) and w \(shape \(6, 4\), "
                                        r"float64\) inside sf\.jit .*write a @ b"):
        _on_traced(lambda x, y, w: np.dot(np.reshape(x, (2, 4, 6)), w))(X, Y, W)


def _numpy_namespace():
    """Every public NumPy callable of the main and linalg namespaces that dispatches on its
    arguments (ufuncs; functions through __array_function__)."""
    out = {}
    for prefix, ns in (("np", np), ("np.linalg", np.linalg)):
        for name in sorted(dir(ns)):
            f = getattr(ns, name)
            if not name.startswith("_") and (isinstance(f, np.ufunc) or type(f).__name__ == "_ArrayFunctionDispatcher"):
                out.setdefault(f, f"{prefix}.{name}")
    return sorted(out.items(), key=lambda kv: kv[1])


@pytest.mark.parametrize("func, name", _numpy_namespace(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_numpy_function_runs_or_is_refused(func, name):
    """The whole namespace, called as f(x) and f(x, y): a traced result only where the function
    is in the table, with NumPy's values; otherwise shardfuse's refusal, or NumPy's own argument
    error raised before the call reaches a traced value."""
    if func in STATIC:  # (np.shape, np.ndim, np.size: known at trace time, Python values as NumPy's)
        seen = []
        sf.jit(lambda x: seen.append(func(x)) or x, mesh=MESH)(X)
        assert seen == [func(X)], (name, seen)
        return
    for n in (1, 2):
        def call(x, y, w):
            return func(*(x, y)[:n])
        try:
            got = _on_traced(call)(X, Y, W)
        except AssertionError:
            raise  # a result that is no traced value
        except Exception as e:  # noqa: BLE001 (sorted out below)
            if func not in NUMPY and _raised_in_shardfuse(e):
                _refused(type("Info", (), {"value": e}))  # (an argument error of a supported one is fine)
            continue
        assert func in NUMPY, f"{name} of {n} traced values ran without a table entry"
        want = func(*(X, Y)[:n])
        for g, w in zip(*((got, want) if isinstance(got, tuple) else ((got,), (want,)))):
            np.testing.assert_allclose(g.gather(), w, rtol=1e-12, atol=1e-12)


STATIC = {np.shape, np.ndim, np.size}


def _raised_in_shardfuse(e) -> bool:
    tb = e.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    return "/shardfuse/" in tb.tb_frame.f_code.co_filename


# ---- Python asking for numbers -------------------------------------------------------------------
CONCRETE = {
    "if s": lambda s: bool(s),
    "int()": int,
    "float()": float,
    "complex()": complex,
    "range()": lambda s: range(s),
    "a list index": lambda s: [1, 2][s],
    "np.asarray": np.asarray,
    "np.array": np.array,
    "in": lambda s: 0.0 in s,
}


@pytest.mark.parametrize("name", sorted(CONCRETE))
def test_asking_a_traced_value_for_its_numbers_raises_a_concretization_error(name):
    def f(a):
        s = a if name == "in" else a.sum(1).sum(0)
        CONCRETE[name](s)
        return a

    with pytest.raises(sf.ConcretizationError) as e:
        sf.jit(f, mesh=MESH).lower(sf.TensorSpec((4, 8), "float64"))
    msg = str(e.value)
    assert isinstance(e.value, TypeError) and "inside sf.jit" in msg and "; " in msg, msg
    whole = name == "in"
    assert ("a (shape (4, 8), float64)" if whole else "(shape (), float64)") in msg, msg


def test_iterating_a_traced_value_gives_its_rows_as_jax():
    """for r in x, tuple(x), sum(x) over the first axis (the shape is static: JAX iterates so; a probe
    met a ConcretizationError); a 0-d value is refused as NumPy refuses it."""
    a = np.random.default_rng().standard_normal((3, 4))
    first, second, third = sf.jit(lambda x: tuple(r * k for k, r in enumerate(x)), mesh=MESH)(a)
    np.testing.assert_array_equal(np.asarray(third), 2 * a[2])
    np.testing.assert_allclose(np.asarray(sf.jit(lambda x: sum(x), mesh=MESH)(a)), a.sum(0), rtol=1e-15)
    with pytest.raises(TypeError, match="0-d"):
        sf.jit(lambda x: list(x.sum()), mesh=MESH)(a)


def test_if_on_a_sum_is_refused_not_always_true():
    """The issue's case: `if s:` on a traced sum took the True branch, silently, whatever the data."""
    def f(a):
        s = a.sum(1).sum(0)
        return a if s else -a

    with pytest.raises(sf.ConcretizationError, match=r"^bool\(\) of the traced value s_1 \(shape \(\), float64\) "
                                                    r"\(inside sf\.jit, sf\.grad, \.\.\.\): .*"
                                                    r"decide the branch outside the jitted function.*"
                                                    r"static_argnames="):
        sf.jit(f, mesh=MESH)(np.zeros((4, 8)))


def test_len_is_the_static_extent_and_a_0d_value_has_none():
    seen = []

    def f(a):
        seen.append(len(a))
        with pytest.raises(TypeError, match="len\\(\\) of the 0-d traced value"):
            len(a.sum())
        return a

    sf.jit(f, mesh=MESH).lower(sf.TensorSpec((4, 8), "float64"))
    assert seen == [4]


@pytest.mark.parametrize("op", [operator.eq, operator.ne])
def test_comparing_traced_values_is_elementwise_and_its_truth_refused(op):  # (issue 31: as JAX)
    with pytest.raises(sf.ConcretizationError, match=r"bool\(\) of the traced value"):
        sf.jit(lambda a, b: a if op(a, b) else b, mesh=MESH).lower(sf.TensorSpec((4,)), sf.TensorSpec((4,)))


def test_the_ufunc_table_is_one_for_traced_values_and_sf_arrays():
    a = sf.shard(X, axis=0, mesh=MESH)
    np.testing.assert_allclose(np.abs(a).gather(), np.abs(X))
    np.testing.assert_allclose(np.subtract(np.float64(1.5), a).gather(), 1.5 - X)
    with pytest.raises(TypeError, match=r"np\.fmod on an sf\.Array is not supported; shardfuse has .*np\.absolute"):
        np.fmod(a, 2.0)
