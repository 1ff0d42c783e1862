#!/usr/bin/env bash
# The next device call on nvidia-h200-x2 (written in session 3 without device time left): checks
# what session 3 wrote on the CPU, then measures the open bars. Each step has its own time limit,
# so one that hangs does not take the rest with it. bash bench/scripts/verify_x2.sh COMMIT
#   1. GPU tests of the new kernels: SwiGLU with a device row count, mHC pre-apply/post and Engram
#      gate backward.
#   2. Two-GPU suites after the rank-ordered home sum: conformance, EP equivalence, nvlink steady
#      state (no host sync, CUDA graph); the overlap schedule runs in step 4.
#   3. The MoE layer EP 1 -> 2 with both backends in one call (issue #9's layer bar).
#   4. bench pipeline on the two GPUs, 1F1B vs overlap (issue #8's bar), and bench kernels --shapes v4
#      (issue #7's bars) on GPU 0.
set -u
commit=${1:?commit}
source bench/scripts/lib.sh
LIMIT=150 run pytest-kernels python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/kernels/quant/test_swiglu_kernel.py \
  tests/kernels/mhc/test_pre_apply_kernel.py tests/kernels/mhc/test_post_kernel.py tests/kernels/mhc/test_split_sinkhorn_kernel.py \
  tests/kernels/engram/test_gate_kernel.py tests/runtime/test_mhc_layer.py
tail -3 "$out/pytest-kernels.log"
LIMIT=240 run pytest-2gpu python3 -m pytest -q -p no:cacheprovider tests/runtime/test_dispatch_conformance.py \
  tests/runtime/test_ep_equivalence.py tests/runtime/test_nvlink_gpu.py -k "2- or nvlink"
tail -3 "$out/pytest-2gpu.log"
save_cache
for d in all_to_all nvlink; do
  LIMIT=120 run "ep-scaling-$d" python3 -m ep_runtime.bench.ep_scaling --launcher local --shape deepseek-v3 --modes weak \
    --dispatcher "$d" --out "$out" --commit "$commit"
  grep "EP " "$out/ep-scaling-$d.log" | tail -2 | cut -c1-200
done
LIMIT=200 run bench-pipeline torchrun --standalone --nproc-per-node 2 -m ep_runtime.bench.pipeline --pp 2 --model v3-layer \
  --batch-size 16 --seq-len 256 --schedules 1f1b,overlap --microbatches 8 --out "$out" --commit "$commit"
tail -8 "$out/bench-pipeline.log"
LIMIT=150 run bench-kernels-v4 python3 -m ep_runtime.cli bench kernels --shapes v4 --out "$out/kernels-v4.json" --commit "$commit"
tail -12 "$out/bench-kernels-v4.log"
