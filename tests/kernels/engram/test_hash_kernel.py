"""The Engram hash kernel against the reference run on the same GPU, bit for bit (every index of
a poisoned output); the public op's choice; argument errors; and sm_90a compiles of layer configs
(N = 2..4, K = 1..8), whose PTX must take every ``h mod prime`` as a multiply-high by a constant,
never a 64-bit division."""

import os

import pytest
import torch

from kernels import engram, lowering
from kernels.engram import hash_kernel, reference
from kernels.engram.hash_kernel import get_hash_indices_kernel, hash_indices, tile_tokens
from kernels.testing import engram_ids, poison_allocator, spy

FULL = os.environ.get("EP_KERNEL_TESTS") == "full"
VOCAB = 129280  # DeepSeek-V3's: the multipliers reach 2**63 / VOCAB, the products almost 2**63
I32, I64 = torch.int32, torch.int64


def layer_config(max_ngram, num_heads, table_size, layer_id=0):
    """A layer of a model with Engram in layers 0, 5 and 11: distinct primes, multipliers and
    offsets per layer (fixed across tests: each config compiles a kernel of its own)."""
    return engram.make_hash_config(layer_id, layer_ids=[0, 5, 11], vocab_size=VOCAB, max_ngram=max_ngram,
                                   num_heads=num_heads, table_size=table_size)


# (max_ngram, num_heads, table_size, layer_id): C = 1 (odd, 8-byte stores), 16 (DeepSeek's Engram:
# orders 2-3, 8 heads), 9, 24; one with primes above 2**31 (the modulo no longer fits 32 bits).
CONFIGS = {
    "N2K1": (2, 1, 1009, 0),
    "N3K8": (3, 8, 646400, 5),
    "N4K3-big": (4, 3, 3 * 2**30, 11),
    "N4K8": (4, 8, (50021, 700001, 9000011), 11),
}
SHAPES = [(0, 7), (3, 0), (1, 1), (5, 1), (2, 3), (3, 130), (1, 4099)]
if FULL:
    SHAPES += [(1, 127), (2, 1000), (7, 129), (16, 4096)]


def check_against_reference(ids_BS, config, compress_V, pad_id):
    want = reference.ngram_hash(ids_BS, config, compress_V=compress_V, pad_id=pad_id)
    poison_allocator("cuda")
    got = hash_indices(ids_BS, config, compress_V=compress_V, pad_id=pad_id)
    assert got.dtype == torch.int64 and got.shape == want.shape
    assert got.numel() == 0 or got.stride() == want.stride()
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("compressed", [False, True], ids=["raw", "compressed"])
@pytest.mark.parametrize("id_dtype", [I32, I64])
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("batch, seq", SHAPES)
def test_matches_reference(batch, seq, config, id_dtype, compressed, seed):
    """Sequences shorter than N (padding reaches into every column), S and B * S not multiples of
    the CTA's 128 tokens (tiles cross sequences), the largest ids; ``pad_id`` never 0; the map of
    the other integer dtype."""
    config = layer_config(*CONFIGS[config])
    num_ids = 200000 if compressed else None
    map_dtype = I64 if id_dtype == I32 else I32
    ids_BS, compress_V = engram_ids(batch, seq, VOCAB, num_ids=num_ids, dtype=id_dtype, map_dtype=map_dtype,
                                    device="cuda", seed=seed)
    pad_id = 1 + seed % ((num_ids or VOCAB) - 1)
    check_against_reference(ids_BS, config, compress_V, pad_id)


@pytest.mark.gpu
@pytest.mark.parametrize("layer_id", [0, 5, 11])
def test_every_layer_of_a_model(layer_id, seed):
    """Each layer's own constants (a kernel each), at a training batch's shape, ids padded with
    the largest id."""
    config = layer_config(3, 8, 646400, layer_id=layer_id)
    ids_BS, _ = engram_ids(4, 2048, VOCAB, device="cuda", seed=seed)
    check_against_reference(ids_BS, config, None, VOCAB - 1)


@pytest.mark.gpu
def test_strided_ids(seed):
    """A column slice of wider ids, and a strided map, are copied before the launch."""
    config = layer_config(*CONFIGS["N3K8"])
    wide_BS, compress_V = engram_ids(3, 300, VOCAB, num_ids=1000, dtype=I32, device="cuda", seed=seed)
    strided_V = compress_V.repeat_interleave(2)[::2]  # the same map, every other entry of a wider one
    check_against_reference(wide_BS[:, 7:250:2], config, strided_V, 3)


@pytest.mark.gpu
def test_public_op_runs_the_kernel_after_checking_values(monkeypatch, seed):
    config = layer_config(*CONFIGS["N3K8"])
    ids_BS, compress_V = engram_ids(2, 130, VOCAB, num_ids=5000, device="cuda", seed=seed)
    calls = spy(monkeypatch, hash_kernel, "hash_indices")
    got = engram.ngram_hash(ids_BS, config, compress_V=compress_V, pad_id=9)
    assert len(calls) == 1
    assert torch.equal(got, reference.ngram_hash(ids_BS, config, compress_V=compress_V, pad_id=9))
    with pytest.raises(ValueError, match=r"^ids_BS: expected entries in \[0, 5000\)"):
        engram.ngram_hash(ids_BS + 5000, config, compress_V=compress_V)
    with pytest.raises(ValueError, match=rf"^compress_V: expected entries in \[0, {VOCAB}\)"):
        engram.ngram_hash(ids_BS, config, compress_V=compress_V + VOCAB)
    with pytest.raises(ValueError, match=r"^pad_id: expected an int in \[0, 5000\)"):
        engram.ngram_hash(ids_BS, config, compress_V=compress_V, pad_id=5000)
    assert len(calls) == 1


@pytest.mark.gpu
def test_ids_out_of_range_still_index_inside_the_tables(seed):
    """The kernel alone checks no values (no error, no sync); out of range, the map reads give
    token 0 and raw ids wrap in uint64, but each index lies in its column's table."""
    config = layer_config(*CONFIGS["N4K8"])
    ids_BS, compress_V = engram_ids(2, 130, VOCAB, num_ids=5000, device="cuda", seed=seed)
    offsets_C = torch.tensor(config.offsets, device="cuda")
    sizes_C = torch.tensor(config.column_sizes, device="cuda")
    for idx_BSC in (hash_indices(ids_BS + 5000, config, compress_V=compress_V), hash_indices(-ids_BS - 1, config)):
        assert bool(((idx_BSC >= offsets_C) & (idx_BSC < offsets_C + sizes_C)).all())


def test_wrapper_names_bad_arguments():
    config = layer_config(*CONFIGS["N3K8"])
    ids_BS, compress_V = engram_ids(2, 5, VOCAB, num_ids=100)
    with pytest.raises(ValueError, match="^ids_BS: expected a tensor on a CUDA device"):
        hash_indices(ids_BS, config)
    with pytest.raises(TypeError, match="^ids_BS: expected dtype"):
        hash_indices(ids_BS.float(), config)
    with pytest.raises(ValueError, match="^ids_BS: expected a 2-D tensor"):
        hash_indices(ids_BS.view(-1), config)
    with pytest.raises(TypeError, match="^compress_V: expected dtype"):
        hash_indices(ids_BS, config, compress_V=compress_V.float())
    with pytest.raises(ValueError, match=r"^pad_id: expected an int in \[0, 100\)"):
        hash_indices(ids_BS, config, compress_V=compress_V, pad_id=100)
    with pytest.raises(ValueError, match=rf"^pad_id: expected an int in \[0, {VOCAB}\)"):
        hash_indices(ids_BS, config, pad_id=True)
    with pytest.raises(TypeError, match="^config: expected a HashConfig"):
        hash_indices(ids_BS, config.multipliers)


def test_tile_tokens_keep_the_output_tile_in_48_kib():
    """128 tokens up to C = 47 (rows of C | 1 int64), then halves, never under a warp."""
    assert [tile_tokens(c) for c in (1, 16, 24, 47, 48, 95, 96, 400)] == [128, 128, 128, 128, 64, 64, 32, 32]


@pytest.mark.parametrize("config, id_dtype, map_dtype", [
    ("N2K1", "int32", None), ("N3K8", "int64", None), ("N3K8", "int32", "int32"),
    ("N4K3-big", "int64", "int32"), ("N4K8", "int32", "int64"),
])  # fmt: skip
def test_compiles_for_sm90a(config, id_dtype, map_dtype, tmp_path):
    """Every column's ``h mod prime`` a ``mul.hi.u64`` by a constant, no 64-bit ``div``/``rem``
    (the one ``rem`` left is the 32-bit position in the sequence); 16-byte stores when C is even."""
    config = layer_config(*CONFIGS[config])
    with lowering.compile_only():
        kernel = get_hash_indices_kernel(config.multipliers, config.table_sizes, id_dtype, map_dtype)
    source = lowering.kernel_source(kernel)
    assert ("longlong2" in source) == (config.num_columns % 2 == 0)
    kernel.export_ptx(str(tmp_path / "hash.ptx"))
    ptx = (tmp_path / "hash.ptx").read_text()
    assert ptx.count("mul.hi.u64") == config.num_columns
    assert not any(op in ptx for op in ("div.u64", "div.s64", "rem.u64", "rem.s64"))
