"""One rank misbehaves; the job must end fast, with that rank's story visible, on every launch.

Run as plain `mpiexec -n P python tests/mpi_scripts/faulty.py MODE` (no `-m mpi4py`: shardfuse
installs its own abort hooks); tests/test_mpi_faults.py launches it and checks the outcome.
Rank 1 is the one that misbehaves; the others go on into a collective that needs it.

Modes: ok, ok_late (rank 1 finishes 3 s after the others), raise_between, raise_in_step,
raise_tracing, raise_in_thread, sys_exit0, sys_exit3, os_exit3, sleep (past SHARDFUSE_TIMEOUT),
sleep_in_step (inside a plan, past it), mismatch (a different shape on rank 1), exit_in_gather
(rank 1 leaves while the others are in Array.gather).
"""
import dataclasses
import os
import sys
import threading
import time

import numpy as np

import shardfuse as sf

mode = sys.argv[1]
mesh = sf.DeviceMesh(4)  # -n 2: two devices per process; -n 4: one
rank, BAD = mesh.rank, 1


def say(msg):
    print(f"rank {rank}: {msg}", flush=True)


f = sf.jit(lambda x: sf.replicate(sf.shard(x, axis=0)), mesh=mesh)
x = np.arange(8.0 * 3).reshape(8, 3)
assert np.array_equal(f(x).gather(), x)  # one good call first: plan checked, bound, ranks paired
say("first call ok")

if rank == BAD:
    time.sleep(0.5)  # let the others get into their collective first
    if mode == "raise_between":
        raise RuntimeError("faulty: rank 1 raises between two calls")
    if mode == "raise_in_thread":
        def boom():
            raise RuntimeError("faulty: rank 1 raises in a worker thread")
        threading.Thread(target=boom, name="worker").start()
        time.sleep(60)  # the main thread would carry on; the job must not wait for it
    if mode == "sys_exit0":
        say("calling sys.exit(0) while the others wait for me")
        sys.exit(0)
    if mode == "sys_exit3":
        say("calling sys.exit(3) while the others wait for me")
        sys.exit(3)
    if mode == "os_exit3":
        say("calling os._exit(3) while the others wait for me")
        os._exit(3)
    if mode == "sleep":
        say("sleeping past the timeout")
        time.sleep(60)

if mode in ("raise_in_step", "sleep_in_step"):
    # a plan step that raises (or sleeps) on rank 1 only, mid-plan (the others are in its collectives)
    @sf.jit(mesh=mesh, streams=2)
    def g(a, b):
        return sf.stream(sf.shard(a, axis=1) @ b, axis=0)

    a, b = np.ones((4, 4, 2, 8)), np.ones((8, 3))
    plan = g.lower(sf.TensorSpec(a.shape, "float64"), sf.TensorSpec(b.shape, "float64"))
    exe = plan.executable
    if rank == BAD:
        def step(bufs):
            if mode == "sleep_in_step":
                say("sleeping inside a plan step")
                time.sleep(60)
            raise RuntimeError("faulty: rank 1 raises inside a plan step")
        k = len(exe.steps) // 2
        exe.steps.insert(k, dataclasses.replace(exe.steps[k], run=step))
    plan(a, b)
elif mode == "raise_tracing":
    def h(x):
        if rank == BAD:
            raise ValueError("faulty: rank 1 raises while tracing")
        return sf.replicate(sf.shard(x, axis=0)) * 2.0
    sf.jit(h, mesh=mesh)(x)  # the others wait in the plan check
elif mode == "exit_in_gather":
    c = sf.shard(x, axis=0, mesh=mesh)  # (sharded: its gather is collective; a replicated value's is local)
    if rank == BAD:
        say("calling sys.exit(0) while the others gather")
        sys.exit(0)
    c.gather()  # the others wait here for rank 1 (gather is collective)
elif mode == "mismatch":
    sf.jit(lambda x: sf.replicate(sf.shard(x, axis=0)), mesh=mesh)(x if rank != BAD else x[:, :2].copy())
elif mode not in ("ok", "ok_late"):
    f(x)  # the others wait here for rank 1

if mode in ("ok", "ok_late"):
    assert np.array_equal(f(x).gather(), x)
    if mode == "ok_late" and rank == BAD:
        time.sleep(3)  # work after the last collective: the others must wait at exit, not abort
    say("done")
else:
    say("UNEXPECTED: got past the fault")
