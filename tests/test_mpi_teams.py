"""The MPI backend's team bookkeeping (backends/mpi_teams.py), without MPI: which processes own
which positions of each team, the rounds of Splits every rank computes alike, and the layouts it
refuses.  tests/mpi/test_teams_mpi.py runs the collectives on these layouts under mpiexec."""
from __future__ import annotations

import itertools

import pytest

import shardfuse as sf
from shardfuse.backends.mpi_teams import split_rounds, team_layout


def _layout(shape, axis, nprocs):
    mesh = sf.DeviceMesh(shape, ("dp", "tp"), backend="numpy")
    return team_layout(mesh.teams(axis), mesh.size // nprocs)


def test_2x2_under_2_processes():
    dp, why = _layout((2, 2), "dp", 2)  # teams (0, 2), (1, 3): process 0 owns devices 0, 1
    assert why is None and dp == [[(0, 0, 1), (1, 1, 1)], [(0, 0, 1), (1, 1, 1)]]
    assert split_rounds(dp) == [0, 1]  # both processes are in both teams: two rounds
    tp, _ = _layout((2, 2), "tp", 2)  # teams (0, 1), (2, 3): one process each, both in round 0
    assert tp == [[(0, 0, 2)], [(1, 0, 2)]] and split_rounds(tp) == [0, 0]


def test_2x4_under_2_and_4_processes():
    dp, _ = _layout((2, 4), "dp", 2)
    assert split_rounds(dp) == [0, 1, 2, 3]
    dp4, _ = _layout((2, 4), "dp", 4)  # process 0 owns 0, 1: teams (0, 4) and (1, 5)
    assert dp4[0] == [(0, 0, 1), (2, 1, 1)] and split_rounds(dp4) == [0, 1, 0, 1]
    tp4, _ = _layout((2, 4), "tp", 4)  # team (0, 1, 2, 3): processes 0, 1 own two positions each
    assert tp4 == [[(0, 0, 2), (1, 2, 2)], [(2, 0, 2), (3, 2, 2)]] and split_rounds(tp4) == [0, 0]


@pytest.mark.parametrize("shape", [(2, 2), (2, 4), (4, 2), (4, 4), (2, 8), (8, 2), (3, 2), (2, 3), (6, 2)], ids=str)
def test_every_supported_layout_keeps_the_rank_order_and_the_rounds_pair_up(shape):
    for nprocs, axis in itertools.product(range(1, shape[0] * shape[1] + 1), ("dp", "tp")):
        if (shape[0] * shape[1]) % nprocs:
            continue
        layout, why = _layout(shape, axis, nprocs)
        if layout is None:
            assert "split unevenly" in why
            continue
        for members in layout:  # team rank k owns positions [k*L, (k+1)*L)
            count = members[0][2]
            assert [first for _, first, _ in members] == [k * count for k in range(len(members))]
        rounds = split_rounds(layout)
        for r in set(rounds):  # in one round a process colors itself with one team at most
            procs = [p for t, members in enumerate(layout) if rounds[t] == r for p, _, _ in members]
            assert len(procs) == len(set(procs)), (shape, nprocs, axis, r)


def test_power_of_two_layouts_are_all_supported():
    for shape in [(2, 2), (2, 4), (4, 2), (4, 4), (2, 8), (8, 2)]:
        for nprocs in (1, 2, 4, 8, 16):
            for axis in ("dp", "tp"):
                if shape[0] * shape[1] % nprocs == 0:
                    assert _layout(shape, axis, nprocs)[1] is None, (shape, nprocs, axis)


def test_an_uneven_team_is_refused_with_its_reason():
    layout, why = _layout((3, 2), "dp", 2)  # dp teams (0, 2, 4), (1, 3, 5); process 0 owns 0, 1, 2
    assert layout is None
    assert why == ("team 0 (0, 2, 4) is split unevenly over the processes (process 0: 2, process 1: 1); "
                   "every process of a team must own the same number of its devices")


def test_a_sub_mesh_in_another_order_needs_consecutive_positions():
    # a team listing devices (3, 1, 2, 0) with 2 devices a process: process 1 owns positions 0 and 2
    layout, why = team_layout([(3, 1, 2, 0)], 2)
    assert layout is None and "positions [0, 2]" in why and "not consecutive" in why
    assert team_layout([(3, 1, 2, 0)], 1)[0] == [[(3, 0, 1), (1, 1, 1), (2, 2, 1), (0, 3, 1)]]
