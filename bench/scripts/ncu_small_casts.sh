#!/usr/bin/env bash
# One device call (issue #3): why the small-batch per-block / per-channel casts trail tile-kernels'
# (0.4-0.6 us at 128 tokens, L2 flushed before each call as `bench kernels` times them): paired
# rounds at both shapes, then Nsight Compute (full set) of one launch each of ours and
# tile-kernels' kernels at 128 x 7168 bf16. Everything comes back in one archive (a call returns
# at most 8 files).
#   bash bench/scripts/ncu_small_casts.sh        (from the checkout's root, on the GPU machine)
set -u
source bench/scripts/lib.sh
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
LIMIT=240 run paired python3 bench/scripts/paired.py --ops per_block_cast,per_channel_cast --shapes large,small \
  --rounds 7 --out "$out/paired.json"
grep "median ratio" "$out/paired.log"
cat > /tmp/small_casts.py <<'PY'
import torch
import tile_kernels as tk
from kernels import quant
x = torch.randn(128, 7168, device="cuda", dtype=torch.bfloat16)
for _ in range(3):  # the third round is profiled (the first two compile and warm up)
    quant.per_block_cast(x); quant.per_channel_cast(x)
    tk.quant.per_block_cast(x, "e4m3", (128, 128)); tk.quant.per_channel_cast(x, "e4m3", 128)
torch.cuda.synchronize()
PY
LIMIT=200 run ncu-casts "$NCU" --clock-control none --set full --kernel-name-base demangled \
  --kernel-name "regex:^(blockwise_cast_kernel|per_block_cast_kernel_kernel|per_channel_cast_kernel_kernel)$" \
  --launch-skip 8 --launch-count 4 -o "$out/small-casts" python3 /tmp/small_casts.py
"$NCU" -i "$out/small-casts.ncu-rep" --page details --csv > "$out/small-casts-details.csv" 2>&1
"$NCU" -i "$out/small-casts.ncu-rep" --page source --print-source sass --csv > "$out/small-casts-sass.csv" 2>&1
for old in bench/results/h100/2026-11-25-s13/ncu/small-casts-s13call6.ncu-rep; do
  "$NCU" -i "$old" --page details --csv > "$out/small-casts-s13call6-details.csv" 2>&1
done
grep -E '"(Duration|Elapsed Cycles|Registers Per Thread|Grid Size|Block Size|Executed Instructions)"' \
  "$out/small-casts-details.csv" | cut -d, -f5,12-16 | head -40
pack ncu-small-casts
ls -la "$out"
