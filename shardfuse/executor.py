"""The one executor: binds a plan to a backend once, then runs it as a flat list of steps.

Binding resolves everything that does not change between calls: loops are unrolled, every
view (chunk slice, pool slot, shard slice, reshape) becomes a `Ref` (slot, per-device element
offsets, shape, strides), the stream of every step is fixed, persistent buffers and events
are created.  A call then only places its inputs, allocates its outputs and runs the steps.
Backends see Refs and streams, never the IR.
"""
from __future__ import annotations

import threading
from dataclasses import replace

import numpy as np

from shardfuse.array import Array, local_pieces, piece_indices
from shardfuse.interop import array_info, check_input, stream_ptr
from shardfuse.backends.protocol import MAIN, Ref, block, contiguous_strides, rank_major, reshape_strides

COLLECTIVES = ("allgather", "allreduce", "reduce_scatter", "alltoall")
VIEW_OPS = ("slice", "select", "view", "shard_slice", "transpose")
ELEMENTWISE_OPS = ("add", "sub", "mul", "div", "neg", "scale", "exp", "tanh", "relu", "gelu")


def _index(idx, env) -> int:
    return idx if isinstance(idx, int) else idx.eval(env)


def _holds(when, env) -> bool:
    """A guard `(var, op, value)`, decided when the loop is unrolled."""
    var, op, value = when
    return {"<": env[var] < value, ">": env[var] > value}[op]


class Executable:
    def __init__(self, prog, backend, graph: bool = False):
        self.prog, self.backend, self.mesh = prog, backend, prog.mesh
        self.ndev = len(backend.local_devices)
        self.refs: dict = {}
        self.slot_templates: list = []  # per slot: None (input / per call) or persistent buffers
        self.per_call: list = []  # (slot, shape, dtype)
        self.steps: list = []
        self.pending: dict = {}  # comm handle -> wait step(s)
        self._physical_order = self._gather_destinations(prog)
        self._foldable = self._one_device_destinations(prog)
        for v in prog.inputs:
            lay = v.type.layout
            shape = lay.local_shape(v.type.shape, self.mesh)
            self.refs[v] = self._new_slot(shape, v.type.dtype, None)
        # where each local device's piece of a plain argument lies (its shape is checked per call)
        self._input_pieces = [piece_indices(v.type.shape, v.type.layout, self.mesh) for v in prog.inputs]
        self._deferred: dict = {}  # slot -> (physical shape, dtype): the program's own persistent buffers
        self._bind(prog.instrs, {}, MAIN)
        self.steps = [s for s in self.steps if s is not None]
        self._allocate_used(prog)
        self._graph_outputs = None
        self._accepted, self._out_layouts = set(), {}  # hot-path caches of layout checks
        # One call at a time: the plan's persistent buffers (gather pools, scratch) and its
        # graphs are shared by every call, so two threads issuing at once would write each
        # other's chunks.  A lock rather than per-thread buffers: it costs no memory, and on GPUs
        # it is held only while the host issues (the kernels run after it is released).
        self._lock = threading.Lock()
        self.graph = backend.capture(self) if graph else None

    # ---- slots ------------------------------------------------------------------------
    def _new_slot(self, shape, dtype, buffers, order=None) -> Ref:
        slot = len(self.slot_templates)
        self.slot_templates.append(buffers)
        order = order or tuple(range(len(shape)))
        phys = contiguous_strides(tuple(shape[o] for o in order))
        strides = [0] * len(shape)
        for j, o in enumerate(order):
            strides[o] = phys[j]
        return Ref(slot, (0,) * self.ndev, tuple(shape), tuple(strides), dtype)

    def _allocate(self, shape, dtype, per_call: bool, order=None) -> Ref:
        """A slot for one of the program's buffers: made every call (per_call), or once, after
        binding, if a step still uses it (see _allocate_used)."""
        phys_shape = tuple(shape[o] for o in order) if order else tuple(shape)
        ref = self._new_slot(shape, dtype, None, order)
        if per_call:
            self.per_call.append((ref.slot, phys_shape, dtype))
        else:
            self._deferred[ref.slot] = (phys_shape, dtype)
        return ref

    def _scratch(self, shape, dtype) -> Ref:
        """A persistent staging buffer that binding itself adds (steps use it): made now."""
        return self._new_slot(shape, dtype, self.backend.empty(tuple(shape), dtype))

    @staticmethod
    def _gather_destinations(prog):
        """Buffers that an Allgather fills along an inner axis whose local extent is 1 are stored
        rank-major (that axis first), so NCCL writes them in place with no copy."""
        order = {}
        from shardfuse.ir import walk

        for i in walk(prog.instrs):
            if i.op == "allgather" and i.attrs["axis"] > 0:
                k = i.attrs["axis"]
                lay = i.ins[0].type.layout
                if lay.local_shape(i.ins[0].type.shape, prog.mesh)[k] == 1:
                    nd = i.into.type.ndim
                    order[i.into] = (k,) + tuple(j for j in range(nd) if j != k)
        return order

    @staticmethod
    def _one_device_destinations(prog):
        """Destinations of collectives over one-device teams that may become views of their
        sources: every read of their buffer goes through such a destination (or a view of one).
        A buffer also read another way (e.g. a whole output whose chunks were all-reduced) keeps
        its collectives, since a view of the source would leave the buffer itself unwritten."""
        from shardfuse.ir import walk

        parent = {}
        candidates = set()
        reads = list(prog.outputs)
        for i in walk(prog.instrs):
            if i.op in VIEW_OPS:
                parent[i.outs[0]] = i.ins[0]
                continue
            reads.extend(i.ins)
            if i.op in COLLECTIVES and (i.ins[0].type.layout.mesh or prog.mesh).axis_size(i.attrs["team"]) == 1:
                candidates.add(i.into)

        def chain(v):
            out = [v]
            while out[-1] in parent:
                out.append(parent[out[-1]])
            return out

        root = {c: chain(c)[-1] for c in candidates}
        blocked = set()
        for v in reads:
            vs = chain(v)
            if vs[-1] in root.values() and not candidates.intersection(vs):
                blocked.add(vs[-1])
        return {c for c in candidates if root[c] not in blocked}

    def _allocate_used(self, prog):
        """The program's own persistent buffers, made once binding is done and only where a step
        still uses them: the destinations of folded one-device collectives are never made (a
        D = 1 plan holds no gathered copy of its input).  Scratch made while binding is in use."""
        from shardfuse.ir import walk

        used = {self.refs[v].slot for v in prog.outputs}
        for i in walk(prog.instrs):
            if i.op in VIEW_OPS or i.op == "allocate":
                continue
            for v in (*i.values(), *i.outs):
                ref = self.refs.get(v)
                if isinstance(ref, Ref):
                    used.add(ref.slot)
        for slot, (shape, dtype) in self._deferred.items():
            if slot in used:
                self.slot_templates[slot] = self.backend.empty(shape, dtype)

    def _local_shape(self, v):
        return v.type.layout.local_shape(v.type.shape, self.mesh)

    # ---- binding ----------------------------------------------------------------------
    def _bind(self, instrs, env, stream):
        be = self.backend
        for i in instrs:
            op, a = i.op, i.attrs
            if "when" in a and not _holds(a["when"], env):
                continue
            if op == "for":
                for it in range(a["extent"]):
                    stream = self._bind(i.body, {**env, a["var"]: it}, stream)
            elif op == "allocate":
                v = i.outs[0]
                shape = self._local_shape(v)
                if a.get("pool"):
                    ref = self._allocate((a["pool"],) + shape, v.type.dtype, False)
                else:
                    ref = self._allocate(shape, v.type.dtype, a.get("per_call", False), self._physical_order.get(v))
                self.refs[v] = ref
            elif op in VIEW_OPS:
                self.refs[i.outs[0]] = self._view(i, env)
            elif op == "get_stream":
                pass
            elif op == "set_stream":
                stream = MAIN if a["stream"] == MAIN else _index(a["index"], env)
            elif op == "record_event":  # events recorded in a loop are one per step: (event, step)
                key = (i.outs[0], _index(a["index"], env)) if "index" in a else i.outs[0]
                self.refs[key] = be.new_event()
                self.steps.append(be.bind_record(self.refs[key], stream))
            elif op == "wait_event":
                key = (i.ins[0], _index(a["index"], env)) if "index" in a else i.ins[0]
                self.steps.append(be.bind_wait_event(self.refs[key], stream))
            elif op == "synchronize":
                self.steps.append(be.bind_join(stream, _index(a["index"], env)))
            elif op == "sendrecv":
                start, wait = be.bind_sendrecv(self.refs[i.ins[0]], self.refs[i.into], self._team(i, a["team"]),
                                               a["shift"], stream)
                self.steps.append(start)
                self.pending[i.outs[0]] = [wait]
            elif op == "transfer":
                self._bind_transfer(i, stream)
            elif op in COLLECTIVES:
                self._bind_collective(i, stream)
            elif op == "wait":
                self.steps.extend(self.pending.pop(i.ins[0]))
            elif op == "matmul":
                x, y = (self.refs[v] for v in i.ins)
                self.steps.append(be.bind_matmul(x, y, self.refs[i.into], stream))
            elif op in ELEMENTWISE_OPS:
                x, y = (self.refs[v] for v in i.ins) if len(i.ins) == 2 else (self.refs[i.ins[0]], None)
                scalar = {"scalar": a["value"]} if "value" in a else {}
                self.steps.append(be.bind_elementwise(op, x, y, self.refs[i.into], stream, **scalar))
            elif op == "sum":
                self.steps.append(be.bind_sum(self.refs[i.ins[0]], a["axis"], self.refs[i.into], stream))
            elif op == "copy":
                self.steps.append(be.bind_copy(self.refs[i.ins[0]], self.refs[i.into], stream))
            else:
                raise NotImplementedError(f"executor: no binding for {op!r}")
        return stream

    def _view(self, i, env) -> Ref:
        op, a = i.op, i.attrs
        src = self.refs[i.ins[0]]
        if op == "select":
            k = _index(a["index"], env)
            return Ref(src.slot, tuple(o + k * src.strides[0] for o in src.offsets), src.shape[1:],
                       src.strides[1:], src.dtype)
        if op == "transpose":
            perm = a["perm"]
            return replace(src, shape=tuple(src.shape[p] for p in perm), strides=tuple(src.strides[p] for p in perm))
        out_shape = self._local_shape(i.outs[0])
        if op == "slice":
            ax, idx = a["axis"], a["index"]
            ranks = self._ranks(i.outs[0], idx.ring) if idx.ring else [0] * self.ndev  # ring: (rank - i) % D
            offs = tuple(o + idx.eval(env, r) * out_shape[ax] * src.strides[ax] for o, r in zip(src.offsets, ranks))
            return replace(src, offsets=offs, shape=out_shape)
        if op == "shard_slice":
            ax = a["axis"]
            offs = tuple(o + r * out_shape[ax] * src.strides[ax]
                         for o, r in zip(src.offsets, self._ranks(i.outs[0], a["team"])))
            return replace(src, offsets=offs, shape=out_shape)
        strides = reshape_strides(src.shape, src.strides, out_shape)
        if strides is None:
            raise NotImplementedError(f"View {i.outs[0].name}: {src.shape} -> {out_shape} needs a copy")
        return replace(src, shape=out_shape, strides=strides)

    def _ranks(self, v, team):
        """Each local device's position along mesh axis `team` of the mesh v lives on (0 outside it)."""
        mesh = v.type.layout.mesh or self.mesh
        mi = mesh.axis_index(team)
        return [mesh.coords(d)[mi] if d in mesh.devices else 0 for d in self.backend.local_devices]

    def _contiguous(self, ref: Ref, stream, before: bool):
        """ref itself if contiguous, else (scratch, copy step) to stage it."""
        if ref.is_contiguous():
            return ref, None
        tmp = self._scratch(ref.shape, ref.dtype)
        step = self.backend.bind_copy(ref, tmp, stream) if before else self.backend.bind_copy(tmp, ref, stream)
        return tmp, step

    def _bind_transfer(self, i, stream):
        """A move between meshes as point-to-point copies: (src device, send, dst device, recv)."""
        a, kind = i.attrs, i.attrs["kind"]
        frm, to = a["from"], a["to"]
        send, recv = self.refs[i.ins[0]], self.refs[i.into]
        pre = post = None
        if kind == "Scatter":  # block q of the root's whole value goes to destination q
            send, pre = self._contiguous(rank_major(send, a["axis"], len(to)), stream, before=True)
            pairs = [(frm[0], block(send, q), d, recv) for q, d in enumerate(to)]
        elif kind == "Gather":  # source p's piece lands in block p of the root's whole value
            recv, post = self._contiguous(rank_major(recv, a["axis"], len(frm)), stream, before=False)
            pairs = [(s, send, to[0], block(recv, p)) for p, s in enumerate(frm)]
        elif kind == "Broadcast":
            pairs = [(frm[0], send, d, recv) for d in to]
        else:  # SendRecv: device p to device p
            pairs = list(zip(frm, [send] * len(frm), to, [recv] * len(to)))
        start, wait = self.backend.bind_transfers(pairs, stream)
        self.steps.extend([pre, start])
        self.pending[i.outs[0]] = [wait, post]

    def _team(self, i, name):
        """What a backend's collective runs over: a mesh axis name of the program's mesh, or
        (sub-mesh, axis name) for a value that lives on a sub-mesh (backends that can)."""
        mesh = i.ins[0].type.layout.mesh
        if mesh is None:
            return name
        if not self.backend.submesh_teams:
            raise NotImplementedError(f"{i.op} of {i.ins[0].name} inside the sub-mesh {mesh}: the {self.backend.name} "
                                      "backend does not run collectives within a sub-mesh yet (moves between meshes work)")
        return (mesh, name)

    def _bind_collective(self, i, stream):
        be, a = self.backend, i.attrs
        d = (i.ins[0].type.layout.mesh or self.mesh).axis_size(a["team"])
        send, recv = self.refs[i.ins[0]], self.refs[i.into]
        if d == 1 and self._fold_one_device(i, send, recv):
            return
        team = self._team(i, a["team"])
        pre, post = [], []
        if i.op == "allgather":
            recv = rank_major(recv, a["axis"], d)
        if i.op == "reduce_scatter":
            send = rank_major(send, a["axis"], d)
        if i.op == "alltoall":  # block r of the target axis goes to rank r; rank r's block lands at r
            send, recv = rank_major(send, a["to_axis"], d), rank_major(recv, a["axis"], d)
        send, s1 = self._contiguous(send, stream, before=True)
        recv, s2 = self._contiguous(recv, stream, before=False)
        pre.append(s1)
        post.append(s2)
        start, wait = getattr(be, f"bind_{i.op}")(send, recv, team, stream)
        self.steps.extend(pre + [start])
        self.pending[i.outs[0]] = [wait] + post

    def _fold_one_device(self, i, send: Ref, recv: Ref) -> bool:
        """A collective over a team of one device is the identity: its destination becomes a view
        of its source, and nothing is issued.  Not when the destination is a per-call buffer (a
        plan output, which must not alias an input)."""
        per_call = {slot for slot, _, _ in self.per_call}
        if i.into not in self._foldable or recv.slot in per_call or send.shape != recv.shape:
            return False
        self.refs[i.into] = send
        self.pending[i.outs[0]] = []
        return True

    # ---- running ----------------------------------------------------------------------
    def _check_args(self, args, infos=None):
        """Every argument against the plan's inputs, before any work is queued.  Returns the
        ArrayInfo of each plain argument (None for sf.Arrays); `infos` when the caller has them."""
        prog = self.prog
        if len(args) != len(prog.inputs):
            raise TypeError(f"{prog.name} takes {len(prog.inputs)} arguments, got {len(args)}")
        out = []
        for k, (arg, v) in enumerate(zip(args, prog.inputs)):
            lay = v.type.layout
            if isinstance(arg, Array):
                out.append(None)
                # hot path: a (layout, shape, dtype) once accepted for this input is not checked again
                key = (v, arg.sharding, arg.shape, arg.dtype_name)
                if key in self._accepted:
                    continue
                if arg.shape != v.type.shape or arg.dtype_name != v.type.dtype:
                    raise ValueError(f"{v.name}: expected shape {v.type.shape} and dtype {v.type.dtype}, got an "
                                     f"sf.Array of shape {arg.shape} and dtype {arg.dtype_name}")
                if arg.sharding.placement() != lay.placement():
                    raise ValueError(f"{v.name}: plan expects layout {lay.placements(self.mesh)}, "
                                     f"got {arg.sharding.placements(self.mesh)}")
                self._accepted.add(key)
                continue
            info = infos[k] if infos is not None else array_info(arg)
            if info.shape != v.type.shape or info.dtype != v.type.dtype:
                raise ValueError(f"{v.name}: expected shape {v.type.shape} and dtype {v.type.dtype}, got a "
                                 f"{info.describe()}")
            check_input(info, self.backend, v.name)
            out.append(info)
        return out

    def __call__(self, *args, stream=None, infos=None):
        """Run the plan.  On the cupy backend the plan's main stream first waits (device-side) for
        the caller's stream (stream=, or CuPy's current stream), and that stream then waits for
        the plan's outputs: the caller's work before and after the call is ordered with it."""
        infos = self._check_args(args, infos)
        with self._lock:
            return self._run(args, infos, stream)

    def _run(self, args, infos, stream):
        be = self.backend
        caller = None
        if be.name == "cupy":
            caller = stream_ptr(stream)
            be.fence_in(caller)
        bufs = list(self.slot_templates)
        for k, (arg, v, info) in enumerate(zip(args, self.prog.inputs, infos)):
            if info is None:  # an sf.Array: its pieces are already placed
                bufs[k] = [be.ascontiguous(s) for s in arg.shards]
            else:
                bufs[k] = local_pieces(arg, v.type.dtype, v.type.layout, self.mesh, info, fenced=caller,
                                       indices=self._input_pieces[k])
        if self.graph is not None:
            # Graph mode: the captured plan writes plan-owned output buffers (the next call
            # overwrites them); the backend keeps one graph per set of input buffers it has seen.
            static = self.graph(bufs)
            if self._graph_outputs is None:
                self._graph_outputs = self._outputs(static)
            outs = self._graph_outputs
        else:
            for slot, shape, dtype in self.per_call:
                bufs[slot] = be.empty(shape, dtype)
            for step in self.steps:
                step(bufs)
            outs = self._outputs(bufs)
        if caller is not None:
            be.fence_out(caller)
        return outs

    def _outputs(self, bufs):
        outs = []
        for v in self.prog.outputs:
            ref = self.refs[v]
            shards = [self.backend.view(bufs, ref, j) for j in range(self.ndev)]
            lay = self._out_layouts.get(v)
            if lay is None:
                lay = self._out_layouts[v] = v.type.layout.placement()
            outs.append(Array(self.mesh, v.type.shape, v.type.dtype, lay, shards))
        return outs[0] if len(outs) == 1 else tuple(outs)
