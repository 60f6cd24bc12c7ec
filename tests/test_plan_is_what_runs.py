"""The plan is what runs (issue 30, item 5): for plans that stage, the steps the executor binds,
the steps a profile times, the steps a prediction simulates and the steps `print(plan)` shows are
one list (shardfuse/steps.py), and every copy is one of the plan's.

Each case below needs a staging copy (or, for the ring, guarded and evented steps): a gather of an
inner axis, a strided reshape, moves between meshes, a stream chunk of an inner axis, an AllToAll.
"""
import numpy as np
import pytest

import shardfuse as sf
from shardfuse.backends.numpy_local import NumpyLocalBackend
from shardfuse.executor import Executable
from shardfuse.ops import COMMUNICATION, STREAM_OPS, Op
from shardfuse.steps import plan_steps


def _mesh(shape=4):
    return sf.DeviceMesh(shape, backend="numpy")


def _submeshes():
    mesh = _mesh()
    return mesh, mesh.submesh([0, 1]), mesh.submesh([2, 3])


def gather_inner_axis():  # the issue's example: an Allgather of axis 1 (2 columns a device)
    return _mesh(), lambda x: sf.replicate(sf.shard(x, axis=1)), [(8, 8)], lambda x: x


def strided_reshape():  # the piece of v.T cannot be reshaped in place
    def f(x):
        v = sf.shard(sf.shard(sf.replicate(x.reshape(8, 4)), 0, over="DIDy"), 1, over="DIDx")
        return sf.shard(v.T, 0, over="DIDy").reshape(32)
    return _mesh((2, 2)), f, [(2, 4, 4)], lambda x: x.reshape(8, 4).T.reshape(32)


def move_between_meshes():  # rows of stage 0 to columns of stage 1: Gather, then Scatter of axis 1
    mesh, s0, s1 = _submeshes()
    return mesh, lambda x: sf.shard(sf.shard(x, axis=0, mesh=s0) * 2.0, axis=1, mesh=s1), [(8, 6)], lambda x: 2 * x


def streamed_move():  # chunks of axis 1 sent from stage 0 to stage 1
    mesh, s0, s1 = _submeshes()
    def f(x):
        return sf.stream(sf.shard(sf.shard(x, axis=0, mesh=s0) * 2.0, axis=0, mesh=s1), axis=1, chunks=3)
    return mesh, f, [(8, 6)], lambda x: 2 * x


def streamed_allgather():  # chunks of axis 1 gathered over axis 0: strided send and receive
    return _mesh(), lambda x: sf.stream(sf.replicate(sf.shard(x, axis=0)), axis=1, chunks=2), [(8, 4)], lambda x: x


def alltoall():  # S(0) -> S(1): rank r sends block r of axis 1
    return _mesh(), lambda x: sf.shard(sf.shard(x, axis=0) * 2.0, axis=1), [(8, 12, 5)], lambda x: 2 * x


def ring():  # Send/Recv around the ring: guarded steps, events on two streams
    def f(x, w):
        return sf.stream(sf.shard(x, axis=0) @ w, axis=0, algorithm="ring")
    return _mesh(), f, [(16, 8), (8, 5)], lambda x, w: x @ w


CASES = [gather_inner_axis, strided_reshape, move_between_meshes, streamed_move, streamed_allgather, alltoall, ring]
STAGING = {"gather_inner_axis": "_staged", "strided_reshape": "_contig", "move_between_meshes": "_staged",
           "streamed_move": "_staged", "streamed_allgather": "_staged", "alltoall": "_staged"}


class Counting(NumpyLocalBackend):
    """The reference backend, counting the copies and the communication it binds."""

    def __init__(self, mesh):
        super().__init__(mesh)
        self.bound = {}

    def _count(self, what):
        self.bound[what] = self.bound.get(what, 0) + 1

    def bind_copy(self, src, dst, stream, devices=None):
        self._count(Op.COPY)
        return super().bind_copy(src, dst, stream, devices)

    def bind_transfers(self, pairs, stream):
        self._count(Op.TRANSFER)
        return super().bind_transfers(pairs, stream)

    def bind_allgather(self, send, recv, team, stream):
        self._count(Op.ALLGATHER)
        return super().bind_allgather(send, recv, team, stream)

    def bind_alltoall(self, send, recv, team, stream):
        self._count(Op.ALLTOALL)
        return super().bind_alltoall(send, recv, team, stream)

    def bind_sendrecv(self, send, recv, team, shift, stream):
        self._count(Op.SENDRECV)
        return super().bind_sendrecv(send, recv, team, shift, stream)


def _unguarded(line):  # a loop step's guard, "[i < 3] ", off
    return line.split("] ", 1)[1] if line.startswith("[") else line


def _lowered(case):
    mesh, fn, shapes, ref = case()
    rng = np.random.default_rng()
    args = [rng.standard_normal(s) for s in shapes]
    f = sf.jit(fn, mesh=mesh, streams=2)
    return f, f.lower(*args), args, ref(*args)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_bound_profiled_predicted_and_printed_steps_are_one_list(case):
    f, plan, args, want = _lowered(case)
    text, prog = str(plan), plan.program
    if case.__name__ in STAGING:  # the staging is in the plan, as an Allocate and a Copy
        assert f"{STAGING[case.__name__]} = Allocate" in text or f"{STAGING[case.__name__]}_pool = Allocate" in text, text
    printed = plan_steps(prog)
    lines = [line.strip() for line in text.splitlines()]
    # printed: each step is an instruction line of print(plan) (its loop step aside), and every line
    # that writes a buffer, waits or records is a step (views and allocations are not)
    steps = [s.text.split("  [")[0] for s in printed]
    assert set(steps) <= set(lines)
    issuing = {line for line in lines if " <- " in line or "RecordEvent" in line
               or _unguarded(line).startswith(("Wait", "Synchronize"))}
    assert issuing == set(steps)
    # bound: the printed steps, in order, but for those NumPy devices have nothing to do for
    bound = plan.executable.steps
    assert [(s.index, s.text, s.op, s.stream) for s in bound] == \
        [(p.index, p.text, p.op, p.stream) for p in printed if p.index in {s.index for s in bound}]
    assert {p.op for p in printed} - {s.op for s in bound} <= STREAM_OPS | {Op.WAIT}
    # each on this process' devices of the printed step's (a sub-mesh's steps on its devices only)
    assert all(s.run is not None and s.devices == tuple(d for d in f.mesh.local_devices if d in printed[s.index].devices)
               for s in bound)
    # profiled: the bound steps, every call
    tl = plan.profile(*args, repeat=2)
    for call in range(2):
        events = sorted((e for e in tl.events if e.call == call), key=lambda e: e.step)
        assert [(e.step, e.text, e.kind, e.stream) for e in events] == [(s.index, s.text, s.kind, str(s.stream)) for s in bound]
    # a step profiled as communication is communication, never a copy
    assert all(printed[e.step].op in COMMUNICATION for e in tl.events if e.kind == "communication")
    assert all(printed[e.step].op == Op.COPY for e in tl.events if e.kind == "copies")
    # predicted: every printed step
    assert [(e.step, e.text, e.kind) for e in plan.predict().events] == [(p.index, p.text, p.kind) for p in printed]
    np.testing.assert_allclose(f(*args).gather(), want, rtol=1e-12, atol=1e-12)  # (buffers poisoned: conftest)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_every_copy_the_backend_binds_is_a_printed_one(case):
    f, plan, args, want = _lowered(case)
    be = Counting(f.mesh)
    exe = Executable(plan.program, be)
    printed = plan_steps(plan.program)
    for op in (Op.COPY, Op.TRANSFER, Op.ALLGATHER, Op.ALLTOALL, Op.SENDRECV):
        assert be.bound.get(op, 0) == sum(s.op == op for s in printed), op
    ((lay, shards, _),) = exe(*args)
    out = sf.Array(plan.program.mesh, want.shape, "float64", lay, shards)
    np.testing.assert_allclose(out.gather(), want, rtol=1e-12, atol=1e-12)


def test_the_issue_example_prints_its_staging_and_profiles_it_as_a_copy():
    f, plan, args, _ = _lowered(gather_inner_axis)
    assert str(plan).splitlines()[2:] == [
        "  x_1_1 = Allocate f64[8, 8]  (per call)",
        "  x_1_1_staged = Allocate f64[8, 8]  (once, as 4 blocks of axis 1)",
        "  ag = Allgather x_1_1_staged <- x, team=DIDx, axis=1",
        "  Wait ag",
        "  Copy x_1_1 <- x_1_1_staged",
        "  return x_1_1",
    ]
    tl = plan.profile(*args)
    assert [(e.text, e.kind) for e in sorted(tl.events, key=lambda e: e.step)] == [
        ("ag = Allgather x_1_1_staged <- x, team=DIDx, axis=1", "communication"),
        ("Copy x_1_1 <- x_1_1_staged", "copies")]
