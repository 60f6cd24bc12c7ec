"""How far the calibrated cost model is from measured times on NumPy devices (issue 15's model on
the CPU backend): calibrate a 4-device NumPy mesh, then for a few AllGather+GEMM shapes and S
print the least of 5 measured calls beside the prediction.  Usage (one BLAS thread, else the
host's other work decides): OPENBLAS_NUM_THREADS=1 python benchmarks/numpy_model.py"""
import time

import numpy as np

import shardfuse as sf
from shardfuse import calibrate

mesh = sf.DeviceMesh(4, backend="numpy")
rates = calibrate.calibrate(mesh, repeat=5, log=lambda m: None)
print(f"calibrated: float32 GEMMs {rates.gemm_flops['float32'] / 1e12:.3f} TFLOP/s, "
      f"{rates.step_s * 1e6:.1f} us per compute step per device")
rng = np.random.default_rng(0)
for m, nk in ((256, 256), (1024, 256), (1024, 512), (4096, 512)):
    for s in (1, 4, 16):
        f = sf.jit(lambda a, b, s=s: sf.stream(sf.shard(a, 0) @ b, axis=0, chunks=s), mesh=mesh, rates=rates)
        a = sf.shard(rng.random((m, nk), dtype=np.float32), 0, mesh=mesh)
        b = sf.replicate(rng.random((nk, nk), dtype=np.float32), mesh=mesh)
        plan = f.lower(a, b)
        plan(a, b)
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            plan(a, b)
            runs.append(time.perf_counter() - t0)
        t, pred = min(runs), plan.predict().total_s
        print(f"M={m} N=K={nk} S={s}: measured {t * 1e3:.2f} ms, predicted {pred * 1e3:.2f} ms ({pred / t - 1:+.0%})")
