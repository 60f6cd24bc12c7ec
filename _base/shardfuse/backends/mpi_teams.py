"""The team communicators of the NumPy-over-MPI backend (backends/numpy_mpi.py).

A collective over mesh axis ``m`` runs within each team of ``m`` (mesh.teams(m): the devices
that differ only in ``m``, in the axis' order).  Process p owns the consecutive device ids
[p*L, (p+1)*L), so in a team it owns a run of consecutive positions (ids increase along a team
of a mesh; a sub-mesh may list its devices in another order, checked below).  A process may own
devices of several teams of one axis (a 2x2 ("dp", "tp") mesh under -n 2: process 0 owns
(dp0, tp0) and (dp0, tp1), in two dp teams): it then takes part in one MPI collective per team.

Layout rule: within one team, every process that owns some of its positions owns the same number,
L_t, and consecutive ones.  Ordering a team's processes by their first position then gives team
rank k the positions [k*L_t, (k+1)*L_t), so the executor's rank-major buffers [D, ...] are exactly
[P_t, L_t, ...].  A team split unevenly (a (2, 3) mesh over 3 processes: team (0, 1, 2) has two
devices on process 0 and one on process 1) raises NotImplementedError when a plan binds a
collective over it, on every rank, before anything is sent.

Splitting: one communicator per team, made by COMM_WORLD.Split, which is collective over every
rank, so all ranks must make the same calls in the same order.  Teams get rounds greedily, in
team order: a team takes the first round in which none of its processes is already in another
team.  In round r every process colors itself with the index of its team of round r (it has at
most one there, by construction) or MPI.UNDEFINED, keyed by its first position in that team.
Rounds depend on the mesh alone, so every rank computes the same ones: with one team per process
that is a single Split, as before; under -n 2 on a 2x4 mesh, dp takes 4 rounds.
"""
from __future__ import annotations

from dataclasses import dataclass

from shardfuse import faults

# Communicators are split once per (teams, devices per process, process count) and reused by
# every mesh with those teams: splitting is collective, and never freeing them avoids a
# collective MPI_Comm_free at garbage-collection time (which need not be the same on all ranks).
_COMMS: dict = {}


@dataclass(frozen=True)
class TeamPart:
    """This process' share of one team: its communicator and its devices there."""

    index: int  # the team's index in mesh.teams(axis)
    comm: object  # the team's communicator: rank k owns positions [k*L_t, (k+1)*L_t)
    first: int  # team position of this process' first device in the team
    js: tuple  # positions in local_devices of this process' devices in the team, in team order
    size: int  # devices in the team (D)


def team_layout(teams, per: int):
    """Per team, [(process, first position, count)] ordered by first position; or (None, the
    reason) where some team breaks the layout rule."""
    out = []
    for t, team in enumerate(teams):
        runs: dict = {}
        for pos, d in enumerate(team):
            runs.setdefault(d // per, []).append(pos)
        procs = sorted(runs, key=lambda p: runs[p][0])
        for p in procs:
            if runs[p] != list(range(runs[p][0], runs[p][0] + len(runs[p]))):
                return None, (f"process {p} owns positions {runs[p]} of team {t} {tuple(team)}, which are not "
                              "consecutive")
        if len({len(runs[p]) for p in procs}) != 1:
            owned = ", ".join(f"process {p}: {len(runs[p])}" for p in procs)
            return None, (f"team {t} {tuple(team)} is split unevenly over the processes ({owned}); "
                          "every process of a team must own the same number of its devices")
        out.append([(p, runs[p][0], len(runs[p])) for p in procs])
    return out, None


def split_rounds(layout) -> list:
    """The round of each team's Split: the first round none of its processes is busy in."""
    busy: dict = {}
    out = []
    for members in layout:
        procs = [p for p, _, _ in members]
        r = 0
        while any(r in busy.get(p, ()) for p in procs):
            r += 1
        for p in procs:
            busy.setdefault(p, set()).add(r)
        out.append(r)
    return out


def team_parts(MPI, teams, per: int, local_index: dict, what: str):
    """This process' TeamParts of `teams` (none where it owns no device of them), splitting the
    communicators the first time these teams are seen (collective: every rank must call this for
    the same teams in the same order); or (None, the reason) where the layout rule is broken."""
    teams = tuple(tuple(t) for t in teams)
    world = MPI.COMM_WORLD
    rank, nprocs = world.Get_rank(), world.Get_size()
    layout, why = team_layout(teams, per)
    if layout is None:
        return None, why
    key = (teams, per, nprocs)
    if key not in _COMMS:
        _COMMS[key] = _split(MPI, layout, rank, nprocs, what)
    parts = []
    for t, comm in sorted(_COMMS[key].items()):
        mine = [d for d in teams[t] if d in local_index]
        first = teams[t].index(mine[0])
        # team rank k owns positions [k*L_t, (k+1)*L_t): the Split key orders ranks by first position
        assert comm.Get_rank() * len(mine) == first, (teams[t], comm.Get_rank(), len(mine), first)
        parts.append(TeamPart(t, comm, first, tuple(local_index[d] for d in mine), len(teams[t])))
    return parts, None


def _split(MPI, layout, rank, nprocs, what) -> dict:
    """team index -> communicator, for the teams this process owns devices of."""
    world = MPI.COMM_WORLD
    if len(layout) == 1 and [p for p, _, _ in layout[0]] == list(range(nprocs)):
        return {0: world}  # one team of every process, in rank order (a 1-D mesh)
    rounds = split_rounds(layout)
    mine = {rounds[t]: (t, first) for t, members in enumerate(layout) for p, first, _ in members if p == rank}
    # Split blocks with no deadline: first make sure every rank has come this far.
    faults.barrier(world, f"splitting the team communicators of {what}")
    comms = {}
    for r in range(max(rounds) + 1):
        color, key = mine.get(r, (MPI.UNDEFINED, 0))
        comm = world.Split(color, key)
        if color != MPI.UNDEFINED:
            comms[color] = comm
    return comms


def world_peers(MPI, parts):
    """What faults.wait reports for requests on these parts' communicators: the one communicator,
    or the world ranks of all of them."""
    if len(parts) == 1:
        return parts[0].comm
    world = MPI.COMM_WORLD.Get_group()
    ranks: set = set()
    for p in parts:
        ranks.update(MPI.Group.Translate_ranks(p.comm.Get_group(), list(range(p.comm.Get_size())), world))
    return ranks
