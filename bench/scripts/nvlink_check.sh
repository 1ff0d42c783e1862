#!/usr/bin/env bash
# One device call on two GPUs (nvidia-h200-x2): the nvlink backend's GPU tests, then its benchmarks.
# Usage (from the checkout's root, on the GPU machine): bash bench/scripts/nvlink_check.sh COMMIT
set -u
commit=${1:?commit}
out=${OUT:-runs/nvlink-check}
mkdir -p "$out"
source .gpu-bundle/activate.sh
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/gpus.txt"
run() { local name=$1; shift; echo "== $name: $*"; timeout "${LIMIT:-240}" "$@" > "$out/$name.log" 2>&1; echo "rc=$? $name"; tail -5 "$out/$name.log"; }
LIMIT=150 run pytest-kernels python3 -m pytest -q -m gpu -n 4 tests/kernels/comm tests/kernels/reduce/test_weighted_reduce_kernel.py
LIMIT=200 run pytest-nvlink python3 -m pytest -q tests/runtime/test_nvlink_gpu.py tests/runtime/test_dispatch_conformance.py tests/runtime/test_ep_equivalence.py -k "nvlink or 2"
LIMIT=60 run bench-vdev torchrun --standalone --nproc-per-node 2 -m ep_runtime.bench.dispatch --peer vdev --out "$out" --commit "$commit"
LIMIT=150 run bench-dispatch torchrun --standalone --nproc-per-node 2 -m ep_runtime.bench.dispatch --profile --out "$out" --commit "$commit"
grep -A60 "profile of" "$out/bench-dispatch.log" | cut -c1-200 | head -90
grep -A30 "dispatch/combine on" "$out/bench-dispatch.log"
grep -B2 -A12 "Error\|assert" "$out/pytest-nvlink.log" | grep -v "^E1122\|INFO" | head -40
