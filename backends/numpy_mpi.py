"""NumPy devices spread over MPI processes (``mpiexec -n P``): each process owns L >= 1 of them.

Only the collectives differ from the in-memory reference (NumpyLocalBackend).  A collective over
a mesh axis runs within each team of that axis (mesh.teams(name)); this process takes part in
every team it owns devices of (backends/mpi_teams.py: the communicators, how they are split, and
which layouts of processes are supported).  Per team, it first combines its own devices'
contributions in memory, then posts ONE non-blocking MPI collective on the team's communicator
(Iallgather / Iallreduce / Ireduce_scatter_block / Ialltoall, or Isend / Irecv for SendRecv) in
the start step; the wait step waits for all of them at once (shardfuse.faults.wait:
SHARDFUSE_TIMEOUT seconds at most, then the job is aborted with the step's name and the ranks
that did not arrive) and copies the results into the local devices' views where needed.

So any layout of processes works where, in every team, the processes owning its devices own
equally many, consecutive ones: one device per process (mpiexec -n D), and every layout of a
power-of-two mesh over a power-of-two number of processes, e.g. a 2x2 ("dp", "tp") mesh under
-n 2, where process 0's two devices are in two dp teams.  A team split unevenly raises
NotImplementedError on every rank when the plan is bound (before anything is sent).

Within a team, team rank k owns positions [k*L_t, (k+1)*L_t) (L_t: its devices in that team), so
the rank-major buffers [D, ...] the executor hands over are exactly [P_t, L_t, ...].  Teams of a
sub-mesh (a pipeline stage) work the same way; their communicators are split the first time a
plan binds them (every rank binds the same plan in the same order, so the splits pair up).

Buffers: gathers move raw bits (bfloat16 / float16 as uint16 views); reductions run in the
array's dtype (float32 for bfloat16 / float16, which MPI cannot sum).
"""
from __future__ import annotations

import numpy as np

from shardfuse import faults
from shardfuse.backends.mpi_teams import team_parts, world_peers
from shardfuse.backends.numpy_local import NumpyLocalBackend, accumulator
from shardfuse.dtypes import np_dtype
from shardfuse.ops import Op, Reduce

_HALF = ("bfloat16", "float16")


def _buf(a: np.ndarray) -> np.ndarray:
    """`a` as an MPI buffer: it must be one contiguous block (the plan stages others)."""
    if not a.flags.c_contiguous:
        raise AssertionError(f"MPI buffer of shape {a.shape}, strides {a.strides} is not contiguous")
    return a


def _wire(a: np.ndarray) -> np.ndarray:
    """A buffer MPI can move bit for bit (for gathers)."""
    a = _buf(a)
    if a.dtype.name in _HALF:
        return a.view(np.uint16)
    return a


def _local_sum(pieces, out):
    """The sum of this process' devices' contributions to one team, into the send buffer."""
    acc = pieces[0].astype(accumulator(pieces[0].dtype)) if len(pieces) > 1 else pieces[0]
    for x in pieces[1:]:
        acc = acc + x
    out[...] = acc
    return out


def _reduce_dtype(dtype: str):
    return np.dtype(np.float32) if dtype in _HALF else np_dtype(dtype)


def _limit_blas_threads(world):
    """Several ranks on one machine each running BLAS with one thread per core oversubscribe
    it badly (seen here: 4 ranks on 2 cores, the demo 100x slower): share the cores out."""
    import os

    from threadpoolctl import threadpool_limits

    on_node = world.Split_type(__import__("mpi4py").MPI.COMM_TYPE_SHARED)
    ranks_here = on_node.Get_size()
    on_node.Free()
    return threadpool_limits(max(1, (os.cpu_count() or 1) // ranks_here), user_api="blas")


class NumpyMPIBackend(NumpyLocalBackend):
    name = "numpy-mpi"

    def __init__(self, mesh):
        super().__init__(mesh)
        from mpi4py import MPI

        self.MPI = MPI
        world = MPI.COMM_WORLD
        # The splits below block with no deadline and pair with whatever the other ranks call:
        # first make sure every rank is here, for the same mesh (else RankMismatchError on all).
        faults.agree(f"mesh {mesh!r} shape={mesh.shape} axes={mesh.axis_names} devices={mesh.devices}",
                     f"the MPI backend of {mesh!r}")
        self._blas_limit = _limit_blas_threads(world)
        self.nprocs, self.rank = world.Get_size(), world.Get_rank()
        if mesh.nprocs != self.nprocs:
            raise ValueError(f"{mesh} was made for {mesh.nprocs} processes, but COMM_WORLD has {self.nprocs}")
        self.L = len(self.local_devices)
        self.parts: dict = {}  # team (axis name, or (sub-mesh, name)) -> this process' TeamParts
        self.unsupported: dict = {}  # team -> why the MPI backend cannot run collectives over it
        for name in mesh.axis_names:  # the same order on every rank: the splits pair up
            self._split(name, mesh, name, f"mesh axis {name!r} of {mesh!r}")

    def _split(self, team, mesh, name, what):
        parts, why = team_parts(self.MPI, mesh.teams(name), self.L, self.local_index, what)
        if parts is None:
            self.unsupported[team] = why
        else:
            self.parts[team] = parts

    submesh_teams = True  # teams of a sub-mesh split on first use (see _parts)

    def _parts(self, team, what):
        """This process' TeamParts of `team` (empty where it owns no device of it).  A sub-mesh's
        teams are split off COMM_WORLD the first time a plan binds them: every rank binds the
        same plan in the same order, so the splits pair up."""
        if isinstance(team, tuple) and team not in self.parts and team not in self.unsupported:
            mesh, name = team
            self._split(team, mesh, name, f"{what} within {mesh}")
        if team in self.unsupported:
            where = f"the sub-mesh {team[0]}" if isinstance(team, tuple) else self.mesh
            name = team[1] if isinstance(team, tuple) else team
            raise NotImplementedError(
                f"{what} over mesh axis {name!r} of {where} under {self.nprocs} MPI processes: "
                f"{self.unsupported[team]} (this process owns {self.L} devices); one device per process "
                f"(mpiexec -n {self.mesh.size}) always works")
        return self.parts[team]

    def _slot_alias(self, a, b):
        return a.slot == b.slot

    # ---- collectives: one MPI collective per team this process owns devices of ------------
    def bind_allgather(self, send, recv, team, stream):
        """send: [*S] per local device; recv: rank-major [D, *S] per local device (both contiguous)."""
        parts = self._parts(team, Op.ALLGATHER)
        if not parts:  # no device of this team here
            return None, None
        assert all(recv.shape[0] == p.size for p in parts), (recv.shape, [p.size for p in parts])
        direct = [len(p.js) == 1 and not self._slot_alias(send, recv) for p in parts]
        state = {}
        what = faults.step_name(Op.ALLGATHER, team, send)

        def start(bufs):
            s, r = self._views(bufs, send), self._views(bufs, recv)
            reqs = []
            for p, dr in zip(parts, direct):
                r0 = r[p.js[0]]
                if dr:
                    reqs.append(p.comm.Iallgather(_wire(s[p.js[0]]), _wire(r0)))
                    continue
                for k, j in enumerate(p.js):
                    r0[p.first + k] = s[j]
                reqs.append(p.comm.Iallgather(self.MPI.IN_PLACE, _wire(r0)))
            state["req"], state["r"] = reqs, r

        return start, _copied_to_all(state, what, parts, world_peers(self.MPI, parts))

    def bind_allreduce(self, send, recv, team, stream, op=Reduce.SUM):
        """send, recv: [*S] per local device (contiguous); recv = sum (or max, min) over the team."""
        parts = self._parts(team, Op.ALLREDUCE)
        if not parts:  # no device of this team here
            return None, None
        if op != Reduce.SUM:
            return self._allreduce_extremum(parts, send, recv, team, op)
        red = _reduce_dtype(send.dtype)
        native = red == np_dtype(send.dtype)
        direct = [len(p.js) == 1 and native and not self._slot_alias(send, recv) for p in parts]
        sbufs = [None if d else np.empty(send.shape, red) for d in direct]
        rbufs = None if native else [np.empty(recv.shape, red) for _ in parts]
        state = {}
        what = faults.step_name(Op.ALLREDUCE, team, send)

        def start(bufs):
            s, r = self._views(bufs, send), self._views(bufs, recv)
            reqs = []
            for i, p in enumerate(parts):
                src = s[p.js[0]] if direct[i] else _local_sum([s[j] for j in p.js], sbufs[i])
                dst = r[p.js[0]] if native else rbufs[i]
                reqs.append(p.comm.Iallreduce(_buf(src), _buf(dst), self.MPI.SUM))
            state["req"], state["r"] = reqs, r

        return start, _copied_to_all(state, what, parts, world_peers(self.MPI, parts), rbufs)

    def _allreduce_extremum(self, parts, send, recv, team, op):
        """Allreduce with MPI.MAX / MIN of integers (a plan moves floats as order keys: MPI's float
        MAX drops NaN by rank order, backends/extrema.py): each team's local devices combined first."""
        if np_dtype(send.dtype).kind != "i":
            raise TypeError(f"Allreduce op={op} of {send.dtype} values: the plan moves integer keys (passes/lower.py)")
        sbufs = [np.empty(send.shape, np_dtype(send.dtype)) for _ in parts]
        state, mpi_op = {}, self.MPI.MAX if op == Reduce.MAX else self.MPI.MIN
        combine = np.maximum if op == Reduce.MAX else np.minimum
        what = faults.step_name(Op.ALLREDUCE, team, send)

        def start(bufs):
            s, r = self._views(bufs, send), self._views(bufs, recv)
            reqs = []
            for p, sbuf in zip(parts, sbufs):
                np.copyto(sbuf, s[p.js[0]])
                for j in p.js[1:]:
                    combine(sbuf, s[j], out=sbuf)
                reqs.append(p.comm.Iallreduce(_buf(sbuf), _buf(r[p.js[0]]), mpi_op))
            state["req"], state["r"] = reqs, r

        return start, _copied_to_all(state, what, parts, world_peers(self.MPI, parts))

    def bind_reduce_scatter(self, send, recv, team, stream):
        """send: rank-major [D, *R] per local device (contiguous); recv: [*R] per local device,
        device at team position q gets the team's sum of block q."""
        parts = self._parts(team, Op.REDUCE_SCATTER)
        if not parts:  # no device of this team here
            return None, None
        red = _reduce_dtype(send.dtype)
        native = red == np_dtype(send.dtype)
        assert all(send.shape[0] == p.size for p in parts), (send.shape, [p.size for p in parts])
        direct_send = [len(p.js) == 1 and native and not self._slot_alias(send, recv) for p in parts]
        direct_recv = [len(p.js) == 1 and native for p in parts]
        sbufs = [None if d else np.empty(send.shape, red) for d in direct_send]
        rbufs = [None if d else np.empty((len(p.js),) + tuple(recv.shape), red) for p, d in zip(parts, direct_recv)]
        empty = int(np.prod(recv.shape, dtype=np.int64)) == 0
        state = {}
        what = faults.step_name(Op.REDUCE_SCATTER, team, send)

        def start(bufs):
            s, r = self._views(bufs, send), self._views(bufs, recv)
            reqs = []
            for i, p in enumerate(parts):
                src = s[p.js[0]] if direct_send[i] else _local_sum([s[j] for j in p.js], sbufs[i])
                dst = r[p.js[0]] if direct_recv[i] else rbufs[i]
                if not empty:
                    reqs.append(p.comm.Ireduce_scatter_block(_buf(src), _buf(dst), self.MPI.SUM))
            state["req"], state["r"] = reqs, r

        def wait(bufs):
            faults.wait(state.pop("req"), what, peers)
            r = state.pop("r")
            for p, rbuf in zip(parts, rbufs):
                for k, j in enumerate(p.js if rbuf is not None else ()):
                    r[j][...] = rbuf[k]
        peers = world_peers(self.MPI, parts)
        return start, wait

    def bind_alltoall(self, send, recv, team, stream):
        """send, recv: rank-major [D, *B] per local device; block q of the device at position p
        goes to block p of the device at position q."""
        parts = self._parts(team, Op.ALLTOALL)
        if not parts:  # no device of this team here
            return None, None
        block, dt = tuple(send.shape[1:]), np_dtype(send.dtype)
        # per team: [P target processes, L source devices here, L target devices there, *B]
        shapes = [(p.comm.Get_size(), len(p.js), len(p.js)) + block for p in parts]
        sbufs, rbufs = [np.empty(sh, dt) for sh in shapes], [np.empty(sh, dt) for sh in shapes]
        state = {}
        what = faults.step_name(Op.ALLTOALL, team, send)

        def start(bufs):
            s, r = self._views(bufs, send), self._views(bufs, recv)
            reqs = []
            for p, sh, sbuf, rbuf in zip(parts, shapes, sbufs, rbufs):
                for k, j in enumerate(p.js):
                    sbuf[:, k] = s[j].reshape(sh[:2] + block)
                reqs.append(p.comm.Ialltoall(_wire(sbuf), _wire(rbuf)))
            state["req"], state["r"] = reqs, r

        def wait(bufs):
            faults.wait(state.pop("req"), what, peers)
            r = state.pop("r")
            for p, sh, rbuf in zip(parts, shapes, rbufs):
                for k, j in enumerate(p.js):
                    r[j].reshape(sh[:2] + block)[...] = rbuf[:, :, k]
        peers = world_peers(self.MPI, parts)
        return start, wait

    def bind_sendrecv(self, send, recv, team, shift, stream):
        """Ring shift within each team: the device at position q sends to q + shift and receives
        from q - shift; peers on this process are copied in memory, others by Isend/Irecv."""
        parts = self._parts(team, Op.SENDRECV)
        if not parts:  # no device of this team here
            return None, None
        state = {}
        what = faults.step_name(Op.SENDRECV, team, send)

        def start(bufs):
            s, r = self._views(bufs, send), self._views(bufs, recv)
            reqs = []
            for p in parts:
                L, me, comm = len(p.js), p.comm.Get_rank(), p.comm
                for k, j in enumerate(p.js):
                    q = p.first + k
                    dst, src = (q + shift) % p.size, (q - shift) % p.size
                    if src // L == me:
                        r[j][...] = s[p.js[src - p.first]]
                    else:
                        reqs.append(comm.Irecv(_wire(r[j]), source=src // L, tag=q))
                    if dst // L != me:
                        reqs.append(comm.Isend(_wire(s[j]), dest=dst // L, tag=dst))
            state["reqs"] = reqs

        def wait(bufs):
            faults.wait(state.pop("reqs"), what, peers)
        peers = world_peers(self.MPI, parts)
        return start, wait

    def bind_transfers(self, pairs, stream):
        """Point-to-point moves between meshes: (src device, send, dst device, recv), each a
        contiguous view.  Pairs within this process are copied; the rest are Isend/Irecv on
        COMM_WORLD, tagged by their place in the list (every rank binds the same list)."""
        world, L, me = self.MPI.COMM_WORLD, self.L, self.rank
        idx = self.local_index
        state = {}
        peers = ({d // L for s, _, d, _ in pairs if s // L == me}  # the processes this one exchanges with
                 | {s // L for s, _, d, _ in pairs if d // L == me})
        what = faults.step_name(Op.TRANSFER, None, pairs[0][1] if pairs else None)

        def start(bufs):
            reqs = []
            for tag, (s, sref, d, rref) in enumerate(pairs):
                here_s, here_d = s // L == me, d // L == me
                if here_s and here_d:
                    self.view(bufs, rref, idx[d])[...] = self.view(bufs, sref, idx[s])
                elif here_s:
                    reqs.append(world.Isend(_wire(self.view(bufs, sref, idx[s])), dest=d // L, tag=tag))
                elif here_d:
                    reqs.append(world.Irecv(_wire(self.view(bufs, rref, idx[d])), source=s // L, tag=tag))
            state["reqs"] = reqs

        def wait(bufs):
            faults.wait(state.pop("reqs"), what, peers)
        return start, wait


def _copied_to_all(state, what, parts, peers, staged=None):
    """The wait step of a collective whose result lands, per team, on this process' first device
    there (through `staged[i]` where it arrives in another dtype): its other devices get a copy."""
    def wait(bufs):
        faults.wait(state.pop("req"), what, peers)
        r = state.pop("r")
        for i, p in enumerate(parts):
            r0 = r[p.js[0]]
            if staged is not None:
                r0[...] = staged[i]
            for j in p.js[1:]:
                r[j][...] = r0
    return wait
