"""Timeline.summary() under mpiexec: plan.profile gathers every rank's steps (len(timeline) is
all of them), but the summary's figures, its step count too, are one device's, not multiplied by
the number of ranks; its collectives are the plan's (plan.collectives(), per call on every device).
Every rank runs every test in the same order, so the collectives pair up."""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import shardfuse as sf
from shardfuse.timeline import Timeline

COMM = MPI.COMM_WORLD
NPROCS = COMM.Get_size()


@pytest.mark.parametrize("d", sorted({4, NPROCS}), ids=lambda d: f"D{d}")
def test_summary_counts_are_one_devices(d):
    mesh = sf.DeviceMesh(d)
    f = sf.jit(lambda a, b: sf.stream(sf.shard(a, axis=1) @ b, axis=0), mesh=mesh, streams=2)
    rng = np.random.default_rng(0)  # (the same on every rank)
    a, b = rng.standard_normal((4, d, 8, 16)), rng.standard_normal((16, 8))
    plan = f.lower(sf.TensorSpec(a.shape, "float64"), sf.TensorSpec(b.shape, "float64"))
    tl = plan.profile(sf.shard(a, axis=1, mesh=mesh), b, repeat=2)
    s = tl.summary()
    rank, device = s["device"]
    own = COMM.allgather(len(plan.executable.steps))  # each rank's steps of one call
    assert len(tl) == 2 * sum(own)  # every rank's, gathered
    assert s["steps"] == 2 * own[rank]  # the device's own: each of its process' steps covers all its devices
    assert device in range(d) and s == Timeline([e for e in tl.events if e.rank == rank], tl.plan_name).summary()
    assert f"{len(tl)} steps" + (f" of {NPROCS} ranks" if NPROCS > 1 else "") + f"; device {s['device']}: " \
        f"{s['steps']} steps" in repr(tl)
    assert plan.collectives() == {"allgather": 4}  # the plan's, whatever the number of ranks
    for call in range(2):  # and each device issues them once per call
        started = [e for e in tl.events if e.rank == rank and e.call == call and device in e.devices
                   and " = Allgather " in e.text]
        assert len(started) == 4, [e.text for e in started]
        assert tl.summary(call=call)["steps"] == own[tl.summary(call=call)["device"][0]]
