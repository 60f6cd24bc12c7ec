"""Is chunks="auto"'s miss inside the run-to-run spread of the recorded sweeps? (issue 29, item 3)

Reads the JSON of `shardfuse bench --sweep --sweep-json` from several runs (default: every
benchmarks/results/*-sweeps*/sweep_d*.json) and, for each D and (M, N, K) timed in more than one
run, prints:
  - auto's miss in each run: its S's measured time over the best fixed S's that run;
  - the spread of each fixed S between runs: its largest measured time over its least, minus 1;
  - whether every miss is at most the spread of auto's S between runs ("same S"), and at most
    the spread between runs of the ratio of the two times it compares (the best S's over auto's:
    "pair"), and whether the S that beat auto's in one run lost to it in another ("flips").
Then it replays choice rules on the recorded predictions (each run's own rates) and scores each
with that run's measured times: the miss of the S it picks (worst, count above the 3% target) and
how many choices differ from the recorded ones; and the model's error on what the chooser
compares (the predicted t(S) / t(S=1) against the measured one).

    python benchmarks/auto_spread.py [SWEEP.json ...]
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from shardfuse.autochunks import AUTO_MARGIN, Candidate, choose
from shardfuse.bench.sweep import AUTO_WITHIN, MODEL_WITHIN

RESULTS = Path(__file__).resolve().parent / "results"


def load(paths) -> dict:
    """{(D, M, N, K): {run: point}}; a run is the results folder the JSON lies in."""
    shapes = defaultdict(dict)
    for path in map(Path, paths):
        for p in json.loads(path.read_text())["points"]:
            shapes[(p["devices"], p["m"], p["n"], p["k"])][path.parent.name] = p
    return shapes


def measured(p) -> dict:
    return {int(s): r["measured_ms"] for s, r in p["rows"].items()}


def predicted(p) -> dict:
    return {int(s): r["predicted_ms"] for s, r in p["rows"].items()}


def miss(p, s) -> float:
    t = measured(p)
    return t[s] / min(t.values()) - 1


def spread(runs: dict, s) -> float:
    """The largest measured time of S over its least, minus 1, among the runs that timed it."""
    t = [measured(p)[s] for p in runs.values() if str(s) in p["rows"]]
    return max(t) / min(t) - 1


def margin_rule(margin):
    def rule(p):
        ok = [Candidate(s, t) for s, t in sorted(predicted(p).items())]
        return choose(ok, margin).s
    return rule


RULES = {  # name: point -> the S it picks
    "recorded (the JSON's auto)": lambda p: p["auto"],
    **{f"margin {m:.0%}" + (" (now)" if m == AUTO_MARGIN else ""): margin_rule(m)
       for m in sorted({0.0, AUTO_MARGIN, AUTO_WITHIN, 0.05, MODEL_WITHIN})},
    "S=2 where level (0.1%)": lambda p: 2 if predicted(p).get(2, float("inf")) <= predicted(p)[1] * 1.001
    else p["auto"],
    "always S=2": lambda p: 2 if 2 in predicted(p) else p["auto"],
}


def spread_table(shapes) -> list:
    runs_of = sorted({r for runs in shapes.values() for r in runs})
    lines = ["runs: " + ", ".join(f"{chr(97 + i)} = {r}" for i, r in enumerate(runs_of)),
             f"{'D':>2} {'M':>6} {'N':>5} {'K':>6} | {'auto, miss (best S) per run':<44}| "
             f"{'spread between runs of S = 1, 2, 4, 8, 16':<42}| same S  pair flips"]
    for (d, m, n, k), runs in sorted(shapes.items()):
        if len(runs) < 2:
            continue
        cells, inside, pair, signs = [], True, True, set()
        for r in runs_of:
            if r not in runs:
                continue
            p = runs[r]
            best = min(measured(p), key=measured(p).get)
            x = miss(p, p["auto"])
            cells.append(f"{chr(97 + runs_of.index(r))} {p['auto']}:{x:+.1%}" + (f"({best})" if x else ""))
            inside &= x <= spread(runs, p["auto"])
            ratios = [measured(q)[best] / measured(q)[p["auto"]] for q in runs.values()]
            pair &= x <= max(ratios) / min(ratios) - 1
            signs |= set(np.sign(np.array(ratios) - 1)) if x else set()
        ss = "".join(f"{spread(runs, s):>8.1%}" for s in (1, 2, 4, 8, 16))
        lines.append(f"{d:>2} {m:>6} {n:>5} {k:>6} | {' '.join(cells):<44}|{ss:<43}| "
                     f"{'yes' if inside else 'NO':>6} {'yes' if pair else 'NO':>5} "
                     f"{'yes' if len(signs) > 1 else ('no' if signs else '-'):>5}")
    return lines


def replay_table(shapes) -> list:
    lines = [f"{'rule':<28} {'D':>2} {'changed':>8} {'worst miss':>11} {'mean miss':>10} "
             f"{f'misses > {AUTO_WITHIN:.0%}':>11}"]
    for name, rule in RULES.items():
        for d in sorted({key[0] for key in shapes}):
            pts = [p for key, runs in shapes.items() if key[0] == d for p in runs.values()]
            picks = [(p, rule(p)) for p in pts if str(rule(p)) in p["rows"]]
            xs = [miss(p, s) for p, s in picks]
            if not xs:
                continue
            changed = sum(s != p["auto"] for p, s in picks)
            lines.append(f"{name:<28} {d:>2} {changed:>4}/{len(picks):<3} {max(xs):>+11.1%} {np.mean(xs):>+10.2%} "
                         f"{sum(x > AUTO_WITHIN for x in xs):>7}/{len(xs)}")
    pts = [p for runs in shapes.values() for p in runs.values()]
    gaps = [min(t for s, t in predicted(p).items() if s != p["auto"]) / predicted(p)[p["auto"]] - 1 for p in pts]
    lines.append(f"the recorded choice was predicted fastest at {sum(g > 0 for g in gaps)}/{len(pts)} points; "
                 f"the next S predicted {min(gaps):+.4%} slower at the closest")
    return lines


def ratio_error_table(shapes) -> list:
    """The model's error on t(S) / t(S=1), the quantity the chooser compares, and the measured
    spread of that ratio between runs."""
    lines = [f"{'D':>2} {'S':>3} | {'predicted/measured t(S)/t(1) - 1: median |.|, worst':>52} | "
             f"{'spread of measured t(S)/t(1) between runs: median, worst':>56}"]
    for d in sorted({key[0] for key in shapes}):
        for s in (2, 4, 8, 16):
            err, spr = [], []
            for key, runs in shapes.items():
                if key[0] != d:
                    continue
                ratios = []
                for p in runs.values():
                    t, pr = measured(p), predicted(p)
                    if s in t:
                        err.append((pr[s] / pr[1]) / (t[s] / t[1]) - 1)
                        ratios.append(t[s] / t[1])
                if len(ratios) > 1:
                    spr.append(max(ratios) / min(ratios) - 1)
            if not err:
                continue
            e = np.abs(err)
            cell = f"{np.median(spr):>8.1%} {max(spr):>8.1%}" if spr else "   (one run)"
            lines.append(f"{d:>2} {s:>3} | {np.median(e):>43.1%} {e.max():>8.1%} | {cell:>56}")
    return lines


def within_run(shapes) -> list:
    """The two passes each S is timed in (sweep.py's passes_ms, recorded by sweeps run after this script was written)."""
    spr = [max(r["passes_ms"]) / min(r["passes_ms"]) - 1 for runs in shapes.values() for p in runs.values()
           for r in p["rows"].values() if "passes_ms" in r]
    if not spr:
        return ["within a run: not recorded (these sweeps kept only the least of each S's two passes; "
                "sweep.py writes both as passes_ms from now on)"]
    return [f"within a run, between an S's two passes: median {np.median(spr):.1%}, 90th percentile "
            f"{np.percentile(spr, 90):.1%}, worst {max(spr):.1%} over {len(spr)} timings"]


def main(argv=None) -> int:
    paths = (argv if argv is not None else sys.argv[1:]) or sorted(RESULTS.glob("*-sweeps*/sweep_d*.json"))
    shapes = load(paths)
    for part in (spread_table, replay_table, ratio_error_table, within_run):
        print("\n".join(part(shapes)), end="\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
