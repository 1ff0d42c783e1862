"""Input generators shared by the kernel tests and the kernel benchmarks, and the tests' call spy.

Every generator draws from its own seeded CPU generator, then moves the result to ``device``, so a
test and a benchmark given the same arguments see the same inputs on any device.

Shape suffixes: T tokens, E experts, K routes per token, M/N matrix rows/columns, P layout rows,
D hidden, G scale groups, I SwiGLU intermediate, B sequences, S positions, V token-id vocabulary.
"""

from __future__ import annotations

import gc
import types

import torch

from kernels.comm.reference import PeerRegion


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


def physical_map_inputs(num_experts: int, max_replicas: int, *, device: torch.device | str = "cpu",
                        seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A replica map's inputs (:meth:`kernels.routing.PhysicalMap.from_replicas`): each expert
    gets 1 .. ``max_replicas`` distinct slots of a placement of ``P`` slots, and random shares, some
    of them 0 (a replica that takes none of this source's routes).

    Returns:
        log2phy_ER: [E, R] int64 slots, -1 padded; fraction_ER: [E, R] float64 (0 on padding); P.
    """
    gen = torch.Generator().manual_seed(seed)
    counts_E = torch.randint(1, max_replicas + 1, (num_experts,), generator=gen)
    num_physical = int(counts_E.sum())
    slots = torch.randperm(num_physical, generator=gen).split(counts_E.tolist())
    valid_ER = torch.arange(max_replicas) < counts_E[:, None]
    log2phy_ER = torch.full((num_experts, max_replicas), -1, dtype=torch.int64)
    log2phy_ER[valid_ER] = torch.cat(slots)
    fraction_ER = torch.rand(num_experts, max_replicas, generator=gen, dtype=torch.float64)
    fraction_ER[torch.rand(num_experts, max_replicas, generator=gen) < 0.2] = 0.0
    fraction_ER[:, 0] += 0.01  # every expert has a share somewhere
    fraction_ER = torch.where(valid_ER, fraction_ER, 0.0)
    fraction_ER = fraction_ER / fraction_ER.sum(1, keepdim=True)
    return log2phy_ER.to(device), fraction_ER.to(device), num_physical


def send_routes(num_tokens: int, topk: int, world: int, num_local_experts: int, *, seed: int = 0,
                device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """A dispatch's routes: distinct experts per token of ``world * num_local_experts``, about a
    fifth masked (-1).

    Returns:
        topk_idx_TK: [T, K] int32; topk_weights_TK: [T, K] float32.
    """
    gen = torch.Generator().manual_seed(seed)
    idx_TK = torch.rand(num_tokens, world * num_local_experts, generator=gen).argsort(1)[:, :topk].to(torch.int32)
    idx_TK[torch.rand(num_tokens, topk, generator=gen) < 0.2] = -1
    return idx_TK.to(device), torch.randn(num_tokens, topk, generator=gen).to(device)


POISON_BYTE = 0x5A  # what poison_allocator fills with by default


def poison_allocator(device: torch.device | str, *, byte: int = POISON_BYTE, large_bytes: int = 256 << 20) -> None:
    """Fills the free blocks of torch's CUDA caching allocator with ``byte``, so outputs a kernel
    wrapper allocates with ``torch.empty`` start as garbage (0x5A5A5A5A as int32; about 1.5e16 as
    float32) and an element the kernel fails to write shows up. A fresh large block and a few
    small-pool segments are cached first (room for the test's outputs without new segments), then
    every free block is filled where it lies, by its address in ``torch.cuda.memory_snapshot()``.
    Not by allocating each block's size: a large-pool remainder under 1 MB cannot be asked for (such
    a request goes to the small pool), stayed clean, and merged with a filled neighbour into a block
    a SwiGLU gradient took, its last rows zeros. Garbage is collected first, so no tensor of an
    earlier test is freed onto a filled block later."""
    gc.collect()
    device = torch.device(device)
    with torch.cuda.device(device):
        torch.cuda.empty_cache()  # whole free segments go back: fewer blocks to fill
        room = [torch.empty(large_bytes, dtype=torch.uint8, device=device)]
        room += [torch.empty(1 << 20, dtype=torch.uint8, device=device) for _ in range(16)]
        del room
        for address, size, state in _allocator_blocks(torch.cuda.current_device()):
            if state == "inactive":
                _bytes_at(address, size, device).fill_(byte)


def _allocator_blocks(device_index: int):
    """``(address, size, state)`` of every block of torch's CUDA caching allocator on a device, from
    ``torch.cuda.memory_snapshot()`` (a segment's blocks lie in address order and cover it)."""
    for segment in torch.cuda.memory_snapshot():
        if segment["device"] == device_index:
            address = segment["address"]
            for block in segment["blocks"]:
                yield address, block["size"], block["state"]
                address += block["size"]


def _bytes_at(address: int, size: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over memory the caching allocator holds free (it does not own the memory),
    through the CUDA array interface."""
    memory = types.SimpleNamespace(__cuda_array_interface__={
        "shape": (size,), "typestr": "|u1", "data": (address, False), "version": 3, "strides": None, "stream": None})
    return torch.as_tensor(memory, device=device)


def assert_poisoned(name: str, t: torch.Tensor, *, byte: int = POISON_BYTE) -> None:
    """Asserts every byte of ``t`` still holds :func:`poison_allocator`'s ``byte`` (memory a kernel
    must not write); otherwise names the first byte that does not, and the allocator block that
    holds ``t`` with its neighbours, so a clean block can be told from a stray store. Allocate every
    output before checking any: the check's temporaries, once freed, leave clean free blocks."""
    flat = t.contiguous().view(torch.uint8).view(-1)
    clean = (flat != byte).nonzero()
    if clean.numel() == 0:
        return
    start, end = t.data_ptr(), t.data_ptr() + flat.numel()
    around = [f"{state} [{address:#x}, +{size})" for address, size, state in _allocator_blocks(t.device.index)
              if address < end and address + size > start - (4 << 20)]
    raise AssertionError(f"{name}: {clean.numel()} of {flat.numel()} bytes lost the poison, the first at byte "
                         f"{int(clean[0])} (value {int(flat[clean[0]])}), the last at {int(clean[-1])}; {name} lies at "
                         f"[{start:#x}, +{flat.numel()}); allocator blocks there: {'; '.join(around)}")


def cast_input(
    m: int, n: int, *, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu", seed: int = 0
) -> torch.Tensor:
    """Input of an FP8 cast: rows spanning six decades of magnitude, an all-zero corner and a tiny
    region (amax below the 1e-4 floor), so the floor, e4m3 subnormals and saturation all occur.

    Returns:
        x_MN: [M, N] ``dtype``.
    """
    gen = torch.Generator().manual_seed(seed)
    x_MN = torch.randn(m, n, generator=gen) * torch.logspace(-3, 3, max(m, 1))[:m, None]
    x_MN[: m // 3, : n // 4] = 0.0
    x_MN[m // 3 : m // 2, n // 2 :] *= 1e-7
    return x_MN.to(dtype).to(device)


def fp8_rows(
    p: int, d: int, *, group: int = 128, packed: bool = False, device: torch.device | str = "cpu", seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 expert outputs with per-token scales, as a weighted reduce with dequantization takes them.

    Returns:
        q_PD: [P, D] float8_e4m3fn.
        sf_PG: [P, ceil(D / group)] float32 in [0.01, 1.01), or uint8 exponent codes in [115, 135).
    """
    gen = torch.Generator().manual_seed(seed)
    q_PD = (4 * torch.randn(p, d, generator=gen)).to(torch.float8_e4m3fn)
    g = -(-d // group)
    if packed:
        sf_PG = torch.randint(115, 135, (p, g), generator=gen, dtype=torch.uint8)
    else:
        sf_PG = torch.rand(p, g, generator=gen) + 0.01
    return q_PD.to(device), sf_PG.to(device)


def arrived_routes(world: int, t_max: int, topk: int, num_local_experts: int, seed: int = 0,
                   device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """``(meta_RM, count_W)`` as a dispatch's receive region holds them: ids in ``[-3, W * E_local +
    2)`` (every rank's, masked and out of range; distinct in a row, as a sender's router gives them),
    random weight bits, each sender's count in ``[0, t_max]`` (rank 1 sent nothing when W > 1; rows
    past a count are left from earlier calls)."""
    g = torch.Generator().manual_seed(seed)
    span = world * num_local_experts + 5
    ids = (torch.rand(world * t_max, span, generator=g).argsort(1)[:, :topk] - 3).to(torch.int32)
    bits = torch.randint(-(2**31), 2**31 - 1, (world * t_max, topk), generator=g, dtype=torch.int32)
    count = torch.randint(0, t_max + 1, (world,), generator=g, dtype=torch.int32)
    if world > 1:
        count[1] = 0
    return torch.cat([ids, bits], 1).to(device), count.to(device)


def reduce_routes(
    num_tokens: int,
    topk: int,
    num_rows: int,
    *,
    dtype: torch.dtype = torch.int32,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routes of a weighted reduce: random layout rows, about a third masked (-1), every fifth
    token fully masked.

    Returns:
        pos_TK: [T, K] ``dtype`` rows in [0, P) or -1.
        weights_TK: [T, K] float32 in [0, 1).
    """
    gen = torch.Generator().manual_seed(seed)
    pos_TK = torch.randint(0, max(num_rows, 1), (num_tokens, topk), generator=gen)
    pos_TK[torch.rand(num_tokens, topk, generator=gen) < 0.3] = -1
    pos_TK[::5] = -1
    if num_rows == 0:
        pos_TK.fill_(-1)
    weights_TK = torch.rand(num_tokens, topk, generator=gen)
    return pos_TK.to(dtype).to(device), weights_TK.to(device)


def swiglu_input(
    num_tokens: int, inter: int, *, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu", seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """SwiGLU input ``[gate | up]`` (gates spread over the sigmoid's useful range) and an output
    gradient.

    Returns:
        x_TI2: [T, 2 * I] ``dtype``.
        grad_TI: [T, I] ``dtype``.
    """
    gen = torch.Generator().manual_seed(seed)
    x_TI2 = 3 * torch.randn(num_tokens, 2 * inter, generator=gen)
    grad_TI = torch.randn(num_tokens, inter, generator=gen)
    return x_TI2.to(dtype).to(device), grad_TI.to(dtype).to(device)


def grouped_gemm_inputs(
    counts_E: list[int], k: int, n: int, *, capacity: int = 0, device: torch.device | str = "cpu", seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An expert-major layout's rows and the experts' matrices for a grouped GEMM: segments of
    ``counts_E`` rows (multiples of 128), then ``capacity`` rows of no expert. Drawn on ``device``
    by a generator of its own (the benchmark's weights are gigabytes), with unit-variance entries
    and rows whose scale spans two decades, so each row's scales differ.

    Returns:
        x_PK: [P, K] bfloat16; w_ENK: [E, N, K] bfloat16; offsets_E: [E] int32.
    """
    gen = torch.Generator(device).manual_seed(seed)
    rows = sum(counts_E) + capacity
    row_scale_P = torch.logspace(-1, 1, max(rows, 1), device=device)[:rows]
    x_PK = torch.randn(rows, k, generator=gen, device=device) * row_scale_P[:, None]
    w_ENK = torch.randn(len(counts_E), n, k, generator=gen, device=device) * k**-0.5
    offsets_E = torch.tensor(counts_E, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
    return x_PK.bfloat16(), w_ENK.bfloat16(), offsets_E


def engram_ids(
    batch: int,
    seq: int,
    vocab_size: int,
    *,
    num_ids: int | None = None,
    dtype: torch.dtype = torch.int64,
    map_dtype: torch.dtype = torch.int64,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token ids of an Engram hash and, with ``num_ids``, a compress map onto ``[0, vocab_size)``:
    uniform, but every seventh id is the largest and the map sends it to ``vocab_size - 1``, so the
    hash's largest products occur.

    Returns:
        ids_BS: [B, S] ``dtype`` in ``[0, num_ids)`` (``[0, vocab_size)`` without a map).
        compress_V: [num_ids] ``map_dtype``, or None.
    """
    gen = torch.Generator().manual_seed(seed)
    high = num_ids or vocab_size
    ids_BS = torch.randint(0, high, (batch, seq), generator=gen)
    ids_BS.view(-1)[::7] = high - 1
    compress_V = None
    if num_ids:
        compress_V = torch.randint(0, vocab_size, (num_ids,), generator=gen)
        compress_V[-1] = vocab_size - 1
        compress_V = compress_V.to(map_dtype).to(device)
    return ids_BS.to(dtype).to(device), compress_V


def spy(monkeypatch, module: object, name: str) -> list[tuple]:
    """Records the positional arguments of every call of ``module.name`` (which still runs) for the
    rest of a test: a public op's result can equal its kernel's through the reference too, so a
    test that it took the kernel checks the calls."""
    calls, original = [], getattr(module, name)

    def recorded(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, recorded)
    return calls


def random_bits(
    rows: int, cols: int, *, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu", seed: int = 0
) -> torch.Tensor:
    """A matrix of uniformly random bytes viewed as ``dtype`` (every bit pattern, NaNs included): the
    input of ops that only move elements (expand, unexpand, transpose), compared as bits.

    Returns:
        x_MN: [M, N] ``dtype``.
    """
    gen = torch.Generator().manual_seed(seed)
    size = torch.empty((), dtype=dtype).element_size()
    bytes_MN = torch.randint(0, 256, (rows, cols * size), generator=gen, dtype=torch.uint8)
    return bytes_MN.view(dtype).to(device)


def peer_heaps(world: int, shapes: list[tuple[tuple[int, int], torch.dtype]], *, device: torch.device | str = "cpu",
               seed: int = 0) -> tuple[list[torch.Tensor], list[PeerRegion]]:
    """``world`` heaps of random bytes, each holding one region per ``((rows, cols), dtype)`` of
    ``shapes`` at the same 256-byte-aligned offsets, as a symmetric heap's are. On CUDA each "rank"
    is one allocation, reached through its address offset (``delta_W``), so the peer-store kernels
    run on one GPU.

    Returns:
        heaps: ``world`` flat uint8 tensors (compare them whole: every byte a kernel may touch).
        regions: one ``PeerRegion`` per shape.
    """
    offsets, size = [], 0
    for (rows, cols), dtype in shapes:
        offsets.append(size)
        size += -(-rows * cols * dtype.itemsize // 256) * 256
    heaps = [random_bits(1, size, dtype=torch.uint8, device=device, seed=seed + w).view(-1) for w in range(world)]
    delta_W = None
    if torch.device(device).type == "cuda":
        delta_W = torch.tensor([h.data_ptr() - heaps[0].data_ptr() for h in heaps], dtype=torch.int64, device=device)
    regions = [PeerRegion(views=tuple(h[o:o + r * c * dt.itemsize].view(dt).view(r, c) for h in heaps), delta_W=delta_W)
               for ((r, c), dt), o in zip(shapes, offsets)]
    return heaps, regions


def assert_same_receive(got: tuple, want: tuple) -> None:
    """A receiver's ``(ReceivePlan, ExpertLayout)`` against the reference's, bit for bit (int32
    everywhere, weights compared as bits)."""
    (plan, layout), (want_plan, want_layout) = got, want
    assert torch.equal(plan.local_idx_RK.cpu(), want_plan.local_idx_RK.cpu())
    assert torch.equal(plan.weights_RK.cpu().view(torch.int32), want_plan.weights_RK.cpu().view(torch.int32))
    assert torch.equal(plan.back_RW.cpu(), want_plan.back_RW.cpu())
    for name in ("counts_E", "offsets_E", "pos_TK", "src_P"):
        assert getattr(layout, name).dtype == torch.int32, name
        assert torch.equal(getattr(layout, name).cpu(), getattr(want_layout, name).cpu()), name
