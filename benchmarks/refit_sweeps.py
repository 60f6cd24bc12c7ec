"""Re-predict a recorded `shardfuse bench --sweep` JSON with other rates, on a CPU (issue 15).

Each point's plan is compiled as the sweep compiles it (shardfuse.simulate.seed, A [M, K] sharded
on rows, B [K, N] replicated), but on a NumPy mesh of D devices from TensorSpecs: nothing runs.
It is predicted as the sweep predicted it on one GPU (D virtual devices: local = share = D), with
the JSON's rates or a rates file's, and any field overridden with --set; then the sweep's figures
are printed: points within 15%, median |error|, and what chunks="auto" would choose with these
rates against the best measured S (its choice's measured time, so only S values the sweep timed).

    python benchmarks/refit_sweeps.py benchmarks/results/2026-12-05-h200-sweeps/sweep_d2.json \
        --set gemm_bw=3.1e12 --set comm_latency_s=20e-6 [--rates cache/rates-cupy-2dev.json] [--table]

--check: also compare the JSON's own predicted_ms with the re-prediction (same rates: ~0).
--fit (D > 1): comm_latency_s and gemm_bw fitted as calibrate fits them on a shared GPU
(calibrate.fit_shared), to the sweep's measured times at calibrate's SHARED_RUNS shapes in place of
calibrate's own runs (the same programs; other inputs, another moment), starting from the rates
after --set (give the chains' gemm_bw from the calibration log: the fit's bounds scale with it);
the figures are then also given for the points left out of the fit.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from functools import cache

import numpy as np

import shardfuse as sf
from shardfuse.autochunks import Candidate, choose
from shardfuse.bench.sweep import MODEL_WITHIN
from shardfuse.calibrate import SHARED_RUNS, fit_shared
from shardfuse.cost import Rates, predict
from shardfuse.simulate import seed

STREAMS = 4  # the sweep's default --streams


def load(path) -> tuple:
    """(rates, points, D) of a sweep JSON."""
    doc = json.loads(open(path).read())
    points = doc["points"]
    return Rates.from_json(doc["rates"]), points, points[0]["devices"]


@cache
def program(d: int, m: int, n: int, k: int, dtype: str, s: int, streams: int = STREAMS):
    mesh = sf.DeviceMesh(d, backend="numpy")
    # A's layout as the seed annotates it (sharded on rows), as shardfuse simulate compiles it
    return seed(mesh, s, streams).lower(sf.TensorSpec((m, k), dtype), sf.TensorSpec((k, n), dtype)).program


def rows(points, d: int) -> list:
    """(point, S, program, measured s, recorded predicted s) of every timed S."""
    return [(p, int(s), program(d, p["m"], p["n"], p["k"], p["dtype"], int(s)), r["measured_ms"] / 1e3,
             r["predicted_ms"] / 1e3) for p in points for s, r in p["rows"].items()]


def fitted(rates, table, d: int) -> tuple:
    """(rates fitted as calibrate fits them on a shared GPU, the rows that stood in for its runs)."""
    ms, bs, ss = SHARED_RUNS
    used = [r for r in table if r[0]["m"] in ms and (r[0]["n"], r[0]["k"]) in bs and r[1] in ss]
    if len(used) != len(ms) * len(bs) * len(ss):
        raise SystemExit(f"the sweep lacks calibrate's shapes {SHARED_RUNS}: --fit cannot stand in for them")
    return fit_shared([(prog, t) for _, _, prog, t, _ in used], rates, d, d), used


def score(rates, table, d: int, left_out=()) -> dict:
    """The sweep's figures for `rates`: within (of n), median |error|, errors, auto vs best, and
    within among the rows not in left_out."""
    pred = [predict(prog, rates, d, d).total_s for _, _, prog, _, _ in table]
    errors = np.array([p / t - 1 for p, (_, _, _, t, _) in zip(pred, table)])
    held = [abs(e) <= MODEL_WITHIN for e, r in zip(errors, table) if not any(r is u for u in left_out)]
    autos = []
    for pt in {id(r[0]): r[0] for r in table}.values():
        mine = sorted((s, p, t) for (q, s, _, t, _), p in zip(table, pred) if q is pt)
        chosen = choose([Candidate(s, p) for s, p, _ in mine]).s  # autochunks.compile_best's rule
        autos.append(dict((s, t) for s, _, t in mine)[chosen] / min(t for _, _, t in mine) - 1)
    return dict(within=int(np.sum(np.abs(errors) <= MODEL_WITHIN)), n=len(errors), held=(sum(held), len(held)),
                median=float(np.median(np.abs(errors))), errors=errors, pred=pred, auto_worst=max(autos))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweep", help="a sweep JSON (shardfuse bench --sweep --sweep-json)")
    p.add_argument("--rates", help="a rates file (calibrate's cache) instead of the JSON's rates")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override a scalar field")
    p.add_argument("--check", action="store_true", help="compare with the JSON's predicted_ms")
    p.add_argument("--table", action="store_true", help="every point's error")
    p.add_argument("--fit", action="store_true", help="fit comm_latency_s and gemm_bw as calibrate does (D > 1)")
    args = p.parse_args(argv)
    rates, points, d = load(args.sweep)
    if args.rates:
        doc = json.loads(open(args.rates).read())
        rates = Rates.from_json(doc.get("rates", doc))
    rates = replace(rates, **{f: float(v) for f, v in (kv.split("=", 1) for kv in args.set)})
    table = rows(points, d)
    used = ()
    if args.fit and d == 1:
        raise SystemExit("--fit is the shared GPU's fit (D > 1); at D = 1 calibrate fits gemm_slowdown instead")
    if args.fit:
        rates, used = fitted(rates, table, d)
    sc = score(rates, table, d, used)
    if args.table:
        for (pt, s, _, t, _), e, pr in zip(table, sc["errors"], sc["pred"]):
            print(f"{pt['m']:>6} {pt['n']:>6} {pt['k']:>6} {s:>3} {t * 1e3:>9.3f} {pr * 1e3:>9.3f} {e:>+7.1%}")
    if args.check:
        dev = max(abs(pr / r[4] - 1) for pr, r in zip(sc["pred"], table))
        print(f"largest deviation from the JSON's predicted_ms: {dev:.2e}")
    print(f"D={d} gemm_bw {rates.gemm_bw / 1e9:.0f} GB/s, comm_latency {rates.comm_latency_s * 1e6:.1f} us: "
          f"within {MODEL_WITHIN:.0%} at {sc['within']}/{sc['n']}, median |error| {sc['median']:.1%}, "
          f"error {sc['errors'].min():+.1%} .. {sc['errors'].max():+.1%}, auto vs best worst {sc['auto_worst']:+.1%}"
          + (f"; fitted to {len(used)} points, within at {sc['held'][0]}/{sc['held'][1]} of the others" if used else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
