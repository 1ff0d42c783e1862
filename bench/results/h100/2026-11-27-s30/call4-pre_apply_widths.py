"""Session 30: pre-apply as shipped at more widths (2048, 5120, 6144) than bench kernels' v4 shapes,
paired against tile-kernels."""
import sys

sys.path.insert(0, "bench/scripts")
from ep_runtime.bench import kernels as bench  # noqa: E402

for d in (2048, 5120, 6144):
    bench.SHAPES[f"v4-d{d}"] = bench.Shape(tokens=8192, hidden=d)
import paired  # noqa: E402

sys.argv = ["paired.py", "--ops", "mhc_pre_apply", "--shapes", "v4-d2048,v4-d5120,v4-d6144", "--kernel-time",
            "--rounds", "7", "--out", sys.argv[1]]
paired.main()
