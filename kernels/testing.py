"""Input generators shared by the kernel tests and the kernel benchmarks.

Every generator draws from its own seeded CPU generator, then moves the result to ``device``, so a
test and a benchmark given the same arguments see the same inputs on any device.

Shape suffixes: T tokens, E experts, K routes per token.
"""

from __future__ import annotations

import torch


def router_inputs(
    num_tokens: int,
    num_experts: int,
    *,
    dtype: torch.dtype = torch.float32,
    ties: bool = False,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits and a selection bias.

    With ``ties``, both take a few distinct values only, so many selection scores tie exactly (the
    tie-breaking rules are then exercised).

    Returns:
        logits_TE: [T, E] ``dtype``.
        bias_E: [E] float32.
    """
    gen = torch.Generator().manual_seed(seed)
    if ties:
        logits_TE = torch.randint(-2, 3, (num_tokens, num_experts), generator=gen) * 0.5
        bias_E = torch.randint(-2, 3, (num_experts,), generator=gen) * 0.125
    else:
        logits_TE = torch.randn(num_tokens, num_experts, generator=gen) * 2
        bias_E = torch.randn(num_experts, generator=gen) * 0.1
    return logits_TE.to(dtype).to(device), bias_E.float().to(device)


def routes(
    num_tokens: int,
    topk: int,
    num_experts: int,
    *,
    masked: bool = True,
    dtype: torch.dtype = torch.int64,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> torch.Tensor:
    """Random top-k routes: with ``masked``, some are -1; when E > 2, expert E - 2 gets none.

    Returns:
        topk_idx_TK: [T, K] ``dtype``.
    """
    gen = torch.Generator().manual_seed(seed)
    idx_TK = torch.randint(-1 if masked else 0, num_experts, (num_tokens, topk), generator=gen)
    if num_experts > 2:
        idx_TK[idx_TK == num_experts - 2] = 0
    return idx_TK.to(dtype).to(device)


def poison_allocator(device: torch.device | str, *, byte: int = 0x5A, large_bytes: int = 256 << 20) -> None:
    """Fills freed blocks of torch's CUDA caching allocator with ``byte``, so outputs a kernel wrapper
    allocates with ``torch.empty`` start as garbage (0x5A5A5A5A as int32; about 1.5e16 as float32)
    and an element the kernel fails to write shows up. Best effort: it fills one large block and
    a few small-pool segments."""
    blocks = [torch.empty(large_bytes, dtype=torch.uint8, device=device)]
    blocks += [torch.empty(1 << 20, dtype=torch.uint8, device=device) for _ in range(16)]
    for block in blocks:
        block.fill_(byte)
    del blocks
