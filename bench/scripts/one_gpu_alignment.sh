#!/usr/bin/env bash
# One device call on ONE GPU: what the layout's alignment costs. The MoE layer (DeepSeek-V3 shape,
# EP 1, forward+backward) and nvlink dispatch + combine at EP 1, at alignment 128 (DeepGEMM's FP8
# grouped GEMM needs it) and 8 (what torch._grouped_mm needs for bf16), then the fused expand's tests
# and benchmark.   bash bench/scripts/one_gpu_alignment.sh COMMIT   (checkout's root, GPU machine)
set -u
commit=${1:?commit}
source bench/scripts/lib.sh
nvidia-smi --query-gpu=name --format=csv,noheader
LIMIT=200 run pytest-gpu python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider \
  tests/kernels/permute/test_expand_cast_back_kernel.py tests/runtime/test_nvlink_gpu.py
tail -1 "$out/pytest-gpu.log"; grep -m6 "^FAILED\|^ERROR" "$out/pytest-gpu.log"
LIMIT=120 run kernels-large python3 -m ep_runtime.cli bench kernels --shapes large --skip-compile \
  --ops expand,cast_back,expand_cast_back --out "$out/kernels-large.json" --commit "$commit"
grep -E "^large |speedup" "$out/kernels-large.log" | cut -c1-150
for align in 128 8; do
  LIMIT=150 run moe-layer-a$align torchrun --standalone --nproc-per-node 1 -m ep_runtime.bench.ep_scaling \
    --shape deepseek-v3 --alignment $align --modes weak --max-ep 1 --warmup 2 --iters 5 --out "$out/moe-a$align" --commit "$commit"
  grep "EP " "$out/moe-layer-a$align.log" | tail -1 | cut -c1-200
  LIMIT=100 run dispatch-a$align torchrun --standalone --nproc-per-node 1 -m ep_runtime.bench.dispatch --tokens 8192,256 \
    --alignment $align --iters 30 --out "$out/dispatch-a$align" --commit "$commit"
  grep -E "tokens/rank|nvlink_graph" "$out/dispatch-a$align.log"
done
