"""What a test that launches processes needs: GPUs on a GPU machine, where each process takes the
GPU of its local rank (CPU runs launch any number), and waits that end inside pytest's timeout."""

import pytest
import torch

from ep_runtime.config import ParallelConfig

# A collective or device wait in a test's processes gives up after this long, inside pytest's 300 s:
# a hang then fails with the line naming the stuck rank and its wait, where pytest's kill would say
# nothing of the processes.
WAIT_S = 120.0


def parallel_config(**options) -> ParallelConfig:
    """The job's parallel config with the test's wait bound."""
    return ParallelConfig(timeout_s=WAIT_S, **options)


def needs_gpus(n: int):
    """Skips the test on a GPU machine with fewer than ``n`` GPUs."""
    return pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < n,
                              reason=f"{n} processes need {n} GPUs on a GPU machine")
