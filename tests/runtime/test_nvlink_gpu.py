"""The nvlink backend's steady state on GPUs: dispatch + combine never synchronize with the host
(CUDA's sync debug mode raises if they do), and a CUDA graph of them replays on new inputs with
the eager results."""

import pytest
import torch
from dispatch_workers import nvlink_steady_state

from launch.local import launch_local


@pytest.mark.gpu
@pytest.mark.parametrize("nproc", [1, 2])
def test_nvlink_has_no_host_sync_and_captures_in_a_cuda_graph(nproc):
    """One GPU runs every kernel of the path (its stores go to its own heap); two add the peers'."""
    if torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} GPUs")
    results = launch_local(nvlink_steady_state, 512, 7168, 64, 8, nproc=nproc)
    for rank, per_dtype in results.items():
        for dtype, r in per_dtype.items():
            assert r["host_sync"] is None, (rank, dtype, r["host_sync"])
            assert r["graph_matches_eager"] and r["nonzero"], (rank, dtype)
