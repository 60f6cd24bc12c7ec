#!/bin/bash
# Issue 15's sweeps on the GPU machine: calibrate the cost model for D = 1, 2, 4 (virtual devices
# beyond the GPUs present), then `shardfuse bench --sweep` each, writing the tables and JSON under
# $OUT (default ./sweeps) and in one archive, $OUT.tgz.  --repeat 10: at 5 the least of the calls
# still moved by ~3-5% between runs at D = 2, the size of the auto target (2026-12-05).
# Run from the repository root with shardfuse importable and a GPU.
set -u
OUT=${OUT:-sweeps}
mkdir -p "$OUT"
export SHARDFUSE_CACHE_DIR=${SHARDFUSE_CACHE_DIR:-$OUT/cache}
for d in 1 2 4; do
  python3 -m shardfuse calibrate --backend cupy --devices $d --force > "$OUT/cal_d$d.txt" 2>&1
  python3 -m shardfuse bench --sweep --backend cupy --devices $d --repeat 10 \
    --sweep-json "$OUT/sweep_d$d.json" > "$OUT/sweep_d$d.txt" 2>&1
  tail -2 "$OUT/sweep_d$d.txt"
  # one archive beside $OUT (the device tool brings back at most 8 files), remade after each D
  # so a run cut short by the device's time limit still brings back the Ds it finished
  tar -czf "${OUT%/}.tgz" -C "$OUT" .
done
echo "all outputs: ${OUT%/}.tgz"
