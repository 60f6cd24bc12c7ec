"""The one executor: binds a plan to a backend once, then runs it as a flat list of steps.

Binding resolves everything that does not change between calls: loops are unrolled, every
view (chunk slice, pool slot, shard slice, reshape) becomes a `Ref` (slot, per-device element
offsets, shape, strides), the stream of every step is fixed, persistent buffers and events
are created.  A call then only places its inputs, allocates its outputs and runs the steps.
The steps are exactly the plan's (steps.issue_order: one per printed instruction that issues
work; none is added here, no staging copy either: passes/contiguity.py prints those), each on
the devices steps.devices_of gives it: this process leaves out the compute steps of a pipeline
stage it holds no device of, and runs the others on its devices of their stage only.
Backends see Refs, streams and local devices, never the IR.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import replace

from shardfuse import faults
from shardfuse.runtime import backend_of
from shardfuse.pieces import check_args, local_pieces, placement
from shardfuse.interop import Fence, host_view, stream_identity, stream_ptr
from shardfuse.backends.protocol import BoundPlan, Ref, block, rank_major
from shardfuse.bind_indexed import INDEXED
from shardfuse.bind_views import bind_view
from shardfuse.fused_steps import bind_fused
from shardfuse.ir import local_shape, walk
from shardfuse.ops import COMMUNICATION, ELEMENTWISE, HOST, Op, VIEWS
from shardfuse.passes.allocate import output_roots
from shardfuse.passes.contiguity import comm_blocks
from shardfuse.slabs import member_ref, poison_slabs
from shardfuse.steps import event_key, issue_order, mesh_of
from shardfuse.strides import ordered_strides

log = logging.getLogger("shardfuse")


class Executable:
    def __init__(self, prog, backend=None, graph: bool = False):
        """Bind prog to `backend` (default: its mesh's, made after the plan check, so ranks that
        disagree fail on the plan, not inside the backend's own setup)."""
        mesh = prog.mesh
        if mesh.nprocs > 1:
            # Under mpiexec every rank must run this very plan, or its collectives pair with
            # other ones (a hang, or garbage).  Checked before binding, which already
            # communicates (sub-communicators, NCCL ids), and again at every call (check_ranks):
            # different shapes, dtypes, chunks, functions, algorithms or meshes print different texts.
            self.agreement = (f"mesh {mesh!r} shape={mesh.shape} axes={mesh.axis_names} devices={mesh.devices} "
                              f"processes={mesh.nprocs} graph={graph}\n{prog}")
            faults.agree(self.agreement, f"plan {prog.name!r}")  # (and each call checks, labelled apart)
        with faults.binding(prog.name):
            self._init(prog, backend_of(mesh) if backend is None else backend, graph)

    def _init(self, prog, backend, graph):
        self.prog, self.backend, self.mesh = prog, backend, prog.mesh
        self.ndev = len(backend.local_devices)
        self.refs: dict = {}
        self.slot_templates: list = []  # per slot: None (input / per call) or persistent buffers
        self.per_call: list = []  # (slot, shape, dtype, devices): the outputs, made at every call
        # slot -> positions j of the local devices its values live on (a pipeline stage's buffers are
        # made on that stage's devices only; a placeholder elsewhere)
        self.slot_devices: dict = {}
        # The plan's steps that this backend runs, in issue order: steps.PlanStep records with
        # `run` (the backend's callable) and `devices` (this process' of the step's) filled in.
        # Steps a backend has nothing to do for (NumPy's events) and steps on none of this
        # process' devices (another pipeline stage's) are left out; `index` is each one's place
        # in the plan's list, as the cost model and a profile number them.
        self.steps: list = []
        self.pending: dict = {}  # comm handle -> its wait step
        self.blocked: dict = {}  # staging buffer stored as [D, ...] blocks -> (axis, D)
        self.pools: list = []  # per pool (Allocate with pool=n): its n entries, one slot each
        self.slabs: dict = {}  # slab number (passes/reuse.py) -> the Ref of its slot, which its buffers view
        for v in prog.inputs:
            self.refs[v] = self._new_slot(local_shape(v, self.mesh), v.type.dtype, None)
        # where each local device's piece of a plain argument lies (its shape checked before the call)
        self._input_pieces = [placement(v.type.shape, v.type.layout, self.mesh) for v in prog.inputs]
        self._deferred: dict = {}  # slot -> (physical shape, dtype): the program's own persistent buffers
        local = tuple(backend.local_devices)
        for i, env, step in issue_order(prog):
            if step is None:  # allocations, views, stream switches: no step
                BIND[i.op](self, i, env, None, ())
                continue
            here = tuple(j for j, d in enumerate(local) if d in step.devices)  # positions j
            if not here and i.op not in BOUND_EVERYWHERE:
                continue  # a compute step of another pipeline stage: nothing to do on this process
            run = BIND[i.op](self, i, env, step.stream, here)
            if run is not None and here:
                self.steps.append(replace(step, devices=tuple(local[j] for j in here), run=run))
        poison_slabs(self, prog)
        self._allocate_used(prog)
        # per output: the slot whose per-call buffers are the output as they are (no view per call), else None
        made = {slot: shape for slot, shape, _, _ in self.per_call}
        # inputs whose buffers outputs took (passes/donate.py): the output is the input's pieces, or a view of
        # them ((x * 2).T: a review found such an argument neither copied nor marked donated)
        roots = output_roots(prog)
        self.donated = tuple(k for k, v in enumerate(prog.inputs) if v in roots)
        made.update({self.refs[prog.inputs[k]].slot: self.refs[prog.inputs[k]].shape for k in self.donated})
        self._whole_outputs = [r.slot if made.get(r.slot) == r.shape and not any(r.offsets) and r.is_contiguous()
                               else None for r in (self.refs[v] for v in prog.outputs)]
        self._graph_outputs, self.calls = None, 0  # (calls run: graph-mode outputs hold until the next)
        self._out_layouts = [v.type.layout.held_by(prog.mesh) for v in prog.outputs]  # (as an sf.Array holds them)
        self._out_spares = {}  # output -> per local device: None (its view) or a placeholder (no buffer there)
        for v in prog.outputs:
            made_on = self.slot_devices.get(self.refs[v].slot)
            if made_on is not None:
                spare = self.backend.empty(self.refs[v].shape, v.type.dtype, ())
                self._out_spares[v] = [None if j in made_on else spare[j] for j in range(self.ndev)]
        self.accepted = set()  # hot-path cache of layout checks
        # One call at a time: the plan's persistent buffers (gather pools, scratch) and its graphs
        # are shared by every call, so two threads issuing at once would write each other's chunks.
        # A lock, not per-thread buffers: no memory, and held only while the host issues.
        self.lock = threading.Lock()
        if graph and backend.name == "cupy" and any(i.op in (Op.ARGSORT, Op.PERMUTE) for i in prog.walk()):
            raise NotImplementedError(f"plan {prog.name!r}: np.sort / np.argsort / sf.top_k do not run in a CUDA graph "
                                      "(CuPy's argsort allocates and synchronises its stream): use graph=False")
        self.graph = backend.capture(self.bound_plan()) if graph else None
        log.info("bound plan %r on %s: %d steps%s", prog.name, backend.name, len(self.steps), " (graphs)" * graph)

    def bound_plan(self) -> BoundPlan:
        """What a backend may see of this bound plan (graph capture): its steps and slots."""
        inputs = tuple((self.refs[v].shape, self.refs[v].dtype, placed_on(where[0]))
                       for v, where in zip(self.prog.inputs, self._input_pieces))
        return BoundPlan(tuple(s.run for s in self.steps), tuple(self.slot_templates), inputs, tuple(self.per_call))

    # ---- slots ------------------------------------------------------------------------
    def _new_slot(self, shape, dtype, buffers, order=None) -> Ref:
        slot = len(self.slot_templates)
        self.slot_templates.append(buffers)
        return Ref(slot, (0,) * self.ndev, tuple(shape), ordered_strides(tuple(shape), order), dtype)

    def _allocate(self, v, shape, per_call: bool, order=None) -> Ref:
        """A slot for one of the program's buffers (value v's): made every call (per_call), or once,
        after binding, if a step still uses it (see _allocate_used)."""
        dtype = v.type.dtype
        phys_shape = tuple(shape[o] for o in order) if order else tuple(shape)
        ref = self._new_slot(shape, dtype, None, order)
        self._lives_on(ref.slot, v)
        if per_call:
            self.per_call.append((ref.slot, phys_shape, dtype, self.slot_devices[ref.slot]))
        else:
            self._deferred[ref.slot] = (phys_shape, dtype)
        return ref

    def _allocate_used(self, prog):
        """The program's own persistent buffers, made once binding is done and only where a step
        still uses them."""
        used = {self.refs[v].slot for v in prog.outputs}
        for i in walk(prog.instrs):
            if i.op in VIEWS or i.op == Op.ALLOCATE:
                continue
            for v in (*i.values(), *i.outs):
                ref = self.refs.get(v)
                if isinstance(ref, Ref):
                    used.add(ref.slot)
        for pool in self.pools:  # a pool's entries serve the iterations in turn: all or none
            if any(r.slot in used for r in pool):
                used.update(r.slot for r in pool)
        for slot, (shape, dtype) in self._deferred.items():
            if slot in used:
                self.slot_templates[slot] = self.backend.empty(shape, dtype, self.slot_devices.get(slot))

    def _lives_on(self, slot, v):
        """Note that value v's buffer is (or shares) `slot`: its devices among the local ones, None for all."""
        if slot in self.slot_devices and self.slot_devices[slot] is None:
            return  # (already on every local device)
        mine = set(mesh_of(v).devices)
        here = {j for j, d in enumerate(self.backend.local_devices) if d in mine} | self.slot_devices.get(slot, set())
        self.slot_devices[slot] = None if len(here) == self.ndev else frozenset(here)

    # ---- binding: each binder returns the instruction's step (None: it issues nothing) ----
    # `devices`: the positions j of the local devices the step runs on (steps.devices_of), which
    # compute steps and copies pass on; communication has its team, stream steps all devices.
    def _bind_allocate(self, i, env, stream, devices):
        v, a = i.outs[0], i.attrs
        shape = local_shape(v, self.mesh)
        if a.get("blocks"):  # a staging buffer stored as communication reads or writes it: [D, ...]
            self.blocked[v] = ax, d = a["blocks"]
            shape = (d,) + shape[:ax] + (shape[ax] // d,) + shape[ax + 1:]
        if a.get("pool"):
            # one buffer per pool entry (Select picks one at bind time), each laid out by the
            # backend as any buffer: the devices of one GPU one piece apart, so their GEMMs on a
            # pool entry can be one batched call (a (pool,) + shape buffer per device would put
            # them `pool` pieces apart)
            self.refs[v] = tuple(self._allocate(v, shape, False) for _ in range(a["pool"]))
            self.pools.append(self.refs[v])
        elif "slab" in a:  # storage shared with buffers whose lives do not overlap
            self.refs[v] = member_ref(self.slabs, self._new_slot, self._deferred, a["slab"], shape, v.type.dtype,
                                      a.get("order"))
            self._lives_on(self.refs[v].slot, v)
        else:
            self.refs[v] = self._allocate(v, shape, a.get("per_call", False), a.get("order"))

    def _bind_record(self, i, env, stream, devices):
        key = event_key(i.outs[0], i, env)
        self.refs[key] = self.backend.new_event()
        return self.backend.bind_record(self.refs[key], stream)

    def _bind_wait_event(self, i, env, stream, devices):
        return self.backend.bind_wait_event(self.refs[event_key(i.ins[0], i, env)], stream)

    def _bind_synchronize(self, i, env, stream, devices):
        return self.backend.bind_join(stream, i.attrs["stream"].at(env))

    def _bind_sendrecv(self, i, env, stream, devices):
        start, self.pending[i.outs[0]] = self.backend.bind_sendrecv(*self._comm_operands(i), self._team(i, i.attrs["team"]),
                                                                    i.attrs["shift"], stream)
        return start

    def _bind_matmul(self, i, env, stream, devices):
        x, y = (self.refs[v] for v in i.ins)
        return self.backend.bind_matmul(x, y, self.refs[i.into], stream, devices=devices)

    def _bind_elementwise(self, i, env, stream, devices):
        x, y = (self.refs[v] for v in i.ins) if len(i.ins) == 2 else (self.refs[i.ins[0]], None)
        scalar = {"scalar": i.attrs["value"]} if "value" in i.attrs else {}
        return self.backend.bind_elementwise(i.op, x, y, self.refs[i.into], stream, devices=devices, **scalar)

    def _bind_sum(self, i, env, stream, devices):
        """A Sum, or a FusedSum: the sum of the chain `expr` of its operands, never written (passes/fuse.py)."""
        args = (i.attrs["axis"], self.refs[i.into], stream, i.attrs.get("factor", 1.0))
        if i.op == Op.FUSED_SUM:
            return self.backend.bind_fused_sum(i.attrs["expr"], [self.refs[v] for v in i.ins], *args, devices=devices)
        return self.backend.bind_sum(self.refs[i.ins[0]], *args, devices=devices)

    def _bind_copy(self, i, env, stream, devices):
        """A copy into or out of a staging buffer stored in blocks sees the other side in blocks too."""
        src, dst = i.ins[0], i.into
        blocks = self.blocked.get(src) or self.blocked.get(dst)
        return self.backend.bind_copy(self._in_blocks(src, blocks), self._in_blocks(dst, blocks), stream,
                                      devices=devices)

    def _in_blocks(self, v, blocks) -> Ref:
        """v as its [D, ...] view where blocks = (axis, D) says it holds D blocks (a staging
        buffer stored in blocks already is one)."""
        ref = self.refs[v]
        return rank_major(ref, *blocks) if blocks is not None and v not in self.blocked else ref

    def _comm_operands(self, i) -> tuple:
        """(send, recv) of communication i as it reads and writes them: contiguous (the plan stages)."""
        refs = [self._in_blocks(v, b) for v, b in zip((i.ins[0], i.into), comm_blocks(i, self.mesh))]
        for v, ref in zip((i.ins[0], i.into), refs):
            if not ref.is_contiguous():  # (backends move contiguous views only)
                raise RuntimeError(f"{i.op} {v.name}: a strided view {ref.shape}, strides {ref.strides}, reached "
                                   "communication unstaged (passes/contiguity.py stages every one, printed)")
        return refs

    def _bind_transfer(self, i, env, stream, devices):
        """A move between meshes as point-to-point copies: (src device, send, dst device, recv)."""
        a, kind = i.attrs, i.attrs["kind"]
        frm, to = a["from"], a["to"]
        send, recv = self._comm_operands(i)
        if kind == "Scatter":  # block q of the root's whole value goes to destination q
            pairs = [(frm[0], block(send, q), d, recv) for q, d in enumerate(to)]
        elif kind == "Gather":  # source p's piece lands in block p of the root's whole value
            pairs = [(s, send, to[0], block(recv, p)) for p, s in enumerate(frm)]
        elif kind == "Broadcast":
            pairs = [(frm[0], send, d, recv) for d in to]
        else:  # SendRecv: device p to device p
            pairs = list(zip(frm, [send] * len(frm), to, [recv] * len(to)))
        start, self.pending[i.outs[0]] = self.backend.bind_transfers(pairs, stream)
        return start

    def _team(self, i, name):
        """What a backend's collective runs over: a mesh axis name of the program's mesh, or
        (sub-mesh, axis name) for a value that lives on a sub-mesh (backends that can)."""
        mesh = mesh_of(i.ins[0])
        if mesh == self.mesh:
            return name
        if not self.backend.submesh_teams:
            raise NotImplementedError(f"{i.op} of {i.ins[0].name} inside the sub-mesh {mesh}: the {self.backend.name} "
                                      "backend does not run collectives within a sub-mesh yet (moves between meshes work)")
        return (mesh, name)

    def _bind_collective(self, i, env, stream, devices):
        op = {"op": i.attrs["op"]} if "op" in i.attrs else {}  # (an Allreduce's max / min)
        start, self.pending[i.outs[0]] = COLLECTIVE_BINDERS[i.op](self.backend)(
            *self._comm_operands(i), self._team(i, i.attrs["team"]), stream, **op)
        return start

    def __call__(self, *args, stream=None, infos=None):
        """Run the plan (call_checked, after check_args)."""
        return self.call_checked(args, check_args(self.prog, args, self.backend, self.accepted, infos), stream)[0]

    def call_checked(self, args, infos, stream):
        """A call on checked arguments (check_args' infos): (the outputs, their interop.Fence, None on
        host devices).  On GPUs the plan's main stream waits for the caller's stream (stream=, or
        CuPy's current one), which then waits for the plan's outputs: the Fence names that stream."""
        self.check_ranks(args, infos)
        caller = None if self.backend.ordinals is None else stream_ptr(stream)
        with self.lock:
            outs = self.run(args, infos, caller)
            return outs, None if caller is None else Fence(stream_identity(caller), self.calls, self.graph and self)

    def check_ranks(self, args=(), infos=()):
        """Under mpiexec, every call: every rank calls this very plan on the same host arguments, else
        RankMismatchError on all."""
        if self.mesh.nprocs > 1:
            prints = faults.input_prints([v.name for v in self.prog.inputs], args, infos, host_view)
            faults.agree(self.agreement, f"plan {self.prog.name!r}{faults.A_CALL}", prints)

    def run(self, args, infos, caller, issue=None):
        """One call, with self.lock held: place the inputs, issue the steps (or issue(bufs)), return
        the outputs; fenced with the caller's stream (a pointer on GPUs, else None)."""
        be = self.backend
        self.calls += 1
        if caller is not None:
            be.fence_in(caller)
        bufs = list(self.slot_templates)
        for k, (arg, v, info) in enumerate(zip(args, self.prog.inputs, infos)):
            if info is None:  # an sf.Array: its pieces are already placed (placeholders outside its stage: kept)
                bufs[k] = arg.shards if arg.pieces_contiguous else [
                    s if at is None else be.ascontiguous(s) for s, at in zip(arg.shards, self._input_pieces[k][0])]
            else:
                bufs[k] = local_pieces(arg, v.type.dtype, v.type.layout, self.mesh, info, fenced=caller,
                                       where=self._input_pieces[k])
            if k in self.donated and not (info is None and arg.owned):
                # a caller's array (maybe viewed, or one buffer for a GPU's devices): the result writes a copy
                bufs[k] = [p if at is None else be.copy(p) for p, at in zip(bufs[k], self._input_pieces[k][0])]
        if self.graph is not None:
            static = self.graph(bufs)  # writes plan-owned outputs (the next call overwrites them)
            if self._graph_outputs is None:
                self._graph_outputs = self._outputs(static)
            outs = self._graph_outputs
        else:
            for slot, shape, dtype, devices in self.per_call:
                bufs[slot] = be.empty(shape, dtype, devices)
            if issue is None:
                for step in self.steps:
                    step.run(bufs)
            else:
                issue(bufs)
            outs = self._outputs(bufs)
        if caller is not None:
            be.fence_out(caller)
        return outs

    def _outputs(self, bufs):
        outs = []
        for v, whole, lay in zip(self.prog.outputs, self._whole_outputs, self._out_layouts):
            if whole is not None:
                shards = list(bufs[whole])
            else:
                ref, spare = self.refs[v], self._out_spares.get(v)
                # (a device the output's buffer was not made on holds a placeholder: no view of one)
                shards = [self.backend.view(bufs, ref, j) if spare is None or spare[j] is None else spare[j]
                          for j in range(self.ndev)]
            outs.append((lay, shards, whole is not None))
        return outs


def placed_on(indices):
    """The positions j of the local devices holding a piece (pieces.piece_indices: not None), None for all."""
    here = tuple(j for j, idx in enumerate(indices) if idx is not None)
    return None if len(here) == len(indices) else here


def _no_step(self, i, env, stream, devices):  # stream switches (steps.issue_order follows them)
    return None


# Every host-level Op's binder (tests/test_architecture.py checks that the keys are ops.HOST).
BIND = {
    Op.ALLOCATE: Executable._bind_allocate,
    **dict.fromkeys(VIEWS, bind_view),  # (shardfuse/bind_views.py)
    Op.GET_STREAM: _no_step,
    Op.SET_STREAM: _no_step,
    Op.RECORD_EVENT: Executable._bind_record,
    Op.WAIT_EVENT: Executable._bind_wait_event,
    Op.SYNCHRONIZE: Executable._bind_synchronize,
    Op.SENDRECV: Executable._bind_sendrecv,
    Op.TRANSFER: Executable._bind_transfer,
    **{op: Executable._bind_collective for op in (Op.ALLGATHER, Op.ALLREDUCE, Op.REDUCE_SCATTER, Op.ALLTOALL)},
    Op.WAIT: lambda self, i, env, stream, devices: self.pending.pop(i.ins[0]),  # (its collective's wait step)
    Op.MATMUL: Executable._bind_matmul,
    **{op: Executable._bind_elementwise for op in ELEMENTWISE},
    **{op: Executable._bind_sum for op in (Op.SUM, Op.FUSED_SUM)},
    **dict.fromkeys((Op.FUSED, Op.FUSED_ROWS), bind_fused),  # (passes/fuse.py, passes/fuse_rows.py)
    **INDEXED,  # Take, ScatterAdd, DynamicSlice, DynamicUpdateSlice (shardfuse/bind_indexed.py)
    Op.COPY: Executable._bind_copy,
}
assert set(BIND) == HOST - {Op.FOR}, set(BIND) ^ HOST  # loops are unrolled (ir.unroll)

# Communication is bound on every process, also where it holds none of the step's devices: setting
# up a team may be collective (an MPI split), and the backend knows where there is nothing to do.
BOUND_EVERYWHERE = COMMUNICATION | {Op.WAIT}

# The backend method each collective binds through (send, recv, team, stream).
COLLECTIVE_BINDERS = {
    Op.ALLGATHER: lambda be: be.bind_allgather,
    Op.ALLREDUCE: lambda be: be.bind_allreduce,
    Op.REDUCE_SCATTER: lambda be: be.bind_reduce_scatter,
    Op.ALLTOALL: lambda be: be.bind_alltoall,
}
