"""ep_runtime.compat.deep_ep behaves as DeepEP's Buffer in intranode normal mode (the checks of
DeepEP's own test_intranode.py, written out here): layout dtypes and values, rows grouped by
source rank, local top-k indices with zero weights elsewhere, per-expert counts, worst-case
padding (combined and cached as DeepEP does), cached dispatch, FP8 (data, scales) inputs, combine as a
per-rank sum with biases added in float32 before the one cast; and routes that would be lost (an id
past the experts, a rank the layout leaves out) or bad arguments named, not dropped."""

import pytest
import torch
from deepep_workers import facade_checks

from launch.local import launch_local

CHECKS_PER_CASE = {"": ["rows", "counts", "cached", "bias", "combine"],
                   "-topk": ["rows", "counts", "local idx", "worst", "worst combine", "worst cached", "combine",
                             "combined weights"]}


@pytest.mark.parametrize("world", [2, 4])
def test_facade_matches_deepep_semantics(world):
    if torch.cuda.is_available() and torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    results = launch_local(facade_checks, 96, 256, 8 * world, 4, nproc=world)
    want = {"layout", "error: id past the experts", "error: route the layout drops",
            "error: counts of half the experts", "error: alignment", "error: weights' shape",
            "error: combine weights' rows"}
    for name in ("rand", "rank", "fp8"):
        for suffix, checks in CHECKS_PER_CASE.items():
            want |= {f"{name}{suffix}: {c}" for c in checks}
            if name != "rand":
                want.add(f"{name}{suffix}: by source")
    for rank, passed in results.items():
        assert set(passed) == want, (rank, sorted(want - set(passed)))


def test_errors_name_the_argument():
    from ep_runtime.compat import deep_ep

    with pytest.raises(ValueError, match="num_max_nvl_chunked_send_tokens"):
        deep_ep.Config(24, 300, 256)
    with pytest.raises(ValueError, match="new_num_sms: expected an even number"):
        deep_ep.Buffer.set_num_sms(3)
    with pytest.raises(ValueError, match="num_ranks: expected one of"):
        deep_ep.Buffer.get_dispatch_config(3)
