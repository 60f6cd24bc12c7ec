"""Where the user path's host time goes (issue 14): cProfile of `calls` back-to-back calls of
bench/host.py's user path (sf.shard in, a device array out), CuPy arrays and torch tensors,
eager and graph.  Usage: python benchmarks/user_path_profile.py [D] [S] [calls]"""
import cProfile
import pstats
import sys

import shardfuse as sf
from shardfuse.bench import host

d, s, calls = (int(x) for x in (sys.argv[1:] + ["1", "1", "2000"][len(sys.argv) - 1:])[:3])
mesh = sf.DeviceMesh(d, backend="cupy")
sync = host.sync_of("cupy")
for graph in (True, False):
    for torch_arrays in (False, True):
        if torch_arrays and not host.torch_on_gpu():
            continue
        fn = host.user_call(mesh, s, graph, torch_arrays)
        us = host.per_call_us(fn, sync, 50, 5)
        print(f"\n=== D={d} S={s} graph={graph} torch={torch_arrays}: {us:.1f} us per call", flush=True)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            fn()
        prof.disable()
        sync()
        pstats.Stats(prof).sort_stats("tottime").print_stats(22)
