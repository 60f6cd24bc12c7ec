"""A value on a sub-mesh is computed on its devices only, in mpiexec ranks (issue 30, item 6;
tests/test_submesh_devices.py in one process).  Under -n 4 each rank owns one device, under -n 2
rank 0 owns stage 0 (devices 0, 1) and rank 1 stage 1 (2, 3): a rank runs its own stage's
Matmul and Gelu and none of the other's, so none of the overflow warnings that computing on
placeholders printed (4-14 a run at -n 4) can appear.  Buffers no step writes hold a huge value
(`loud`): any arithmetic on one raises here, where warnings are errors."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
from mpi4py import MPI

import shardfuse as sf
from shardfuse.backends.numpy_mpi import NumpyMPIBackend
from shardfuse.ops import Op
from shardfuse.steps import plan_steps
from test_submesh_devices import (STAGE_STEPS, compute_devices, each_stage_buffers_on_its_devices, inputs, loud, pipeline,
                                  reference, with_backend)

NPROCS = MPI.COMM_WORLD.Get_size()
VARIANTS = [False, True]  # (under -n 2 a tensor-parallel stage's team is one process' two devices)


def _loud_mesh():
    mesh = sf.DeviceMesh(4)
    return with_backend(mesh, loud(NumpyMPIBackend)(mesh))


@pytest.mark.parametrize("collective", VARIANTS, ids=["plain", "tensor-parallel-stage"])
def test_each_rank_runs_its_own_stage_only(collective):
    mesh = _loud_mesh()
    f = pipeline(mesh, collective)
    rng = np.random.default_rng(7)  # the same on every rank: inputs are global arrays
    x, w0, w1 = inputs(rng)
    plan = f.lower(x, w0, w1)
    mine = set(mesh.local_devices)
    printed = {s.index: s for s in plan_steps(plan.program)}
    for s in plan.executable.steps:  # this rank's steps: its devices of each printed step's, never none
        assert s.devices and s.devices == tuple(d for d in mesh.local_devices if d in printed[s.index].devices), s
    compute = [s for s in printed.values() if s.op in (Op.MATMUL, Op.GELU)]
    bound = {s.index for s in plan.executable.steps}
    assert {s.index for s in compute if mine & set(s.devices)} == {s.index for s in compute} & bound
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an overflow on a placeholder raises
        for _ in range(3):
            x, w0, w1 = inputs(rng)
            np.testing.assert_allclose(f(x, w0, w1).gather(), reference(x, w0, w1, collective), rtol=2e-5, atol=1e-5)


def test_the_profile_shows_each_stage_on_its_devices():
    mesh = _loud_mesh()
    x, w0, w1 = inputs(np.random.default_rng(8))
    plan = pipeline(mesh).lower(x, w0, w1)
    printed = plan_steps(plan.program)
    per = 4 // NPROCS
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tl = plan.profile(x, w0, w1, repeat=2)  # every rank's events (collective)
    assert {e.rank for e in tl.events} == set(range(NPROCS))
    for e in tl.events:
        ranks_devices = range(e.rank * per, (e.rank + 1) * per)
        assert e.devices == tuple(d for d in ranks_devices if d in printed[e.step].devices), e
    assert compute_devices(tl) == STAGE_STEPS


def test_whole_mesh_replicas_used_on_stages_across_ranks():
    """tests/test_submesh.py's whole-mesh values on a stage (copied there, no communication) and AdamW
    over two stages' weights, with the stages on different ranks."""
    import test_submesh as ts
    ts.test_replicated_values_of_the_whole_mesh_are_used_on_a_stage(sf.DeviceMesh(4), np.random.default_rng(7))
    ts.test_adamw_steps_over_weights_on_two_stages(sf.DeviceMesh(4), np.random.default_rng(8))
    ts.test_arrays_placed_on_a_stage_are_taken_by_the_whole_meshs_programs(sf.DeviceMesh(4), np.random.default_rng(9))
    ts.test_a_whole_mesh_parameter_used_on_two_stages_gets_its_gradient(sf.DeviceMesh(4), np.random.default_rng(10))


@pytest.mark.parametrize("collective", VARIANTS, ids=["plain", "tensor-parallel-stage"])
def test_each_rank_makes_its_own_stage_buffers_only(collective):
    """Under -n 2 rank 1 holds stage 1 only: it made stage 0's buffers too (a probe), now placeholders."""
    made, m = each_stage_buffers_on_its_devices(sf.DeviceMesh(4), collective)
    others = MPI.COMM_WORLD.allgather(made)
    everywhere = {d: n for part in others for d, n in part.items()}
    assert set(everywhere) == {0, 1, 2, 3} and max(everywhere.values()) == m["persistent"]
    assert everywhere[0] == everywhere[1] != everywhere[2] == everywhere[3]
