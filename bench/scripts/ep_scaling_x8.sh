#!/usr/bin/env bash
# Device call on nvidia-h200-x8 (issue #6): the topology, the SwiGLU row-count kernel test (the
# nvlink layer's experts now stop at the rows in use), then ep-scaling at the DeepSeek-V3 layer
# shape at EP 1, 2, 4, 8 with the backends in $BACKENDS (all_to_all through torchrun; nvlink through
# the local launcher, a fresh process set per EP size).
# BACKENDS="all_to_all" bash bench/scripts/ep_scaling_x8.sh COMMIT
set -u
commit=${1:?commit}
source bench/scripts/lib.sh
nvidia-smi topo -m > "$out/topology.txt" 2>&1; head -10 "$out/topology.txt" | cut -c1-120
[ -n "${SKIP_TESTS:-}" ] || { LIMIT=120 run pytest-swiglu python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/quant/test_swiglu_kernel.py; tail -2 "$out/pytest-swiglu.log"; }
for d in ${BACKENDS:-all_to_all nvlink}; do
  if [ "$d" = nvlink ]; then launch=(python3 -m ep_runtime.bench.ep_scaling --launcher local)
  else launch=(torchrun --standalone --nproc-per-node 8 -m ep_runtime.bench.ep_scaling); fi
  LIMIT=${SCALING_LIMIT:-300} run "ep-scaling-$d" "${launch[@]}" --shape deepseek-v3 --dispatcher "$d" \
    --modes "${MODES:-weak,strong}" --warmup 2 --iters 6 --out "$out" --commit "$commit"
  grep "EP " "$out/ep-scaling-$d.log" | tail -8 | cut -c1-250
  grep -m3 -B2 -A8 "Error\|Traceback" "$out/ep-scaling-$d.log" | head -30
  save_cache
done
