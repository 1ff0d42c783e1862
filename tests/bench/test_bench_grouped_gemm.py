"""The grouped-GEMM benchmark's splits of the rows over the experts (the measurements:
tests/launch/test_bench.py)."""

import pytest

from ep_runtime.bench.grouped_gemm import split_counts


def test_grouped_gemm_splits_are_whole_tiles():
    """DeepSeek-V3 on one EP-4 rank: 32768 rows over 64 experts, 512 each, or Zipf-like shares
    (the first 29%, the last six empty), every count a multiple of 128, the same total."""
    assert split_counts(32768, 64, "uniform") == [512] * 64
    skewed = split_counts(32768, 64, "skewed")
    assert sum(skewed) == 32768 and all(c % 128 == 0 for c in skewed) and skewed.count(0) == 6
    assert skewed[0] == max(skewed) == 75 * 128 and skewed == sorted(skewed, reverse=True)
    with pytest.raises(ValueError, match="--splits"):
        split_counts(256, 2, "zipf")
