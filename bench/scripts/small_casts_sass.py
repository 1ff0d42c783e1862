"""Warp-instructions a warp executes in the blockwise casts at 128 x 7168 bf16 -> e4m3, counted on a
CPU from the sm_90a SASS (no GPU): ours (each ``CastVariant``) and tile-kernels' per_channel /
per_block casts. A walk of the listing along the path a full row tile takes (IEEE division on its
fast path, warps 0-3 and 4-7 apart) gave Nsight Compute's counts of session 14 exactly (444.0 /
448.0 ours, 387.5 / 431.0 tile-kernels).

    PYTHONPATH=. python3 bench/scripts/small_casts_sass.py --out /tmp/small-casts \\
        [--cuobjdump PATH] [--tile-kernels SITE_DIR (appended to sys.path, so its own tilelang does not shadow ours)]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

from kernels import lowering
from kernels.quant.blockwise_cast_kernel import CastVariant, get_blockwise_cast_kernel

VARIANTS = {
    "shipped": CastVariant(),
    "grid_2d": CastVariant(grid_2d=True),
    "full_tiles": CastVariant(grid_2d=True, full_tiles=True),
    "bf16_words": CastVariant(grid_2d=True, full_tiles=True, bf16_words=True),
}


def tile_kernels_casts():
    """tile-kernels 2.1.0's two kernels for the same specialization (16-byte vectors, as on Hopper)."""
    import torch
    from tile_kernels.quant import common, per_block_cast_cuda, per_channel_cast_cuda

    per_block_cast_cuda.get_best_vectorize_size = lambda dtype: 16 // dtype.bytes  # asks the GPU otherwise
    bf16 = common.CastInputConfig(torch.bfloat16)
    out = lambda block: common.get_cast_output_config("e4m3", block, False, False, False)  # noqa: E731
    return {"per_channel": per_channel_cast_cuda.get_per_channel_cast_kernel_cuda(7168, in_config=bf16,
                                                                                  out_config=out((128, 1))),
            "per_block": per_block_cast_cuda.get_per_block_cast_kernel_cuda(hidden=7168, in_config=bf16,
                                                                            out_config=out((128, 128)))}


def sass(kernel, stem: Path, cuobjdump: str) -> tuple[list[tuple[int, str]], str]:
    """``[(address, instruction)]`` of the kernel's cubin, and ptxas' register line."""
    kernel.export_ptx(str(stem.with_suffix(".ptx")))
    report = subprocess.run(["ptxas", "-arch=sm_90a", "-v", str(stem.with_suffix(".ptx")), "-o",
                             str(stem.with_suffix(".cubin"))], capture_output=True, text=True, check=True).stderr
    dump = subprocess.run([cuobjdump, "-sass", str(stem.with_suffix(".cubin"))], capture_output=True, text=True,
                          check=True).stdout
    code = [(int(a, 16), ins.strip()) for a, ins in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", dump)]
    return code, re.search(r"Used \d+ registers.*", report).group(0)


def walk(code: list[tuple[int, str]], upper_warps: bool) -> int:
    """Instructions from the entry to EXIT for a warp of a full row tile: row guards false, IEEE
    division's slow-path checks false, ``tid >= 128`` as ``upper_warps``; tile-kernels' two-predicate
    branch to its interior body not taken (at 128 rows it runs the guarded body)."""
    at = {addr: i for i, (addr, _) in enumerate(code)}
    meaning = {}  # predicate register -> its value on this path
    pc, count = 0, 0
    while True:
        ins = code[pc][1]
        count += 1
        m = re.match(r"(@!?)(P\d)\s+(.*)", ins)
        guard, body = (m.group(1, 2), m.group(3)) if m else (None, ins)
        if d := re.match(r"(FCHK|LOP3\.LUT|ISETP\S*)\s+(P\d)", body):
            tid = "0xffffff80" in body or body.endswith("0x7f, PT")
            meaning[d.group(2)] = upper_warps if tid else False if d.group(1) == "FCHK" or "UR" in body else None
        op = body.split()[0]
        if op in ("BRA", "EXIT") and not re.match(r"BRA !?P\d,", body):
            taken = guard is None
            if guard is not None:
                if meaning.get(guard[1]) is None:
                    raise ValueError(f"unknown predicate at {code[pc][0]:#x}: {ins}")
                taken = meaning[guard[1]] != (guard[0] == "@!")
            if taken and op == "EXIT":
                return count
            if taken:
                pc = at[int(re.search(r"0x([0-9a-f]+)", body).group(1), 16)]
                continue
        pc += 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--cuobjdump", default="cuobjdump")
    p.add_argument("--tile-kernels", help="a folder holding the tile_kernels package")
    a = p.parse_args()
    if a.tile_kernels:
        sys.path.append(a.tile_kernels)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with lowering.compile_only():
        kernels = {(layout, name): get_blockwise_cast_kernel(7168, 128, size, "bfloat16", False, False, variant=v)
                   for name, v in VARIANTS.items() for layout, size in (("per_channel", 1), ("per_block", 128))}
        kernels |= {(layout, "tile-kernels"): k for layout, k in tile_kernels_casts().items()}
    for (layout, name), kernel in kernels.items():
        code, registers = sass(kernel, out / f"{layout}-{name}", a.cuobjdump)
        first_load = next(i for i, (_, ins) in enumerate(code) if "LDG" in ins) + 1
        low, high = walk(code, False), walk(code, True)
        print(f"{layout:12} {name:13} warps 0-3 {low:4} 4-7 {high:4} mean {(low + high) / 2:6.1f}  "
              f"first load: instruction {first_load}  {registers}")


if __name__ == "__main__":
    main()
