"""The shape of the hot path, pinned so that it cannot silently grow back (issue 14): what a bound
plan issues per call, and that a call after the first binds and keeps nothing new.

Counted on the real NumPy backend (a subclass that counts; the steps are its own), for the seed
AllGather+GEMM at D = 8, S = 8 and smaller.  The figures of the GPU backend are in BENCHMARKS.md
(benchmarks/host_cost.py); what is pinned here is the structure they rest on: one step per
collective and per GEMM, all of a plan's devices inside that one step, nothing bound per call.
"""
from __future__ import annotations

import gc
import tracemalloc

import numpy as np
import pytest

import shardfuse as sf
from shardfuse.backends.numpy_local import NumpyLocalBackend
from shardfuse.executor import Executable

pytestmark = pytest.mark.gpu  # part of the GPU run (benchmarks/gpu_first.sh)


class CountingBackend(NumpyLocalBackend):
    """The NumPy backend, counting what the executor asks of it at bind and at call time."""

    def __init__(self, mesh):
        super().__init__(mesh)
        self.bound = {}
        self.empties = self.output_views = 0
        self.outputs = ()  # the Refs of the plan's outputs, set by the test

    def _count(self, name):
        self.bound[name] = self.bound.get(name, 0) + 1

    def bind_matmul(self, a, b, out, stream, devices=None):
        self._count("matmul")
        return super().bind_matmul(a, b, out, stream, devices)

    def bind_allgather(self, send, recv, team, stream):
        self._count("allgather")
        return super().bind_allgather(send, recv, team, stream)

    def empty(self, shape, dtype, devices=None):
        self.empties += 1
        return super().empty(shape, dtype, devices)

    def view(self, bufs, ref, j):
        self.output_views += any(ref is r for r in self.outputs)  # the steps make views too
        return super().view(bufs, ref, j)


def seed(d, s):
    mesh = sf.DeviceMesh(d, backend="numpy")
    f = sf.jit(lambda a, b: sf.stream(sf.shard(a, axis=1) @ b, axis=0), mesh=mesh, streams=4)
    plan = f.lower(sf.TensorSpec((s, d, 2, 4), "float64"), sf.TensorSpec((4, 3), "float64"))
    backend = CountingBackend(mesh)
    return plan, Executable(plan.program, backend), backend


@pytest.mark.parametrize("d, s", [(1, 1), (1, 8), (8, 1), (8, 8)])
def test_one_step_per_collective_and_gemm_with_every_device_inside(d, s):
    plan, exe, be = seed(d, s)
    # S GEMMs and S all-gathers (none at D = 1: they fold), each one bound step for all D devices
    assert be.bound == ({"matmul": s} if d == 1 else {"matmul": s, "allgather": s})
    assert len(exe.steps) == s * (1 if d == 1 else 2)  # NumPy's stream steps are no-ops (None): dropped
    assert sum(plan.collectives().values()) == (0 if d == 1 else s)


def test_a_call_after_the_first_binds_and_keeps_nothing_new():
    plan, exe, be = seed(8, 8)
    rng = np.random.default_rng()
    a, b = rng.standard_normal((8, 8, 2, 4)), rng.standard_normal((4, 3))
    ref = np.einsum("sdmk,kn->sdmn", a, b)
    steps, templates, refs = list(exe.steps), list(exe.slot_templates), dict(exe.refs)
    be.outputs = [exe.refs[v] for v in plan.program.outputs]
    bound = dict(be.bound)
    for _ in range(3):  # warm: the plan's own caches fill on the first calls
        exe(a, b)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    empties = be.empties
    for _ in range(100):
        ((lay, pieces, whole),) = exe(a, b)
        del lay, pieces, whole
    gc.collect()
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(st.size_diff for st in after.compare_to(before, "filename") if st.size_diff > 0)
    assert grown < 64 * 1024, f"100 calls kept {grown} bytes"  # nothing per call stays alive
    assert be.empties - empties == 100  # one allocation per call: the per-call output buffer
    assert be.output_views == 0  # the output is that buffer as it is: no view per device per call
    assert be.bound == bound and exe.steps == steps and exe.slot_templates == templates and exe.refs == refs
    ((lay, pieces, whole),) = exe(a, b)
    assert whole  # the output is the call's own buffer: known contiguous
    out = sf.Array(plan.program.mesh, plan.program.outputs[0].type.shape, "float64", lay, pieces)
    np.testing.assert_allclose(out.gather(), ref, rtol=1e-12, atol=1e-12)


def test_a_mesh_keeps_its_backend_and_nothing_keeps_the_mesh():
    import weakref

    from shardfuse.runtime import backend_of

    mesh = sf.DeviceMesh(4, backend="numpy")
    sub, same = mesh.submesh([0, 1]), mesh.submesh([0, 1])
    be = backend_of(mesh)
    assert backend_of(mesh) is be and backend_of(sub) is backend_of(same) is not be  # equal sub-meshes share
    assert mesh.backend_cache is be  # the hot path's one lookup
    f = sf.jit(lambda a: a * 2.0, mesh=mesh)
    np.testing.assert_allclose(f(sf.shard(np.arange(8.0), 0, mesh=mesh)).gather(), np.arange(8.0) * 2)
    gone = weakref.ref(mesh)
    del mesh, sub, same, be, f
    gc.collect()
    assert gone() is None  # its backend (streams, handles, workspaces on GPUs) goes with it


@pytest.mark.parametrize("axis", [1, 2])
def test_blocks_of_an_inner_axis_are_placed_by_one_copy(axis):
    # D pieces along an inner axis: one copy with that axis outermost, each piece a contiguous view
    from shardfuse.pieces import local_pieces, piece_indices, split_axis

    mesh = sf.DeviceMesh(4, backend="numpy")
    x = np.random.default_rng(7).standard_normal((4, 8, 8, 5))
    placed = sf.shard(x, axis, mesh=mesh)
    lay = placed.sharding
    assert split_axis(x.shape, lay, mesh) == axis
    pieces = local_pieces(x, "float64", lay, mesh)
    for piece, idx in zip(pieces, piece_indices(x.shape, lay, mesh)):
        assert piece.flags.c_contiguous and np.array_equal(piece, x[idx])
    assert len({id(p.base) for p in pieces}) == 1  # views of one buffer, not D copies
    np.testing.assert_array_equal(placed.gather(), x)
    assert split_axis(x.shape, sf.shard(x, 0, mesh=mesh).sharding, mesh) is None  # axis 0: views already
    assert split_axis(x.shape, sf.replicate(x, mesh=mesh).sharding, mesh) is None


def test_pieces_cut_from_one_copy_are_made_when_first_read():
    # issue 29 item 2: a graph-mode call needs only the pieces' addresses; a CuPy view costs ~2.5 us
    from shardfuse.pieces import SplitViews

    mesh = sf.DeviceMesh(4, backend="numpy")
    x = np.random.default_rng(8).standard_normal((3, 8, 5))
    shards = sf.shard(x, 1, mesh=mesh).shards
    assert isinstance(shards, SplitViews) and len(shards) == 4
    assert shards[1] is shards[1]  # made once, then kept
    for j, piece in enumerate(shards):
        np.testing.assert_array_equal(piece, x[:, 2 * j:2 * j + 2])
    assert [p.shape for p in shards[1:3]] == [(3, 2, 5)] * 2 and list(shards)[3] is shards[3]


def test_a_placement_answer_of_none_is_remembered_too(monkeypatch):
    from shardfuse import pieces

    mesh = sf.DeviceMesh(4, backend="numpy")
    lay = sf.replicate(np.ones((4, 8)), mesh=mesh).sharding
    made, real = [], pieces.piece_indices
    monkeypatch.setattr(pieces, "piece_indices", lambda *a: made.append(a) or real(*a))
    for _ in range(3):
        assert pieces.split_axis((4, 6), lay, mesh) is None  # a shape not placed before
    assert len(made) <= 1  # worked out once at most (meshes of one geometry share the memo), not on every call


def test_devices_outside_a_sub_mesh_share_one_placeholder_allocation(monkeypatch):
    from shardfuse.pieces import local_pieces
    from shardfuse.runtime import backend_of

    mesh = sf.DeviceMesh(4, backend="numpy")
    a = np.random.default_rng(3).standard_normal((4, 6))
    t = sf.jit(lambda v: sf.to_mesh(v, mesh.submesh([2, 3]), axis=0), mesh=mesh)(a)
    be, made = backend_of(mesh), []
    real = be.empty
    monkeypatch.setattr(be, "empty", lambda *args, **kw: made.append(args) or real(*args, **kw))
    pieces = local_pieces(a, "float64", t.sharding, mesh)
    assert len(made) == 1  # devices 0 and 1 hold placeholders of one element, broadcast
    assert pieces[0].shape == pieces[1].shape == (2, 6) and pieces[0].strides == (0, 0)
    np.testing.assert_array_equal(np.concatenate(pieces[2:]), a)


def test_pieces_shardfuse_placed_are_taken_without_asking_each_one(monkeypatch):
    from shardfuse.runtime import backend_of

    mesh = sf.DeviceMesh(4, backend="numpy")
    f = sf.jit(lambda x: x * 2.0, mesh=mesh)
    x = np.random.default_rng(5).standard_normal((8, 6))
    placed, asked = sf.shard(x, 0, mesh=mesh), []
    be = backend_of(mesh)
    real = be.ascontiguous
    monkeypatch.setattr(be, "ascontiguous", lambda p: asked.append(p) or real(p))
    y = f(placed)
    assert placed.pieces_contiguous and y.pieces_contiguous and asked == []  # placed, and a plan's own buffer
    np.testing.assert_allclose(f(y).gather(), 4 * x, rtol=1e-12)
    assert asked == []
    strided = sf.Array(mesh, (8, 6), "float64", placed.sharding, [p[:, ::-1][:, ::-1] for p in placed.shards])
    np.testing.assert_allclose(f(strided).gather(), 2 * x, rtol=1e-12)
    assert len(asked) == 4  # pieces from elsewhere: each made contiguous as before


def test_arguments_of_one_kind_are_checked_against_the_plan_once(monkeypatch):
    """sf.jit's dispatch key holds what the argument check reads (shape, dtype, layout and mesh of
    an sf.Array; shape, dtype, device and contiguity of a plain array): a call with a key seen
    before is not checked again, one with a new key is, and a bad one still raises every time."""
    from shardfuse import plan as plan_module

    mesh = sf.DeviceMesh(2, backend="numpy")
    f = sf.jit(lambda a, b: sf.shard(a, axis=0) @ b, mesh=mesh)
    rng = np.random.default_rng(11)
    a, b = rng.standard_normal((4, 3)), rng.standard_normal((3, 5))
    checks, real = [], plan_module.check_args
    monkeypatch.setattr(plan_module, "check_args", lambda *args: checks.append(1) or real(*args))
    for _ in range(3):
        np.testing.assert_allclose(f(sf.shard(a, 0, mesh=mesh), b).gather(), a @ b, rtol=1e-12)
    assert len(checks) == 1
    np.testing.assert_allclose(f(sf.shard(a, 0, mesh=mesh), np.asfortranarray(b)).gather(), a @ b, rtol=1e-12)
    assert len(checks) == 2  # a non-contiguous weight: another key, checked once
    np.testing.assert_allclose(f(sf.replicate(a, mesh=mesh), b).gather(), a @ b, rtol=1e-12)
    other = sf.shard(a, 0, mesh=sf.DeviceMesh(2, ("tp",), backend="numpy"))
    for _ in range(2):
        with pytest.raises(ValueError, match="compiled for"):
            f(other, b)


def test_a_fence_covers_its_stream_until_the_plans_next_call():
    """A result read on the stream its call already ordered (the caller's) needs no second fence
    when exported; a graph-mode result only until the plan's next call, which overwrites it; on
    NumPy devices there are no streams, and nothing is remembered."""
    from shardfuse.interop import Fence

    class Plan:  # (an executable's call count, all a Fence reads of it)
        calls = 5

    exe = Plan()
    assert Fence(0x7F00, 5).covers(0x7F00) and not Fence(0x7F00, 5).covers(0x7F08)
    assert Fence(0x7F00, 5, exe).covers(0x7F00)
    exe.calls += 1
    assert not Fence(0x7F00, 5, exe).covers(0x7F00) and Fence(0x7F00, 5).covers(0x7F00)
    y = sf.jit(lambda v: v * 2.0, mesh=sf.DeviceMesh(2, backend="numpy"))(np.ones((4, 3)))
    assert y.fenced is None


def test_a_python_value_before_a_traced_argument_is_inlined():
    """Inside another jitted function, a Python value (a string, a dtype) may come before the
    traced arguments: the call is inlined, as JAX inlines, not refused as a bad array."""
    mesh = sf.DeviceMesh(4, backend="numpy")
    g = sf.jit(lambda kind, x: x * 2.0 if kind == "double" else x, mesh=mesh)
    f = sf.jit(lambda x: g("double", x) + 1.0, mesh=mesh)
    x = np.random.default_rng(8).standard_normal((8, 3))
    np.testing.assert_allclose(f(x).gather(), 2 * x + 1, rtol=1e-14)
    with pytest.raises(TypeError, match=r"argument kind \(position 0\)"):
        g("double", x)  # outside a trace a string is no array
