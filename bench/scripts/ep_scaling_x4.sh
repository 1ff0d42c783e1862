#!/usr/bin/env bash
# Device call on nvidia-h200-x4 (issue #6): the NVLink topology, then ep-scaling at the
# DeepSeek-V3 layer shape at EP 1, 2, 4 (weak and strong) with each backend.
# bash bench/scripts/ep_scaling_x4.sh COMMIT
set -u
commit=${1:?commit}
source bench/scripts/lib.sh
nvidia-smi topo -m > "$out/topology.txt" 2>&1; head -8 "$out/topology.txt"
for d in ${BACKENDS:-all_to_all nvlink}; do
  LIMIT=${SCALING_LIMIT:-240} run "ep-scaling-$d" torchrun --standalone --nproc-per-node 4 -m ep_runtime.bench.ep_scaling \
    --shape deepseek-v3 --dispatcher "$d" --warmup 2 --iters 6 --out "$out" --commit "$commit"
  grep "EP " "$out/ep-scaling-$d.log" | tail -6 | cut -c1-250
  grep -m3 -B2 -A8 "Error\|Traceback" "$out/ep-scaling-$d.log" | head -30
  save_cache
done
