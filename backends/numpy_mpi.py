"""NumPy devices spread over MPI processes (``mpiexec -n P``): each process owns L >= 1 of them.

Only the collectives differ from the in-memory reference (NumpyLocalBackend): each one first
combines the contributions of this process' local devices in memory, then posts ONE
non-blocking MPI collective across the processes of the team (Iallgather / Iallreduce /
Ireduce_scatter_block) in its start step; its wait step polls the request until it completes
(shardfuse.faults.wait: SHARDFUSE_TIMEOUT seconds at most, then the job is aborted with the
step's name and the ranks that did not arrive) and copies the result into the local devices'
views where needed.

Teams: a collective over mesh axis ``m`` runs within each group of devices that differ only
in ``m`` (mesh.teams(m)).  On a 1-D mesh that is every device: COMM_WORLD.  On a mesh with
more axes, one sub-communicator per mesh axis is split off COMM_WORLD when the backend is
created (collective, in axis order on every rank), provided every process' local devices
lie in one team of that axis; a collective over an axis where they do not raises
NotImplementedError on every rank, when the plan is bound (before anything is sent).

Within a team, a process' local devices hold consecutive team positions, and the processes
of a team are ranked by their first position, so team rank k holds positions [k*L, (k+1)*L):
the rank-major buffers [D, ...] the executor hands over are exactly [P_team, L, ...].

Buffers: gathers move raw bits (bfloat16 / float16 as uint16 views); reductions run in the
array's dtype (float32 for bfloat16 / float16, which MPI cannot sum).
"""
from __future__ import annotations

import numpy as np

from shardfuse import faults
from shardfuse.backends.numpy_local import NumpyLocalBackend
from shardfuse.dtypes import np_dtype
from shardfuse.ops import Op, Reduce

# Sub-communicators are split once per (mesh geometry, process count) and reused by every
# mesh of that geometry: splitting is collective, and never freeing them avoids a
# collective MPI_Comm_free at garbage-collection time (which need not be the same on all ranks).
_TEAM_COMMS: dict = {}

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
    """The sum of this process' local devices' contributions, into the send buffer."""
    acc = pieces[0].astype(np.float64) if len(pieces) > 1 else pieces[0]
    for x in pieces[1:]:
        acc = acc + x
    out[...] = acc
    return out


def _reduce_dtype(dtype: str):
    return np.dtype(np.float32) if dtype in _HALF else np_dtype(dtype)


def _team_layout(mesh, name, nprocs):
    """For mesh axis `name`: per process p, (team index, first team position), or the reason
    it is not supported (some process' local devices span several teams)."""
    per = mesh.size // nprocs
    where = {}
    for t, team in enumerate(mesh.teams(name)):
        for pos, d in enumerate(team):
            where[d] = (t, pos)
    out = []
    for p in range(nprocs):
        devs = range(p * per, (p + 1) * per)
        teams = {where[d][0] for d in devs}
        if len(teams) != 1:
            return None, (f"process {p} owns devices {tuple(devs)}, which lie in {len(teams)} different "
                          f"teams of mesh axis {name!r}")
        first = where[devs[0]][1]
        if [where[d][1] for d in devs] != list(range(first, first + per)):  # cannot happen, but check
            return None, f"process {p}'s devices {tuple(devs)} are not consecutive in their team of {name!r}"
        out.append((teams.pop(), first))
    return out, None


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
        self.comms: dict = {}  # mesh axis name -> team communicator
        self.first: dict = {}  # mesh axis name -> team position of this process' first local device
        self.unsupported: dict = {}  # mesh axis name -> reason
        for name in mesh.axis_names:  # the same order on every rank: the splits pair up
            layout, why = _team_layout(mesh, name, self.nprocs)
            if layout is None:
                self.unsupported[name] = why
                continue
            self.first[name] = layout[self.rank][1]
            if len(mesh.shape) == 1:
                self.comms[name] = world
                continue
            key = (mesh.shape, mesh.axis_index(name), self.nprocs)
            if key not in _TEAM_COMMS:
                color, first = layout[self.rank]
                _TEAM_COMMS[key] = world.Split(color, first)
            self.comms[name] = _TEAM_COMMS[key]

    def _comm(self, team, what):
        """The team's communicator, or None where this process holds no device of the team."""
        if isinstance(team, tuple):
            return self._submesh_comm(team, what)
        if team in self.unsupported:
            raise NotImplementedError(
                f"{what} over mesh axis {team!r} of {self.mesh} under {self.nprocs} MPI processes: "
                f"{self.unsupported[team]}; the MPI backend needs each process' {self.L} local devices to lie "
                f"in one team of {team!r} (one device per process, mpiexec -n {self.mesh.size}, always does)")
        comm = self.comms[team]
        # team rank k holds positions [k*L, (k+1)*L): the Split key orders ranks by first position
        assert comm.Get_rank() * self.L == self.first[team], (team, comm.Get_rank(), self.L, self.first[team])
        return comm

    submesh_teams = True  # with one device per process (see _submesh_comm)

    def _submesh_comm(self, team, what):
        """A team of a sub-mesh (a pipeline stage): split off COMM_WORLD the first time a plan
        binds it -- every rank binds the same plan in the same order, so the splits pair up."""
        mesh, name = team
        if self.L != 1:
            raise NotImplementedError(f"{what} within the sub-mesh {mesh} under MPI needs one device per process "
                                      f"(this process owns {self.L}); run mpiexec -n {self.mesh.size}")
        if team not in self.comms:
            me = self.local_devices[0]
            mine = [t for t in mesh.teams(name) if me in t]
            pos = mine[0].index(me) if mine else 0
            cache = ("submesh", mesh.devices, mesh.shape, name, self.nprocs)  # reused, like the whole-mesh splits
            if cache not in _TEAM_COMMS:
                color = mesh.teams(name).index(mine[0]) if mine else self.MPI.UNDEFINED
                faults.barrier(self.MPI.COMM_WORLD, f"splitting the communicator of {what} within {mesh}")
                _TEAM_COMMS[cache] = self.MPI.COMM_WORLD.Split(color, pos)
            comm = _TEAM_COMMS[cache]
            self.comms[team] = None if comm == self.MPI.COMM_NULL else comm
            self.first[team] = pos
        return self.comms[team]

    def _slot_alias(self, a, b):
        return a.slot == b.slot

    # ---- collectives ------------------------------------------------------------------
    def bind_allgather(self, send, recv, team, stream):
        """send: [*S] per local device; recv: rank-major [D, *S] per local device (both contiguous)."""
        comm = self._comm(team, Op.ALLGATHER)
        if comm is None:  # no device of this team here
            return None, None
        L = self.L
        first = self.first[team]  # this process' first position in the team
        assert recv.shape[0] == comm.Get_size() * L, (recv.shape, comm.Get_size(), L)
        direct = L == 1 and not self._slot_alias(send, recv)
        state = {}
        what = faults.step_name(Op.ALLGATHER, team, send)

        def start(bufs):
            s, r = self._views(bufs, send), self._views(bufs, recv)
            r0 = r[0]
            if direct:
                state["req"] = comm.Iallgather(_wire(s[0]), _wire(r0))
            else:
                for j in range(L):
                    r0[first + j] = s[j]
                state["req"] = comm.Iallgather(self.MPI.IN_PLACE, _wire(r0))
            state["r"] = r

        return start, _copied_to_all(state, what, comm, L)

    def bind_allreduce(self, send, recv, team, stream, op=Reduce.SUM):
        """send, recv: [*S] per local device (contiguous); recv = sum (or max, min) over the team."""
        comm = self._comm(team, Op.ALLREDUCE)
        if comm is None:  # no device of this team here
            return None, None
        if op != Reduce.SUM:
            return self._allreduce_extremum(comm, send, recv, team, op)
        L, red = self.L, _reduce_dtype(send.dtype)
        native = red == np_dtype(send.dtype)
        direct_send = L == 1 and native and not self._slot_alias(send, recv)
        sbuf = None if direct_send else np.empty(send.shape, red)
        rbuf = None if native else np.empty(recv.shape, red)
        state = {}
        what = faults.step_name(Op.ALLREDUCE, team, send)

        def start(bufs):
            s, r = self._views(bufs, send), self._views(bufs, recv)
            src = s[0] if direct_send else _local_sum(s, sbuf)
            dst = r[0] if native else rbuf
            state["req"] = comm.Iallreduce(_buf(src), _buf(dst), self.MPI.SUM)
            state["r"] = r

        return start, _copied_to_all(state, what, comm, L, None if native else rbuf)

    def _allreduce_extremum(self, comm, send, recv, team, op):
        """Allreduce with MPI.MAX / MIN of integers (a plan moves floats as order keys: MPI's float
        MAX drops NaN by rank order, backends/extrema.py): this process' devices combined first."""
        if np_dtype(send.dtype).kind != "i":
            raise TypeError(f"Allreduce op={op} of {send.dtype} values: the plan moves integer keys (passes/lower.py)")
        L, sbuf = self.L, np.empty(send.shape, np_dtype(send.dtype))
        state, mpi_op = {}, self.MPI.MAX if op == Reduce.MAX else self.MPI.MIN
        what = faults.step_name(Op.ALLREDUCE, team, send)

        def start(bufs):
            s, r = self._views(bufs, send), self._views(bufs, recv)
            (np.maximum if op == Reduce.MAX else np.minimum).reduce(s, out=sbuf) if L > 1 else np.copyto(sbuf, s[0])
            state["req"], state["r"] = comm.Iallreduce(_buf(sbuf), _buf(r[0]), mpi_op), r

        return start, _copied_to_all(state, what, comm, L)

    def bind_reduce_scatter(self, send, recv, team, stream):
        """send: rank-major [D, *R] per local device (contiguous); recv: [*R] per local device,
        device at team position q gets the team's sum of block q."""
        comm = self._comm(team, Op.REDUCE_SCATTER)
        if comm is None:  # no device of this team here
            return None, None
        L, red = self.L, _reduce_dtype(send.dtype)
        native = red == np_dtype(send.dtype)
        assert send.shape[0] == comm.Get_size() * L, (send.shape, comm.Get_size(), L)
        direct_send = L == 1 and native and not self._slot_alias(send, recv)
        direct_recv = L == 1 and native
        sbuf = None if direct_send else np.empty(send.shape, red)
        rbuf = None if direct_recv else np.empty((L,) + tuple(recv.shape), red)
        count = L * int(np.prod(recv.shape, dtype=np.int64))
        state = {}
        what = faults.step_name(Op.REDUCE_SCATTER, team, send)

        def start(bufs):
            s, r = self._views(bufs, send), self._views(bufs, recv)
            src = s[0] if direct_send else _local_sum(s, sbuf)
            dst = r[0] if direct_recv else rbuf
            state["req"] = comm.Ireduce_scatter_block(_buf(src), _buf(dst), self.MPI.SUM) if count else None
            state["r"] = r

        def wait(bufs):
            req = state.pop("req")
            if req is not None:
                faults.wait(req, what, comm)
            r = state.pop("r")
            if not direct_recv:
                for j in range(L):
                    r[j][...] = rbuf[j]
        return start, wait

    def bind_alltoall(self, send, recv, team, stream):
        """send, recv: rank-major [D, *B] per local device; block q of the device at position p
        goes to block p of the device at position q."""
        comm = self._comm(team, Op.ALLTOALL)
        if comm is None:  # no device of this team here
            return None, None
        L, P = self.L, comm.Get_size()
        block = tuple(send.shape[1:])
        dt = np_dtype(send.dtype)
        # [P target processes, L source devices here, L target devices there, *B]
        sbuf = np.empty((P, L, L) + block, dt)
        rbuf = np.empty((P, L, L) + block, dt)
        state = {}
        what = faults.step_name(Op.ALLTOALL, team, send)

        def start(bufs):
            s, r = self._views(bufs, send), self._views(bufs, recv)
            for j in range(L):
                sbuf[:, j] = s[j].reshape((P, L) + block)
            state["req"] = comm.Ialltoall(_wire(sbuf), _wire(rbuf))
            state["r"] = r

        def wait(bufs):
            faults.wait(state.pop("req"), what, comm)
            r = state.pop("r")
            for k in range(L):
                r[k].reshape((P, L) + block)[...] = rbuf[:, :, k]
        return start, wait

    def bind_sendrecv(self, send, recv, team, shift, stream):
        """Ring shift within the team: the device at position q sends to q + shift and receives
        from q - shift; peers on this process are copied in memory, others by Isend/Irecv."""
        comm = self._comm(team, Op.SENDRECV)
        if comm is None:  # no device of this team here
            return None, None
        L, first = self.L, self.first[team]
        d = comm.Get_size() * L
        me = comm.Get_rank()
        state = {}
        what = faults.step_name(Op.SENDRECV, team, send)

        def start(bufs):
            s, r = self._views(bufs, send), self._views(bufs, recv)
            reqs = []
            for j in range(L):
                q = first + j
                dst, src = (q + shift) % d, (q - shift) % d
                if src // L == me:
                    r[j][...] = s[src - first]
                else:
                    reqs.append(comm.Irecv(_wire(r[j]), source=src // L, tag=q))
                if dst // L != me:
                    reqs.append(comm.Isend(_wire(s[j]), dest=dst // L, tag=dst))
            state["reqs"] = reqs

        def wait(bufs):
            faults.wait(state.pop("reqs"), what, comm)
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


def _copied_to_all(state, what, comm, L, staged=None):
    """The wait step of a collective whose result lands on this process' first device (through
    `staged` where it arrives in another dtype): every other local device gets a copy."""
    def wait(bufs):
        faults.wait(state.pop("req"), what, comm)
        r = state.pop("r")
        if staged is not None:
            r[0][...] = staged
        for j in range(1, L):
            r[j][...] = r[0]
    return wait
