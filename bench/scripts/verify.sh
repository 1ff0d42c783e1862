#!/usr/bin/env bash
# Device-call steps (sessions 4-5), run in the order given, each with its own time limit so that one
# that hangs does not take the rest with it:  bash bench/scripts/verify.sh COMMIT STEP...
# At most 8 files come back from a call ($OUT): pick steps whose logs and results fit, the kernel
# cache (tl-cache.tar.gz) among them.
#   kernels      GPU tests of the kernels written without a GPU: weighted_reduce_backward, SwiGLU
#                with a device row count, mHC pre-apply/post/split-Sinkhorn and Engram gate
#                backward, the mHC layer (GPU 0); $KERNEL_TESTS picks other test files.
#   suites       the two-GPU suites: dispatch conformance, EP equivalence, nvlink steady state.
#   scaling-D    ep-scaling of backend D (all_to_all | nvlink) over every GPU, $MODES (default weak,strong).
#   pipeline     bench pipeline on two GPUs (PP 2, EP 1), 1F1B vs the overlap schedule, v3-layer.
#   kernels-v4   bench kernels at the DeepSeek-V4-like mHC/Engram shapes (GPU 0).
#   kernels-small-gpu-time  bench kernels at 128 tokens with --kernel-time (GPU 0): issue #3's ratio and
#                fusion bars by the timer and by the kernels' own GPU time; first Timer.kernel_us's GPU test.
#   mhc-overhead the mHC sublayer's time against the MoE layer's, T = 8192, D = 4096 and 7168 (GPU 0),
#                bfloat16 streams, then float32 streams under autocast (as training runs them).
#   sweep        kernel variants (tiles, prefetch) against the shipped kernels and tile-kernels
#                (bench/scripts/sweep.py; $SWEEP_OPS picks the ops, $SWEEP_SHAPE the shape: large, small).
#   paired       ours and tile-kernels timed in alternating rounds (bench/scripts/paired.py) for the
#                entries a single run calls a tie ($PAIRED_OPS picks the ops).
#   profile-mhc  the mHC sublayer's GPU time by kernel, T = 8192, N = 4, D = 4096 (GPU 0).
#   moe-layer    the DeepSeek-V3 MoE layer forward+backward on one GPU (EP 1), TileLang kernels vs the
#                references (EP_KERNELS), issue #3's end-to-end number.
#   reduce-vectors  weighted_reduce of e4m3 rows from 128 to 4096 tokens: the shipped 8/16-byte choice
#                against both forced (bench/scripts/reduce_vectors.py, GPU 0; session 24's open question).
#   dispatch-profile  bench dispatch on two GPUs with --profile: where nvlink dispatch + combine
#                spend their GPU time (issue #9's bandwidth bars), 4096 and 128 tokens per rank.
set -u
commit=${1:?commit}; shift
source bench/scripts/lib.sh
gpus=$(nvidia-smi -L | wc -l)
for step in "$@"; do
  case $step in
    kernels)
      LIMIT=${KERNELS_LIMIT:-170} run pytest-kernels python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider ${KERNEL_TESTS:-\
        tests/kernels/reduce/test_weighted_reduce_backward.py tests/kernels/quant/test_swiglu_kernel.py \
        tests/kernels/mhc/test_pre_apply_kernel.py tests/kernels/mhc/test_post_kernel.py \
        tests/kernels/mhc/test_split_sinkhorn_kernel.py tests/kernels/engram/test_gate_kernel.py tests/runtime/test_mhc_layer.py}
      tail -3 "$out/pytest-kernels.log"; grep -m6 "^FAILED\|^ERROR" "$out/pytest-kernels.log" ;;
    suites)
      LIMIT=200 run pytest-2gpu python3 -m pytest -q -p no:cacheprovider tests/runtime/test_dispatch_conformance.py \
        tests/runtime/test_ep_equivalence.py tests/runtime/test_nvlink_gpu.py -k "2- or nvlink"
      tail -3 "$out/pytest-2gpu.log"; grep -m6 "^FAILED\|^ERROR" "$out/pytest-2gpu.log" ;;
    scaling-all_to_all)
      LIMIT=120 run ep-scaling-all_to_all torchrun --standalone --nproc-per-node "$gpus" -m ep_runtime.bench.ep_scaling \
        --shape deepseek-v3 --dispatcher all_to_all --modes "${MODES:-weak,strong}" --warmup 2 --iters 6 --out "$out" --commit "$commit"
      grep "EP " "$out/ep-scaling-all_to_all.log" | tail -8 | cut -c1-250 ;;
    scaling-nvlink)
      LIMIT=220 run ep-scaling-nvlink python3 -m ep_runtime.bench.ep_scaling --launcher local \
        --shape deepseek-v3 --dispatcher nvlink --modes "${MODES:-weak,strong}" --warmup 2 --iters 6 --out "$out" --commit "$commit"
      grep "EP " "$out/ep-scaling-nvlink.log" | tail -8 | cut -c1-250
      grep -m3 -A8 "Error\|Traceback" "$out/ep-scaling-nvlink.log" | head -20 ;;
    pipeline)
      LIMIT=200 run bench-pipeline torchrun --standalone --nproc-per-node 2 -m ep_runtime.bench.pipeline --pp 2 \
        --model v3-layer --batch-size 16 --seq-len 256 --schedules 1f1b,overlap --microbatches 8 --out "$out" --commit "$commit"
      tail -8 "$out/bench-pipeline.log" ;;
    kernels-v4)
      LIMIT=330 run bench-kernels-v4 python3 -m ep_runtime.cli bench kernels --shapes v4 --out "$out/kernels-v4.json" --commit "$commit"
      tail -12 "$out/bench-kernels-v4.log" ;;
    kernels-small-gpu-time)
      LIMIT=60 run pytest-kernel-us python3 -m pytest -q -m gpu -p no:cacheprovider tests/bench/test_bench_kernels.py
      tail -2 "$out/pytest-kernel-us.log"
      LIMIT=300 run bench-kernels-small python3 -m ep_runtime.cli bench kernels --shapes small --kernel-time \
        --out "$out/kernels-small.json" --commit "$commit"
      grep -A40 "^fused vs" "$out/bench-kernels-small.log" | cut -c1-200 ;;
    mhc-overhead)
      LIMIT=150 run bench-mhc-overhead python3 -m ep_runtime.cli bench mhc-overhead --out "$out" --commit "$commit"
      tail -4 "$out/bench-mhc-overhead.log"
      LIMIT=150 run bench-mhc-overhead-fp32 python3 -m ep_runtime.cli bench mhc-overhead --stream-dtype float32 \
        --out "$out/fp32" --commit "$commit"
      tail -4 "$out/bench-mhc-overhead-fp32.log" ;;
    sweep)
      LIMIT=300 run sweep python3 bench/scripts/sweep.py --out "$out/sweep.json" ${SWEEP_OPS:+--ops $SWEEP_OPS} \
        ${SWEEP_SHAPE:+--shape $SWEEP_SHAPE}
      grep -v INFO "$out/sweep.log" | tail -60 ;;
    dispatch-profile)
      LIMIT=200 run bench-dispatch torchrun --standalone --nproc-per-node 2 -m ep_runtime.bench.dispatch --profile \
        --out "$out" --commit "$commit"
      grep -A40 "profile of" "$out/bench-dispatch.log" | cut -c1-180 | head -90 ;;
    moe-layer)
      for k in tilelang reference; do
        EP_KERNELS=$k LIMIT=200 run moe-layer-$k torchrun --standalone --nproc-per-node 1 -m ep_runtime.bench.ep_scaling \
          --shape deepseek-v3 --modes weak --max-ep 1 --warmup 2 --iters 5 --out "$out/moe-$k" --commit "$commit"
        grep "EP " "$out/moe-layer-$k.log" | tail -2 | cut -c1-200
      done ;;
    reduce-vectors)
      LIMIT=150 run reduce-vectors python3 bench/scripts/reduce_vectors.py
      grep "^T=" "$out/reduce-vectors.log" ;;
    paired)
      LIMIT=240 run paired python3 bench/scripts/paired.py --out "$out/paired.json" ${PAIRED_OPS:+--ops $PAIRED_OPS}
      grep -v INFO "$out/paired.log" | tail -12 ;;
    profile-mhc)
      LIMIT=120 run profile-mhc python3 bench/scripts/profile_mhc.py
      grep -v INFO "$out/profile-mhc.log" | head -40 | cut -c1-200 ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
  save_cache > /dev/null
done
