"""Engram tables sharded by rows over 2 and 4 gloo processes give what one process holding the
whole table and every rank's sequences gives: outputs, input gradients, the table's initial rows
and gradients, the dense parameters' gradients; each distinct row travels once per rank. On 2
processes also the whole v4-style model (mHC + Engram + MoE), with gradients reduced as the
training step reduces them (dense summed over ranks, experts and table shards left with their
owners)."""

import pytest
import torch
from engram_workers import CASES, sharded_matches_unsharded

from ep_runtime.config import EngramConfig
from ep_runtime.engram import Engram
from launch.local import launch_local

# Relative to the largest expected magnitude: the rows themselves travel exactly; the sharded run
# adds a row's gradient terms in another order (per rank, then over ranks) and multiplies matrices
# of other batch sizes.
# The model's gradients go through more sums (the head's mixing weights: over every token).
# On GPUs the experts run in bf16.
RTOL = 1e-4 if torch.cuda.is_available() else 1e-5
RTOL_MODEL = 2e-2 if torch.cuda.is_available() else 1e-4


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_engram_matches_unsharded(world):
    if torch.cuda.is_available() and torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    results = launch_local(sharded_matches_unsharded, sorted(CASES), world == 2, nproc=world)
    assert sorted(results) == list(range(world))
    served = {case: 0 for case in CASES}
    asked = {case: 0 for case in CASES}
    for rank, cases in results.items():
        model = cases.pop("model", None)
        assert sorted(cases) == sorted(CASES)
        for case, errs in cases.items():
            moved, distinct = errs.pop("rows_moved"), errs.pop("distinct_rows")
            assert moved[1] <= world * errs.pop("shard_rows")  # each asker at most every row once
            # forward: counts, indices asked of this rank, rows this rank needs; backward: gradients back
            assert len(moved) == 4 and moved[0] == world, (rank, case, moved)
            assert moved[2] == distinct, (rank, case, moved, distinct)  # each distinct row once
            assert moved[3] == moved[1], (rank, case, moved)
            served[case] += moved[1]
            asked[case] += moved[2]
            assert errs.pop("table_padding") == 0
            for name, err in errs.items():
                assert err <= RTOL, f"rank {rank} {case} {name}: max relative error {err:.3g} > {RTOL}"
        if world == 2:
            assert model.pop("num_sharded") == 2
            assert len(model) > 30
            for name, err in model.items():
                assert err <= RTOL_MODEL, f"rank {rank} model {name}: max relative error {err:.3g} > {RTOL_MODEL}"
    assert served == asked  # what the owners served is what the ranks asked for


def test_shards_past_the_table_are_padding():
    """4062 rows (the default tables) over 96 ranks, 43 a rank: rank 95 starts past the last row and
    holds padding only; the shards laid end to end are the whole table's rows, then zeros."""
    from ep_runtime.engram import ShardedTable

    rows, world = 4062, 96
    whole = ShardedTable(rows, 2, group=None, seed=4)
    shards = []
    for rank in range(world):
        shard = ShardedTable(1, 2, group=None, seed=4)
        shard.num_rows, shard.world, shard.rank, shard.rows_per_rank = rows, world, rank, -(-rows // world)
        shard.first_row = rank * shard.rows_per_rank
        shards.append(shard._initial_rows(2, seed=4))
    laid = torch.cat(shards)
    assert torch.equal(laid[:rows], whole.weight_LE.detach()) and not laid[rows:].any()


def test_lookup_without_group_is_an_embedding(seed):
    from ep_runtime.engram import ShardedTable

    table = ShardedTable(50, 3, group=None, seed=1)
    idx = torch.randint(0, 50, (4, 7))
    rows = table(idx)
    torch.testing.assert_close(rows, torch.nn.functional.embedding(idx, table.weight_LE), rtol=0, atol=0)
    g = torch.randn_like(rows)
    (rows * g).sum().backward()
    want = torch.zeros(50, 3).index_add_(0, idx.flatten(), g.reshape(-1, 3))
    torch.testing.assert_close(table.weight_LE.grad, want)
    with pytest.raises(ValueError, match="idx: expected entries in \\[0, 50\\)"):
        table(torch.tensor([3, 50]))
    with pytest.raises(TypeError, match="idx: expected dtype torch.int64"):
        table(torch.tensor([3], dtype=torch.int32))


def test_engram_layer_gradcheck(seed):
    """The whole layer in float64 (table, projections, gate and conv weights, input streams)."""
    from torch.func import functional_call

    from ep_runtime.config import EngramConfig
    from ep_runtime.engram import Engram

    cfg = EngramConfig(layers=(0,), max_ngram=2, num_heads=1, table_size=11, head_dim=2)
    layer = Engram(cfg, layer_id=0, vocab_size=7, hidden=3, streams=2, group=None, seed=0).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p))
    names = [n for n, _ in layer.named_parameters()]
    ids = torch.randint(0, 7, (2, 5))

    def run(x, *params):
        return functional_call(layer, dict(zip(names, params)), (x, ids))

    x = torch.randn(2, 5, 2, 3, dtype=torch.float64, requires_grad=True)
    params = [p.detach().clone().requires_grad_() for p in layer.parameters()]
    assert torch.autograd.gradcheck(run, (x, *params))


def test_engram_bad_input_is_named():
    memory = Engram(EngramConfig(layers=(0,)), layer_id=0, vocab_size=50, hidden=8, streams=2, group=None, seed=0)
    with pytest.raises(ValueError, match=r"^x_BSND: expected a 4-D tensor"):
        memory(torch.randn(3, 2, 8), torch.zeros(1, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"^x_BSND: expected \[B, S, 2, 8\], got \(1, 3, 1, 8\)$"):
        memory(torch.randn(1, 3, 1, 8), torch.zeros(1, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"^ids_BS: expected shape \(1, 3\), got \(1, 4\)$"):
        memory(torch.randn(1, 3, 2, 8), torch.zeros(1, 4, dtype=torch.int64))


def test_engram_initial_values():
    """Norm weights 1, conv taps ~ N(0, (0.1 / sqrt(4))^2), projections without bias, the table's rows
    ~ N(0, 1): what the layer documents, so a change of scale shows."""
    memory = Engram(EngramConfig(layers=(0,), head_dim=16), layer_id=0, vocab_size=50, hidden=64, streams=4,
                    group=None, seed=0)
    for name in ("query_norm_ND", "key_norm_ND", "conv_norm_ND"):
        assert torch.equal(getattr(memory, name).detach(), torch.ones(4, 64)), name
    assert 0.045 < float(memory.conv_NDW.std()) < 0.055  # 1024 taps: the std within 10%
    assert memory.key.bias is None and memory.value.bias is None
    assert 0.95 < float(memory.table.weight_LE.std()) < 1.05


def test_table_rows_follow_their_blocks_seed():
    """Row ``r`` is row ``r % 1024`` of ``randn(1024, dim)`` from a generator seeded
    ``((seed * 1_000_003 + r // 1024) ^ 0x9E3779B97F4A7C15) & (2**63 - 1)``, whichever shard holds it."""
    from ep_runtime.engram import ShardedTable

    table = ShardedTable(2500, 3, group=None, seed=7).weight_LE.detach()
    for block in range(3):
        g = torch.Generator().manual_seed(((7 * 1_000_003 + block) ^ 0x9E3779B97F4A7C15) & (2**63 - 1))
        rows = torch.randn(1024, 3, generator=g)[: 2500 - 1024 * block]
        assert torch.equal(table[1024 * block : 1024 * block + rows.shape[0]], rows), block
