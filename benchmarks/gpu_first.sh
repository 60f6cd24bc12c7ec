#!/bin/bash
# The first call of a GPU session (issue 29): every GPU test, then the host-cost floors and the
# `shardfuse bench --host` table, each written under $OUT (default ./gpu_first) and archived in
# $OUT.tgz after each part, so a call cut short by the device's time limit still brings back what
# finished.  The GPU tests are collected by their marker (`pytest -m gpu`: tests/test_gpu.py,
# tests/test_gpu_interop.py and the dispatch tests of the CUDA code), never by a list of files.
# Run from the repository root on the GPU machine (about 7 minutes); the last line is the verdict.
# Then, in a second call if wanted, `OUT=$OUT/sweeps bash benchmarks/h200_sweeps.sh` (the sweeps).
# Output file names use letters, digits, '.', '_' and '-' only: others do not come back.
set -u
OUT=${OUT:-gpu_first}
NEW=${NEW:-natural_layout}  # -k expression: GPU tests never run before, run first in their own process
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.txt" 2>&1
save() { tar -czf "${OUT%/}.tgz" -C "$OUT" .; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
# tests of code never yet run on a GPU first, in their own process: a misaligned address is a
# sticky CUDA error that would fail every later test of the same process
# (tests/test_notebooks.py holds no GPU test and needs nbformat, which the GPU machine lacks)
SKIP="--ignore=tests/test_notebooks.py"
python3 -m pytest -q -x -p no:cacheprovider -m gpu $SKIP -k "$NEW" tests > "$OUT/gpu_tests_new.txt" 2>&1
new_rc=$?
tail -3 "$OUT/gpu_tests_new.txt"; save
python3 -m pytest -q -p no:cacheprovider -m gpu $SKIP tests > "$OUT/gpu_tests.txt" 2>&1
all_rc=$?
tail -3 "$OUT/gpu_tests.txt"; save
# and with one step per op (no fused chains), the path SHARDFUSE_FUSE=0 takes
SHARDFUSE_FUSE=0 python3 -m pytest -q -p no:cacheprovider -m gpu $SKIP tests > "$OUT/gpu_tests_unfused.txt" 2>&1
unfused_rc=$?
tail -3 "$OUT/gpu_tests_unfused.txt"; save
for case in "D=8 S=8" "D=2 S=8" "D=1 S=8"; do
  name=${case//=/}
  python3 benchmarks/step_cost.py "$case" > "$OUT/step_cost_${name// /_}.txt" 2>&1
  python3 benchmarks/step_cost.py "$case" --layout natural > "$OUT/step_cost_natural_${name// /_}.txt" 2>&1
done
save
python3 -m shardfuse bench --host --backend cupy --no-progress > "$OUT/host.txt" 2>&1
host_rc=$?
cat "$OUT/host.txt"; save
echo "all outputs: ${OUT%/}.tgz"
verdict() { [ "$1" = 0 ] && echo pass || echo "FAIL (rc $1)"; }
# (pytest's 5: nothing matched -k $NEW, which is no failure)
[ "$new_rc" = 5 ] && new_rc=0
echo "VERDICT $(cat "$OUT/gpu.txt" | tr '\n' ' '): new GPU tests $(verdict $new_rc); GPU suite $(verdict $all_rc)" \
  "($(tail -1 "$OUT/gpu_tests.txt")); unfused $(verdict $unfused_rc); bench --host $(verdict $host_rc)" | tee "$OUT/verdict.txt"
save
