#!/usr/bin/env bash
# One device call for the dispatch path (issue #9): the GPU tests of the kernels the path runs
# ($GPU_TESTS), their kernel benchmarks ($KERNEL_OPS), and the nvlink dispatch + combine on $GPUS
# GPUs (1: EP 1 at 8192 and 256 tokens, every kernel of the path with its stores to its own heap;
# 2: EP 2 at 4096 and 128 tokens per rank across NVLink), at COMMIT and, when OLD is set, at OLD in
# a worktree beside it (same GPUs, same run: the before/after; OLD may also be a folder holding an
# old tree, carried with the call, for a commit that has not landed). Two processes cannot share
# one GPU's symmetric memory (torch 2.11 refuses: bench/scripts/symm_one_gpu.py), so the
# cross-rank path needs two GPUs. SAME_BENCH=1 runs OLD's kernels under this tree's bench harness
# (its timer and profile), and AGAIN=1 measures COMMIT once more after OLD (the spread between two
# runs of the same tree).
#   [GPUS=2] bash bench/scripts/dispatch_call.sh COMMIT     (from the checkout's root, on the GPU machine)
set -u
commit=${1:?commit}
source bench/scripts/lib.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
# Set and empty, GPU_TESTS or KERNEL_OPS skips that part.
tests=${GPU_TESTS-tests/kernels/permute/test_expand_cast_back_kernel.py tests/kernels/comm tests/kernels/reduce \
  tests/runtime/test_nvlink_gpu.py}
if [ -n "$tests" ]; then
  LIMIT=240 run pytest-gpu python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider $tests
  tail -2 "$out/pytest-gpu.log"; grep -m6 "^FAILED\|^ERROR" "$out/pytest-gpu.log"
fi
ops=${KERNEL_OPS-expand,cast_back,expand_cast_back,weighted_reduce,weighted_reduce_fp8}
for shape in ${ops:+large small}; do
  LIMIT=150 run kernels-$shape python3 -m ep_runtime.cli bench kernels --shapes $shape --skip-compile \
    --ops "$ops" --out "$out/kernels-$shape.json" --commit "$commit"
  grep -E "^(large|small) |speedup" "$out/kernels-$shape.log" | cut -c1-160
done
gpus=${GPUS:-1}
tokens=$([ "$gpus" = 1 ] && echo 8192,256 || echo 4096,128)
dispatch() {  # NAME COMMIT: bench dispatch at EP $gpus from the current directory
  LIMIT=150 run "$1" torchrun --standalone --nproc-per-node "$gpus" -m ep_runtime.bench.dispatch --tokens $tokens \
    --iters 30 ${PROFILE:+--profile} --out "$out/$1" --commit "$2"
  grep -E "tokens/rank|nvlink_graph|p2p|nccl" "$out/$1.log"
}
dispatch dispatch-ep$gpus "$commit"
if [ -n "${OLD:-}" ]; then
  here=$PWD
  if [ -d "$OLD" ] && cp -r "$OLD" /tmp/old || git worktree add -f /tmp/old "$OLD" > "$out/worktree.log" 2>&1; then
    [ -n "${SAME_BENCH:-}" ] && cp ep_runtime/bench/dispatch.py ep_runtime/bench/ep_scaling.py /tmp/old/ep_runtime/bench/
    cd /tmp/old && PYTHONPATH=/tmp/gpu-site:/tmp/old dispatch dispatch-ep$gpus-old "$OLD"; cd "$here"
  else
    cat "$out/worktree.log"
  fi
  [ -n "${AGAIN:-}" ] && dispatch dispatch-ep$gpus-again "$commit"
fi
pack "dispatch-$commit"
