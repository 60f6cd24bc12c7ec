"""Arrays in and out through the public API on the NumPy backend: sf.shard / sf.from_local /
sf.replicate on concrete arrays, plain call arguments, to_local / addressable_shards / DLPack
export / full_array, one-device collectives folded to views.  (CuPy, torch and JAX arrays and
streams: tests/test_gpu_interop.py, on the GPU machine.)"""
import numpy as np
import pytest

import shardfuse as sf
from cases import assert_close, fresh_rng


class DLPackOnly:
    """An array that offers nothing but the DLPack protocol (as many libraries' arrays do)."""

    def __init__(self, x):
        self._x = x

    def __dlpack__(self, **kw):
        return self._x.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._x.__dlpack_device__()


def seed(mesh, streams=2):
    @sf.jit(mesh=mesh, streams=streams)
    def ag_matmul(a, b):
        return sf.stream(sf.shard(a, axis=0) @ b, axis=0, chunks=2)

    return ag_matmul


@pytest.mark.parametrize("d", [1, 2, 4])
def test_placed_once_weights_and_plain_arguments(d):
    mesh = sf.DeviceMesh(d, backend="numpy")
    r = fresh_rng(mesh)
    a, b = r.standard_normal((8 * d, 16)), r.standard_normal((16, 12))
    w = sf.replicate(b, mesh=mesh)
    assert w.placements == (sf.Replicate(),) and w.shape == b.shape
    assert all(s.data.shape == b.shape for s in w.addressable_shards)
    f = seed(mesh)
    ref = a @ b
    for a_in in (a, sf.shard(a, axis=0, mesh=mesh), DLPackOnly(a)):
        for b_in in (b, w, DLPackOnly(b)):
            assert_close(f(a_in, b_in).gather(), ref, "float64")


def test_zero_copy_pieces_on_numpy():
    """A contiguous piece of the caller's array is used as it is, not copied."""
    mesh = sf.DeviceMesh(2, backend="numpy")
    x = fresh_rng(mesh).standard_normal((8, 4))
    arr = sf.shard(x, axis=0, mesh=mesh)
    assert all(np.shares_memory(s.data, x) for s in arr.addressable_shards)
    cols = sf.shard(x, axis=1, mesh=mesh)  # a column block is strided: made contiguous
    assert all(s.data.flags.c_contiguous for s in cols.addressable_shards)


def test_addressable_shards_and_to_local():
    mesh = sf.DeviceMesh(4, backend="numpy")
    x = fresh_rng(mesh).standard_normal((8, 6))
    arr = sf.shard(x, axis=0, mesh=mesh)
    shards = arr.addressable_shards
    assert [s.device for s in shards] == [0, 1, 2, 3]
    for s in shards:
        np.testing.assert_array_equal(s.data, x[s.index])
    # several pieces: the box they tile, assembled (what sf.from_local takes back from this process)
    whole = arr.to_local()
    np.testing.assert_array_equal(whole, x)
    assert not any(np.shares_memory(whole, s.data) for s in shards)
    half = sf.distribute(x, sf.DeviceMesh((2, 2), backend="numpy"), [sf.Shard(0), sf.Replicate()])
    np.testing.assert_array_equal(half.to_local(), x)  # (replicas counted once)
    back = sf.from_local(half.to_local(), axis=0, mesh=half.mesh)
    np.testing.assert_array_equal(back.gather(), x)
    np.testing.assert_array_equal(arr.full_array().to_local(), x)  # replicas: any one is the value
    one = sf.DeviceMesh(1, backend="numpy")
    np.testing.assert_array_equal(sf.shard(x, axis=0, mesh=one).to_local(), x)


def test_dlpack_export_of_a_whole_value():
    mesh = sf.DeviceMesh(2, backend="numpy")
    r = fresh_rng(mesh)
    a, b = r.standard_normal((8, 16)), r.standard_normal((16, 4))
    f = sf.jit(lambda a, b: sf.replicate(sf.shard(a, axis=0) @ b), mesh=sf.DeviceMesh(1, backend="numpy"))
    out = f(a, b)
    np.testing.assert_allclose(np.from_dlpack(out), a @ b, rtol=1e-12)
    np.testing.assert_array_equal(np.from_dlpack(sf.replicate(a, mesh=mesh)), a)  # two replicas held
    sharded = sf.shard(a, axis=0, mesh=mesh)
    with pytest.raises(ValueError, match=r"not held whole.*to_local\(\).*full_array\(\)"):
        sharded.__dlpack__()
    with pytest.raises(AttributeError, match="host memory"):
        sharded.__cuda_array_interface__


@pytest.mark.parametrize("axis", [0, 1])
def test_full_array_gathers_through_a_plan(axis):
    mesh = sf.DeviceMesh(4, backend="numpy")
    x = fresh_rng(mesh).standard_normal((8, 12))
    full = sf.shard(x, axis=axis, mesh=mesh).full_array()
    assert full.placements == (sf.Replicate(),)
    for s in full.addressable_shards:
        np.testing.assert_array_equal(s.data, x)
    assert full.full_array() is full  # already whole: nothing to do


def test_from_local_takes_dlpack_arrays():
    mesh = sf.DeviceMesh(2, backend="numpy")
    x = fresh_rng(mesh).standard_normal((6, 4))
    arr = sf.from_local(DLPackOnly(x), axis=0, mesh=mesh)  # one process: its piece is the whole
    np.testing.assert_array_equal(arr.gather(), x)


def test_bad_inputs_are_named():
    mesh = sf.DeviceMesh(2, backend="numpy")
    f = seed(mesh)
    a, b = np.ones((8, 16)), np.ones((16, 12))
    plan = f.lower(sf.TensorSpec(a.shape, "float64"), sf.TensorSpec(b.shape, "float64"))
    with pytest.raises(ValueError, match=r"expected shape \(16, 12\) and dtype float64, got a numpy array float32"):
        plan(a, b.astype(np.float32))
    with pytest.raises(ValueError, match=r"got an sf.Array of shape \(8, 12\)"):
        plan(a, sf.replicate(np.ones((8, 12)), mesh=mesh))
    with pytest.raises(TypeError, match=r"unsupported dtype 'int16'"):
        sf.shard(np.ones((4, 4), np.int16), axis=0, mesh=mesh)
    with pytest.raises(ValueError, match="sf.replicate on a concrete array needs mesh="):
        sf.replicate(a)
    with pytest.raises(TypeError, match="expected an array"):
        sf.shard(object(), axis=0, mesh=mesh)


def test_one_device_collectives_fold_to_views():
    """At D = 1 the pipelined plan issues no copy for its Allgathers: the GEMMs read the input."""
    one = sf.DeviceMesh(1, backend="numpy")
    r = fresh_rng(one)
    a, b = r.standard_normal((8, 16)), r.standard_normal((16, 12))
    f = seed(one)
    plan = f.lower(sf.TensorSpec(a.shape, "float64"), sf.TensorSpec(b.shape, "float64"))
    exe = plan.executable
    # the plan is what runs: the folded Allgathers print as views and are not counted
    assert plan.collectives() == {}
    assert "folded=allgather over DIDx (1 device)" in str(plan) and "Allgather" not in str(plan)
    # what runs: 2 GEMMs and nothing that copies (stream ops are no-ops on NumPy)
    assert len(exe.steps) == 2
    assert_close(plan(a, b).gather(), a @ b, "float64")


def test_one_device_fold_keeps_buffers_read_whole():
    """The TP MLP all-reduces chunks of a buffer that is later read whole: at D = 1 those
    Allreduces must still write it (a view of each source would leave it unwritten)."""
    from shardfuse.mlp import mlp_block, mlp_inputs, mlp_reference

    one = sf.DeviceMesh(1, backend="numpy")
    f = mlp_block(one, "tp", chunks=2, streams=2)
    args = mlp_inputs(fresh_rng(one), tokens=8, hidden=2)
    assert_close(f(*args).gather(), mlp_reference(*args), "float64")
