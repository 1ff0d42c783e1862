#!/usr/bin/env bash
# Device call on nvidia-h200-x4 after the nvlink ep-scaling run hung at EP 2 of 4 ranks: which
# symmetric-heap pattern hangs (bench/scripts/symm_groups.py), then the 4-GPU correctness suites
# and ep-scaling with nvlink again. bash bench/scripts/ep_scaling_x4_diag.sh COMMIT
set -u
commit=${1:?commit}
source bench/scripts/lib.sh
for s in prefix partition world-after-prefix dispatcher; do
  LIMIT=45 run "symm-$s" torchrun --standalone --nproc-per-node 4 bench/scripts/symm_groups.py "$s"
  grep "^rank\|Error\|assert" "$out/symm-$s.log" | head -12
  grep -A12 "most recent call first" "$out/symm-$s.log" | grep "File" | head -8
done
LIMIT=${TEST_LIMIT:-200} run pytest-4gpu python3 -m pytest -q -x tests/runtime/test_dispatch_conformance.py tests/runtime/test_ep_equivalence.py -k "4-"
tail -5 "$out/pytest-4gpu.log"
save_cache
LIMIT=${SCALING_LIMIT:-200} run ep-scaling-nvlink torchrun --standalone --nproc-per-node 4 -m ep_runtime.bench.ep_scaling \
  --shape deepseek-v3 --dispatcher nvlink --warmup 2 --iters 6 --out "$out" --commit "$commit"
grep "EP " "$out/ep-scaling-nvlink.log" | tail -6 | cut -c1-250
grep -A14 "most recent call first" "$out/ep-scaling-nvlink.log" | grep "File" | head -12
