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


def _pct(key):
    return lambda r: 100 * r[key] if r.get(key) else None


# (header, value of a row or None, format); a column no row fills is left out of the table
COLUMNS = [("dtype", lambda r: r["dtype"], "%s"), ("S", lambda r: r["S"], "%d"), ("str", lambda r: r["streams"], "%d"),
           ("ms", lambda r: r["ms"], "%.3f"), ("TFLOP/s", lambda r: r["tflops"], "%.0f"),
           ("host-us", lambda r: r["host_us"], "%.1f"), ("host%", _pct("host_frac"), "%.1f%%"),
           ("steady", lambda r: r.get("host_us_steady"), "%.1f"), ("st%", _pct("host_frac_steady"), "%.1f"),
           ("overlap", lambda r: r.get("overlap_eff"), "%.3f"),
           ("/cupy-S", lambda r: r.get("vs_bare_cupy_chunks"), "%.3f"),
           ("/cuBLAS-S", lambda r: r.get("vs_bare_cublas_chunks"), "%.3f"),
           ("/cupy-1", lambda r: r.get("vs_bare_cupy_one"), "%.3f"),
           ("/cuBLAS-1", lambda r: r.get("vs_bare_cublas_one"), "%.3f"),
           ("/plan", lambda r: r.get("vs_plan_alone"), "%.3f"), ("b2b-ms", lambda r: r.get("ms_steady"), "%.3f"),
           ("b2b/cuBLAS-1", lambda r: r.get("vs_bare_cublas_one_steady"), "%.3f"),
           ("b2b/plan", lambda r: r.get("vs_plan_alone_steady"), "%.3f"),
           ("rel-err", lambda r: r.get("rel_err"), "%.1e")]


def table(rows):
    """One line per row; only the columns some row fills (the NumPy backend's rows have no
    bare-library ratios, a run without --graph no replay columns)."""
    cells = [[None if get(r) is None else fmt % get(r) for _, get, fmt in COLUMNS] for r in rows]
    keep = [c for c in range(len(COLUMNS)) if any(line[c] is not None for line in cells)]
    widths = {c: max([len(COLUMNS[c][0])] + [len(line[c] or "") for line in cells]) for c in keep}
    name_w = max([4] + [len(r["name"]) for r in rows])
    align = {c: "<" if COLUMNS[c][2] == "%s" else ">" for c in keep}  # text left, numbers right
    head = " ".join([f"{'plan':<{name_w}}"] + [f"{COLUMNS[c][0]:{align[c]}{widths[c]}}" for c in keep])
    out = [head, "-" * len(head)]
    for r, line in zip(rows, cells):
        out.append(" ".join([f"{r['name']:<{name_w}}"] + [f"{line[c] or '':{align[c]}{widths[c]}}" for c in keep]))
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
