"""Where the host's time goes in one case of `shardfuse bench --host` (its table: run that): the
cProfile top entries of 200 calls issued back to back, the plan alone or the user path.

    python benchmarks/host_cost.py "D=8 S=8 eager"        # the plan alone, eager
    python benchmarks/host_cost.py "D=1 S=1 graph user"   # the user path, graph replay
    python benchmarks/host_cost.py "D=1 S=1 graph user torch"   # ... with torch tensors
    python benchmarks/host_cost.py "D=2 S=4 eager" --backend numpy
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats

import shardfuse as sf
from shardfuse.bench import host


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("case", nargs="?", default="D=8 S=8 eager", help='e.g. "D=1 S=8 eager" or "D=1 S=1 graph user"')
    ap.add_argument("--backend", default="cupy")
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    words = args.case.replace("=", " ").split()
    d, s, graph = int(words[words.index("D") + 1]), int(words[words.index("S") + 1]), "graph" in words
    mesh = sf.DeviceMesh(d, backend=args.backend)
    call = host.user_call(mesh, s, graph, "torch" in words) if "user" in words else host.plan_call(mesh, s, graph)[0]
    sync = host.sync_of(args.backend)
    call()
    sync()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(args.calls):
        call()
    pr.disable()
    sync()
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(25)
    print(out.getvalue()[:6000])


if __name__ == "__main__":
    main()
