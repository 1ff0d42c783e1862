"""Worker functions for the sharded Engram tests (run in spawned gloo processes)."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from gpus import parallel_config

import ep_runtime.engram as engram_module
from ep_runtime.config import EngramConfig, MHCConfig
from ep_runtime.config_files import preset
from ep_runtime.dispatch import make_dispatcher
from ep_runtime.engram import Engram
from ep_runtime.model import TinyDeepSeek
from ep_runtime.parallel import init_parallel, single_process
from kernels.engram import ngram_hash

HIDDEN, SEQ, VOCAB = 16, 9, 12  # a small vocabulary: n-grams repeat within and across ranks

# name -> (EngramConfig, mHC streams, sequences per rank (rank -> B))
CASES = {
    "one-stream": (EngramConfig(layers=(0,), max_ngram=2, num_heads=1, table_size=37, head_dim=4), 1,
                   lambda rank: 3),
    "four-streams": (EngramConfig(layers=(1, 0), max_ngram=3, num_heads=2, table_size=53, head_dim=3), 4,
                     lambda rank: 2 + rank),
    "empty-rank": (EngramConfig(layers=(0,), max_ngram=3, num_heads=2, table_size=29, head_dim=4), 2,
                   lambda rank: 0 if rank == 1 else 2),
}


def _randomize_dense(layer: Engram) -> None:
    """Fresh random values (same on every rank) for every parameter but the table."""
    g = torch.Generator().manual_seed(77)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if not name.startswith("table."):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5 + (1.0 if name.endswith("norm_ND") else 0.0))


def _build(cfg: EngramConfig, streams: int, group, device: torch.device) -> Engram:
    torch.manual_seed(1234)
    layer = Engram(cfg, layer_id=0, vocab_size=VOCAB, hidden=HIDDEN, streams=streams, group=group, seed=5)
    _randomize_dense(layer)
    return layer.to(device)


def _inputs(rank: int, batch: int, streams: int, device: torch.device):
    g = torch.Generator().manual_seed(300 + rank)
    ids = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
    x = torch.randn(batch, SEQ, streams, HIDDEN, generator=g)
    grad_out = torch.randn(batch, SEQ, streams, HIDDEN, generator=g)
    return ids.to(device), x.to(device), grad_out.to(device)


def _run(layer: Engram, ids, x, grad_out):
    x = x.clone().requires_grad_()
    out = layer(x, ids)
    (out * grad_out).sum().backward()
    return out.detach(), x.grad


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-30)) if want.numel() else 0.0


def _gather_cat(t: torch.Tensor, world: int) -> torch.Tensor:
    # Through the CPU: a pickled CUDA tensor unpickles on its sender's GPU, and torch.cat refuses
    # parts on cuda:0 and cuda:1.
    parts = [None] * world
    dist.all_gather_object(parts, t.cpu())
    return torch.cat(parts).to(t.device)


class _CountRows:
    """Records the rows each all-to-all of the lookup moves (monkeypatching the exchange)."""

    def __init__(self):
        self.calls: list[int] = []
        self._original = engram_module._Exchange.__call__

    def __enter__(self):
        counter, original = self, self._original

        def counting(exchange, rows, in_splits, out_splits):
            counter.calls.append(sum(out_splits))
            return original(exchange, rows, in_splits, out_splits)

        engram_module._Exchange.__call__ = counting
        return self

    def __exit__(self, *exc):
        engram_module._Exchange.__call__ = self._original


def sharded_matches_unsharded(case_names: list[str], check_model: bool) -> dict:
    """For each case: the Engram layer with its table sharded over all ranks vs one process holding
    the whole table and every rank's sequences. Returns per case the largest relative errors of the
    outputs, input gradients, table (initial values and gradients) and dense gradients, and what
    the lookup moved. With ``check_model``, also the whole v4-style model (mHC, Engram, MoE) over
    the EP group vs one process ("model" entry)."""
    ctx = init_parallel(parallel_config())
    world, rank = ctx.world_size, ctx.rank
    results = {}
    for name in case_names:
        cfg, streams, batch_of = CASES[name]
        layer = _build(cfg, streams, ctx.ep_group, ctx.device)
        ids, x, grad_out = _inputs(rank, batch_of(rank), streams, ctx.device)
        with _CountRows() as counted:
            out, grad_x = _run(layer, ids, x, grad_out)
        dense = {n: p.grad.clone() for n, p in layer.named_parameters() if not n.startswith("table.")}
        for g in dense.values():
            dist.all_reduce(g)  # replicated parameters: the gradient of the sum over ranks
        table = _gather_cat(layer.table.weight_LE.detach(), world)
        table_grad = _gather_cat(layer.table.weight_LE.grad, world)
        distinct = int(torch.unique(ngram_hash(ids, layer.hash)).numel())

        ref = _build(cfg, streams, None, ctx.device)
        inputs = [_inputs(r, batch_of(r), streams, ctx.device) for r in range(world)]
        ref_out, ref_grad_x = _run(ref, *(torch.cat([inp[i] for inp in inputs]) for i in range(3)))
        num_rows = ref.table.num_rows
        results[name] = {
            "out": _rel(_gather_cat(out, world), ref_out),
            "grad_x": _rel(_gather_cat(grad_x, world), ref_grad_x),
            "table_init": _rel(table[:num_rows], ref.table.weight_LE.detach()),
            "table_padding": float(table[num_rows:].abs().sum()),
            "grad_table": _rel(table_grad[:num_rows], ref.table.weight_LE.grad),
            **{f"grad_{n}": _rel(g, dict(ref.named_parameters())[n].grad) for n, g in dense.items()},
            # forward: counts (world ints), indices (one per distinct row), rows; backward: rows
            "rows_moved": counted.calls, "distinct_rows": distinct, "shard_rows": layer.table.weight_LE.shape[0],
        }
    if check_model:
        results["model"] = _model_matches_single_process(ctx)
    dist.destroy_process_group()
    return results


def _model_matches_single_process(ctx) -> dict:
    """The v4-style model over the EP group (experts and Engram tables sharded) vs one process:
    logits, and gradients reduced the way the training step must reduce them — dense parameters
    summed over ranks, expert and sharded (table) parameters gathered from their owners."""
    world = ctx.world_size
    cfg = dataclasses.replace(preset("v4").model, hidden=32, num_layers=2, max_seq_len=16, vocab_size=64,
                              mhc=MHCConfig(n=2, sinkhorn_iters=5),
                              engram=EngramConfig(layers=(0, 1), table_size=101, head_dim=4))
    torch.manual_seed(3)
    model = TinyDeepSeek(cfg, make_dispatcher(cfg.moe, ctx), ep_rank=ctx.ep_rank, seed=3).to(ctx.device)
    torch.manual_seed(3)
    ref = TinyDeepSeek(cfg, make_dispatcher(cfg.moe, single_process(ctx.device)), seed=3).to(ctx.device)
    tokens = [torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(40 + r)).to(ctx.device)
              for r in range(world)]
    grads = [torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(60 + r)).to(ctx.device)
             for r in range(world)]

    logits = model(tokens[ctx.rank])
    (logits * grads[ctx.rank]).sum().backward()
    ref_logits = ref(torch.cat(tokens))
    (ref_logits * torch.cat(grads)).sum().backward()

    errors = {"logits": _rel(_gather_cat(logits.detach(), world), ref_logits.detach())}
    ref_params = dict(ref.named_parameters())
    sharded = {id(p) for p in model.sharded_parameters()}
    experts = {id(p) for p in model.expert_parameters()}
    dense_ids = {id(p) for p in model.dense_parameters()}
    for name, p in model.named_parameters():
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        want = ref_params[name].grad if ref_params[name].grad is not None else torch.zeros_like(ref_params[name])
        if id(p) in dense_ids:
            dist.all_reduce(grad)
            errors[name] = _rel(grad, want)
        elif id(p) in sharded:
            errors[name] = _rel(_gather_cat(grad, world)[: want.shape[0]], want)
        else:
            assert id(p) in experts, name
            errors[name] = _rel(_gather_cat(grad, world), want)
    errors["num_sharded"] = len(sharded)
    return errors
