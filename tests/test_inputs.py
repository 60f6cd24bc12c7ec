"""Issue 12: what comes in (extents, axes, chunks, streams, NumPy subclasses, lists, NaN, byte
order, pickles), nested jitted functions, default arguments, and the bounded plan cache.

Every bad input gets a clear error (what was expected, what came) before any communication;
the rest works and matches NumPy float64 references on random inputs.  The MPI part runs one
script under `mpiexec -n 2` and `-n 4` (hard timeouts, the process group killed on a hang).
"""
from __future__ import annotations

import os
import pickle
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import shardfuse as sf
from shardfuse.jit import MAX_PLANS

T = sf.TensorSpec
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def mesh():
    return sf.DeviceMesh(4, backend="numpy")


def rng():
    return np.random.default_rng(int.from_bytes(os.urandom(4), "little"))


def gelu(x):
    return 0.5 * x * (1 + np.tanh(0.7978845608028654 * (x + 0.044715 * x ** 3)))


# ---- 4. validation: extents, mesh shapes, chunks, streams, axes ------------------------------
@pytest.mark.parametrize("shape, err, msg", [
    ((8.7, 4), TypeError, r"TensorSpec shape \(8.7, 4\): a TensorSpec extent must be an int, got 8.7 \(float\)"),
    ((8, -4), ValueError, r"TensorSpec shape \(8, -4\): a TensorSpec extent must be an int >= 0, got -4"),
    ((True, 4), TypeError, r"got True \(bool\)"),
    (("8", 4), TypeError, r"got '8' \(str\)"),
    ("84", TypeError, r"TensorSpec shape must be a tuple of ints, got '84' \(str\)"),
    (None, TypeError, r"TensorSpec shape must be a tuple of ints, got None"),
])
def test_tensorspec_refuses_bad_extents(shape, err, msg):
    with pytest.raises(err, match=msg):
        T(shape)


def test_tensorspec_takes_numpy_integers():
    assert T((np.int64(8), np.int32(4))).shape == (8, 4)
    assert all(type(n) is int for n in T(np.array([3, 2])).shape)
    assert T(5).shape == (5,)
    with pytest.raises(ValueError, match=r"TensorSpec layout .* has 1 axes, the shape \(8, 4\) has 2"):
        T((8, 4), "float32", sf.Layout.replicated(1))


@pytest.mark.parametrize("shape, err, msg", [
    (True, TypeError, r"DeviceMesh shape must be positive ints .*got True \(bool\)"),
    ((2, True), TypeError, r"DeviceMesh shape must be positive ints .*True is a bool"),
    (2.0, TypeError, r"got 2.0 \(float\)"),
    ((2, 0), ValueError, r"DeviceMesh shape must be positive ints .*got \(2, 0\)"),
    ("4", TypeError, r"got '4' \(str\)"),
])
def test_device_mesh_refuses_bad_shapes(shape, err, msg):
    with pytest.raises(err, match=msg):
        sf.DeviceMesh(shape, backend="numpy")


def test_device_mesh_takes_numpy_integers():
    m = sf.DeviceMesh(np.int64(4), backend="numpy")
    assert m.shape == (4,) and type(m.shape[0]) is int and m.size == 4
    assert sf.DeviceMesh((np.int32(2), np.int64(2)), backend="numpy").shape == (2, 2)
    with pytest.raises(TypeError, match="axis_names must be a name or a sequence of names"):
        sf.DeviceMesh(2, axis_names=(1,), backend="numpy")
    x = rng().standard_normal((8, 3))
    np.testing.assert_array_equal(sf.shard(x, axis=0, mesh=m).gather(), x)


@pytest.mark.parametrize("chunks, err, msg", [
    (2.0, TypeError, r"sf.stream chunks= must be an int, got 2.0 \(float\)"),
    (True, TypeError, r"sf.stream chunks= must be an int, got True \(bool\)"),
    ("2", TypeError, r"sf.stream chunks= must be an int or \"auto\", got '2' \(str\)"),
    ("Auto", TypeError, r"sf.stream chunks= must be an int or \"auto\", got 'Auto' \(str\)"),
    (0, ValueError, r"sf.stream chunks= must be an int >= 1, got 0"),
])
def test_stream_chunks_are_checked(mesh, chunks, err, msg):
    f = sf.jit(lambda x, w: sf.stream(sf.shard(x, axis=0) @ w, axis=0, chunks=chunks), mesh=mesh)
    with pytest.raises(err, match=msg):
        f.lower(T((32, 8)), T((8, 8)))


def test_stream_chunks_take_numpy_integers(mesh):
    r = rng()
    x, w = r.standard_normal((32, 8)), r.standard_normal((8, 8))
    f = sf.jit(lambda x, w: sf.stream(sf.shard(x, axis=0) @ w, axis=0, chunks=np.int64(2)), mesh=mesh)
    np.testing.assert_allclose(f(x, w).gather(), x @ w, rtol=1e-12)
    assert f.lower(T((32, 8), "float64"), T((8, 8), "float64")).collectives() == {"allgather": 2}


@pytest.mark.parametrize("streams, err, msg", [
    (True, TypeError, r"streams must be a positive int \(the size of the stream pool\), got True \(bool\)"),
    (2.0, TypeError, r"got 2.0 \(float\)"),
    ("2", TypeError, r"got '2' \(str\)"),
    (0, ValueError, r"streams must be a positive int, got 0"),
])
def test_jit_streams_are_checked(mesh, streams, err, msg):
    with pytest.raises(err, match=msg):
        sf.jit(lambda x: x, mesh=mesh, streams=streams)


def test_jit_arguments_are_checked(mesh):
    assert sf.jit(lambda x: x, mesh=mesh, streams=np.int64(3)).streams == 3
    with pytest.raises(TypeError, match="graph must be True or False, got 'yes'"):
        sf.jit(lambda x: x, mesh=mesh, graph="yes")
    with pytest.raises(TypeError, match="sf.jit mesh= must be an sf.DeviceMesh, got int"):
        sf.jit(lambda x: x, mesh=4)
    with pytest.raises(TypeError, match="sf.jit compiles a function, got int"):
        sf.jit(3, mesh=mesh)


def test_bool_axes_are_refused_everywhere(mesh):
    x = rng().standard_normal((8, 4))
    with pytest.raises(TypeError, match=r"axis must be an int, got True \(bool\)"):
        sf.shard(x, axis=True, mesh=mesh)
    with pytest.raises(TypeError, match=r"axis must be an int, got True \(bool\)"):
        sf.from_local(x, axis=True, mesh=mesh)
    for fn in (lambda a: sf.shard(a, axis=True), lambda a: sf.stream(a, axis=True), lambda a: a.sum(True),
               lambda a: a.mean(axis=False), lambda a: sf.to_mesh(a, mesh.submesh([0, 1]), axis=True),
               lambda a: a.transpose(True, False)):
        with pytest.raises(TypeError, match=r"axis must be an int, got (True|False) \(bool\)"):
            sf.jit(fn, mesh=mesh).lower(T((8, 4)))
    with pytest.raises(TypeError, match=r"axis must be an int, got 1.0 \(float\)"):
        sf.jit(lambda a: a.sum(1.0), mesh=mesh).lower(T((8, 4)))
    with pytest.raises(TypeError, match=r"reshape of \(8, 4\): an extent must be an int, got 2.0"):
        sf.jit(lambda a: a.reshape(2.0, 16), mesh=mesh).lower(T((8, 4)))


def test_a_remembered_placement_does_not_let_a_bool_axis_through(mesh):
    """sf.shard remembers placements per (shape, axis); True == 1 as a dict key, so the check
    must come before the lookup."""
    x = rng().standard_normal((4, 8))
    a = sf.shard(x, axis=1, mesh=mesh)
    assert sf.shard(x, axis=np.int64(1), mesh=mesh).sharding == a.sharding
    with pytest.raises(TypeError, match=r"axis must be an int, got True \(bool\)"):
        sf.shard(x, axis=True, mesh=mesh)
    with pytest.raises(TypeError, match=r"axis must be an int, got 1.0 \(float\)"):
        sf.shard(x, axis=1.0, mesh=mesh)


def test_concrete_placement_needs_a_mesh(mesh):
    with pytest.raises(TypeError, match="sf.shard: mesh= must be an sf.DeviceMesh, got int"):
        sf.shard(np.ones((4, 4)), axis=0, mesh=4)


# ---- 5. np.matrix, nested lists, NaN ---------------------------------------------------------
MATRIX_WARNING = "ignore:the matrix subclass:PendingDeprecationWarning"


@pytest.mark.filterwarnings(MATRIX_WARNING)
@pytest.mark.parametrize("sharded, axis", [(None, 0), (0, 0), (0, 1), (1, 0)])
def test_matrix_lists_and_nan_through_gelu_and_sum(mesh, sharded, axis):
    x = rng().standard_normal((8, 4))
    xn = x.copy()
    xn[1, 2] = np.nan
    xn[5, 0] = np.inf

    def fn(a):
        a = a if sharded is None else sf.shard(a, axis=sharded)
        return sf.gelu(a).sum(axis)

    f = sf.jit(fn, mesh=mesh)
    got = f(np.matrix(x)).gather()
    assert type(got) is np.ndarray and got.shape == (x.shape[1 - axis],)
    np.testing.assert_allclose(got, gelu(x).sum(axis), rtol=1e-12)
    for arg in (x.tolist(), tuple(map(tuple, x))):  # a pytree of numbers: refused, saying what to write
        with pytest.raises(TypeError, match=r"argument a \(position 0\) is a (list|tuple) holding Python numbers"
                                            r".*np.asarray\(a\)"):
            f(arg)
    with np.errstate(invalid="ignore"):
        ref = gelu(xn).sum(axis)
    got = f(xn).gather()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))  # NaN propagates as in NumPy
    np.testing.assert_allclose(got[np.isfinite(ref)], ref[np.isfinite(ref)], rtol=1e-12)
    # placed first, as sf.Arrays
    a = sf.shard(np.matrix(x), axis=0, mesh=mesh)
    assert all(type(s) is np.ndarray for s in a.shards)
    np.testing.assert_array_equal(a.gather(), x)
    np.testing.assert_array_equal(sf.replicate(x.tolist(), mesh=mesh).gather(), x)


def test_a_tuple_of_arrays_is_a_pytree_and_a_list_of_numbers_is_refused(mesh):
    """As in JAX, a tuple or list argument is a pytree (NumPy would stack arrays into one [2, 4, 4]
    argument, or read numbers as one array): its arrays are leaves; a list of numbers only is
    refused, saying how to pass one array."""
    x = rng().standard_normal((4, 4))
    f = sf.jit(lambda ab, c: ab[0] @ ab[1] + c, mesh=mesh)
    for arg in ((x, x), [x, x]):
        np.testing.assert_allclose(f(arg, x).gather(), x @ x + x, rtol=1e-12)
    g = sf.jit(lambda a, b: a @ b, mesh=mesh)
    for arg in ([[1.0, 2.0], [3.0, 4.0]], [[np.float32(1), 2.0]]):
        with pytest.raises(TypeError, match=r"argument a \(position 0\) is a list holding Python numbers .*"
                                            r"np.asarray\(a\)"):
            g(arg, np.eye(2))
    np.testing.assert_array_equal(g(np.asarray([[1.0, 2.0], [3.0, 4.0]]), np.eye(2)).gather(), [[1, 2], [3, 4]])


def test_numbers_beside_arrays_in_a_pytree_are_leaves_as_in_jax(mesh):
    """An optimizer state {"count": 0, "mu": w} (optax's): the Python int a weak 0-d leaf, a NumPy
    scalar a 0-d leaf of its dtype; a new count value is a new argument value, not a new plan."""
    w = rng().standard_normal((4, 2))
    f = sf.jit(lambda s: {"count": s["count"] + 1, "mu": s["mu"] * s["n"], "n": s["n"] * 2}, mesh=mesh)
    for count in (0, 7):
        out = f({"count": count, "mu": w, "n": np.int32(3)})
        assert int(out["count"]) == count + 1 and out["n"].dtype == np.int32 and int(out["n"]) == 6
        np.testing.assert_array_equal(np.asarray(out["mu"]), w * 3)
    assert f.cache_info()["plans"] == 1
    g = sf.jit(lambda ab: ab[0] + ab[1], mesh=mesh)
    np.testing.assert_array_equal(np.asarray(g((w, 2.5))), w + 2.5)


@pytest.mark.filterwarnings(MATRIX_WARNING)
def test_submesh_placements_do_not_break_later_calls(mesh):
    """The IndexError that np.matrix, lists and NaN inputs were blamed for: a sub-mesh placing an
    array of a shape first made its piece indices the parent's (a shared placement memo)."""
    x = rng().standard_normal((8, 4))
    sf.shard(np.ones((4, 4)), axis=0, mesh=mesh)
    sf.shard(x, axis=0, mesh=mesh.submesh([0, 1]))
    f = sf.jit(lambda a: sf.gelu(sf.shard(a, axis=0)).sum(0), mesh=mesh)
    for arg in (np.matrix(x), x):
        np.testing.assert_allclose(f(arg).gather(), gelu(x).sum(0), rtol=1e-12)


def test_bad_python_and_numpy_inputs_are_refused_clearly(mesh):
    f = sf.jit(lambda a: sf.gelu(sf.shard(a, axis=0)).sum(0), mesh=mesh)
    for numbers in ([[1.0, 2.0], [3.0]], [[1, 2], [3, 4], [5, 6], [7, 8]]):  # pytrees of numbers
        with pytest.raises(TypeError, match=r"is a list holding Python numbers .* np.asarray\(a\)"):
            f(numbers)
    with pytest.raises(TypeError, match="a NumPy masked array: shardfuse takes plain arrays and would drop the mask"):
        f(np.ma.masked_array(np.ones((4, 2)), mask=np.eye(4, 2)))
    with pytest.raises(TypeError, match="unsupported dtype 'int16'"):
        sf.shard(np.ones((4, 2), np.int16), axis=0, mesh=mesh)


# ---- 6. byte order -------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [">f8", ">f4"])
def test_big_endian_inputs_are_converted(mesh, dtype):
    r = rng()
    x, w = r.standard_normal((8, 6)).astype(dtype), r.standard_normal((6, 5)).astype(dtype)
    native = np.dtype(dtype).newbyteorder("=")
    tol = 1e-12 if native == np.float64 else 1e-5
    ref = x.astype(np.float64) @ w.astype(np.float64)
    f = sf.jit(lambda a, b: sf.replicate(sf.shard(a, axis=0)) @ b, mesh=mesh)
    out = f(x, w)
    assert out.dtype == native and out.dtype.isnative
    np.testing.assert_allclose(out.gather(), ref, rtol=tol, atol=tol)
    a = sf.shard(x, axis=0, mesh=mesh)
    assert all(s.dtype.isnative for s in a.shards)
    np.testing.assert_array_equal(a.gather(), x)
    np.testing.assert_allclose(f(a, w).gather(), ref, rtol=tol, atol=tol)
    b = sf.from_local(x, axis=0, mesh=mesh)
    assert all(s.dtype.isnative for s in b.shards)
    np.testing.assert_array_equal(b.gather(), x)


# ---- 7. pickling -----------------------------------------------------------------------------------
def test_pickled_array_is_small_and_round_trips(mesh):
    x = rng().standard_normal((8, 8))  # 512 bytes
    a = sf.shard(x, axis=0, mesh=mesh)
    blob = pickle.dumps(a)
    assert len(blob) < 2048, len(blob)  # was 141 KB: the whole mesh and its backend
    b = pickle.loads(blob)
    assert b.mesh is mesh  # the live mesh of those constructor arguments (and its backend)
    assert b.sharding == a.sharding and b.shape == a.shape and b.dtype == a.dtype
    assert all(p is not q for p, q in zip(a.shards, b.shards))
    np.testing.assert_array_equal(b.gather(), x)
    assert len(pickle.dumps(mesh)) < 200 and pickle.loads(pickle.dumps(mesh)) is mesh
    # a plan's output, on a sub-mesh
    s0, s1 = mesh.submesh([2, 1]), mesh.submesh([0, 3])
    f = sf.jit(lambda v: sf.shard(sf.shard(v, axis=0, mesh=s0) * 2.0, axis=0, mesh=s1), mesh=mesh)
    out = pickle.loads(pickle.dumps(f(x)))
    assert out.sharding.mesh == s1
    np.testing.assert_allclose(out.gather(), 2 * x, rtol=1e-12)
    # an array on a sub-mesh
    c = pickle.loads(pickle.dumps(sf.shard(x, axis=1, mesh=s1)))
    assert c.mesh == s1 and c.mesh.root is mesh
    np.testing.assert_array_equal(c.gather(), x)


def test_a_pickled_step_count_stays_weakly_typed(mesh):
    """A step count returned weakly typed (count + 1 of a Python int) stays so through a pickled
    checkpoint: the resumed float32 step stays float32, bit for bit the uninterrupted one (a probe:
    it turned float64 and its donation warned)."""
    step = sf.jit(lambda w, count: (w * (1.0 - 0.9 ** (count + 1)), count + 1), mesh=mesh)
    w = sf.shard(rng().standard_normal((8, 4)).astype(np.float32), axis=0, mesh=mesh)
    w1, count = step(w, 0)
    assert count.weak
    saved = pickle.loads(pickle.dumps((w1, count)))
    assert saved[1].weak and not saved[0].weak
    w2, _ = step(*saved)
    assert w2.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(w2), np.asarray(step(w1, count)[0]))


def test_pickle_in_a_fresh_process(mesh, tmp_path):
    x = rng().standard_normal((4, 6))
    path = tmp_path / "a.pkl"
    path.write_bytes(pickle.dumps(sf.shard(x, axis=0, mesh=mesh)))
    code = ("import pickle, sys, numpy as np; a = pickle.loads(open(sys.argv[1], 'rb').read()); "
            "np.save(sys.argv[2], a.gather()); print(a.mesh)")
    out = subprocess.run([sys.executable, "-c", code, str(path), str(tmp_path / "x.npy")], capture_output=True,
                         text=True, timeout=120, cwd=ROOT, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stderr
    assert "DeviceMesh(DIDx=4, backend=numpy)" in out.stdout
    np.testing.assert_array_equal(np.load(tmp_path / "x.npy"), x)


def test_pickle_made_by_another_process_is_refused(mesh):
    from shardfuse.array import _rebuild_array

    with pytest.raises(ValueError, match=r"pickled by MPI process 1 of 2 .* here is process 0 of 1\. Pickle "
                                         r"\.gather\(\)"):
        _rebuild_array(mesh, (4, 4), "float64", sf.Layout.replicated(2), [np.ones((4, 4))] * 4, 1, 2)


# ---- 8. gather is collective -------------------------------------------------------------------
def test_gather_says_it_is_collective():
    assert "Otherwise collective: under mpiexec every\n        process must call it" in sf.Array.gather.__doc__
    assert "with no communication" in sf.Array.gather.__doc__  # (a replicated value: read locally)
    readme = (ROOT / "README.md").read_text()
    assert "c.gather()                              # the global result, on every process (read locally" in readme
    assert "a sharded value's `gather()` is collective" in readme


# ---- 3. a jitted function called inside another is inlined ---------------------------------------
def test_jitted_function_inlines_into_its_caller(mesh):
    r = rng()
    x, w1, w2 = r.standard_normal((8, 6)), r.standard_normal((6, 4)), r.standard_normal((4, 3))

    @sf.jit(mesh=mesh)
    def layer(a, w, scale=0.5):
        return sf.gelu(a @ w) * scale

    @sf.jit(mesh=mesh)
    def net(a, w1, w2):
        h = layer(sf.shard(a, axis=0), w1)
        return layer(h, w2, 2.0)

    plan = net.lower(T((8, 6), "float64"), T((6, 4), "float64"), T((4, 3), "float64"))
    assert plan.program.inputs[0].name == "a" and len(plan.program.inputs) == 3
    assert str(plan).count("Matmul") == 2 and not layer.cached_plans()  # traced into net's program, not compiled alone
    np.testing.assert_allclose(net(x, w1, w2).gather(), gelu(gelu(x @ w1) * 0.5 @ w2) * 2.0, rtol=1e-12)
    # and still a function of its own on arrays
    np.testing.assert_allclose(layer(x, w1).gather(), gelu(x @ w1) * 0.5, rtol=1e-12)


def test_inlining_refusals(mesh):
    other = sf.DeviceMesh(2, backend="numpy")
    inner = sf.jit(lambda a: a * 2.0, mesh=other)
    with pytest.raises(ValueError, match=r"<lambda> is compiled for DeviceMesh\(DIDx=2, backend=numpy\), but is "
                                         r"called inside a function traced for DeviceMesh\(DIDx=4"):
        sf.jit(lambda a: inner(a), mesh=mesh).lower(T((4, 4)))
    add = sf.jit(lambda a, b: a + b, mesh=mesh)
    on_other = sf.replicate(np.ones((4, 4), np.float32), mesh=other)  # (on the same mesh: a constant, test_constants)
    with pytest.raises(ValueError, match="a closed-over sf.Array becomes a constant of the program only on the "
                                         "program's mesh"):
        sf.jit(lambda a: add(a, on_other), mesh=mesh).lower(T((4, 4)))
    with pytest.raises(TypeError, match="stream= is for calls on arrays"):
        sf.jit(lambda a: add(a, a, stream=1), mesh=mesh).lower(T((4, 4)))
    np.testing.assert_array_equal(add(np.ones(4), b=np.ones(4)).gather(), 2 * np.ones(4))  # bound as in Python


# ---- 10. default arguments ---------------------------------------------------------------------
def test_default_arguments_keep_their_python_value(mesh):
    r = rng()
    a, b = r.standard_normal((32, 8)), r.standard_normal((8, 5))

    def f(a, b, chunks=8):
        return sf.stream(sf.shard(a, axis=0) @ b, axis=0, chunks=chunks)

    jf = sf.jit(f, mesh=mesh)
    plan = jf.lower(T((32, 8), "float64"), T((8, 5), "float64"))
    assert plan.collectives() == {"allgather": 8} and len(plan.program.inputs) == 2
    np.testing.assert_allclose(jf(a, b).gather(), a @ b, rtol=1e-12)
    # given, it is a traced input like any other (here a third array)
    g = sf.jit(lambda a, b, c=None: a @ b if c is None else a @ b + c, mesh=mesh)
    c = r.standard_normal((32, 5))
    np.testing.assert_allclose(g(a, b).gather(), a @ b, rtol=1e-12)
    np.testing.assert_allclose(g(a, b, c).gather(), a @ b + c, rtol=1e-12)
    with pytest.raises(TypeError, match=r"f takes 2 to 3 arguments, got 1 \(chunks keep their defaults when not "
                                        r"given\)"):
        jf.lower(T((32, 8)))
    with pytest.raises(TypeError, match="f takes 2 to 3 arguments, got 4"):
        jf.lower(T((32, 8)), T((8, 5)), T((1,)), T((1,)))


def test_varargs_and_keyword_only(mesh):
    r = rng()
    xs = [r.standard_normal((4, 4)) for _ in range(3)]

    def total(first, *rest, scale=2.0):
        out = first
        for v in rest:
            out = out + v
        return out * scale

    f = sf.jit(total, mesh=mesh)
    np.testing.assert_allclose(f(*xs).gather(), 2.0 * sum(xs), rtol=1e-12)
    assert [v.name for v in f.lower(*(T((4, 4), "float64"),) * 3).program.inputs] == ["first", "rest0", "rest1"]
    with pytest.raises(TypeError, match="total takes at least 1 arguments, got 0"):
        f.lower()
    with pytest.raises(TypeError, match=r"keyword-only parameters without a default \(k\) cannot be traced"):
        sf.jit(lambda a, *, k: a, mesh=mesh).lower(T((4,)))


# ---- 9. the plan cache is bounded -------------------------------------------------------------
def test_plan_cache_is_lru_bounded(mesh):
    f = sf.jit(lambda a: sf.shard(a, axis=0) * 2.0, mesh=mesh, max_plans=3)
    xs = {n: rng().standard_normal((4 * n, 2)) for n in range(1, 8)}
    hot = f.lower(T((4, 2), "float64"))
    for n in range(2, 8):
        np.testing.assert_allclose(f(xs[n]).gather(), 2 * xs[n], rtol=1e-12)
        np.testing.assert_allclose(f(xs[1]).gather(), 2 * xs[1], rtol=1e-12)  # keeps the first one recent
        assert f.cache_info()["plans"] <= 3 and f.cache_info()["dispatch"] <= 3
    assert f.lower(T((4, 2), "float64")) is hot  # used all along: never evicted
    assert [s[0].shape for s in f.cached_plans()] == [(24, 2), (28, 2), (4, 2)]  # the last lower() made it newest
    evicted = f.lower(T((8, 2), "float64"))  # compiled again, and correct
    np.testing.assert_allclose(f(xs[2]).gather(), 2 * xs[2], rtol=1e-12)
    assert list(f.cached_plans().values())[-1] is evicted  # the call found the re-compiled plan
    with pytest.raises(ValueError, match="sf.jit max_plans= must be an int >= 1, got 0"):
        sf.jit(lambda a: a, mesh=mesh, max_plans=0)


def test_plan_cache_default_bound(mesh):
    f = sf.jit(lambda a: a * 2.0, mesh=mesh)
    assert f.max_plans == MAX_PLANS == 64
    for n in range(1, MAX_PLANS + 12):
        f(np.full((n,), 0.5))
    assert f.cache_info() == {"plans": MAX_PLANS, "dispatch": MAX_PLANS, "max_plans": MAX_PLANS}
    assert min(s[0].shape[0] for s in f.cached_plans()) == 12


# ---- the MPI tier: items 1, 2, 5, 6 and 7 under mpiexec -n 2 and -n 4 ------------------------------
MPI_SCRIPT = textwrap.dedent('''
    import pickle
    import numpy as np
    import shardfuse as sf
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, P = comm.Get_rank(), comm.Get_size()
    __import__("warnings").filterwarnings("ignore", "the matrix subclass", PendingDeprecationWarning)
    rng = np.random.default_rng(comm.bcast(int.from_bytes(__import__("os").urandom(4), "little")))

    def same(got, ref, what, rtol=1e-12):
        if got.shape != ref.shape or not np.allclose(got, ref, rtol=rtol, atol=rtol, equal_nan=True):
            raise AssertionError(f"rank {rank}: {what}: got {got!r}, expected {ref!r}")

    for D in (P, 2 * P):
        mesh = sf.DeviceMesh(D, backend="numpy")
        x, w = rng.standard_normal((4 * D, 6)), rng.standard_normal((6, 5))
        # 1. a sub-mesh owns its placements (submesh([1, 0]): rank 0's device is the sub-mesh's second)
        sf.shard(np.ones((D, 3)), axis=0, mesh=mesh)
        sub = mesh.submesh([1, 0])
        same(sf.shard(x, axis=0, mesh=sub).gather(), x, "sf.shard on the sub-mesh")
        same(sf.shard(x, axis=0, mesh=mesh).gather(), x, "sf.shard on the parent after the sub-mesh")
        same(sf.shard(x[:2 * D], axis=0, mesh=mesh).gather(), x[:2 * D], "parent first")
        same(sf.shard(x[:2 * D], axis=0, mesh=sub).gather(), x[:2 * D], "then the sub-mesh")
        f = sf.jit(lambda a, b: sf.replicate(sf.shard(a, axis=0)) @ b, mesh=mesh)
        same(f(x, w).gather(), x @ w, "a plan on the parent")
        # 2. a program on a sub-mesh is refused under MPI, at jit time
        try:
            sf.jit(lambda a: a * 2.0, mesh=sub)
            raise AssertionError("jit on a sub-mesh under MPI was accepted")
        except NotImplementedError as e:
            assert "under MPI" in str(e), e
        # 5. np.matrix, lists, NaN
        g = sf.jit(lambda a: sf.gelu(sf.shard(a, axis=0)).sum(0), mesh=mesh)
        ref = 0.5 * x * (1 + np.tanh(0.7978845608028654 * (x + 0.044715 * x ** 3)))
        same(g(np.matrix(x)).gather(), ref.sum(0), "np.matrix")
        same(g(np.asarray(x.tolist())).gather(), ref.sum(0), "nested lists, as one array")
        xn = x.copy(); xn[1, 2] = np.nan
        assert np.isnan(g(xn).gather()[2]) and np.isfinite(g(xn).gather()[[0, 1, 3]]).all()
        # 6. big-endian inputs, through collectives
        for dt in (">f8", ">f4"):
            xb, wb = x.astype(dt), w.astype(dt)
            tol = 1e-12 if dt == ">f8" else 1e-5
            same(f(xb, wb).gather(), x.astype(dt).astype(np.float64) @ w.astype(dt).astype(np.float64),
                 f"big-endian {dt} call", tol)
            a = sf.shard(xb, axis=0, mesh=mesh)
            same(a.gather(), xb.astype(np.float64), f"big-endian {dt} sf.shard")
            same(f(a, wb).gather(), xb.astype(np.float64) @ wb.astype(np.float64), f"big-endian {dt} sf.Array", tol)
            local = xb[rank * 4 * D // P:(rank + 1) * 4 * D // P]
            same(sf.from_local(local, axis=0, mesh=mesh).gather(), xb.astype(np.float64), f"from_local {dt}")
        # 7. pickling: small, round trips on its own rank, refused on another
        a = sf.shard(x, axis=0, mesh=mesh)
        blob = pickle.dumps(a)
        assert len(blob) < 4096 + x.nbytes, len(blob)
        b = pickle.loads(blob)
        assert b.mesh is mesh
        same(b.gather(), x, "unpickled on its own rank")
        theirs = comm.bcast(blob if rank == 0 else None)
        if rank:
            try:
                pickle.loads(theirs)
                raise AssertionError("a pickle of rank 0's pieces unpickled on another rank")
            except ValueError as e:
                assert f"pickled by MPI process 0 of {P}" in str(e), e
        same(pickle.loads(pickle.dumps(a.gather())), x, "the gathered value pickles as NumPy")
        comm.Barrier()
    print(f"INPUTS-OK rank {rank}", flush=True)
''')


def _mpiexec():
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.is_file() and os.access(here, os.X_OK) else shutil.which("mpiexec")


def _mpi_skip_reason():
    import importlib.util

    if any(k in os.environ for k in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK")):
        return "this pytest itself runs under mpiexec (no nested launches)"
    if _mpiexec() is None:
        return "no mpiexec next to sys.executable or on PATH"
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed (pip install -e '.[mpi,test]')"
    return None


@pytest.mark.skipif(_mpi_skip_reason() is not None, reason=str(_mpi_skip_reason()))
@pytest.mark.parametrize("nprocs", [2, 4])
def test_inputs_under_mpiexec(nprocs, tmp_path):
    script = tmp_path / "inputs_mpi.py"
    script.write_text(MPI_SCRIPT)
    version = subprocess.run([_mpiexec(), "--version"], capture_output=True, text=True, timeout=20,
                             stdin=subprocess.DEVNULL).stdout
    flags = ["--oversubscribe"] if "Open MPI" in version or "OpenRTE" in version else []
    if flags and hasattr(os, "geteuid") and os.geteuid() == 0:
        flags.append("--allow-run-as-root")
    cmd = [_mpiexec(), "-n", str(nprocs), *flags, sys.executable, "-m", "mpi4py", str(script)]
    env = {**os.environ, "SHARDFUSE_POISON": "1", "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": "",
           "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # mpiexec and every rank it started
        out, _ = proc.communicate()
        pytest.fail(f"mpiexec -n {nprocs} hung (killed after {time.monotonic() - t0:.0f} s):\n{out[-6000:]}")
    assert proc.returncode == 0, f"mpiexec -n {nprocs} failed (exit {proc.returncode}):\n{out[-6000:]}"
    for r in range(nprocs):
        assert f"INPUTS-OK rank {r}" in out, out[-6000:]


def test_cache_info_counts_the_plans_of_pytree_arguments(mesh):
    """From a new-user probe: a training step called with a dict of parameters reported
    cache_info() == {'plans': 0, ...} after 60 calls (its plans are kept per pytree structure),
    while cached_plans() listed them."""
    f = sf.jit(lambda p, x: p["w"] * x, mesh=mesh)
    x = np.ones((4,))
    f({"w": x}, x)
    f({"w": np.ones((8,))}, np.ones((8,)))
    assert f.cache_info() == {"plans": 2, "dispatch": 2, "max_plans": MAX_PLANS} and len(f.cached_plans()) == 2


def test_a_pickled_array_holds_each_block_once():
    """A probe: a replicated optimizer state pickled at ~2.4x its data (every replica's piece); replicas
    are pickled once now, and each device gets a buffer of its own back (written apart by a donation)."""
    import pickle
    mesh = sf.DeviceMesh((2, 2), backend="numpy")
    x = np.random.default_rng().standard_normal((64, 64))
    for spec in [(None, None), ("DIDy", None), (None, "DIDx"), ("DIDx", "DIDy")]:
        a = sf.distribute(x, mesh, spec)
        blob = pickle.dumps(a)
        assert len(blob) < 1.05 * x.nbytes, (spec, len(blob) / x.nbytes)
        back = pickle.loads(blob)
        np.testing.assert_array_equal(np.asarray(back), x)
        assert back.placements == a.placements and len({id(s) for s in back.shards}) == 4
        step = sf.jit(lambda v: v * 2.0, mesh=mesh, donate_argnums=0)
        np.testing.assert_array_equal(np.asarray(step(back)), 2.0 * x)
