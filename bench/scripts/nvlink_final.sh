#!/usr/bin/env bash
# Device call on nvidia-h200-x2 after the planning kernels: their tests, the two-GPU suites
# (hierarchical with every GPU its own node included), then bench dispatch and the layer's scaling.
# bash bench/scripts/nvlink_final.sh COMMIT
set -u
commit=${1:?commit}
out=${OUT:-runs/nvlink-final}
mkdir -p "$out"
source .gpu-bundle/activate.sh
run() { local name=$1; shift; echo "== $name: $*"; timeout "${LIMIT:-240}" "$@" > "$out/$name.log" 2>&1; echo "rc=$? $name"; tail -3 "$out/$name.log"; }
LIMIT=100 run pytest-kernels python3 -m pytest -q -m gpu -n 8 tests/kernels/comm tests/kernels/engram/test_gate_kernel.py
LIMIT=150 run pytest-2gpu python3 -m pytest -q tests/runtime/test_nvlink_gpu.py tests/runtime/test_dispatch_conformance.py tests/runtime/test_ep_equivalence.py -k "nvlink or 2-1 or 2-None"
LIMIT=90 run bench-dispatch torchrun --standalone --nproc-per-node 2 -m ep_runtime.bench.dispatch --iters 30 --out "$out" --commit "$commit"
grep -A30 "dispatch/combine on" "$out/bench-dispatch.log"
LIMIT=90 run ep-scaling-nvlink torchrun --standalone --nproc-per-node 2 -m ep_runtime.bench.ep_scaling --shape deepseek-v3 --modes weak --dispatcher nvlink --out "$out" --commit "$commit"
grep "EP " "$out/ep-scaling-nvlink.log" | tail -2 | cut -c1-200
grep -B3 -A15 "Error\|FAILED\|assert" "$out/pytest-2gpu.log" | grep -v "^E1122\|INFO" | head -40
