#!/usr/bin/env bash
# One device call on ONE GPU: what the layout's alignment costs. The MoE layer (DeepSeek-V3 shape,
# EP 1, forward+backward) and nvlink dispatch + combine at EP 1, at alignment 128 (DeepGEMM's FP8
# grouped GEMM needs it) and 8 (what torch._grouped_mm needs for bf16), in the order $ALIGNMENTS.
#   bash bench/scripts/one_gpu_alignment.sh COMMIT   (checkout's root, GPU machine)
set -u
commit=${1:?commit}
source bench/scripts/lib.sh
nvidia-smi --query-gpu=name --format=csv,noheader
for align in ${ALIGNMENTS:-128 8}; do
  LIMIT=150 run moe-layer-a$align torchrun --standalone --nproc-per-node 1 -m ep_runtime.bench.ep_scaling \
    --shape deepseek-v3 --alignment $align --modes weak --max-ep 1 --warmup 2 --iters 5 --out "$out/moe-a$align" --commit "$commit"
  grep "EP " "$out/moe-layer-a$align.log" | tail -1 | cut -c1-200
  LIMIT=100 run dispatch-a$align torchrun --standalone --nproc-per-node 1 -m ep_runtime.bench.dispatch --tokens 8192,256 \
    --alignment $align --iters 30 --out "$out/dispatch-a$align" --commit "$commit"
  grep -E "tokens/rank|nvlink_graph" "$out/dispatch-a$align.log"
done
