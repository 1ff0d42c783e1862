"""The blockwise FP8 cast kernel (per-token, per-block, per-channel) against the reference:
bit-exact e4m3 bytes and scales, every output element written (outputs start as poison)."""

import pytest
import torch

from kernels import lowering
from kernels.quant import reference
from kernels.quant.blockwise_cast_kernel import (
    NARROW_CHANNEL_COLUMNS,
    STAGED_CHANNEL_CTAS,
    blockwise_cast,
    get_blockwise_cast_kernel,
    narrow_channel_tile,
    per_token_tile,
    staged_channel_ctas,
)
from kernels.testing import cast_input, poison_allocator, spy

LAYOUTS = {  # name: (reference op, its size argument, block shape of a size)
    "per_token": (reference.per_token_cast, "group", lambda size: (1, size)),
    "per_block": (reference.per_block_cast, "block", lambda size: (size, size)),
    "per_channel": (reference.per_channel_cast, "block", lambda size: (size, 1)),
}
SHAPES = [  # (M, N, block size, input dtype)
    (0, 7168, 128, torch.bfloat16),
    (1, 64, 128, torch.bfloat16),
    (37, 100, 128, torch.bfloat16),
    (130, 300, 128, torch.float32),
    (200, 7168 + 64, 128, torch.bfloat16),
    (257, 7168, 128, torch.float16),
    (129, 256, 64, torch.float32),
    (70, 96, 32, torch.bfloat16),
    (4096, 7168, 128, torch.bfloat16),  # per-token: more CTAs than the SMs hold, two vectors a thread
    (4096, 7168, 64, torch.float32),
    (300, 7168, 64, torch.bfloat16),  # per-channel: staged in shared memory, 64-row blocks
]
SF_MODES = {"fp32_sf": (False, False), "ue8m0_sf": (True, False), "packed_sf": (True, True)}


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.gpu
@pytest.mark.parametrize("sf_mode", SF_MODES)
@pytest.mark.parametrize("m,n,size,dtype", SHAPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_matches_reference_bit_for_bit(layout, m, n, size, dtype, sf_mode, seed):
    op, size_arg, block_of = LAYOUTS[layout]
    round_sf, pack_sf = SF_MODES[sf_mode]
    x = cast_input(m, n, dtype=dtype, device="cuda", seed=seed)
    poison_allocator("cuda")
    q, sf = blockwise_cast(x, block_of(size), round_sf=round_sf, pack_sf=pack_sf)
    q_ref, sf_ref = op(x.cpu(), **{size_arg: size}, round_sf=round_sf, pack_sf=pack_sf)
    assert q.dtype == q_ref.dtype and q.shape == q_ref.shape and q.stride() == q_ref.stride()
    assert sf.dtype == sf_ref.dtype and sf.shape == sf_ref.shape
    assert torch.equal(bytes_of(q).cpu(), bytes_of(q_ref))
    assert torch.equal(sf.cpu().view(torch.uint8), sf_ref.view(torch.uint8))


@pytest.mark.gpu
def test_public_ops_pick_the_kernel_and_accept_strided_input(monkeypatch, seed):
    from kernels import quant

    calls = spy(monkeypatch, quant, "blockwise_cast")
    x = cast_input(256, 2 * 7168, dtype=torch.bfloat16, device="cuda", seed=seed)[:, ::2]
    for op in ("per_token_cast", "per_block_cast", "per_channel_cast"):
        q, sf = getattr(quant, op)(x, round_sf=True)
        q_ref, sf_ref = getattr(reference, op)(x.cpu(), round_sf=True)
        assert torch.equal(bytes_of(q).cpu(), bytes_of(q_ref)) and torch.equal(sf.cpu(), sf_ref), op
    assert [block for _, block in calls] == [(1, 128), (128, 128), (128, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "call,error,argname",
    [
        (lambda x: blockwise_cast(x.int(), (1, 128), round_sf=False, pack_sf=False), TypeError, "x_MN"),
        (lambda x: blockwise_cast(x.cpu(), (1, 128), round_sf=False, pack_sf=False), ValueError, "x_MN"),
        (lambda x: blockwise_cast(x, (1, 100), round_sf=False, pack_sf=False), ValueError, "block"),
        (lambda x: blockwise_cast(x, (1, 128), round_sf=False, pack_sf=True), ValueError, "pack_sf"),
    ],
    ids=["dtype", "device", "block", "pack_without_round"],
)
def test_bad_input_names_the_argument(call, error, argname):
    with pytest.raises(error, match=f"^{argname}: expected"):
        call(torch.randn(4, 256, device="cuda"))


# What the runtime casts (per-token 1x128 tokens at hidden 7168 and the tiny model's 64, bf16 and
# float32 activations), the other layouts at 7168, and ragged widths.
SPECIALIZATIONS = [  # (num_cols, block_m, block_n, in_dtype, round_sf, pack_sf)
    (7168, 1, 128, "bfloat16", False, False),
    (7168, 1, 128, "float32", False, False),
    (64, 1, 128, "bfloat16", False, False),
    (64, 1, 128, "float32", False, False),
    (7168, 1, 128, "bfloat16", True, True),
    (300, 1, 128, "float16", True, False),
    (7168, 128, 128, "bfloat16", True, False),
    (300, 128, 128, "float32", False, False),
    (7168, 128, 1, "bfloat16", False, False),
    (300, 128, 1, "bfloat16", True, True),
]


def test_compiles_for_sm90a():
    with lowering.compile_only():
        for spec in SPECIALIZATIONS:
            assert "fp8" in lowering.kernel_source(get_blockwise_cast_kernel(*spec)), spec
        # per-channel scales over few rows: narrow tiles (narrow_channel_tile)
        tile = (128, NARROW_CHANNEL_COLUMNS, 128)
        for dtype in ("bfloat16", "float32"):
            assert "fp8" in lowering.kernel_source(get_blockwise_cast_kernel(7168, 128, 1, dtype, False, False, tile)), dtype
        # per-channel 2-byte tiles staged in shared memory (staged_channel_ctas)
        for dtype in ("bfloat16", "float16"):
            kernel = get_blockwise_cast_kernel(7168, 128, 1, dtype, False, False, None, None, STAGED_CHANNEL_CTAS)
            assert "fp8" in lowering.kernel_source(kernel), dtype
        # per-token scales over many rows: two vectors a thread (per_token_tile's 1 x 1024 tile of 64 threads)
        for dtype, vec in (("bfloat16", 8), ("float32", 4)):
            tile = (1, 1024, 1024 // (2 * vec))
            assert "fp8" in lowering.kernel_source(get_blockwise_cast_kernel(7168, 1, 128, dtype, False, False, tile)), dtype


@pytest.mark.gpu
def test_many_tokens_take_two_vectors_a_thread():
    """The per-token tile of two vectors a thread only where the grid outnumbers the CTAs the SMs
    hold (its results: the bit-exact test above at 4096 rows)."""
    device = torch.device("cuda")
    assert per_token_tile(4096, 7168, (1, 128), 8, device) == (1, 1024, 64)
    assert per_token_tile(4096, 7168, (1, 128), 4, device) == (1, 1024, 128)  # float32: 4 elements a vector
    assert per_token_tile(128, 7168, (1, 128), 8, device) is None
    assert per_token_tile(4096, 7168, (128, 128), 8, device) is None


def test_per_channel_stages_two_byte_tiles_on_the_shuffle_path():
    """Staged only where measured (tile_caster's per-channel shuffles); under the register cap
    blocks of 4 or 8 rows spill, and float32 tiles do not fit four CTAs an SM."""
    assert staged_channel_ctas(7168, (128, 1), 8, 2) == STAGED_CHANNEL_CTAS
    assert staged_channel_ctas(7168, (64, 1), 8, 2) == STAGED_CHANNEL_CTAS
    assert staged_channel_ctas(300, (64, 1), 4, 2) == 0  # 64 vectors a row: TileLang's reduce
    assert staged_channel_ctas(7168, (8, 1), 8, 2) == 0
    assert staged_channel_ctas(7168, (128, 1), 4, 4) == 0
    assert staged_channel_ctas(7168, (128, 128), 8, 2) == 0
    assert staged_channel_ctas(7168, (1, 128), 8, 2) == 0


@pytest.mark.gpu
def test_few_rows_per_channel_take_narrow_tiles():
    """The narrow tile only where the default grid leaves SMs idle (its results: the bit-exact test above)."""
    device = torch.device("cuda")
    assert narrow_channel_tile(128, 7168, (128, 1), 8, device) == (128, NARROW_CHANNEL_COLUMNS, 128)
    assert narrow_channel_tile(16384, 7168, (128, 1), 8, device) is None
    assert narrow_channel_tile(128, 7168, (128, 128), 8, device) is None
