#!/bin/bash
# This session's GPU figures after the suite (issue 29 item 2 and the 2048^3 ratios); outputs under $OUT/b
set -u
B=${OUT:-out}/b; mkdir -p "$B"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$B/gpu.txt"
for ds in "8 4" "8 1" "8 8"; do
  python3 benchmarks/user_path_parts.py $ds --rounds 5 2>&1 | tee "$B/parts_${ds// /_}.txt" | grep -v Warning
done
python3 -m shardfuse bench --host --backend cupy --no-progress > "$B/host.txt" 2>&1; tail -30 "$B/host.txt"
timeout 150 python3 -m shardfuse bench --devices 1 --m 2048 --k 2048 --n 2048 --chunks 1,8 --graph > "$B/r2048.txt" 2>&1
grep -iE "ratio|torch|x1|chunks" "$B/r2048.txt" | head -20
