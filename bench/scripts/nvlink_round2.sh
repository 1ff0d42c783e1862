#!/usr/bin/env bash
# Device call on nvidia-h200-x2: kernel tests touched since the last run, DeepEP's intranode test
# on the facade, then the nvlink benchmarks. bash bench/scripts/nvlink_round2.sh COMMIT
set -u
commit=${1:?commit}
out=${OUT:-runs/nvlink-round2}
mkdir -p "$out"
source .gpu-bundle/activate.sh
run() { local name=$1; shift; echo "== $name: $*"; timeout "${LIMIT:-240}" "$@" > "$out/$name.log" 2>&1; echo "rc=$? $name"; tail -4 "$out/$name.log"; }
LIMIT=120 run pytest-permute python3 -m pytest -q -m gpu -n 8 tests/kernels/permute/test_expand_kernel.py tests/runtime/test_deep_ep_compat.py
LIMIT=200 run deepep-test bash bench/scripts/deepep_test.sh 2
grep -v "^W1122\|^I1122" "$out/deepep-test.log" | head -60
OUT=$out SCALING="${SCALING:-}" bash bench/scripts/nvlink_bench.sh "$commit"
