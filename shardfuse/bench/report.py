"""The bench's output: a row per timed variant, the table, the memory table, the JSON object and
the environment it ran in (from the backend's describe())."""
from __future__ import annotations

import datetime
import json
import platform

import numpy as np

from shardfuse.runtime import backend_of

# what the environment report takes from backend.describe() (the rest of it is in "mesh")
DESCRIBE_KEYS = ("backend", "gpu", "cupy", "cuda_runtime", "driver", "nccl", "cublas")


def row(v, dtype, flops):
    """The columns every suite fills from a variant's idle rounds; `flops` per call."""
    ms, host = float(np.median(v.gpu)), float(np.median(v.host))
    return {"name": v.name, "dtype": dtype, "S": v.s, "streams": v.streams, "ms": ms,
            "ms_min": float(np.min(v.gpu)), "ms_max": float(np.max(v.gpu)),
            "tflops": flops / (ms * 1e-3) / 1e12 if v.flops else None, "host_us": host, "host_frac": host * 1e-3 / ms}


def environment(mesh):
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "python": platform.python_version(), "numpy": np.__version__, "backend": backend_of(mesh).name,
           "mesh": repr(mesh), "nprocs": mesh.nprocs, "host": platform.node()}
    described = backend_of(mesh).describe()
    env.update({k: described[k] for k in DESCRIBE_KEYS if k in described})
    return env


def to_json(env, args, rows, mem):
    return json.dumps({"env": env, "args": dict(vars(args)), "rows": rows, "memory": mem})


def table(rows):
    def f(x, fmt):
        return fmt % x if x is not None else ""

    head = (f"{'plan':<27} {'dtype':<8} {'S':>3} {'str':>3} {'ms':>8} {'TFLOP/s':>7} {'host us':>8} {'host%':>6} {'steady':>7} {'st%':>5} "
            f"{'overlap':>7} {'/cupy S':>7} {'/cuBLAS S':>9} {'/cupy 1':>7} {'/cuBLAS 1':>9} {'/plan':>6} {'b2b ms':>7} "
            f"{'/cuBLAS 1':>9} {'/plan':>6} "
            f"{'rel err':>8}")
    out = [head, "-" * len(head)]
    for r in rows:
        out.append(f"{r['name']:<27} {r['dtype']:<8} {f(r['S'], '%d'):>3} {f(r['streams'], '%d'):>3} "
                   f"{r['ms']:8.3f} {f(r['tflops'], '%.0f'):>7} {r['host_us']:8.1f} {100 * r['host_frac']:5.1f}% "
                   f"{f(r.get('host_us_steady'), '%.1f'):>7} {f(100 * r['host_frac_steady'] if r.get('host_frac_steady') else None, '%.1f'):>5} "
                   f"{f(r.get('overlap_eff'), '%.3f'):>7} {f(r.get('vs_bare_cupy_chunks'), '%.3f'):>7} "
                   f"{f(r.get('vs_bare_cublas_chunks'), '%.3f'):>9} {f(r.get('vs_bare_cupy_one'), '%.3f'):>7} "
                   f"{f(r.get('vs_bare_cublas_one'), '%.3f'):>9} "
                   f"{f(r.get('vs_plan_alone'), '%.3f'):>6} {f(r.get('ms_steady'), '%.3f'):>7} "
                   f"{f(r.get('vs_bare_cublas_one_steady'), '%.3f'):>9} "
                   f"{f(r.get('vs_plan_alone_steady'), '%.3f'):>6} {f(r.get('rel_err'), '%.1e'):>8}")
    return "\n".join(out)


def memory_table(mem):
    out = []
    mib = 1 << 20
    for m in mem:
        if "pool_growth_bytes" in m:
            out.append(f"growth  {m['name']:<27} {m['dtype']:<8} S={m['S']} over {m['growth_calls']} calls: "
                       f"pool {m['pool_growth_bytes']} B, device {m['device_growth_bytes']} B")
        else:
            out.append(f"peak    {m['name']:<27} {m['dtype']:<8} S={m['S']}: {m['peak_bytes'] / mib:.0f} MiB "
                       f"(inputs {m['inputs_bytes'] / mib:.0f} + plan live peak {m['plan_peak_live_bytes'] / mib:.0f}"
                       f" + cuBLAS workspaces {m['cublas_workspace_bytes'] / mib:.0f}) vs bound "
                       f"{m['bound_bytes'] / mib:.0f} MiB -> {'within' if m['within_bound'] else 'OVER'}")
    return "\n".join(out)
