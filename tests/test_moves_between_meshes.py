"""Issue 30's wrong results and crashes around sub-meshes, multi-axis shardings and empty or 0-d
values, each reduced to a few lines and compared with NumPy in float64 (buffers poisoned, so an
element never written is NaN).  Each gives NumPy's result or a clear refusal raised while
compiling.  The bodies take the mesh maker, so tests/mpi/test_cases_mpi.py runs them under
mpiexec too (the seeds are fixed: every rank passes the same global arrays)."""
from __future__ import annotations

import numpy as np
import pytest

import shardfuse as sf


def _numpy_mesh(shape):
    return sf.DeviceMesh(shape, backend="numpy")


def _same(f, args, want):
    got = np.asarray(f(*args).gather())
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def _rng(seed=30):
    return np.random.default_rng(seed)


# ---- moves between a sub-mesh and the mesh --------------------------------------------------
def partly_sharded_to_sub_mesh(make, rows):
    """Sharded over DIDy only (replicated over DIDx) -> a sub-mesh: the blocks are held by
    devices 0 and 2, not by all four."""
    mesh = make((2, 2))
    sub = mesh.submesh([0, 1])
    x = _rng().standard_normal((rows, 6))
    for to in (lambda v: sf.shard(v, axis=0, mesh=sub), lambda v: sf.replicate(v, mesh=sub)):
        f = sf.jit(lambda a: to(sf.shard(a, axis=0, over="DIDy") * 2.0), mesh=mesh)
        _same(f, (x,), x * 2.0)


def sub_mesh_to_partly_sharded(make):
    """A sub-mesh -> sharded over DIDy on the whole mesh: each device gets its DIDy block."""
    mesh = make((2, 2))
    sub = mesh.submesh([0, 1])
    x = _rng().standard_normal((4, 6))
    for frm in (lambda v: sf.shard(v, axis=0, mesh=sub), lambda v: sf.replicate(v, mesh=sub)):
        f = sf.jit(lambda a: sf.shard(frm(a) * 2.0, axis=0, over="DIDy"), mesh=mesh)
        _same(f, (x,), x * 2.0)


def tuple_in_non_mesh_order_and_sub_mesh(make, devices):
    """over=("DIDx", "DIDy") (the inner mesh axis outermost) to and from a sub-mesh: blocks in
    block order, not device order."""
    mesh = make((2, 2))
    sub = mesh.submesh(devices)
    x = _rng().standard_normal((4, 6))
    f = sf.jit(lambda a: sf.shard(sf.shard(a, axis=0, over=("DIDx", "DIDy")) * 2.0, axis=0, mesh=sub), mesh=mesh)
    _same(f, (x,), x * 2.0)
    f = sf.jit(lambda a: sf.shard(sf.shard(a, axis=0, mesh=sub) * 2.0, axis=0, over=("DIDx", "DIDy")), mesh=mesh)
    _same(f, (x,), x * 2.0)


def two_sharded_axes_to_sub_mesh(make):
    """A value cut on two axes moved to a 1-D sub-mesh (refused before stages of several axes came):
    gathered on its mesh, then moved; against NumPy."""
    mesh = make((2, 2))
    sub = mesh.submesh([0, 1])
    f = sf.jit(lambda a: sf.replicate(sf.shard(sf.shard(a, axis=0, over="DIDy"), axis=1, over="DIDx") * 2.0,
                                      mesh=sub), mesh=mesh)
    x = _rng().standard_normal((4, 6))
    _same(f, (x,), 2.0 * x)


# ---- reshapes and streams on a sub-mesh ------------------------------------------------------
def reshape_on_a_sub_mesh(make):
    """Checked against the sub-mesh's axis sizes: no collective, as on sf.DeviceMesh(2)."""
    whole = make(4)
    sub = whole.submesh([0, 1])
    x = _rng().standard_normal((2, 6))
    f = sf.jit(lambda a: sf.shard(a, axis=0, mesh=sub).reshape(2, 3, 2), mesh=whole)
    assert f.lower(sf.TensorSpec((2, 6), "float64")).collectives() == {}
    _same(f, (x,), x.reshape(2, 3, 2))
    named = whole.submesh([0, 1], axis_names=("pp",))  # an axis name the whole mesh lacks
    f = sf.jit(lambda a: sf.shard(a, axis=0, over="pp", mesh=named).reshape(2, 3, 2) * 1.0, mesh=whole)
    _same(f, (x,), x.reshape(2, 3, 2))


def reshape_on_a_sub_mesh_larger_than_the_mesh_axis(make):
    """A 4-device sub-mesh of a 2x2 mesh: its DIDx has 4 devices, the mesh's 2."""
    mesh = make((2, 2))
    sub = mesh.submesh([0, 1, 2, 3])
    x = _rng().standard_normal((4, 6))
    f = sf.jit(lambda a: sf.shard(a, axis=0, mesh=sub).reshape(4, 3, 2) * 1.0, mesh=mesh)
    _same(f, (x,), x.reshape(4, 3, 2))
    f = sf.jit(lambda a: sf.shard(a, axis=0, mesh=sub).reshape(2, 2, 6) * 1.0, mesh=mesh)
    # 2 rows do not split over the sub-mesh's 4 devices: the cut axis is gathered there first
    assert f.lower(sf.TensorSpec((4, 6), "float64")).collectives() == {"allgather": 1}
    _same(f, (x,), x.reshape(2, 2, 6))


def stream_a_value_moved_to_a_sub_mesh_and_back(make):
    whole = make(4)
    sub = whole.submesh([0, 1])
    x, w = _rng().standard_normal((4, 6)), _rng(1).standard_normal((6, 5))
    f = sf.jit(lambda a: sf.stream(sf.replicate(sf.shard(a, axis=0, mesh=sub) * 2.0), axis=0, chunks=2), mesh=whole)
    _same(f, (x,), x * 2.0)
    f = sf.jit(lambda a, b: sf.stream(sf.replicate(sf.replicate(a, mesh=sub) * 2.0) @ b, axis=0, chunks=2),
               mesh=whole)
    _same(f, (x, w), (x * 2.0) @ w)


# ---- found by the differential test's moves between meshes -------------------------------------
def pending_sum_moved_to_another_sub_mesh(make):
    """A sum pending on one sub-mesh, consumed on another: reduced where it is, then moved (a
    pending sum moved as such was reduced again on arrival: 4x the result)."""
    mesh = make((2, 2))
    s0, s1 = mesh.submesh((0, 1)), mesh.submesh((3, 2))
    x = _rng().standard_normal((2, 2, 4))
    f = sf.jit(lambda a: sf.shard(sf.shard(a, 1, mesh=s0).sum(1).T, 0, mesh=s1), mesh=mesh)
    _same(f, (x,), x.sum(1).T)


def reshape_on_a_larger_sub_mesh_than_its_input(make):
    """A reshape annotated onto a 4-device sub-mesh from a 2-device one: checked against the
    sub-mesh it runs on (the input moves whole where its sharding cannot give the result's)."""
    mesh = make((2, 2))
    s0, s1 = mesh.submesh((0, 1)), mesh.submesh((2, 0, 3, 1))
    x = _rng().standard_normal((4, 4))
    f = sf.jit(lambda a: sf.shard(sf.shard(a, 0, mesh=s0).reshape(2, 2, 2, 2).reshape(4, 2, 2), 0, mesh=s1),
               mesh=mesh)
    _same(f, (x,), x.reshape(4, 2, 2))


# ---- 0-d and empty values ----------------------------------------------------------------------
def zero_d_on_a_mesh(make):
    mesh = make(4)
    z = sf.replicate(np.array(1.5), mesh=mesh)
    assert z.gather().shape == () and float(z.gather()) == 1.5
    f = sf.jit(lambda a: a * 2.0, mesh=mesh)
    assert float(f(z).gather()) == 3.0


def empty_values(make):
    mesh = make(4)
    f = sf.jit(lambda a: a.reshape(0, -1) * 1.0, mesh=mesh)
    with pytest.raises(ValueError, match="cannot reshape"):
        f.lower(sf.TensorSpec((0, 6), "float64"))
    p = np.zeros((0, 8))
    f = sf.jit(lambda a: sf.stream(a * 1.0, 0), mesh=mesh)
    _same(f, (sf.shard(p, axis=0, mesh=mesh),), p)


# ---- one process, NumPy virtual devices ---------------------------------------------------------
@pytest.mark.parametrize("rows", [2, 4])
def test_partly_sharded_to_sub_mesh(rows):
    partly_sharded_to_sub_mesh(_numpy_mesh, rows)


def test_sub_mesh_to_partly_sharded():
    sub_mesh_to_partly_sharded(_numpy_mesh)


@pytest.mark.parametrize("devices", [[0, 1, 2, 3], [3, 1, 2, 0]])
def test_tuple_in_non_mesh_order_and_sub_mesh(devices):
    tuple_in_non_mesh_order_and_sub_mesh(_numpy_mesh, devices)


def test_two_sharded_axes_to_sub_mesh():
    two_sharded_axes_to_sub_mesh(_numpy_mesh)


def test_reshape_on_a_sub_mesh():
    reshape_on_a_sub_mesh(_numpy_mesh)


def test_reshape_on_a_sub_mesh_larger_than_the_mesh_axis():
    reshape_on_a_sub_mesh_larger_than_the_mesh_axis(_numpy_mesh)


def test_stream_a_value_moved_to_a_sub_mesh_and_back():
    stream_a_value_moved_to_a_sub_mesh_and_back(_numpy_mesh)


def test_pending_sum_moved_to_another_sub_mesh():
    pending_sum_moved_to_another_sub_mesh(_numpy_mesh)


def test_reshape_on_a_larger_sub_mesh_than_its_input():
    reshape_on_a_larger_sub_mesh_than_its_input(_numpy_mesh)


def test_zero_d_on_a_mesh():
    zero_d_on_a_mesh(_numpy_mesh)


def test_empty_values():
    empty_values(_numpy_mesh)


def test_partly_sharded_move_plan_text():
    """Block p goes from one holder of it to each device that holds block p there."""
    mesh = _numpy_mesh((2, 2))
    sub = mesh.submesh([0, 1])
    f = sf.jit(lambda a: sf.shard(sf.shard(a, axis=0, over="DIDy") * 2.0, axis=0, mesh=sub), mesh=mesh)
    text = str(f.lower(sf.TensorSpec((4, 6), "float64")))
    assert "  sendrecv = SendRecv a_moved <- a, from=(0, 2), to=(0, 1), axis=0" in text.splitlines(), text
