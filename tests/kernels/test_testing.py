"""The GPU test helpers themselves: poisoned allocations and the check of them."""

import pytest
import torch

from kernels.testing import POISON_BYTE, assert_poisoned, poison_allocator

MB = 1 << 20


@pytest.mark.gpu
def test_every_allocation_after_poisoning_is_poisoned():
    """Zeroed tensors of both pools freed around live ones leave free fragments of many sizes (under
    and over 1 MB, beside live blocks); every tensor allocated after poisoning, from a few bytes to
    many MB, holds nothing but the poison."""
    sizes = [512, 4096, 600_000, MB, MB + 512, int(1.5 * MB), 3 * MB, int(9.75 * MB), 12 * MB]
    live, freed = [], []
    for size in sizes * 3:
        (live if len(live) <= len(freed) else freed).append(torch.zeros(size, dtype=torch.uint8, device="cuda"))
    del freed  # ``live`` stays allocated to the end, between the freed fragments
    poison_allocator("cuda")
    # every tensor first: the check's own temporaries, freed, would leave clean blocks behind
    outs = [torch.empty(size, dtype=torch.uint8, device="cuda") for size in sorted(sizes * 2, reverse=True) + sizes]
    for out in outs:
        assert_poisoned(f"torch.empty({out.numel()})", out)


@pytest.mark.gpu
def test_a_written_byte_is_named():
    poison_allocator("cuda")
    out = torch.empty(3 * MB, dtype=torch.uint8, device="cuda")
    out[MB + 7] = POISON_BYTE ^ 1
    with pytest.raises(AssertionError, match=rf"out: 1 of {3 * MB} bytes lost the poison, the first at byte {MB + 7}"):
        assert_poisoned("out", out)


def test_allocator_blocks_lie_in_address_order(monkeypatch):
    """Block addresses come from their segment's start and the sizes before them; other devices' left out."""
    from kernels import testing

    snapshot = [{"device": 0, "address": 0x1000, "blocks": [{"size": 512, "state": "active_allocated"},
                                                            {"size": 2048, "state": "inactive"}]},
                {"device": 1, "address": 0x9000, "blocks": [{"size": 512, "state": "inactive"}]},
                {"device": 0, "address": 0x8000, "blocks": [{"size": 4096, "state": "inactive"}]}]
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: snapshot)
    assert list(testing._allocator_blocks(0)) == [(0x1000, 512, "active_allocated"), (0x1200, 2048, "inactive"),
                                                  (0x8000, 4096, "inactive")]
