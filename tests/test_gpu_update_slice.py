"""sf.dynamic_update_slice / sf.dynamic_slice / x.at[] on the CuPy backend (run on the GPU machine by
`pytest -m gpu`): backends/cuda/boxes.py's kernel, which reads the start from its device buffer (no
device-to-host read, no sync), wraps and clamps it, and copies the box element by element, strides
honoured.  The bodies of tests/test_update_slice.py on CuPy meshes (virtual devices of one GPU where
there is one): tp and dp x tp layouts, starts in and out of range, int32 / int64 starts, float32 /
bfloat16 / float16 / float64 data (a copy: exact), strided updates (a fused QKV's slice) and a
transposed operand, the donated decode loop keeping its device buffers, gradients; a captured graph
replayed with different starts (the start is read on the device at each replay); and the donated
update against the where-based one at a serving size (the update writes kilobytes, where rewrites the
cache).  Buffers are poisoned (conftest): an unwritten element fails.  Written on a machine without a
GPU (no NVRTC there either): never compiled or run yet."""
from __future__ import annotations


import numpy as np
import pytest

from cases import gpu_count

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_count() == 0, reason="CuPy sees no GPU")]

import shardfuse as sf  # noqa: E402
import test_update_slice as us  # noqa: E402


@pytest.mark.parametrize("idx_dtype", ["int32", "int64"])
@pytest.mark.parametrize("t", us.STARTS)
@pytest.mark.parametrize("layout", sorted(us.LAYOUTS))
def test_update(layout, t, idx_dtype):
    us.check_update(layout, "float64", idx_dtype, t, True, np.random.default_rng(t + 10), backend="cupy")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("layout", sorted(us.LAYOUTS))
def test_update_dtypes_and_eager(layout, dtype):
    us.check_update(layout, dtype, "int32", 3, True, np.random.default_rng(1), backend="cupy")
    us.check_update(layout, dtype, "int64", -2, False, np.random.default_rng(2), backend="cupy")


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
@pytest.mark.parametrize("t", [0, 3, us.M + 2, -2])
def test_slice_and_at(t, dtype):
    us.check_slice_and_at("dp2xtp2", dtype, t, True, np.random.default_rng(2), backend="cupy")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("t", [0, 3, us.M + 1])
def test_strided_operands(t, dtype):
    us.check_strided("dp2xtp2", dtype, t, np.random.default_rng(t), backend="cupy")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", sorted(us.LAYOUTS))
def test_decode_loop_donated(layout, dtype):
    us.check_decode_loop(layout, np.random.default_rng(4), backend="cupy", dtype=dtype)


def test_grad():
    us.check_grad("dp2xtp2", np.random.default_rng(5), backend="cupy")


def test_graph_replays_read_the_start_on_the_device():
    """One captured graph, replayed with t = 1, 4, 0, 9: each replay writes where that call's t says."""
    mesh, spec = us.mesh_of("tp2", "cupy"), us.LAYOUTS["tp2"][2]
    rng = np.random.default_rng(6)
    c, k = rng.standard_normal((us.B, us.NH, us.M, us.HD)), rng.standard_normal((us.B, us.NH, 1, us.HD))
    f = sf.jit(us.step, mesh=mesh, graph=True)
    cd, kd = sf.distribute(c, mesh, spec), sf.distribute(k, mesh, spec)
    for t in (1, 4, 0, 9):
        got = np.asarray(f(cd, kd, np.asarray(t, np.int32)))  # (graph outputs are the plan's: read now)
        us.exact(got, us.ref_update(c, k, (0, 0, t, 0)))


def test_donated_update_at_a_serving_size_writes_the_box_in_place():
    """A cache [8, 32, 4096, 128] float32 (512 MiB) with heads over tp, donated call after call: the
    buffers stay the cache's own and only position t changes (timed against where() in
    benchmarks/kv_cache_update.py, not here)."""
    mesh, spec = us.mesh_of("tp2", "cupy"), us.LAYOUTS["tp2"][2]
    b, nh, m, hd = 8, 32, 4096, 128
    f = sf.jit(us.step, mesh=mesh, donate_argnums=0)
    cache = sf.distribute(np.zeros((b, nh, m, hd), np.float32), mesh, spec)
    k = sf.distribute(np.ones((b, nh, 1, hd), np.float32), mesh, spec)
    cache = f(cache, k, 0)  # (the first call may copy the caller's placed array)
    ptrs = [s.data.ptr for s in cache.shards]
    for t in range(1, 6):
        cache = f(cache, k, t)
        assert [s.data.ptr for s in cache.shards] == ptrs
    got = np.asarray(cache)
    assert (got[:, :, :6] == 1.0).all() and (got[:, :, 6:] == 0.0).all()
