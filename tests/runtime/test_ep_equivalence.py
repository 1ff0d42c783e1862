"""Expert parallelism changes where experts run, not what the layer computes: the MoE layer over
an EP group of 2 or 4 gloo processes gives the outputs, input gradients, router gradient and expert
gradients of one process holding all experts and all ranks' tokens, with either dispatcher."""

import pytest
import torch
from ep_workers import case_name, ep_matches_single_process

from launch.local import launch_local

CASES = [(routing, fp8, dispatcher) for routing in ("balanced", "skewed", "masked") for fp8 in (False, True)
         for dispatcher in ("all_to_all", "nvlink")]
# Relative to the largest expected magnitude. CPU: fp32 everywhere, the EP run sums the same
# terms in another order (matmul blocking, index_add). GPU: experts run torch._grouped_mm in bf16
# over segments of other lengths.
RTOL = 2e-2 if torch.cuda.is_available() else 1e-5


@pytest.mark.parametrize("world,ranks_per_node", [(2, None), (4, None), (4, 2)])
def test_ep_layer_matches_single_process(world, ranks_per_node):
    """(4, 2): the EP group spans two declared nodes, so ``nvlink`` runs as ``hierarchical``."""
    if torch.cuda.is_available() and torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    results = launch_local(ep_matches_single_process, CASES, ranks_per_node, nproc=world)
    assert sorted(results) == list(range(world))
    for rank, errors in results.items():
        assert sorted(errors) == sorted(case_name(*c) for c in CASES)
        for case, errs in errors.items():
            assert errs.pop("nonzero_out"), (rank, case)
            assert errs.pop("load") == 0, (rank, case)
            for name, err in errs.items():
                assert err <= RTOL, f"rank {rank} {case} {name}: max relative error {err:.3g} > {RTOL}"
