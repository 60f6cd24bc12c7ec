"""Memory: pool and device growth over many calls, and a pipelined plan's peak footprint against
what it must hold (workspace and handle counts from backend.memory_stats())."""
from __future__ import annotations

from shardfuse.bench import runner
from shardfuse.bench.inputs import nbytes
from shardfuse.demo import seed_functions
from shardfuse.runtime import backend_of


def growth(clock, v, calls):
    """Pool and device memory growth over `calls` calls of v (fresh inputs each call), after 3
    warm-up calls; None where the clock reads no device memory."""
    if clock.memory() is None:
        return None
    runner.run(clock, (v,), runner.Schedule(calls=min(3, calls), each=False))
    m0 = clock.memory()
    runner.run(clock, (v,), runner.Schedule(calls=calls, each=False))
    m1 = clock.memory()
    return {"growth_calls": calls, "pool_growth_bytes": m1[0] - m0[0], "device_growth_bytes": m1[1] - m0[1]}


def plan_bytes(exe):
    """Bytes of the plan's persistent buffers (on local device 0)."""
    return sum(int(t[0].nbytes) for t in exe.slot_templates if t is not None)


def bound(m, k, n, mesh, dtype, s, nstreams, gpus, stats):
    """What a pipelined seed plan must hold: inputs + outputs + one gathered A per local device
    (virtual devices on one GPU add up) + the cuBLAS workspaces it uses (per GPU: main and the
    worker streams this plan issues on; `stats` is backend.memory_stats())."""
    d, local = mesh.size, len(mesh.local_devices)
    per_handle = stats["workspace_bytes"] // max(1, stats["handles"])
    rec = {"inputs_bytes": local * (nbytes((m // d, k), dtype) + nbytes((k, n), dtype)),
           "outputs_bytes": local * nbytes((m, n), dtype), "gathered_a_bytes": local * nbytes((m, k), dtype),
           "cublas_workspace_bytes": gpus * per_handle * min(1 + nstreams, 1 + s)}
    rec["bound_bytes"] = sum(rec.values())
    return rec


def _live_hook():
    """A CuPy memory hook counting live pool bytes (mallocs minus frees) and their peak."""
    import cupy

    class Live(cupy.cuda.MemoryHook):
        name = "shardfuse_live"

        def __init__(self):
            self.live = self.peak = 0

        def malloc_postprocess(self, **kw):
            self.live += kw["mem_size"]
            self.peak = max(self.peak, self.live)

        def free_postprocess(self, **kw):
            self.live -= kw["mem_size"]

    return Live()


def footprint(args, mesh, dtype, inputs, s, nstreams):
    """Peak device bytes of a fresh pipelined plan over 3 calls (the caller drops each output
    before the next call), against `bound`.  Live bytes come from a CuPy memory hook; library
    allocations outside CuPy's pool show in the device delta (CUDA only)."""
    import cupy

    be = backend_of(mesh)
    pipelined, _ = seed_functions(mesh, nstreams)
    placed = [(inputs.a_array(r, s), inputs.b_array(r)) for r in range(3)]  # inputs exist before the hook
    be.synchronize()
    ws0 = be.memory_stats()["workspace_bytes"]
    free0, _ = cupy.cuda.runtime.memGetInfo()
    hook = _live_hook()
    with hook:
        exe = pipelined.lower(placed[0][0].spec, placed[0][1].spec).executable
        for a, b in placed:
            c = exe(a, b)
            be.synchronize()
            del c
    free1, _ = cupy.cuda.runtime.memGetInfo()
    stats = be.memory_stats()
    gpus = len({sh.data.device.id for sh in placed[0][0].addressable_shards})  # virtual devices share a GPU's
    rec = {"name": "footprint (eager)", "dtype": dtype, "S": s, "streams": nstreams,
           "plan_peak_live_bytes": hook.peak, "plan_persistent_bytes": plan_bytes(exe),
           "new_workspace_bytes": stats["workspace_bytes"] - ws0, "device_delta_bytes": free0 - free1}
    rec.update(bound(args.m, args.k, args.n, mesh, dtype, s, nstreams, gpus, stats))
    rec["peak_bytes"] = rec["inputs_bytes"] + hook.peak + rec["cublas_workspace_bytes"]
    rec["within_bound"] = rec["peak_bytes"] <= rec["bound_bytes"]
    return rec
