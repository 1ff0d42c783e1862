#!/usr/bin/env bash
# One device call: Nsight Compute on the small batch, where the time is latency, not bytes.
# 1. the nvlink dispatch + combine at EP 1, 256 tokens (issue #9): every kernel of the path with the
#    full section set, and receive_layout's SASS with its warp-stall samples;
# 2. the small-shape casts, SwiGLU and transpose (issue #3) with their peers: each kernel's own
#    duration, launch shape and occupancy, to tell a slower kernel from a costlier launch.
#   [DISPATCH_ONLY=1] bash bench/scripts/ncu_small_batch.sh   (from the checkout's root, on the GPU
#   machine; everything comes back in one archive)
set -u
source bench/scripts/lib.sh
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
NCU_RUN=("$NCU" --clock-control none --target-processes all)  # an array: `run` execs it under timeout
echo "ncu: $NCU"
path='receive_layout|put_routes|put_tokens|expand_cast_back|weighted_reduce'
LIMIT=200 run ncu-dispatch "${NCU_RUN[@]}" --set full --kernel-name "regex:$path" --launch-skip 12 --launch-count 6 \
  -o "$out/dispatch-256" torchrun --standalone --nproc-per-node 1 -m ep_runtime.bench.dispatch --tokens 256 \
  --iters 3 --warmup 2 --out "$out/dispatch"
"$NCU" -i "$out/dispatch-256.ncu-rep" --page details > "$out/dispatch-256-details.txt" 2>&1
"$NCU" -i "$out/dispatch-256.ncu-rep" --page source --print-source sass --csv --kernel-name regex:receive_layout \
  --launch-count 1 > "$out/receive-layout-sass.csv" 2>&1
grep -E "^  [a-z_]+.*\(|Duration|Registers Per|Achieved Occupancy|Block Size|Grid Size" "$out/dispatch-256-details.txt" | head -60
# Only the ops' kernels (ours and tile-kernels' end in _kernel, torch.compile's start with triton_):
# profiling torch's own input and check kernels too took the whole 360 s in session 13.
# DISPATCH_ONLY=1 stops here (bench/scripts/ncu_small_casts.sh profiles the casts one launch each).
if [ -z "${DISPATCH_ONLY:-}" ]; then
LIMIT=360 run ncu-small "${NCU_RUN[@]}" --section SpeedOfLight --section LaunchStats --section Occupancy -o "$out/small" \
  --kernel-name-base demangled --kernel-name "regex:^([a-z0-9_]+_kernel|triton_.*)$" \
  python3 -m ep_runtime.cli bench kernels --shapes small --ops per_token_cast,per_block_cast,per_channel_cast,swiglu,batched_transpose \
  --iters 3 --warmup 1 --out "$out/kernels-small.json"
"$NCU" -i "$out/small.ncu-rep" --page details --csv > "$out/small-details.csv" 2>&1
"$NCU" -i "$out/small.ncu-rep" --page details --csv --print-summary per-kernel > "$out/small-summary.csv" 2>&1
grep -E "gpu__time_duration|Duration" "$out/small-summary.csv" | cut -c1-200 | head -40
fi
pack ncu-small-batch
