#!/usr/bin/env bash
# Runs DeepEP's own tests/legacy/test_intranode.py against ep_runtime.compat.deep_ep on the GPUs of
# this machine. DeepEP's files are not part of this repository: put test_intranode.py and
# test_low_latency.py (tests/legacy/ of github.com/deepseek-ai/DeepEP) and the tests/utils.py of
# its commit 9249c25 (the same helpers, before they moved into the package) in .deepep/ (ignored),
# carry it to the GPU machine, then: bash bench/scripts/deepep_test.sh [NUM_PROCESSES]
# The script makes a `deep_ep` package that is the facade, with `deep_ep.utils.{envs,math,testing}`
# re-exporting those helpers, and runs the test unchanged.
set -eu
nproc=${1:-2}
shim=$(mktemp -d)
mkdir -p "$shim/deep_ep/utils"
echo "from ep_runtime.compat.deep_ep import *  # noqa" > "$shim/deep_ep/__init__.py"
touch "$shim/deep_ep/utils/__init__.py"
echo "from utils import init_dist  # noqa" > "$shim/deep_ep/utils/envs.py"
echo "from utils import calc_diff, inplace_unique, per_token_cast_to_fp8, per_token_cast_back, hash_tensor  # noqa" > "$shim/deep_ep/utils/math.py"
echo "from utils import bench, bench_kineto  # noqa" > "$shim/deep_ep/utils/testing.py"
cd .deepep
unset WORLD_SIZE RANK  # DeepEP's init_dist reads them as the node count and node rank
PYTHONPATH="$shim:$(cd .. && pwd):${PYTHONPATH:-}" python3 test_intranode.py --num-processes "$nproc"
