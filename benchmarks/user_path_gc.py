"""Whether Python's garbage collector is in the user path's host time (issue 29, item 2): for
each part of `shardfuse bench --host`'s graph-mode user path, 2000 calls back to back with the
collections counted (gc.callbacks) and the time spent in them, the objects left tracked, and the
cyclic garbage made per 200 calls (gc.DEBUG_SAVEALL); then each part again after gc.freeze().
On the H100 of 2026-12-06 (session 11): no cyclic garbage, 0-5 young collections per 2000 calls,
under 0.03 us per call: the collector is not where the time goes.

    python benchmarks/user_path_gc.py [D]
"""
import gc, collections, sys, time
import cupy
import shardfuse as sf
from shardfuse.bench import host
d = int(sys.argv[1]) if len(sys.argv) > 1 else 1
mesh = sf.DeviceMesh(d, backend="cupy")
sync = host.sync_of("cupy")
f, a, b = host.seed(mesh, 1, True)
pa, pb = sf.shard(a, axis=1, mesh=mesh), sf.replicate(b, mesh=mesh)
res = f(pa, pb)
stats = collections.Counter(); spent = [0.0]; t = [0.0]
def cb(phase, info):
    if phase == "start":
        t[0] = time.perf_counter()
    else:
        stats[info["generation"]] += 1; spent[0] += time.perf_counter() - t[0]
        stats["collected"] += info["collected"]
gc.callbacks.append(cb)
print("gc thresholds", gc.get_threshold(), "objects tracked", len(gc.get_objects()), "frozen", gc.get_freeze_count())
cases = {"cupy.matmul": lambda: cupy.matmul(b, b), "sf.shard(a)": lambda: sf.shard(a, axis=1, mesh=mesh),
         "f(pa, pb)": lambda: f(pa, pb), "from_dlpack(res)": lambda: cupy.from_dlpack(res),
         "user path": lambda: cupy.from_dlpack(f(sf.shard(a, axis=1, mesh=mesh), b))}
for name, fn in cases.items():
    for _ in range(50): fn()
    sync(); gc.collect(); stats.clear(); spent[0] = 0
    n0 = len(gc.get_objects())
    t0 = time.perf_counter()
    for _ in range(2000): fn()
    dt = (time.perf_counter() - t0) / 2000 * 1e6
    sync()
    print(f"{name:20s} {dt:7.2f} us/call; collections {dict(stats)}, in GC {spent[0] / 2000 * 1e6:.2f} us/call; "
          f"tracked objects +{len(gc.get_objects()) - n0}")
    gc.set_debug(gc.DEBUG_SAVEALL)
    for _ in range(200): fn()
    sync(); gc.collect()
    print("   cyclic garbage per 200 calls:", collections.Counter(type(o).__name__ for o in gc.garbage).most_common(8))
    gc.garbage.clear(); gc.set_debug(0)
gc.freeze()
print("after gc.freeze():")
for name, fn in cases.items():
    print(f"  {name:20s} {host.per_call_us(fn, sync, 2000, 3):7.2f} us/call")
