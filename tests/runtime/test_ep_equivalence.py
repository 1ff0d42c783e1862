"""Expert parallelism changes where experts run, not what the layer computes: the MoE layer over
an EP group of 2 or 4 gloo processes gives the outputs, input gradients, router gradient and expert
gradients of one process holding all experts and all ranks' tokens."""

import pytest
from ep_workers import ep_matches_single_process

from launch.local import launch_local

CASES = [("balanced", False), ("skewed", False), ("masked", False),
         ("balanced", True), ("skewed", True), ("masked", True)]
# fp32 everywhere; the EP run sums the same terms in another order (matmul blocking, index_add).
ATOL = 2e-5


@pytest.mark.parametrize("world", [2, 4])
def test_ep_layer_matches_single_process(world):
    results = launch_local(ep_matches_single_process, CASES, nproc=world)
    assert sorted(results) == list(range(world))
    for rank, errors in results.items():
        assert sorted(errors) == sorted(f"{r}{'-fp8' if f else ''}" for r, f in CASES)
        for case, errs in errors.items():
            assert errs.pop("nonzero_out"), (rank, case)
            assert errs.pop("load") == 0, (rank, case)
            for name, err in errs.items():
                assert err <= ATOL, f"rank {rank} {case} {name}: max abs error {err:.3g} > {ATOL}"
