#!/usr/bin/env bash
# One device call on one GPU for kernels changed without a GPU (issue #3): their GPU tests
# ($GPU_TESTS), paired rounds against tile-kernels ($PAIRED_OPS at large and small), and `bench
# kernels` of $KERNEL_OPS at both shapes from this tree and, when OLD names a carried folder holding
# an older tree, from that one in the same call (large shape, ours only). Everything comes back in one archive.
#   GPU_TESTS="..." PAIRED_OPS=a,b KERNEL_OPS=a,b,c OLD=old-tree bash bench/scripts/one_gpu_kernels.sh COMMIT
set -u
commit=${1:?commit}
source bench/scripts/lib.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
LIMIT=240 run pytest-gpu python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider $GPU_TESTS
tail -2 "$out/pytest-gpu.log"; grep -m6 "^FAILED\|^ERROR" "$out/pytest-gpu.log"
LIMIT=200 run paired python3 bench/scripts/paired.py --ops "$PAIRED_OPS" --shapes large,small --rounds 7 --out "$out/paired.json"
grep "median ratio" "$out/paired.log" | cut -c1-150
here=$PWD
for tree in new ${OLD:+old}; do  # the old tree at the large shape, ours only (the peers are timed above)
  shapes="large small"; peers=""
  [ "$tree" = old ] && cp -r "$OLD" /tmp/old && cd /tmp/old && shapes=large && peers=--skip-peers
  for shape in $shapes; do
    PYTHONPATH=/tmp/gpu-site:$PWD LIMIT=150 run kernels-$shape-$tree python3 -m ep_runtime.cli bench kernels --shapes $shape \
      --skip-compile $peers --ops "$KERNEL_OPS" --out "$out/kernels-$shape-$tree.json" --commit "$commit-$tree"
    grep -E "^(large|small) |speedup" "$out/kernels-$shape-$tree.log" | cut -c1-150
  done
  cd "$here"
done
pack one-gpu-kernels
