#!/usr/bin/env bash
# The nvlink benchmarks on two GPUs (nvidia-h200-x2): bench dispatch (with the vdev peer) and the
# MoE layer's EP 1 -> 2 weak scaling with each backend.
# Usage (from the checkout's root, on the GPU machine): bash bench/scripts/nvlink_bench.sh COMMIT
set -u
commit=${1:?commit}
out=${OUT:-runs/nvlink-bench}
mkdir -p "$out"
source .gpu-bundle/activate.sh
run() { local name=$1; shift; echo "== $name: $*"; timeout "${LIMIT:-240}" "$@" > "$out/$name.log" 2>&1; echo "rc=$? $name"; }
LIMIT=60 run bench-vdev torchrun --standalone --nproc-per-node 2 -m ep_runtime.bench.dispatch --peer vdev --out "$out" --commit "$commit"
LIMIT=150 run bench-dispatch torchrun --standalone --nproc-per-node 2 -m ep_runtime.bench.dispatch ${PROFILE:+--profile} --out "$out" --commit "$commit"
for d in ${SCALING:-}; do
  LIMIT=150 run "ep-scaling-$d" torchrun --standalone --nproc-per-node 2 -m ep_runtime.bench.ep_scaling --shape deepseek-v3 --modes weak --dispatcher "$d" --out "$out" --commit "$commit"
  grep "EP " "$out/ep-scaling-$d.log" | tail -2
done
grep -A40 "profile of" "$out/bench-dispatch.log" | cut -c1-180 | head -100
grep -A30 "dispatch/combine on" "$out/bench-dispatch.log"
tail -3 "$out/bench-dispatch.log"
