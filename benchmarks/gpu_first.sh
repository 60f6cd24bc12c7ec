#!/bin/bash
# The first call of a GPU session (issue 14): the GPU tests, then the host-cost floors and the
# `shardfuse bench --host` table, each written under $OUT (default ./gpu_first) and archived in
# $OUT.tgz after each part, so a call cut short by the device's time limit still brings back what
# finished.  Run from the repository root on the GPU machine (about 5 minutes); then, in a second
# call, `OUT=$OUT/sweeps bash benchmarks/h200_sweeps.sh` for issue 15.
set -u
OUT=${OUT:-gpu_first}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.txt" 2>&1
save() { tar -czf "${OUT%/}.tgz" -C "$OUT" .; }
# the tests of code never yet run on a GPU first, in their own process: a misaligned address is
# a sticky CUDA error that would fail every later test of the same process
python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu.py -k "odd_sizes or means_whose or elementwise_and_sum" \
  > "$OUT/gpu_tests_new.txt" 2>&1
tail -3 "$OUT/gpu_tests_new.txt"; save
python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_gpu_interop.py tests/test_hot_path.py \
  tests/test_gemm_shared.py tests/test_array_ops.py tests/test_prebound_launch.py > "$OUT/gpu_tests.txt" 2>&1
tail -3 "$OUT/gpu_tests.txt"; save
for case in "D=8 S=8" "D=2 S=8" "D=1 S=8"; do
  python3 benchmarks/step_cost.py "$case" > "$OUT/step_cost_${case// /_}.txt" 2>&1
done
save
python3 -m shardfuse bench --host --backend cupy --no-progress > "$OUT/host.txt" 2>&1
cat "$OUT/host.txt"; save
echo "all outputs: ${OUT%/}.tgz"
