#!/bin/bash
# The first calls of a GPU session (issue 29): every GPU test, the unfused run, then the host-cost
# floors, `shardfuse bench --host` and the layer against torch, each written under $OUT (default
# ./gpu_first) and archived in $OUT.tgz after each part, so a call cut short by the device's time
# limit still brings back what finished.  The GPU tests are collected by their marker (`pytest -m
# gpu`: tests/test_gpu*.py and the dispatch tests of the CUDA code), never by a list of files.
# Run from the repository root on the GPU machine; the last line is the verdict.
#
# The whole run is longer than one device call (600 s): the GPU suite alone took ~720 s on an H100
# (2026-12-06, thirteenth session: every Fused step a kernel compiled per layout).  PART picks one
# part per call, and SPLIT=K/N the K-th of N interleaved parts of the GPU suite (tests/conftest.py's
# --part: every N-th test, so each part holds some of every file), each under 600 s there:
#   PART=tests SPLIT=1/2 bash benchmarks/gpu_first.sh   # GPU tests never run before (NEW), then half the suite
#   PART=tests SPLIT=2/2 bash benchmarks/gpu_first.sh   # the other half
#   PART=unfused bash benchmarks/gpu_first.sh   # the suite again with SHARDFUSE_FUSE=0 (one step per op)
#   PART=bench   bash benchmarks/gpu_first.sh   # step_cost floors, bench --host, layer_vs_torch --train
# PART=all (the default) runs the three in turn, for a machine without the limit.
# Output file names use letters, digits, '.', '_' and '-' only: others do not come back.
set -u
OUT=${OUT:-gpu_first}
PART=${PART:-all}
SPLIT=${SPLIT:-1/1}
# seconds from the start after which a test run is stopped: a device call's 600, less the archive (none for PART=all)
LIMIT=${LIMIT:-$([ "$PART" = all ] && echo 86400 || echo 570)}
NEW=${NEW:-gpu_sort}  # -k expression: GPU tests never run before, run first in their own process
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.txt" 2>&1
save() { tar -czf "${OUT%/}.tgz" -C "$OUT" .; }
left() { local s=$((LIMIT - SECONDS)); echo $((s > 1 ? s : 1)); }  # (seconds to the limit, at least 1: timeout 0 is none)
verdict() { [ "$1" = 0 ] && echo pass || echo "FAIL (rc $1)"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
# (tests/test_notebooks.py holds no GPU test and needs nbformat, which the GPU machine lacks)
SKIP="--ignore=tests/test_notebooks.py"
# (COMMIT=: the commit the caller's tree is at; the device machine's copy of .git can be stale)
line="$(tr '\n' ' ' < "$OUT/gpu.txt")${COMMIT:-$(git log --oneline -1 2>/dev/null | cut -c1-12)}:"

if [ "$PART" = all ] || [ "$PART" = tests ]; then
  # tests of code never yet run on a GPU first, in their own process: a misaligned address is a
  # sticky CUDA error that would fail every later test of the same process
  timeout -s INT "$(left)" python3 -m pytest -q -x -p no:cacheprovider -m gpu $SKIP -k "$NEW" tests \
    > "$OUT/gpu_tests_new.txt" 2>&1
  new_rc=$?
  [ "$new_rc" = 5 ] && new_rc=0  # (pytest's 5: nothing matched -k $NEW, which is no failure)
  tail -3 "$OUT/gpu_tests_new.txt"; save
  # (stopped by SIGINT before the device call's limit, so pytest still prints its summary and failures)
  timeout -s INT "$(left)" python3 -m pytest -q -rf --durations=10 -p no:cacheprovider -m gpu $SKIP \
    --part "$SPLIT" tests > "$OUT/gpu_tests.txt" 2>&1
  all_rc=$?
  grep -E "^FAILED|^ERROR" "$OUT/gpu_tests.txt" | head -20; tail -1 "$OUT/gpu_tests.txt"; save
  line="$line new GPU tests $(verdict $new_rc); GPU suite (part $SPLIT) $(verdict $all_rc) ($(tail -1 "$OUT/gpu_tests.txt"));"
fi
if [ "$PART" = all ] || [ "$PART" = unfused ]; then
  SHARDFUSE_FUSE=0 timeout -s INT "$(left)" python3 -m pytest -q -rf -p no:cacheprovider -m gpu $SKIP \
    --part "$SPLIT" tests > "$OUT/gpu_tests_unfused.txt" 2>&1
  unfused_rc=$?
  grep -E "^FAILED|^ERROR" "$OUT/gpu_tests_unfused.txt" | head -20; tail -1 "$OUT/gpu_tests_unfused.txt"; save
  line="$line unfused $(verdict $unfused_rc) ($(tail -1 "$OUT/gpu_tests_unfused.txt"));"
fi
if [ "$PART" = all ] || [ "$PART" = bench ]; then
  for case in "D=8 S=8" "D=2 S=8" "D=1 S=8"; do
    name=${case//=/}
    python3 benchmarks/step_cost.py "$case" > "$OUT/step_cost_${name// /_}.txt" 2>&1
    python3 benchmarks/step_cost.py "$case" --layout natural > "$OUT/step_cost_natural_${name// /_}.txt" 2>&1
  done
  save
  python3 -m shardfuse bench --host --backend cupy --no-progress > "$OUT/host.txt" 2>&1
  host_rc=$?
  cat "$OUT/host.txt"; save
  python3 benchmarks/layer_vs_torch.py --repeat 5 --train > "$OUT/layer_vs_torch.txt" 2>&1
  layer_rc=$?
  grep -v Warning "$OUT/layer_vs_torch.txt" | tail -9; save
  line="$line bench --host $(verdict $host_rc); layer_vs_torch $(verdict $layer_rc);"
fi
echo "all outputs: ${OUT%/}.tgz"
echo "VERDICT ($PART) $line" | tee "$OUT/verdict.txt"
save
