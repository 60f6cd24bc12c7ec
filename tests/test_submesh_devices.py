"""A value on a sub-mesh is computed on its devices only (issue 30, item 6).

A two-stage pipeline on 4 devices (stage 0 on devices 0, 1; stage 1 on 2, 3), each stage a
Matmul and a Gelu:

    plan two_stages(x: f32[8:DIDx, 6] @devices(0, 1), w0: f32[6, 6] @devices(0, 1), w1: f32[6, 4] @devices(2, 3)) -> ...
      Matmul c <- x @ w0                  devices 0, 1
      Gelu g <- c                         devices 0, 1
      sendrecv = SendRecv g_moved <- g, from=(0, 1), to=(2, 3), axis=0    all four
      Wait sendrecv                       all four
      Matmul c_1 <- g_moved @ w1          devices 2, 3
      Gelu g_1 <- c_1                     devices 2, 3

Before, every device ran every step, those outside a stage on placeholder buffers (work
doubled; under mpiexec -n 4, nondeterministic overflow warnings from the garbage they held).
Here: the steps carry their devices, the backend binds each compute step for those, the
profile shows them there, and a backend whose unwritten buffers overflow on any arithmetic
(`loud`) runs the pipeline with RuntimeWarnings as errors.  tests/mpi/test_submesh_devices_mpi.py
runs the same bodies in mpiexec ranks.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import shardfuse as sf
from shardfuse.backends.numpy_local import NumpyLocalBackend
from shardfuse.ops import Op
from shardfuse.steps import plan_steps

STAGES = ((0, 1), (2, 3))
# the pipeline's compute steps (as a profile labels them) and the devices each stage runs them on
STAGE_STEPS = {"Matmul c <- x @ w0": {0, 1}, "Gelu g <- c": {0, 1},
               "Matmul c_1 <- g_moved @ w1": {2, 3}, "Gelu g_1 <- c_1": {2, 3}}


def compute_devices(timeline) -> dict:
    """{step text: the devices its events ran on} for the GEMM and compute steps of a profile."""
    stage: dict = {}
    for e in timeline.events:
        if e.kind in ("gemm", "compute"):
            stage.setdefault(e.text, set()).update(e.devices)
    return stage


def gelu64(x):
    x = np.asarray(x, np.float64)
    return 0.5 * x * (1 + np.tanh(0.7978845608028654 * (x + 0.044715 * x ** 3)))


def pipeline(mesh, collective=False, **jit):
    """Two stages, each a Matmul and a Gelu.  collective=True: stage 1 is tensor parallel (its
    weight's columns sharded over the stage: an Allgather of its input within the stage, and an
    Allreduce of the row sums), so collectives on a sub-mesh's team run beside the stage's steps.
    jit: more arguments of sf.jit (graph=True)."""
    s0, s1 = (mesh.submesh(list(d)) for d in STAGES)

    @sf.jit(mesh=mesh, **jit)
    def two_stages(x, w0, w1):
        h = sf.gelu(sf.shard(x, axis=0, mesh=s0) @ sf.replicate(w0, mesh=s0))
        if collective:
            y = sf.gelu(sf.to_mesh(h, s1, axis=0) @ sf.shard(w1, axis=1, mesh=s1))
            return sf.replicate(y.sum(1), mesh=s1)
        return sf.gelu(sf.to_mesh(h, s1, axis=0) @ sf.replicate(w1, mesh=s1))

    return two_stages


def reference(x, w0, w1, collective=False):
    y = gelu64(gelu64(x @ np.asarray(w0, np.float64)) @ np.asarray(w1, np.float64))
    return y.sum(1) if collective else y


def inputs(rng):
    return [rng.standard_normal(s).astype(np.float32) for s in ((8, 6), (6, 6), (6, 4))]


def loud(base):
    """`base` with every new buffer filled with a huge finite value, so that any arithmetic on a
    buffer no step has written (a placeholder of a device outside a value's sub-mesh) overflows:
    a RuntimeWarning, an error where warnings are."""
    class Loud(base):
        def empty(self, shape, dtype, devices=None):
            bufs = super().empty(shape, dtype, devices)
            big = np.finfo(bufs[0].dtype).max / 4
            for j, b in enumerate(bufs):
                if b.flags.writeable:
                    b.fill(big)
                else:  # (a placeholder: read-only, one element broadcast)
                    bufs[j] = np.broadcast_to(np.full((), big, b.dtype), b.shape)
            return bufs
    return Loud


class Counting(NumpyLocalBackend):
    """The NumPy backend, recording which local devices each compute step is bound for and, while
    the step runs, on which devices it makes the view of its output (once per device it computes on)."""

    def __init__(self, mesh):
        super().__init__(mesh)
        self.bound, self.ran, self.running = [], [], None

    def _counted(self, name, out, devices, step):
        name = f"{name}#{len(self.bound)}"
        self.bound.append((name, devices))

        def run(bufs):
            self.running = (name, out)
            step(bufs)
            self.running = None
        return run

    def bind_matmul(self, a, b, out, stream, devices=None):
        return self._counted("matmul", out, devices, super().bind_matmul(a, b, out, stream, devices))

    def bind_elementwise(self, op, a, b, out, stream, scalar=None, devices=None):
        return self._counted(str(op), out, devices, super().bind_elementwise(op, a, b, out, stream, scalar, devices))

    def view(self, bufs, ref, j):
        if self.running is not None and ref is self.running[1]:
            self.ran.append((self.running[0], self.local_devices[j]))
        return super().view(bufs, ref, j)


def with_backend(mesh, backend):
    mesh.backend_cache = backend  # (what runtime.backend_of fills on first use)
    return mesh


def compute_steps(steps):
    return [(s.op, s.devices) for s in steps if s.op in (Op.MATMUL, Op.GELU)]


# ---- (a) each stage's Matmul and Gelu are bound and run on its devices only -------------------
def test_the_plan_steps_carry_their_stage_devices():
    mesh = sf.DeviceMesh(4, backend="numpy")
    x, w0, w1 = inputs(np.random.default_rng(0))
    steps = plan_steps(pipeline(mesh).lower(x, w0, w1).program)
    assert compute_steps(steps) == [(Op.MATMUL, (0, 1)), (Op.GELU, (0, 1)), (Op.MATMUL, (2, 3)), (Op.GELU, (2, 3))]
    (move,) = [s for s in steps if s.op == Op.TRANSFER]
    (wait,) = [s for s in steps if s.op == Op.WAIT]
    assert move.devices == wait.devices == (0, 1, 2, 3)  # a move between stages: both ends


def test_a_counting_backend_binds_and_runs_each_stage_on_its_devices():
    mesh = sf.DeviceMesh(4, backend="numpy")
    be = Counting(mesh)
    f = pipeline(with_backend(mesh, be))
    x, w0, w1 = inputs(np.random.default_rng(1))
    out = f(x, w0, w1)
    np.testing.assert_allclose(out.gather(), reference(x, w0, w1), rtol=2e-5, atol=1e-6)
    # bound: positions of the local devices (all four are local here, so positions are ids); under
    # SHARDFUSE_POISON a buffer that shares a slab is refilled with NaN where its life starts
    # (shardfuse/slabs.py), on its stage's devices too: those fills are left out of the plan's steps
    poison = [b for b in be.bound if b[0].startswith("full_like")]
    assert all(devices in ((0, 1), (2, 3)) for _, devices in poison)
    be.bound = [b for b in be.bound if b not in poison]
    be.ran = [r for r in be.ran if not r[0].startswith("full_like")]
    assert be.bound == [("matmul#0", (0, 1)), ("gelu#1", (0, 1)), ("matmul#2", (2, 3)), ("gelu#3", (2, 3))]
    # run: one output view per device the step computes on, and none elsewhere
    assert sorted(be.ran) == [("gelu#1", 0), ("gelu#1", 1), ("gelu#3", 2), ("gelu#3", 3),
                              ("matmul#0", 0), ("matmul#0", 1), ("matmul#2", 2), ("matmul#2", 3)]
    exe = f.lower(x, w0, w1).executable
    assert compute_steps(exe.steps) == [(Op.MATMUL, (0, 1)), (Op.GELU, (0, 1)), (Op.MATMUL, (2, 3)),
                                        (Op.GELU, (2, 3))]


def test_a_collective_inside_a_stage_runs_over_its_team_beside_the_stage_steps():
    mesh = sf.DeviceMesh(4, backend="numpy")
    f = pipeline(with_backend(mesh, Counting(mesh)), collective=True)
    x, w0, w1 = inputs(np.random.default_rng(2))
    plan = f.lower(x, w0, w1)
    assert plan.collectives() == {"sendrecv": 1, "allgather": 1, "allreduce": 1}
    by_op = {}
    for s in plan.executable.steps:
        by_op.setdefault(s.op, set()).add(s.devices)
    # (stage 1's Gelu and its row sums are one step, passes/fuse.py: the Gelu's result is never written)
    assert by_op[Op.ALLGATHER] == by_op[Op.ALLREDUCE] == by_op[Op.FUSED_SUM] == {(2, 3)}
    assert by_op[Op.MATMUL] == {(0, 1), (2, 3)} and by_op[Op.GELU] == {(0, 1)}
    np.testing.assert_allclose(f(x, w0, w1).gather(), reference(x, w0, w1, collective=True), rtol=2e-5, atol=1e-5)


# ---- (b) no arithmetic on placeholders: warnings as errors, placeholders that would overflow ------
@pytest.mark.parametrize("collective", [False, True], ids=["plain", "tensor-parallel-stage"])
def test_no_placeholder_is_computed_on(collective):
    mesh = sf.DeviceMesh(4, backend="numpy")
    f = pipeline(with_backend(mesh, loud(NumpyLocalBackend)(mesh)), collective)
    rng = np.random.default_rng(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an overflow on a placeholder raises
        for _ in range(3):
            x, w0, w1 = inputs(rng)
            got = f(x, w0, w1).gather()
            np.testing.assert_allclose(got, reference(x, w0, w1, collective), rtol=2e-5, atol=1e-5)


def test_the_loud_backend_would_catch_a_step_on_placeholders():
    """The check above can fail: a backend that runs every Matmul on all local devices (as every
    step ran before) overflows on the placeholders, or writes a buffer made only where its stage is
    (a read-only placeholder elsewhere), with the same backend and inputs."""
    class Everywhere(loud(NumpyLocalBackend)):
        def bind_matmul(self, a, b, out, stream, devices=None):
            return super().bind_matmul(a, b, out, stream, None)

    mesh = sf.DeviceMesh(4, backend="numpy")
    f = pipeline(with_backend(mesh, Everywhere(mesh)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises((RuntimeWarning, ValueError), match="overflow|read-only"):
            f(*inputs(np.random.default_rng(4)))


# ---- (d) the profile shows each stage's steps on its own devices ---------------------------------
def test_the_profile_shows_each_stage_on_its_devices():
    mesh = sf.DeviceMesh(4, backend="numpy")
    plan = pipeline(mesh, collective=True).lower(*inputs(np.random.default_rng(5)))
    tl = plan.profile(*inputs(np.random.default_rng(6)), repeat=2)
    printed = plan_steps(plan.program)
    assert len(tl) == 2 * len(plan.executable.steps)
    for e in tl.events:
        assert e.devices == printed[e.step].devices, e
    stage = {e.text: e.devices for e in tl.events if e.kind in ("gemm", "compute")}
    assert {d for d in stage.values()} == set(STAGES)
    assert stage["Matmul c <- x @ w0"] == (0, 1) and stage["Gelu g <- c"] == (0, 1)
    # the Chrome trace: a stage's steps only on its devices' tracks
    doc = tl.to_chrome_trace()
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "process_name"}
    tracks = {}
    for e in doc["traceEvents"]:
        if e["ph"] == "X" and e["cat"] in ("gemm", "compute"):
            tracks.setdefault(e["name"], set()).add(names[e["pid"]])
    assert tracks["Matmul c <- x @ w0"] == {"rank 0 device 0", "rank 0 device 1"}
    assert all(t <= {"rank 0 device 2", "rank 0 device 3"} for n, t in tracks.items() if n != "Matmul c <- x @ w0"
               and n != "Gelu g <- c")
    # the summary's slowest device is one device's own steps
    assert tl.summary()["device"][1] in range(4)


# ---- (e) each stage's buffers are made on its devices only ----------------------------------------
def placeholder(b) -> bool:
    """Whether buffer b is a backend's placeholder: one element broadcast (read-only on NumPy)."""
    flat = b.size > 1 and not any(b.strides)
    if isinstance(b, np.ndarray):  # (NumPy's is read-only too: a step writing it raises)
        assert b.flags.writeable != flat, b.strides
    return flat


def made_bytes(exe, mesh) -> dict:
    """{local device: bytes of the plan's own persistent buffers made there}; checks that a buffer of a
    value on a stage is a buffer on that stage's devices and a placeholder elsewhere (one element
    broadcast, read-only on NumPy: a step writing it would raise)."""
    made = dict.fromkeys(mesh.local_devices, 0)
    for i in exe.prog.walk():
        if i.op != Op.ALLOCATE:
            continue
        v = i.outs[0]
        for ref in exe.refs[v] if isinstance(exe.refs[v], tuple) else (exe.refs[v],):
            for d, b in zip(mesh.local_devices, exe.slot_templates[ref.slot] or ()):
                assert placeholder(b) == (d not in v.type.layout.mesh.devices), (v.name, d)
    for bufs in exe.slot_templates[len(exe.prog.inputs):]:
        for d, b in zip(mesh.local_devices, bufs or ()):
            made[d] += 0 if placeholder(b) else b.nbytes
    return made


def each_stage_buffers_on_its_devices(mesh, collective, **jit):
    f = pipeline(mesh, collective, **jit)
    rng = np.random.default_rng(9)
    plan = f.lower(*inputs(rng))
    made, m = made_bytes(plan.executable, mesh), plan.memory()
    stage_of = {d: k for k, s in enumerate(STAGES) for d in s}
    # plan.memory() is the most loaded device's figure, and what this process made there
    assert m["device"] in range(4) and (m["device"] not in made or made[m["device"]] == m["persistent"]), (made, m)
    for d in made:  # a device holds its own stage's buffers only: the same on both devices of a stage
        twin = next(e for e in STAGES[stage_of[d]] if e != d)
        assert made[d] <= m["persistent"] and (twin not in made or made[twin] == made[d]), made
    # the outputs: made where the result lives, a placeholder on the other stage's devices
    for _ in range(2):
        args = inputs(rng)
        out = f(*args)
        for d, piece in zip(mesh.local_devices, out.shards):
            assert (stage_of[d] == 0) == placeholder(piece), (d, piece.strides)
        np.testing.assert_allclose(np.asarray(out.gather()), reference(*args, collective), rtol=2e-5, atol=1e-5)
    return made, m


@pytest.mark.parametrize("collective", [False, True], ids=["plain", "tensor-parallel-stage"])
def test_each_stage_buffers_are_made_on_its_devices_only(collective):
    """A probe: under mpiexec -n 2 a rank holding only stage 1 made stage 0's buffers too (16.9 MB per
    device where stage 1 needs 4.3 MB), and plan.memory() summed both stages' as one device's."""
    mesh = sf.DeviceMesh(4, backend="numpy")
    made, m = each_stage_buffers_on_its_devices(mesh, collective)
    assert made[0] != made[2] and max(made.values()) == m["persistent"]
    whole = sf.jit(lambda x, w: sf.gelu(sf.shard(x, axis=0) @ w), mesh=mesh).lower(*inputs(np.random.default_rng(1))[:2])
    assert whole.memory()["device"] == 0  # a plan of the whole mesh: every device the same


def test_a_stage_result_fed_back_copies_no_placeholder(monkeypatch):
    """A review: a stage's result that is a view (not contiguous) fed to the next call made every
    piece contiguous, the placeholders of the other stage too: full-size copies there, every call."""
    fed_back_copies_no_placeholder(sf.DeviceMesh(4, backend="numpy"), monkeypatch)


def fed_back_copies_no_placeholder(mesh, monkeypatch):
    from shardfuse.runtime import backend_of

    s0, s1 = (mesh.submesh(list(d)) for d in STAGES)
    x = np.random.default_rng(11).standard_normal((64, 16))
    f = sf.jit(lambda v: sf.to_mesh(sf.shard(v, axis=0, mesh=s0) * 2.0, s1, axis=0).T, mesh=mesh)
    out = f(x)
    assert not out.pieces_contiguous and [placeholder(p) for p in out.shards] == [True, True, False, False]
    be, copied = backend_of(mesh), []
    real = be.ascontiguous
    monkeypatch.setattr(be, "ascontiguous", lambda p: copied.append(p) or real(p))
    g = sf.jit(lambda y: y + 1.0, mesh=mesh)
    np.testing.assert_array_equal(np.asarray(g(out).gather()), 2.0 * x.T + 1.0)
    assert copied and not any(placeholder(p) for p in copied)


def test_a_view_of_a_placeholder_reads_its_one_element_only():
    """A review: a view of a placeholder took the view's strides over its one element (reading past it)."""
    from shardfuse.backends.protocol import Ref
    from shardfuse.runtime import backend_of

    be = backend_of(sf.DeviceMesh(2, backend="numpy"))
    bufs = [be.empty((64, 64), "float64", devices=(1,))]
    v = be.view(bufs, Ref(0, (0, 5), (32, 64), (64, 1), "float64"), 0)
    assert v.shape == (32, 64) and v.strides == (0, 0) and not v.flags.writeable
    assert be.view(bufs, Ref(0, (0, 5), (32, 64), (64, 1), "float64"), 1).strides == (512, 8)


def test_eager_value_and_grad_of_parameters_placed_on_stages():
    """A pipeline probe: sf.value_and_grad outside jit refused parameters placed on two stages of one mesh ("they are
    on 2 meshes"), though a function jitted on the whole mesh takes them; it compiles for their whole mesh now."""
    mesh = sf.DeviceMesh((2, 2), ("pp", "tp"), backend="numpy")
    st0, st1 = mesh.submesh([0, 1], ("tp",)), mesh.submesh([2, 3], ("tp",))
    r = np.random.default_rng()
    w0, w1, x = r.standard_normal((4, 4)), r.standard_normal((4, 2)), r.standard_normal((3, 4))
    p = {"a": sf.shard(w0, axis=1, over="tp", mesh=st0), "b": sf.shard(w1, axis=0, over="tp", mesh=st1)}

    def loss(p, x):
        h = sf.to_mesh(np.tanh(sf.replicate(x, mesh=st0) @ p["a"]), st1)
        return (h @ p["b"]).sum()
    v, g = sf.value_and_grad(loss)(p, x)
    h = np.tanh(x @ w0)
    np.testing.assert_allclose(float(v), (h @ w1).sum(), rtol=1e-14)
    np.testing.assert_allclose(np.asarray(g["b"]), h.T @ np.ones((3, 2)), rtol=1e-14)
    np.testing.assert_allclose(np.asarray(g["a"]), x.T @ ((1 - h ** 2) * w1.sum(1)), rtol=1e-13)
    assert g["a"].sharding.mesh == st0 and g["b"].sharding.mesh == st1
