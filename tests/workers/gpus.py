"""What a test that launches processes needs of a GPU machine, where each process takes the GPU of
its local rank (CPU runs launch any number)."""

import pytest
import torch


def needs_gpus(n: int):
    """Skips the test on a GPU machine with fewer than ``n`` GPUs."""
    return pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < n,
                              reason=f"{n} processes need {n} GPUs on a GPU machine")
