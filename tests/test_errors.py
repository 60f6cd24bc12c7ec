"""Bad input gets a clear error at lower or call time, before any communication."""
import numpy as np
import pytest

import shardfuse as sf

T = sf.TensorSpec


@pytest.fixture
def mesh():
    return sf.DeviceMesh(4, backend="numpy")


def seed(a, b):
    return sf.stream(sf.shard(a, axis=1) @ b, axis=0)


def test_contraction_sizes_differ(mesh):
    with pytest.raises(ValueError, match=r"matmul a_1 @ b: contraction sizes differ: a_1\(8, 4, 16, 32\) has K=32.*b\(33, 24\) has K=33"):
        sf.jit(seed, mesh=mesh).lower(T((8, 4, 16, 32)), T((33, 24)))


def test_axis_out_of_range(mesh):
    f = sf.jit(lambda a: sf.shard(a, axis=4), mesh=mesh)
    with pytest.raises(ValueError, match=r"axis 4 out of range for a 2-D value of shape \(8, 8\)"):
        f.lower(T((8, 8)))


def test_extent_not_divisible_by_mesh(mesh):
    f = sf.jit(lambda a: sf.shard(a, axis=0), mesh=mesh)
    with pytest.raises(ValueError, match=r"cannot shard axis 0 of extent 6 of a\[6, 8\] \(an argument\) over DIDx: "
                                         "the mesh axis has 4 devices"):
        f.lower(T((6, 8)))
    g = sf.jit(lambda a, w: sf.shard(a @ w, axis=0), mesh=mesh)  # (a serving probe: which value, in a model?)
    with pytest.raises(ValueError, match=r"of c\[6, 8\] \(the result of matmul\) over DIDx"):
        g.lower(T((6, 8)), T((8, 8)))


def test_extent_not_divisible_by_chunks(mesh):
    f = sf.jit(lambda x, w: sf.stream(sf.shard(x, axis=0) @ w, axis=0, chunks=3), mesh=mesh)
    with pytest.raises(ValueError, match="stream chunks=3 does not divide axis 0 of extent 32"):
        f.lower(T((32, 8)), T((8, 8)))


def test_chunks_times_devices_must_divide(mesh):
    f = sf.jit(lambda x, w: sf.stream(sf.shard(x, axis=0) @ w, axis=0, chunks=8), mesh=mesh)
    with pytest.raises(ValueError, match=r"the extent 16 must divide into 4 device\(s\) x 8 chunks"):
        f.lower(T((16, 8)), T((8, 8)))


def test_unknown_mesh_axis(mesh):
    f = sf.jit(lambda a: sf.shard(a, axis=0, over="DIDy"), mesh=mesh)
    with pytest.raises(ValueError, match=r"unknown mesh axis 'DIDy': this mesh has axes \('DIDx',\)"):
        f.lower(T((8, 8)))


def test_mixed_dtypes_promote(mesh):  # (issue 31: NumPy's and JAX's promotion, no longer a refusal)
    plan = sf.jit(seed, mesh=mesh).lower(T((8, 4, 16, 32), "float32"), T((32, 24), "float64"))
    assert "-> (c: f64[" in str(plan)


def test_unsupported_dtype():
    with pytest.raises(TypeError, match="unsupported dtype 'complex64'.*complex values are not supported"):
        T((2, 2), "complex64")
    with pytest.raises(TypeError, match=r"unsupported dtype 'uint16'.*ids.astype\(np.int32\)"):  # (a JAX port's tokens)
        T((2, 2), "uint16")


def test_array_on_another_mesh(mesh):
    other = sf.DeviceMesh(2, backend="numpy")
    a = sf.shard(np.random.default_rng().standard_normal((8, 2, 4, 4)), axis=1, mesh=other)
    with pytest.raises(ValueError, match=r"sf.Array on DeviceMesh\(DIDx=2, backend=numpy\), but the function "
                                         r"is compiled for DeviceMesh\(DIDx=4, backend=numpy\)"):
        sf.jit(seed, mesh=mesh)(a, np.ones((4, 4)))
    # named by its parameter, as the README says errors are (from a new-user probe: it said "argument is")
    with pytest.raises(ValueError, match=r"seed\(\): argument a \(position 0\) is an sf.Array on DeviceMesh\(DIDx=2"):
        sf.jit(seed, mesh=mesh)(a, np.ones((4, 4)))
    with pytest.raises(ValueError, match=r"argument p_a \(position 0\) is an sf.Array on DeviceMesh\(DIDx=2"):
        sf.jit(lambda p, b: p["a"] @ b, mesh=mesh)({"a": a}, np.ones((4, 4)))


def test_call_with_wrong_arity(mesh):
    with pytest.raises(TypeError, match="takes 2 arguments, got 1"):
        sf.jit(seed, mesh=mesh).lower(T((8, 4, 16, 32)))


def test_bad_mesh_and_streams():
    with pytest.raises(ValueError, match="DeviceMesh shape must be positive ints"):
        sf.DeviceMesh(0)
    with pytest.raises(ValueError, match="streams must be a positive int, got 0"):
        sf.jit(seed, mesh=sf.DeviceMesh(2, backend="numpy"), streams=0)


def test_double_stream(mesh):  # (two placements on one value compose: tests/test_annotation_rule.py)
    f = sf.jit(lambda a: sf.stream(sf.stream(a, axis=0), axis=1), mesh=mesh)
    with pytest.raises(ValueError, match="already has a stream axis"):
        f.lower(T((8, 8)))


def test_stream_outside_jit():
    with pytest.raises(TypeError, match="inside an sf.jit function"):
        sf.stream(np.ones(4), axis=0)


def test_ranks_at_different_collective_steps_are_told_so():
    """A rank setting up a mesh's backend (its first sf.shard there) while another checks a plan:
    not 'different versions of the plan', but which step each rank is at."""
    from shardfuse.fault_messages import describe_mismatch

    texts = ["the MPI backend of DeviceMesh(DIDx=4)\nmesh ...", "plan 'f'\nmesh ...\nplan f(x: f64[8, 3])"]
    msg = describe_mismatch(texts, "plan 'f'")
    assert "different collective steps" in msg and "rank(s) 0 at the MPI backend of DeviceMesh(DIDx=4)" in msg
    assert "rank(s) 1 at plan 'f'" in msg and "sets up its backend" in msg
    same = describe_mismatch(["plan 'f'\nmesh\nplan f(x: f64[8, 3])", "plan 'f'\nmesh\nplan f(x: f64[8, 2])"], "plan 'f'")
    assert "different versions of plan 'f'" in same and "line 2:" in same and "f64[8, 2]" in same


def test_a_bad_argument_is_named_by_its_parameter(mesh):
    @sf.jit(mesh=mesh)
    def f(x, weight):
        return x @ weight

    a = np.random.default_rng(0).standard_normal((8, 4))
    with pytest.raises(TypeError, match=r"^f\(\): argument weight \(position 1\): expected an array .*got str"):
        f(a, "w")
    with pytest.raises(TypeError, match=r"^f\(\): argument weight \(position 1\): expected an array .*got complex"):
        f(a, weight=3j)  # (a Python int or float is a weak scalar argument: tests/test_elementwise_ops.py)
    with pytest.raises(ValueError, match=r"^matmul x @ weight: contraction sizes differ"):
        f(a, a)


def test_lower_and_keyword_only_parameters_say_what_to_write(mesh):
    f = sf.jit(lambda a, b: a @ b, mesh=mesh)
    with pytest.raises(TypeError, match=r"lower takes TensorSpecs, .*got \(16, 8\): for a shape, write \(\(16, 8\), "):
        f.lower((16, 8), (8, 6))

    def scaled(a, *, s=2.0):
        return a * s

    x = np.random.default_rng(0).standard_normal((4, 4))
    with pytest.raises(TypeError, match=r"scaled\(\): s given, but a keyword-only .*functools.partial\(scaled, s=...\)"):
        sf.jit(scaled, mesh=mesh)(x, s=5.0)
    np.testing.assert_allclose(sf.jit(scaled, mesh=mesh)(x).gather(), 2 * x)


def test_lower_takes_an_int_shape_with_its_dtype(mesh):
    f = sf.jit(lambda a: a * 2.0, mesh=mesh)
    assert f.lower((16, "float32")).program.inputs[0].type.shape == (16,)


def test_a_numpy_table_inside_jit_is_placed_and_its_traced_index_says_what_to_write():
    """A Llama probe: sf.replicate(table) inside sf.jit (jnp.asarray's use) said it needs mesh=, and
    table[t] of a traced position named no op that takes it.  Now the annotations capture the table
    as a constant of the program and place it; the refusal names sf.take, which works."""
    mesh = sf.DeviceMesh((2,), ("tp",), backend="numpy")
    table = np.cos(np.arange(16.0)).reshape(2, 8)
    x = np.random.default_rng(2).standard_normal((2, 8))
    f = sf.jit(lambda x: x * sf.replicate(table) + sf.shard(table, axis=1, over="tp")
               + sf.distribute(table, mesh, (None, "tp")) + sf.shard(table, axis=1, mesh=mesh), mesh=mesh)
    np.testing.assert_allclose(np.asarray(f(x)), x * table + 3 * table, rtol=1e-13)
    assert "arrays captured" in str(f.lower(x))  # (mesh= given: an sf.Array made once, not bound from the host)
    rows = np.cos(np.arange(16.0)).reshape(8, 2)
    with pytest.raises(sf.ConcretizationError, match=r"sf.take\(table, t, axis=0\)"):
        sf.jit(lambda t: rows[t] + 0, mesh=mesh)(3)
    np.testing.assert_array_equal(np.asarray(sf.jit(lambda t: sf.take(rows, t, axis=0) + 0, mesh=mesh)(3)), rows[3])


def test_streaming_a_sharded_axis_without_chunks_names_the_users_value():
    """A DTensor-port probe met "axis 0 of c_3_1(32, 16) is sharded over tp: streaming it too needs chunks=":
    the message says what the value is (placed by sf.shard) and what chunks= means."""
    m = sf.DeviceMesh((2,), ("tp",), backend="numpy")
    with pytest.raises(ValueError, match=r"sf.stream: axis 0 of a_1\[8, 4\] \(placed by sf.shard / sf.replicate\) is "
                                         r"sharded over tp: streaming it too needs chunks= \(how many chunks"):
        sf.jit(lambda a: sf.stream(sf.shard(a, axis=0, over="tp"), axis=0), mesh=m)(np.ones((8, 4)))
