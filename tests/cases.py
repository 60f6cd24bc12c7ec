"""Test bodies shared by every tier: one process (virtual NumPy devices) and mpiexec ranks.

Each case builds a jitted function on `mesh`, runs it on fresh random inputs and compares
the gathered result with a float64 NumPy reference.  Output buffers are poisoned with NaN
(SHARDFUSE_POISON=1, set in conftest and by the MPI runner), so an unwritten element fails.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

import shardfuse as sf
from shardfuse.ir import local_shape, unroll
from shardfuse.layout import Layout
from shardfuse.ops import COMMUNICATION, ELEMENTWISE, VIEWS, Op
from shardfuse.passes.allocate import view_bases

os.environ.setdefault("SHARDFUSE_POISON", "1")

TOL = {"float64": 1e-12, "float32": 1e-5}


def gpu_count() -> int:
    """GPUs CuPy sees (0 without CuPy or a driver): what the GPU tests skip on."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


def fresh_rng(mesh):
    """A fresh seed per call, the same on every process (inputs are global arrays)."""
    seed = int.from_bytes(os.urandom(4), "little")
    if mesh.nprocs > 1:
        from mpi4py import MPI

        seed = MPI.COMM_WORLD.bcast(seed)
    return np.random.default_rng(seed)


def assert_close(got, ref, dtype):
    got = np.asarray(got, dtype=np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert np.all(np.isfinite(got)), "unwritten (poisoned) elements in the result"
    # relative to the reference's size, absolute where the reference is all zeros (e.g. a relu
    # of all-negative products, which hypothesis finds)
    err = np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1.0 if not ref.any() else 0.0)
    assert err <= TOL[dtype], f"relative error {err:.3e} > {TOL[dtype]:.0e}"


def randn(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


# At D = 1 a collective is the identity: a view of its source where its destination is an
# intermediate, else a copy into it (passes/fold.py): the plan then issues none, and says so.
ONE_DEVICE: dict = {}


def seed_case(mesh, chunks, streams, dtype, b_sharded=False, m=4, k=8, n=8):
    """nvFuser's seed: a[S, D, m, K] sharded on axis 1, c = stream(a @ b, axis=0)."""
    d = mesh.size
    rng = fresh_rng(mesh)

    @sf.jit(mesh=mesh, streams=streams)
    def ag_matmul(a, b):
        a = sf.shard(a, axis=1, over="DIDx")
        if b_sharded:
            b = sf.shard(b, axis=1, over="DIDx")
            return sf.stream(sf.shard(a @ b, axis=3, over="DIDx"), axis=0)
        return sf.stream(a @ b, axis=0)

    a = randn(rng, (chunks, d, m, k), dtype)
    b = randn(rng, (k, n * d), dtype)
    c = ag_matmul(sf.shard(a, axis=1, over="DIDx", mesh=mesh), b)
    assert c.sharding.placements(mesh) == (("S(3)",) if b_sharded else ("R",))
    assert_close(c.gather(), a.astype(np.float64) @ b.astype(np.float64), dtype)
    plan = ag_matmul.lower(sf.TensorSpec(a.shape, dtype), sf.TensorSpec(b.shape, dtype))
    assert plan.collectives() == (ONE_DEVICE if d == 1 else {"allgather": chunks})
    return plan


def natural_case(mesh, chunks, streams, dtype, b_sharded=False, m=2, k=8, n=8):
    """The natural layout: x[M, K] sharded on rows, stream(x @ w, axis=0, chunks=S)."""
    d = mesh.size
    rng = fresh_rng(mesh)

    @sf.jit(mesh=mesh, streams=streams)
    def linear(x, w):
        x = sf.shard(x, axis=0, over="DIDx")
        if b_sharded:
            w = sf.shard(w, axis=1, over="DIDx")
            return sf.stream(sf.shard(x @ w, axis=1, over="DIDx"), axis=0, chunks=chunks)
        return sf.stream(x @ w, axis=0, chunks=chunks)

    x = randn(rng, (d * chunks * m, k), dtype)
    w = randn(rng, (k, n * d), dtype)
    c = linear(x, w)  # plain arrays: replicated globals, sliced locally at entry
    assert_close(c.gather(), x.astype(np.float64) @ w.astype(np.float64), dtype)
    assert linear.lower(sf.TensorSpec(x.shape, dtype), sf.TensorSpec(w.shape, dtype)).collectives() == \
        (ONE_DEVICE if d == 1 else {"allgather": chunks})


def unpipelined_case(mesh, dtype, chunks=4, m=3, k=8, n=5):
    d = mesh.size
    rng = fresh_rng(mesh)

    @sf.jit(mesh=mesh)
    def ag_then_matmul(a, b):
        return sf.replicate(sf.shard(a, axis=1, over="DIDx") @ b)

    a, b = randn(rng, (chunks, d, m, k), dtype), randn(rng, (k, n), dtype)
    assert_close(ag_then_matmul(a, b).gather(), a.astype(np.float64) @ b, dtype)
    assert ag_then_matmul.lower(sf.TensorSpec(a.shape, dtype), sf.TensorSpec(b.shape, dtype)).collectives() == \
        (ONE_DEVICE if d == 1 else {"allgather": 1})


def allgather_case(mesh, axis, dtype="float64"):
    d = mesh.size
    rng = fresh_rng(mesh)
    f = sf.jit(lambda x: sf.replicate(sf.shard(x, axis=axis)), mesh=mesh)
    x = randn(rng, (3 * d, 2 * d, 5), dtype)
    out = f(sf.shard(x, axis=axis, mesh=mesh))
    assert out.sharding.placements(mesh) == ("R",)
    assert_close(out.gather(), x.astype(np.float64), dtype)


def allreduce_case(mesh, dtype="float64"):
    d = mesh.size
    rng = fresh_rng(mesh)
    f = sf.jit(lambda x: sf.shard(x, axis=1).sum(1), mesh=mesh)
    x = randn(rng, (6, 3 * d), dtype)
    assert_close(f(x).gather(), x.astype(np.float64).sum(1), dtype)
    assert f.lower(sf.TensorSpec(x.shape, dtype)).collectives() == (ONE_DEVICE if d == 1 else {"allreduce": 1})


def reduce_scatter_case(mesh, dtype="float64"):
    """Row-parallel linear: x column-sharded, w row-sharded, output sharded on rows."""
    d = mesh.size
    rng = fresh_rng(mesh)

    @sf.jit(mesh=mesh)
    def row_parallel(x, w):
        return sf.shard(sf.shard(x, axis=1) @ sf.shard(w, axis=0), axis=0)

    x, w = randn(rng, (2 * d, 3 * d), dtype), randn(rng, (3 * d, 4), dtype)
    out = row_parallel(x, w)
    assert out.sharding.placements(mesh) == ("S(0)",)
    assert_close(out.gather(), x.astype(np.float64) @ w, dtype)
    assert row_parallel.lower(sf.TensorSpec(x.shape, dtype), sf.TensorSpec(w.shape, dtype)).collectives() == \
        (ONE_DEVICE if d == 1 else {"reduce_scatter": 1})


def slice_case(mesh, dtype="float64"):
    """Replicated -> sharded is a local slice: no communication."""
    d = mesh.size
    rng = fresh_rng(mesh)
    f = sf.jit(lambda x, w: sf.shard(x @ w, axis=0), mesh=mesh)
    x, w = randn(rng, (2 * d, 3), dtype), randn(rng, (3, 4), dtype)
    spec = sf.TensorSpec(x.shape, dtype, Layout.replicated(2))
    plan = f.lower(spec, sf.TensorSpec(w.shape, dtype, Layout.replicated(2)))
    assert plan.collectives() == {}
    assert any(i.op == "shard_slice" for i in plan.program.walk())
    out = plan(x, w)
    assert out.sharding.placements(mesh) == ("S(0)",)
    assert_close(out.gather(), x.astype(np.float64) @ w, dtype)


def from_local_case(mesh, dtype="float64"):
    """SPMD input: each process passes its own shard."""
    rng = fresh_rng(mesh)
    d = mesh.size
    x = randn(rng, (d * 2, 3), dtype)
    per = x.shape[0] // mesh.nprocs
    piece = x[mesh.rank * per:(mesh.rank + 1) * per]
    arr = sf.from_local(piece, axis=0, mesh=mesh)
    assert arr.shape == x.shape
    f = sf.jit(lambda x: sf.replicate(sf.shard(x, axis=0)), mesh=mesh)
    assert_close(f(arr).gather(), x.astype(np.float64), dtype)


def from_local_2d_case(mesh, over, run_plan=True):
    """SPMD input on a 2-D mesh (JAX's make_array_from_process_local_data): each process passes
    the blocks of its devices' positions along `over`, in order; the value is sharded on `over`
    and replicated over the other mesh axis, and every device holds its position's block."""
    k = mesh.axis_index(over)
    x = np.random.default_rng(7).standard_normal((2 * mesh.shape[k], 3))  # (the same on every rank)
    held = sorted({mesh.coords(d)[k] for d in mesh.local_devices})
    arr = sf.from_local(np.concatenate([x[2 * p:2 * p + 2] for p in held]), axis=0, over=over, mesh=mesh)
    assert arr.shape == x.shape
    assert arr.sharding.placements(mesh) == tuple("S(0)" if n == over else "R" for n in mesh.axis_names)
    for d, piece in zip(mesh.local_devices, arr.shards):
        p = mesh.coords(d)[k]
        np.testing.assert_array_equal(piece, x[2 * p:2 * p + 2])
    np.testing.assert_array_equal(arr.gather(), x)
    if run_plan:
        f = sf.jit(lambda v: sf.replicate(v * 2.0), mesh=mesh)
        np.testing.assert_allclose(f(arr).gather(), 2 * x, rtol=1e-15)


# (from_local's arguments, the same layout as sf.distribute's placements) on a ("dp", "tp") mesh
FROM_LOCAL_2AXES = {
    "axes (0, 1) over (dp, tp)": ({"axis": (0, 1), "over": ("dp", "tp")}, [sf.Shard(0), sf.Shard(1)]),
    "axes (1, 0) over (dp, tp)": ({"axis": (1, 0), "over": ("dp", "tp")}, [sf.Shard(1), sf.Shard(0)]),
    "axis 0 over (dp, tp)": ({"axis": 0, "over": ("dp", "tp")}, [sf.Shard(0), sf.Shard(0)]),
    "axis 0 over (tp, dp)": ({"axis": 0, "over": ("tp", "dp")}, [sf.StridedShard(0, split_factor=2), sf.Shard(0)]),
    "spec ((tp, dp), None)": ({"placements": (("tp", "dp"), None)}, [sf.StridedShard(0, 2), sf.Shard(0)]),
}


def local_part(x, ref):
    """The piece this process passes to sf.from_local for the layout of `ref` (an sf.Array of x):
    along each axis, the blocks its devices hold, in order."""
    rows = [sorted({(s.index[i].start, s.index[i].stop) for s in ref.addressable_shards}) for i in range(x.ndim)]
    return x[np.ix_(*[np.concatenate([np.arange(a, b) for a, b in r]) for r in rows])]


def from_local_2axes_case(mesh, case):
    """sf.from_local of a value sharded on two tensor axes (or one over two mesh axes, in either
    order): the same layout as sf.distribute with DTensor's placements (and DTensor's call form
    from_local(piece, mesh, placements)), every device holding its own distinct block."""
    kwargs, placements = FROM_LOCAL_2AXES[case]
    x = np.arange(8.0 * 12).reshape(8, 12)  # (distinct values: every block differs; the same on every rank)
    ref = sf.distribute(x, mesh, placements)
    piece = local_part(x, ref)
    for arr in (sf.from_local(piece, mesh=mesh, **kwargs), sf.from_local(piece, mesh, placements)):
        assert arr.shape == x.shape and arr.sharding == ref.sharding
        assert arr.placements == tuple(placements)
        for s, r in zip(arr.addressable_shards, ref.addressable_shards):
            assert s.index == r.index
            np.testing.assert_array_equal(s.data, x[s.index])
        np.testing.assert_array_equal(arr.gather(), x)
    try:  # to_local: this process' blocks as the one box they tile, what from_local took
        local = arr.to_local()
    except ValueError as e:  # (blocks dp and dp + 2 of one axis, under -n 2: no box)
        assert "do not tile one box" in str(e) and mesh.nprocs > 1, e
    else:
        np.testing.assert_array_equal(local, piece)
    f = sf.jit(lambda v: sf.replicate(v * 2.0), mesh=mesh)
    np.testing.assert_array_equal(f(arr).gather(), 2 * x)


def from_local_partial_sums_case(mesh):
    """What from_local's refusal of Partial() says to do: the partial sums stacked on a new axis
    sharded over that mesh axis, summed (an all-reduce)."""
    parts = np.arange(2 * 4 * 3.0).reshape(2, 4, 3) ** 2  # partial sum p on dp position p
    with pytest.raises(ValueError, match=r"Partial\(\) placements .* are not supported: stack .*\.sum\(0\)"):
        sf.from_local(parts[0], mesh, [sf.Partial(), sf.Replicate()])
    held = sorted({mesh.coords(d)[0] for d in mesh.local_devices})
    total = sf.from_local(parts[held], axis=0, over="dp", mesh=mesh).sum(0)
    np.testing.assert_array_equal(total.gather(), parts.sum(0))


# ---- the resharding table, one entry per row: (source, target, what the plan must insert) ----
RESHARD_TABLE = {
    "S(0)->R": ({"allgather": 1}, lambda x: sf.replicate(sf.shard(x, axis=0) * 2.0), lambda x: 2 * x),
    "S(1)->R": ({"allgather": 1}, lambda x: sf.replicate(sf.shard(x, axis=1) * 2.0), lambda x: 2 * x),
    "R->S(0)": ({}, lambda x: sf.shard(x * 2.0, axis=0), lambda x: 2 * x),
    "S(0)->S(1)": ({"alltoall": 1}, lambda x: sf.shard(sf.shard(x, axis=0) * 2.0, axis=1), lambda x: 2 * x),
    "S(1)->S(2)": ({"alltoall": 1}, lambda x: sf.shard(sf.shard(x, axis=1) * 2.0, axis=2), lambda x: 2 * x),
    "P->R": ({"allreduce": 1}, lambda x: sf.replicate(sf.shard(x, axis=1).sum(1)), lambda x: x.sum(1)),
    "P->S(0)": ({"reduce_scatter": 1}, lambda x: sf.shard(sf.shard(x, axis=1).sum(1), axis=0), lambda x: x.sum(1)),
    "P->S(1)": ({"reduce_scatter": 1}, lambda x: sf.shard(sf.shard(x, axis=0).sum(0), axis=1), lambda x: x.sum(0)),
}


def reshard_case(mesh, entry, dtype="float64"):
    expected, fn, ref = RESHARD_TABLE[entry]
    d = mesh.size
    if d == 1:  # the identity: folded into a view (the all-to-all's destination feeds the * 2.0), or a copy
        expected = ONE_DEVICE  # into the output (passes/fold.py)
    rng = fresh_rng(mesh)
    x = randn(rng, (2 * d, 3 * d, 2 * d), dtype)
    f = sf.jit(fn, mesh=mesh)
    spec = sf.TensorSpec(x.shape, dtype, Layout.replicated(3) if entry.startswith("R->") else None)
    plan = f.lower(spec)
    assert plan.collectives() == expected, str(plan)
    assert_close(plan(x).gather(), ref(x.astype(np.float64)), dtype)


# ---- moves between meshes (pipeline stages), one row per lowering -------------------------
def _put(v, how, mesh):
    kind, devices = how
    sub = mesh.submesh(devices) if devices is not None else mesh
    return sf.replicate(v, mesh=sub) if kind == "R" else sf.shard(v, axis=int(kind[2]), mesh=sub)


def _move(v, how, mesh):
    kind, devices = how
    return sf.to_mesh(v, mesh.submesh(devices), axis=None if kind == "R" else int(kind[2]))


MOVES = {  # (source placement, devices), (target placement, devices), what the plan must insert
    "R(0,1)->R(2,3)": (("R", (0, 1)), ("R", (2, 3)), {"sendrecv": 1}),
    "R(0)->R(2,3)": (("R", (0,)), ("R", (2, 3)), {"broadcast": 1}),
    "R(0,1)->S0(2,3)": (("R", (0, 1)), ("S(0)", (2, 3)), {"scatter": 1}),
    "S0(0,1)->S0(2,3)": (("S(0)", (0, 1)), ("S(0)", (2, 3)), {"sendrecv": 1}),
    "S0(0,1)->R(2,3)": (("S(0)", (0, 1)), ("R", (2, 3)), {"gather": 1, "broadcast": 1}),
    "S0(0,1)->R(3)": (("S(0)", (0, 1)), ("R", (3,)), {"gather": 1}),
    # (cut into the destination's column blocks where it is, then each block sent: never through one device)
    "S0(0,1)->S1(2,3)": (("S(0)", (0, 1)), ("S(1)", (2, 3)), {"alltoall": 1, "sendrecv": 1}),
    "S0(all)->S0(2,3)": (("S(0)", None), ("S(0)", (2, 3)), {"gather": 1, "scatter": 1}),
}


def move_case(mesh, entry, dtype="float64"):
    """mesh has 4 devices; x is placed on one mesh, scaled there, and moved to another."""
    src, dst, expected = MOVES[entry]
    rng = fresh_rng(mesh)
    x = randn(rng, (8, 6), dtype)
    f = sf.jit(lambda x: _move(_put(x, src, mesh) * 2.0, dst, mesh), mesh=mesh)
    plan = f.lower(sf.TensorSpec(x.shape, dtype))
    assert plan.collectives() == expected, str(plan)
    out = f(x)
    assert out.sharding.mesh.devices == dst[1]
    assert_close(out.gather(), 2 * x.astype(np.float64), dtype)


def pipeline_case(mesh, dtype="float64"):
    """Two pipeline stages: stage 0 computes on rows sharded over its devices, stage 1 takes
    them over with SendRecv and finishes the layer."""
    s0, s1 = mesh.submesh([0, 1]), mesh.submesh([2, 3])
    rng = fresh_rng(mesh)
    x, w0, w1 = randn(rng, (8, 6), dtype), randn(rng, (6, 6), dtype), randn(rng, (6, 5), dtype)

    @sf.jit(mesh=mesh)
    def two_stages(x, w0, w1):
        h = sf.shard(x, axis=0, mesh=s0) @ sf.replicate(w0, mesh=s0)
        return sf.relu(sf.to_mesh(h, s1, axis=0)) @ sf.replicate(w1, mesh=s1)

    plan = two_stages.lower(*(sf.TensorSpec(a.shape, dtype) for a in (x, w0, w1)))
    assert plan.collectives() == {"sendrecv": 1}
    out = two_stages(x, w0, w1)
    x64 = x.astype(np.float64)
    assert_close(out.gather(), np.maximum(x64 @ w0, 0) @ w1, dtype)


def stage_collectives_case(mesh, dtype="float64"):
    """Tensor parallelism inside a pipeline stage: collectives over the stage's own devices."""
    s1 = mesh.submesh(mesh.devices[len(mesh.devices) // 2:])
    rng = fresh_rng(mesh)
    x, w = randn(rng, (4 * s1.size, 6), dtype), randn(rng, (6, 2 * s1.size), dtype)

    @sf.jit(mesh=mesh)
    def stage(x, w):
        h = sf.shard(x, axis=0, mesh=s1) @ sf.shard(w, axis=1, mesh=s1)  # gathers x within the stage
        return sf.replicate(h.sum(1), mesh=s1)                           # all-reduces within the stage

    plan = stage.lower(sf.TensorSpec(x.shape, dtype), sf.TensorSpec(w.shape, dtype))
    # a one-device stage's gather folds into a view, its all-reduce (which writes the output) a device copy
    assert plan.collectives() == ({} if s1.size == 1 else {"allgather": 1, "allreduce": 1}), str(plan)
    out = stage(x, w)
    assert out.sharding.mesh == s1
    assert_close(out.gather(), (x.astype(np.float64) @ w).sum(1), dtype)


# ---- buffer reuse (passes/reuse.py): checked apart from the pass, on any plan ----
def slabs_of(prog) -> dict:
    """buffer -> its slab, as printed."""
    return {i.outs[0]: i.attrs["slab"] for i in prog.instrs if i.op == Op.ALLOCATE and "slab" in i.attrs}


def check_lives_apart(prog):
    """Independently of the pass: over the steps one call issues (loops unrolled), every buffer's
    first and last use (views included, communication until its Wait); slab-mates never overlap."""
    base, comm, span, steps = view_bases(prog), {}, {}, list(unroll(prog.instrs))
    for k, (i, _) in enumerate(steps):
        if i.op in VIEWS or i.op == Op.ALLOCATE:
            continue
        if i.op in COMMUNICATION:
            comm[i.outs[0]] = [base.get(v, v) for v in i.values()]
        used = [b for h in i.ins for b in comm.get(h, ())] if i.op == Op.WAIT else \
            [base.get(v, v) for v in (*i.values(), *i.outs)]
        for b in used:
            span[b] = (span.get(b, (k, k))[0], k)
    members = {}
    for v, s in slabs_of(prog).items():
        members.setdefault(s, []).append(v)
    printed = {i.outs[0]: i.attrs.get("in_place_of") for i in prog.instrs if i.op == Op.ALLOCATE}
    for vs in members.values():
        lives = sorted((span[v], v) for v in vs if v in span)
        for ((_, end), a), ((start, _), b) in zip(lives, lives[1:]):
            # or they meet at one step that writes b over a, element for element (passes/reuse.py)
            assert end < start or (end == start and printed[b] == a.name and _writes_over(steps[end][0], a, b, base, prog.mesh)), \
                (vs, lives)
    return members


def _writes_over(i, a, b, base, mesh) -> bool:
    """Whether step i reads buffer a itself (no other view of it) and writes buffer b, of a's dtype and local shape, with an elementwise op that reads each element before writing it."""
    op = i.attrs["expr"].op if i.op == Op.FUSED else i.op
    return (i.into is b and a in i.ins and all(v is a for v in i.ins if base.get(v, v) is a)
            and a.type.dtype == b.type.dtype and local_shape(a, mesh) == local_shape(b, mesh)
            and op in ELEMENTWISE and op not in (Op.WHERE_THEN, Op.WHERE_ELSE, Op.FILL_THEN, Op.FILL_ELSE,
                                                 Op.REDUCE_MAX, Op.REDUCE_MIN, Op.ORDER_KEYS, Op.FROM_ORDER_KEYS))


def central_differences(f, w, eps=1e-6):
    """The gradient of the scalar f at the array w by central differences, element by element (float64)."""
    g = np.zeros_like(w)
    for i in np.ndindex(*w.shape):
        d = np.zeros_like(w)
        d[i] = eps
        g[i] = (f(w + d) - f(w - d)) / (2 * eps)
    return g


def directional(loss_np, params, grads, rng, eps=1e-6):
    """(central difference of loss_np along a random direction of params, <grads, direction>): a
    gradient checked along one direction of every parameter at once (params and grads: pytrees)."""
    from shardfuse import tree

    leaves, td = tree.flatten(params)
    dirs = [rng.standard_normal(np.shape(v)) for v in leaves]
    at = lambda s: td.unflatten([v + s * d for v, d in zip(leaves, dirs)])  # noqa: E731
    numeric = (loss_np(at(eps)) - loss_np(at(-eps))) / (2 * eps)
    return numeric, sum(float(np.sum(np.asarray(g) * d)) for g, d in zip(tree.leaves(grads), dirs))
