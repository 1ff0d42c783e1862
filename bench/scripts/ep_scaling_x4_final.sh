#!/usr/bin/env bash
# Device call on nvidia-h200-x4 (issue #6), after one symmetric-memory group per process: the
# 4-GPU conformance and EP-equivalence suites, then ep-scaling with nvlink (the local launcher
# starts a fresh process set per EP size). bash bench/scripts/ep_scaling_x4_final.sh COMMIT
set -u
commit=${1:?commit}
source bench/scripts/lib.sh
[ -n "${SKIP_TESTS:-}" ] || LIMIT=${TEST_LIMIT:-180} run pytest-4gpu python3 -m pytest -q tests/runtime/test_dispatch_conformance.py tests/runtime/test_ep_equivalence.py -k "4-"
[ -n "${SKIP_TESTS:-}" ] || { tail -4 "$out/pytest-4gpu.log"; grep -m3 -A12 "^E " "$out/pytest-4gpu.log" | head -30; }
LIMIT=${SCALING_LIMIT:-260} run ep-scaling-nvlink python3 -m ep_runtime.bench.ep_scaling --launcher local \
  --shape deepseek-v3 --dispatcher nvlink --warmup 2 --iters 6 --out "$out" --commit "$commit"
grep "EP " "$out/ep-scaling-nvlink.log" | tail -6 | cut -c1-260
grep -A14 "most recent call first" "$out/ep-scaling-nvlink.log" | grep "File" | head -12
