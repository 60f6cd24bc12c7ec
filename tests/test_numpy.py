"""Results against float64 NumPy on virtual NumPy devices in one process."""
import pytest

import shardfuse as sf
from cases import (allgather_case, allreduce_case, from_local_2d_case, from_local_case, natural_case, reduce_scatter_case,
                   seed_case, slice_case, unpipelined_case)

DEVICES = [1, 2, 3, 4]


def mesh(d):
    return sf.DeviceMesh(d, backend="numpy")


def full_matrix(test):
    """D in {1, 2, 3, 4} x chunks {1, 2, 4, 8} x streams {1, 2, 4} x dtypes x B replicated / column-sharded."""
    for name, values in [("dtype", ["float32", "float64"]), ("streams", [1, 2, 4]), ("chunks", [1, 2, 4, 8]),
                         ("d", DEVICES)]:
        test = pytest.mark.parametrize(name, values)(test)
    return pytest.mark.parametrize("b_sharded", [False, True], ids=["b_replicated", "b_column_sharded"])(test)


@full_matrix
def test_seed_layout(d, chunks, streams, dtype, b_sharded):
    seed_case(mesh(d), chunks, streams, dtype, b_sharded)


@full_matrix
def test_natural_layout(d, chunks, streams, dtype, b_sharded):
    natural_case(mesh(d), chunks, streams, dtype, b_sharded)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("d", DEVICES)
def test_unpipelined(d, dtype):
    unpipelined_case(mesh(d), dtype)


@pytest.mark.parametrize("axis", [0, 1, 2])
@pytest.mark.parametrize("d", DEVICES)
def test_allgather(d, axis):
    if axis == 2 and 5 % d:  # axis 2 has extent 5: sharding it over d devices must be refused
        with pytest.raises(ValueError, match="cannot shard axis 2 of extent 5"):
            allgather_case(mesh(d), axis)
        return
    allgather_case(mesh(d), axis)


@pytest.mark.parametrize("d", DEVICES)
def test_allreduce(d):
    allreduce_case(mesh(d))


@pytest.mark.parametrize("d", DEVICES)
def test_reduce_scatter(d):
    reduce_scatter_case(mesh(d))


@pytest.mark.parametrize("d", DEVICES)
def test_slice(d):
    slice_case(mesh(d))


@pytest.mark.parametrize("d", DEVICES)
def test_from_local(d):
    from_local_case(mesh(d))


@pytest.mark.parametrize("shape", [(2, 2), (2, 3), (3, 2)])
@pytest.mark.parametrize("over", ["dp", "tp"])
def test_from_local_on_a_2d_mesh(shape, over):
    from_local_2d_case(sf.DeviceMesh(shape, ("dp", "tp"), backend="numpy"), over)


def test_results_identical_across_stream_counts():
    import numpy as np

    m = mesh(4)
    rng = np.random.default_rng()
    a, b = rng.standard_normal((8, 4, 4, 8)), rng.standard_normal((8, 6))
    outs = []
    for streams in (1, 2, 4):
        f = sf.jit(lambda a, b: sf.stream(sf.shard(a, axis=1) @ b, axis=0), mesh=m, streams=streams)
        outs.append(f(a, b).gather())
    assert all(np.array_equal(outs[0], o) for o in outs[1:])


def test_plans_are_cached_and_buffers_reused():
    import numpy as np

    m = mesh(2)
    f = sf.jit(lambda a, b: sf.stream(sf.shard(a, axis=1) @ b, axis=0), mesh=m)
    rng = np.random.default_rng()
    spec = (sf.TensorSpec((4, 2, 3, 5)), sf.TensorSpec((5, 7)))
    assert f.lower(*spec) is f.lower(*spec)
    exe = f.lower(*spec).executable
    persistent = [id(t) for t in exe.slot_templates if t is not None]
    results = []
    for _ in range(3):  # new inputs each call; earlier results must stay intact
        a, b = rng.standard_normal((4, 2, 3, 5)).astype("float32"), rng.standard_normal((5, 7)).astype("float32")
        results.append((f(a, b), a.astype(np.float64) @ b))
    assert [id(t) for t in exe.slot_templates if t is not None] == persistent
    for c, ref in results:
        np.testing.assert_allclose(c.gather(), ref, rtol=1e-4, atol=1e-4)


def test_one_device_plan_keeps_no_gathered_copy():
    """At D = 1 the Allgather folds to a view of the input, so the gathered pool it would have
    filled is never made; at D = 2 the plan has it, one buffer per pool entry (and still computes
    the product)."""
    import numpy as np

    for d, persistent in ((1, 0), (2, 3)):
        m = mesh(d)
        f = sf.jit(lambda a, b: sf.stream(sf.shard(a, axis=1) @ b, axis=0), mesh=m, streams=3)
        exe = f.lower(sf.TensorSpec((4, d, 3, 5)), sf.TensorSpec((5, 7))).executable
        assert d == 1 or "Allocate 3 x" in str(f.lower(sf.TensorSpec((4, d, 3, 5)), sf.TensorSpec((5, 7))))
        assert sum(t is not None for t in exe.slot_templates) == persistent, d
        rng = np.random.default_rng()
        a, b = rng.standard_normal((4, d, 3, 5)).astype("float32"), rng.standard_normal((5, 7)).astype("float32")
        np.testing.assert_allclose(f(a, b).gather(), a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4)


def test_from_local_refusals_on_a_2d_mesh():
    import numpy as np

    mesh = sf.DeviceMesh((2, 2), ("dp", "tp"), backend="numpy")
    with pytest.raises(ValueError, match=r"extent 3 cannot be cut into the 2 block\(s\) of this process' positions "
                                         r"\[0, 1\] along mesh axis 'dp'"):
        sf.from_local(np.ones((3, 4)), axis=0, over="dp", mesh=mesh)
    with pytest.raises(ValueError, match="over= takes a mesh axis name or a tuple of distinct ones"):
        sf.from_local(np.ones((4, 4)), axis=0, over=("dp", "dp"), mesh=mesh)
    with pytest.raises(ValueError, match="unknown mesh axis 'pp'"):
        sf.from_local(np.ones((4, 4)), axis=0, over="pp", mesh=mesh)


def test_gather_keeps_the_sign_of_zero():
    import numpy as np

    mesh = sf.DeviceMesh((2, 2), ("dp", "tp"), backend="numpy")
    x = np.array([[-0.0, 1.0, -0.0, 2.0], [3.0, -0.0, 4.0, -0.0]])
    for axis in (0, 1):
        got = sf.shard(x, axis=axis, over="tp", mesh=mesh).gather()
        np.testing.assert_array_equal(np.signbit(got), np.signbit(x))
