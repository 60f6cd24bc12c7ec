"""Collectives per team of a mesh axis (or of a sub-mesh's axis), and moves between meshes.

A team whose devices are all in this process and on one GPU runs as device copies and CuPy
reductions on the step's stream (allgather: one gather kernel up to 16 members, else D copies into
the first member's buffer, then D - 1 whole copies; reductions sum all D inputs in one kernel, in float32 for float16 / bfloat16 and
float64 for float64, rounded once; no scratch).  A team of distinct GPUs is NCCL, one
communicator per team (keyed by its devices, made by its members only): one process owning
several GPUs uses NcclCommunicator.initAll and groupStart/groupEnd; under mpiexec the team's
unique id is shared over MPI.  A team mixing both is refused at bind time.  On an NCCL error the
team's communicators are aborted (garbage collection would call destroy, which can hang when a
peer died) and the error names the failed step.  Collectives are issued on the step's stream,
so their wait steps are None.
"""
from __future__ import annotations

import cupy
from cupy.cuda import driver, nccl, runtime

from shardfuse.backends.cuda.copies import dma_copy
from shardfuse.backends.cuda.devices import offsets_bytes
from shardfuse.backends.cuda.libs import D2D, ITEM, NCCL_T, Prebound
from shardfuse.ops import Op, Reduce

# How a team runs: all its devices in this process on one GPU, or NCCL across distinct GPUs
ONE_GPU, NCCL = "one GPU", "NCCL"
GATHER_KERNEL_MAX = 16  # virtual-device all-gathers up to this team size run as one kernel (kernels.gather)


class Collectives:
    """The NCCL communicators of one backend's teams, and the collective steps over them."""

    def __init__(self, dev, kernels, one_device_nccl=False):
        self.dev, self.kernels = dev, kernels
        self.comms = {}  # team (tuple of devices) -> {local device j: communicator}
        # A team of one device is a copy; one_device_nccl makes it a one-rank NCCL communicator
        # instead, so that a machine with one GPU still runs the NCCL path.
        self.one_device_nccl = one_device_nccl

    # ---- teams ------------------------------------------------------------------------
    def team_axis(self, team):
        return team if isinstance(team, tuple) else (self.dev.mesh, team)

    def team_size(self, team):
        mesh, name = self.team_axis(team)
        return mesh.axis_size(name)

    def describe(self, team):
        mesh, name = self.team_axis(team)
        return repr(name) if mesh is self.dev.mesh else f"{name!r} of {mesh}"

    def team_kind(self, g, team):
        """ONE_GPU for a team all in this process and on one GPU, NCCL for one of distinct GPUs."""
        if len(g) == 1:
            return NCCL if self.one_device_nccl else ONE_GPU
        idx = self.dev.local_index
        if not all(d in idx for d in g):
            return NCCL  # spans processes, whose devices all have GPUs of their own
        gpus = [self.dev.ordinals[idx[d]] for d in g]
        if len(set(gpus)) == 1:
            return ONE_GPU
        if len(set(gpus)) == len(g):
            return NCCL
        raise NotImplementedError(f"cupy_nccl: team {g} of mesh axis {self.describe(team)} has devices on GPUs "
                                  f"{gpus}: some share a GPU and some do not, and a team runs either as copies on "
                                  "one GPU or as NCCL across distinct GPUs; use a mesh (or device count) whose "
                                  "teams are all on one GPU or all on different GPUs")

    # ---- communicators ------------------------------------------------------------------
    def make_comms(self, groups):
        """NCCL communicators of teams `groups` (the same list on every process): {j: comm} each."""
        dev, made = self.dev, {}
        try:
            if dev.mesh.nprocs == 1:
                for g in groups:
                    js = [dev.local_index[d] for d in g]
                    made[g] = dict(zip(js, nccl.NcclCommunicator.initAll([dev.ordinals[j] for j in js])))
            else:
                self._make_comms_mpi(groups, made)
        except Exception as e:
            for cs in made.values():
                for c in cs.values():
                    c.abort()
            raise RuntimeError(f"cupy_nccl: creating the NCCL communicators of teams {groups} failed: {e}") from e
        self.comms.update(made)

    def _make_comms_mpi(self, groups, made):
        from shardfuse import faults

        idx = self.dev.local_index
        uids = {g: nccl.get_unique_id() for g in groups if g[0] in idx}
        merged = {}
        # every process, members or not; with SHARDFUSE_TIMEOUT (NCCL's own init has none)
        for part in faults.allgather_object(uids, f"sharing the NCCL ids of teams {groups}"):
            merged.update(part)
        nccl.groupStart()
        try:
            for g in groups:
                made[g] = {}
                for rank, d in enumerate(g):
                    if d in idx:
                        j = idx[d]
                        with cupy.cuda.Device(self.dev.ordinals[j]):
                            made[g][j] = nccl.NcclCommunicator(len(g), merged[g], rank)
        finally:
            nccl.groupEnd()

    def abort(self, groups):
        """Abort and forget the communicators of teams `groups` (after an NCCL error)."""
        for g in groups:
            for c in self.comms.pop(g, {}).values():
                try:
                    c.abort()
                except Exception:
                    pass

    # ---- the driver ---------------------------------------------------------------------
    def collective(self, kind, send, recv, team, stream, call, copy):
        """A collective over every team of `team` that has a device here (kind: its Op, for
        messages).  Teams on one GPU: copy(S, R, stream) with S, R the members' (buffer, byte
        offset) of send and recv in rank order, issued with that GPU and stream current.  Teams of
        distinct GPUs: one NCCL call per local member, call(comm, sendptr, recvptr, streamptr),
        grouped when there are several."""
        if not (send.is_contiguous() and recv.is_contiguous()):
            raise ValueError(f"cupy_nccl: {kind} needs contiguous send and recv buffers, got send {send.shape} "
                             f"strides {send.strides}, recv {recv.shape} strides {recv.strides}")
        dev = self.dev
        mesh, name = self.team_axis(team)
        groups = [tuple(g) for g in mesh.teams(name)]
        kinds = {g: self.team_kind(g, team) for g in groups}
        copies = [([dev.local_index[d] for d in g], dev.ordinals[dev.local_index[g[0]]]) for g in groups
                  if kinds[g] == ONE_GPU and g[0] in dev.local_index]
        copies = [(t, o, dev.gpu_stream(o, stream)) for t, o in copies]
        nccl_groups = [g for g in groups if kinds[g] == NCCL]
        missing = [g for g in nccl_groups if g not in self.comms]
        if missing:
            self.make_comms(missing)
        comms = [(j, c) for g in nccl_groups for j, c in self.comms[g].items()]
        so, ro = offsets_bytes(send), offsets_bytes(recv)
        ss, rs = send.slot, recv.slot

        def run_copies(bufs):
            S, R = bufs[ss], bufs[rs]
            for t, o, st in copies:
                with cupy.cuda.Device(o), st:
                    copy([(S[j], so[j]) for j in t], [(R[j], ro[j]) for j in t], st)

        if not comms:
            return (run_copies if copies else None), None

        def fail(e):
            self.abort(nccl_groups)
            raise RuntimeError(f"cupy_nccl: NCCL {kind} on team {self.describe(team)} ({send.shape} -> {recv.shape}, "
                               f"{send.dtype}) failed; communicators aborted: {e}") from e

        run_nccl = _nccl_step(comms, [dev.stream(j, stream).ptr for j, _ in comms], call, fail, ss, so, rs, ro)
        if not copies:
            return run_nccl, None

        def start(bufs):
            run_copies(bufs)
            run_nccl(bufs)
        return start, None

    # ---- the collectives ----------------------------------------------------------------
    def allgather(self, send, recv, team, stream):
        d = self.team_size(team)
        count, t = send.size, NCCL_T[send.dtype]
        if recv.size != count * d:
            raise ValueError(f"allgather sizes {send.shape} -> {recv.shape} over a team of {d}")
        nb = count * ITEM[send.dtype]

        def copies(S, R, st):  # every block into the first member's buffer, then that whole buffer to the rest
            r0 = R[0][0].data.ptr + R[0][1]
            for rank, (x, off) in enumerate(S):
                runtime.memcpyAsync(r0 + rank * nb, x.data.ptr + off, nb, D2D, st.ptr)
            for x, off in R[1:]:
                runtime.memcpyAsync(x.data.ptr + off, r0, d * nb, D2D, st.ptr)

        if 1 < d <= GATHER_KERNEL_MAX and nb:
            # virtual devices of one GPU: one kernel for all 2d - 1 copies (a copy costs ~5 us of
            # host), its arguments set in place (libs.Prebound); 16-byte loads where the block
            # size, the offsets and the base pointers (read per call: a caller's array may start
            # anywhere) allow, else bytes
            aligned = nb % 16 == 0 and all(o % 16 == 0 for o in offsets_bytes(send) + offsets_bytes(recv))
            kernels, kern, units = self.kernels, {}, {True: nb // 16, False: nb}
            grids = {v: min(4096, -(-u * d * d // 256)) for v, u in units.items()}

            def gathered(S, R, st):  # (the kernels compiled at first use: NCCL teams never need them)
                ptrs = [x.data.ptr + off for x, off in S] + [x.data.ptr + off for x, off in R]
                vector, sp = aligned and not any(p & 15 for p in ptrs), st.ptr
                k = kern.get((sp, vector))
                if k is None:  # per stream (the kernel compiled for its GPU); both variants at once,
                    # so the warm-up compiles them before a graph capture (no module loads there)
                    for v in (True, False) if aligned else (False,):
                        kern[sp, v] = Prebound(kernels.gather(d, v).kernel, 2 * d + 1, driver.launchKernel)
                    k = kern[sp, vector]
                ptrs.append(units[vector])
                k(grids[vector], 256, ptrs, sp)
        return self.collective(Op.ALLGATHER, send, recv, team, stream,
                               lambda c, s, r, st: c.allGather(s, r, count, t, st),
                               gathered if 1 < d <= GATHER_KERNEL_MAX and nb else copies)

    def allreduce(self, send, recv, team, stream, op=Reduce.SUM):
        """recv = the sum, or with op="max" / "min" (ncclMax / ncclMin) the max or min, of the team's
        sends; a plan moves floats' maxima as integer keys (backends/extrema.py: NCCL's float max
        does not keep NumPy's NaN), so those are integers here."""
        d = self.team_size(team)
        count, t = send.size, NCCL_T[send.dtype]
        nb = count * ITEM[send.dtype]
        if op != Reduce.SUM and send.dtype not in ("int32", "int64"):
            raise TypeError(f"Allreduce op={op} of {send.dtype}: the plan moves integer keys (passes/lower.py)")
        kern = self.kernels.sum_of(send.dtype, d) if op == Reduce.SUM else \
            self.kernels.extremum_of(send.dtype, d, op)

        def copy(S, R, st):  # the result into the first member's buffer, then copied to the rest
            (r0, o0) = R[0]
            out = cupy.ndarray((count,), r0.dtype, r0.data + o0)
            kern(*[cupy.ndarray((count,), x.dtype, x.data + off) for x, off in S], out)
            for x, off in R[1:]:
                runtime.memcpyAsync(x.data.ptr + off, out.data.ptr, nb, D2D, st.ptr)
        nccl_op = {Reduce.SUM: 0, Reduce.MAX: 2, Reduce.MIN: 3}[op]  # (ncclSum, ncclMax, ncclMin)
        return self.collective(Op.ALLREDUCE, send, recv, team, stream,
                               lambda c, s, r, st: c.allReduce(s, r, count, t, nccl_op, st), copy)

    def reduce_scatter(self, send, recv, team, stream):
        """send: [D, *recv] contiguous; rank r gets the sum of every member's block r."""
        d = self.team_size(team)
        count, t = recv.size, NCCL_T[recv.dtype]
        if send.size != count * d:
            raise ValueError(f"reduce_scatter sizes {send.shape} -> {recv.shape} over a team of {d}")
        kern, nb = self.kernels.sum_of(recv.dtype, d), count * ITEM[recv.dtype]

        def copy(S, R, st):
            for rank, (r, off) in enumerate(R):
                kern(*[cupy.ndarray((count,), x.dtype, x.data + (xo + rank * nb)) for x, xo in S],
                     cupy.ndarray((count,), r.dtype, r.data + off))
        return self.collective(Op.REDUCE_SCATTER, send, recv, team, stream,
                               lambda c, s, r, st: c.reduceScatter(s, r, count, t, 0, st), copy)

    def alltoall(self, send, recv, team, stream):
        """send, recv: [D, ...] contiguous; block p of send goes to rank p, rank p's block lands at p.
        NCCL: grouped send/recv pairs (CuPy wraps no ncclAlltoAll)."""
        d = self.team_size(team)
        count, t = send.size // d, NCCL_T[send.dtype]
        nb = count * ITEM[send.dtype]

        def call(c, s, r, st):
            nccl.groupStart()
            try:
                for peer in range(d):
                    c.send(s + peer * nb, count, t, peer, st)
                    c.recv(r + peer * nb, count, t, peer, st)
            finally:
                nccl.groupEnd()

        def copy(S, R, st):
            for rank, (r, off) in enumerate(R):
                base = r.data.ptr + off
                for peer, (x, xo) in enumerate(S):
                    runtime.memcpyAsync(base + peer * nb, x.data.ptr + xo + rank * nb, nb, D2D, st.ptr)
        return self.collective(Op.ALLTOALL, send, recv, team, stream, call, copy)

    def sendrecv(self, send, recv, team, shift, stream):
        """Ring shift within the team: send to rank + shift, receive from rank - shift (the ring
        variant's step; NCCL: grouped send/recv)."""
        d = self.team_size(team)
        count, t = send.size, NCCL_T[send.dtype]
        nb = count * ITEM[send.dtype]

        def call(c, s, r, st):
            me = c.rank_id()
            nccl.groupStart()
            try:
                c.send(s, count, t, (me + shift) % d, st)
                c.recv(r, count, t, (me - shift) % d, st)
            finally:
                nccl.groupEnd()

        def copy(S, R, st):  # send and recv never overlap (the ring double-buffers), so no staging
            for rank, (r, off) in enumerate(R):
                x, xo = S[(rank - shift) % d]
                runtime.memcpyAsync(r.data.ptr + off, x.data.ptr + xo, nb, D2D, st.ptr)
        return self.collective(Op.SENDRECV, send, recv, team, stream, call, copy)


def _nccl_step(comms, streams, call, fail, ss, so, rs, ro):
    """The step of one NCCL call per local member (comms: (j, communicator)), grouped when there
    are several; fail(e) on any error."""
    if len(comms) == 1:
        (j0, c0), st0 = comms[0], streams[0]

        def run_nccl(bufs):
            try:
                call(c0, bufs[ss][j0].data.ptr + so[j0], bufs[rs][j0].data.ptr + ro[j0], st0)
            except Exception as e:
                fail(e)
        return run_nccl

    def run_nccl(bufs):
        S, R = bufs[ss], bufs[rs]
        try:
            nccl.groupStart()
            try:
                for (j, c), st in zip(comms, streams):
                    call(c, S[j].data.ptr + so[j], R[j].data.ptr + ro[j], st)
            finally:
                nccl.groupEnd()
        except Exception as e:
            fail(e)
    return run_nccl


# ---- moves between meshes: point-to-point copies within this process -------------------------
def _sort_transfers(dev, pairs, stream):
    """(same, views, cross): DMA copies on one GPU, elementwise copies on one GPU, peer copies."""
    idx = dev.local_index
    same, views, cross = [], [], []
    for s, sref, d, rref in pairs:
        if s not in idx and d not in idx:
            continue
        if s not in idx or d not in idx:
            other = s if s not in idx else d
            raise NotImplementedError(f"cupy_nccl: moving a value from device {s} to device {d}: device {other} "
                                      "belongs to another process, and the cupy backend moves values between "
                                      "meshes only within one process (the NumPy backends also do it over MPI)")
        if sref.shape != rref.shape or sref.dtype != rref.dtype:
            raise ValueError(f"cupy_nccl: transfer {sref.dtype}{list(sref.shape)} -> "
                             f"{rref.dtype}{list(rref.shape)}")
        js, jd = idx[s], idx[d]
        os_, od = dev.ordinals[js], dev.ordinals[jd]
        src = (sref.slot, sref.offsets[js] * ITEM[sref.dtype])
        dst = (rref.slot, rref.offsets[jd] * ITEM[rref.dtype])
        if os_ == od:
            st = dev.gpu_stream(os_, stream)
            copy = dma_copy(sref, rref)
            if copy is None:  # neither one block nor rows: an elementwise copy on that GPU
                views.append((js, sref, jd, rref, os_, st))
            else:
                same.append((copy, js, src, jd, dst, st.ptr))
        else:
            if not (sref.is_contiguous() and rref.is_contiguous()):
                raise NotImplementedError(f"cupy_nccl: moving {sref.shape} from GPU {os_} to GPU {od} needs "
                                          f"contiguous buffers, got strides {sref.strides} -> {rref.strides}")
            cross.append((js, os_, src, jd, od, dst, sref.size * ITEM[sref.dtype]))
    return same, views, cross


def bind_transfers(dev, pairs, stream):
    """Copies (src device, send Ref, dst device, recv Ref): on one GPU on its stream; between
    GPUs a peer copy on the source GPU's stream, after the destination's stream (whose
    earlier work may still read the buffer) and before it (which reads the result)."""
    same, views, cross = _sort_transfers(dev, pairs, stream)
    if not same and not views and not cross:
        return None, None
    src_gpus = sorted({c[1] for c in cross})
    dst_gpus = sorted({c[4] for c in cross})
    gs = {o: dev.gpu_stream(o, stream).ptr for o in set(src_gpus) | set(dst_gpus)}
    events = {}
    for o in gs:
        with cupy.cuda.Device(o):
            events[o] = cupy.cuda.Event(disable_timing=True)
    dev.events.append(list(events.values()))
    ready = [(events[o].ptr, gs[o]) for o in dst_gpus]
    done = [(events[o].ptr, gs[o]) for o in src_gpus]
    view = dev.view

    def start(bufs):
        for copy, js, (ss, so), jd, (ds, do), sp in same:
            copy(bufs[ds][jd].data.ptr + do, bufs[ss][js].data.ptr + so, sp)
        for js, sref, jd, rref, o, st in views:
            with cupy.cuda.Device(o), st:
                view(bufs, rref, jd)[...] = view(bufs, sref, js)
        if not cross:
            return
        for e, sp in ready:
            runtime.eventRecord(e, sp)
        for _, sp in done:
            for e, _ in ready:
                runtime.streamWaitEvent(sp, e, 0)
        for js, os_, (ss, so), jd, od, (ds, do), nbytes in cross:
            runtime.memcpyPeerAsync(bufs[ds][jd].data.ptr + do, od, bufs[ss][js].data.ptr + so, os_, nbytes,
                                    gs[os_])
        for e, sp in done:
            runtime.eventRecord(e, sp)
        for _, sp in ready:
            for e, _ in done:
                runtime.streamWaitEvent(sp, e, 0)
    return start, None
