"""Small-batch bytes: is a kernel that reads four bytes for each one it writes slower than a copy of
as many bytes (half read, half written) because of its kernel or because of the mix? GPU time
(CUPTI, L2 flushed) of device copies and of a read-heavy reduction (``torch.sum`` of four rows into
one) at the sizes of ``weighted_reduce``'s small batch (128 tokens, top-8, hidden 7168, e4m3 rows:
~7.2 MB read, 1.8 MB written), beside that op (session 29, ``kernels/reduce/NOTES.md``).

    python3 bench/scripts/read_write_mix.py
"""

import torch

from ep_runtime.bench import kernels as bench
from kernels.reduce import weighted_reduce
from reduce_vectors import positions

MB = 1 << 20


def main() -> None:
    device, seed, timer = bench.tuning_setup(20)
    timer.kernel_calls = 20  # the copies' calls
    gen = torch.Generator(device).manual_seed(seed)
    t, k, d = 128, 8, 7168
    pos = positions("layout", t, k, gen, device)
    y = torch.randn(int(pos.max()) + 1, d, generator=gen, device=device).to(torch.float8_e4m3fn)
    sf = torch.rand(y.shape[0], d // 128, generator=gen, device=device) + 0.5
    w = torch.rand(t, k, generator=gen, device=device)
    routed = int((pos >= 0).sum())
    read, written = routed * d + routed * (d // 128) * 4, t * d * 2
    print(f"{bench.device_name(device)}  weighted_reduce_fp8 reads {read / MB:.2f} MB, writes {written / MB:.2f} MB: "
          f"{timer.kernel_us(lambda: weighted_reduce(y, pos, w, sf_PG=sf)):.2f} us")
    for label, each_way in (("a copy of its bytes (half each way)", (read + written) // 2),
                            ("a copy reading its reads", read), ("a copy reading its writes", written)):
        each_way = each_way // 16 * 16
        print(f"{label:40s} {each_way / MB:5.2f} MB each way: {timer.copy_kernel_us(2 * each_way):.2f} us")
    for parts in (2, 4, 8):  # a sum of `parts` rows: reads parts x what it writes
        src = torch.randn(parts, written // 2, generator=gen, device=device).to(torch.bfloat16)
        dst = torch.empty(written // 2, dtype=torch.bfloat16, device=device)
        print(f"sum of {parts} rows into one{'':19s} reads {src.numel() * 2 / MB:5.2f} MB, writes {written / MB:.2f} MB: "
              f"{timer.kernel_us(lambda: torch.sum(src, 0, out=dst)):.2f} us")  # noqa: B023


if __name__ == "__main__":
    main()
