"""Worker functions of tests/runtime/test_placement.py (run in spawned gloo processes).

One launch runs three checks on an EP group of ``world`` ranks and returns what they measured:

* ``replicas``: a layer whose placement replicates hot experts (some twice on one rank) equals one
  process holding every expert once, over all ranks' tokens (outputs, input and router gradients,
  each slot's gradient after ``sync_replica_gradients`` against its logical expert's).
* ``switch``: after an optimizer step, switching the layer to another placement keeps its outputs,
  gradients, weights and optimizer state per logical expert.
* ``train``: a tiny model trained on plan A, switched to plan B and trained on gives the losses of a
  model started on plan B from the weights and optimizer state plan A reached.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from gpus import parallel_config
from ep_workers import (
    HIDDEN,
    _relative_error,
    build_layer,
    forward_backward,
    inputs,
    moe_config,
)

from ep_runtime.config import ModelConfig, MoEConfig, RouterConfig
from ep_runtime.dispatch import AllToAllDispatcher
from ep_runtime.gradients import average_gradients
from ep_runtime.model import TinyDeepSeek
from ep_runtime.moe import MoELayer
from ep_runtime.parallel import init_parallel, single_process
from ep_runtime.placement import ExpertPlacement, placements_from_phy2log
from ep_runtime.replicas import switch_placement, sync_replica_gradients
from ep_runtime.train import global_expert_load

# 8 logical experts in 12 slots (6 per rank at world 2): 5 three times (twice on rank 0), 1 and 2 on
# both ranks. Plan B moves most experts to the other rank and replicates 0, 5 and 6 instead.
PLAN_A = [5, 0, 1, 2, 3, 5, 4, 5, 6, 7, 2, 1]
PLAN_B = [7, 6, 6, 3, 2, 0, 1, 4, 5, 5, 0, 6]


def placed_layer(cfg: MoEConfig, ctx, phy2log: list[int]) -> MoELayer:
    placement = ExpertPlacement(phy2log_P=torch.tensor(phy2log), num_experts=cfg.num_experts, ep_size=ctx.ep_size)
    dispatcher = AllToAllDispatcher(num_experts=len(phy2log), group=ctx.ep_group, alignment=cfg.alignment)
    torch.manual_seed(1234)  # as ep_workers.build_layer: the same router and shared expert
    return MoELayer(cfg, HIDDEN, dispatcher, ep_rank=ctx.ep_rank, seed=7, placement=placement).to(ctx.device)


def gather_slots(t: torch.Tensor) -> torch.Tensor:
    """[S, ...] per rank -> [P, ...] in slot order."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def by_logical(full_P: torch.Tensor, phy2log: list[int]) -> tuple[torch.Tensor, bool]:
    """[P, ...] -> ([E, ...] from each expert's lowest slot, whether all replicas are bitwise equal)."""
    first, same = {}, True
    for slot, e in enumerate(phy2log):
        if e in first:
            same &= torch.equal(full_P[slot], full_P[first[e]])
        else:
            first[e] = slot
    return torch.stack([full_P[first[e]] for e in range(len(first))]), same


def _grad(p):
    return p.grad if p.grad is not None else torch.zeros_like(p)


def _expert_state(layer: MoELayer, optimizer, phy2log) -> tuple[dict, bool]:
    """Logical weights, gradients and AdamW moments of the layer's experts; whether replicas agree."""
    out, same = {}, True
    for name, p in (("w13", layer.experts.w13_EDI2), ("w2", layer.experts.w2_EID)):
        tensors = {"weight": p.detach(), "grad": _grad(p)}
        if optimizer is not None:
            tensors.update(exp_avg=optimizer.state[p]["exp_avg"], exp_avg_sq=optimizer.state[p]["exp_avg_sq"])
        for kind, t in tensors.items():
            out[f"{name}.{kind}"], ok = by_logical(gather_slots(t), phy2log)
            same &= ok
    return out, same


def _layer_pass(layer, x, g, ctx):
    out, grad_x = forward_backward(layer, x, g)
    sync_replica_gradients(layer, ctx)
    router = layer.router.weight.grad.clone()
    dist.all_reduce(router)
    return {"out": gather_slots(out), "grad_x": gather_slots(grad_x), "router": router}


def check_replicas(ctx) -> dict:
    cfg = moe_config("balanced", False)
    layer = placed_layer(cfg, ctx, PLAN_A)
    x, g = inputs(ctx.rank, ctx.device)
    got = _layer_pass(layer, x, g, ctx)
    state, replicas_equal = _expert_state(layer, None, PLAN_A)
    # Every slot served routes: the hot experts' load really spreads over their replicas.
    routes_P = torch.bincount(layer.placement.physical_route(layer.router(x).topk_idx_TK, ep_rank=ctx.ep_rank)
                              .flatten(), minlength=len(PLAN_A))
    dist.all_reduce(routes_P)

    ref = build_layer(cfg, single_process(ctx.device), "balanced")
    pairs = [inputs(r, ctx.device) for r in range(ctx.world_size)]
    ref_out, ref_grad_x = forward_backward(ref, torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs]))
    want = {"out": ref_out, "grad_x": ref_grad_x, "router": ref.router.weight.grad,
            "w13.grad": _grad(ref.experts.w13_EDI2), "w2.grad": _grad(ref.experts.w2_EID)}
    got.update({k: state[k] for k in ("w13.grad", "w2.grad")})
    return {"errors": {k: _relative_error(got[k], want[k]) for k in want},
            "weights_equal": torch.equal(state["w13.weight"], ref.experts.w13_EDI2.detach())
            and torch.equal(state["w2.weight"], ref.experts.w2_EID.detach()),
            "replicas_equal": replicas_equal, "min_routes_per_slot": int(routes_P.min())}


def check_switch(ctx) -> dict:
    cfg = moe_config("balanced", False)
    layer = placed_layer(cfg, ctx, PLAN_A)
    x, g = inputs(ctx.rank, ctx.device)
    optimizer = torch.optim.AdamW(layer.experts.parameters(), lr=1e-2)  # router/shared: not switched
    forward_backward(layer, x, g)
    sync_replica_gradients(layer, ctx)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    layer.zero_grad(set_to_none=True)

    try:  # optimizer state on rank 0 only: refused on both ranks before anything moves
        switch_placement(layer, optimizer if ctx.rank == 0 else None, [placed_layer_placement(cfg, ctx, PLAN_B)], ctx)
        one_sided = "no error"
    except ValueError as error:
        one_sided = str(error)
    before = _layer_pass(layer, x, g, ctx)
    state_before, same_before = _expert_state(layer, optimizer, PLAN_A)
    layer.zero_grad(set_to_none=True)
    moved = switch_placement(layer, optimizer, [placed_layer_placement(cfg, ctx, PLAN_B)], ctx)
    after = _layer_pass(layer, x, g, ctx)
    state_after, same_after = _expert_state(layer, optimizer, PLAN_B)
    before.update(state_before)
    after.update(state_after)
    return {"max_abs_diff": {k: float((after[k] - before[k]).abs().max()) for k in before},
            "replicas_equal": same_before and same_after, "moved": moved, "one_sided": one_sided,
            "logical_after": list(layer.experts.logical_ids)}


def placed_layer_placement(cfg: MoEConfig, ctx, phy2log: list[int]) -> ExpertPlacement:
    return ExpertPlacement(phy2log_P=torch.tensor(phy2log), num_experts=cfg.num_experts, ep_size=ctx.ep_size)


# ---------------------------------------------------------------------------------------------
# Training across a switch.

MODEL = ModelConfig(vocab_size=32, hidden=16, num_layers=2, num_heads=2, max_seq_len=16,
                    moe=MoEConfig(num_experts=4, expert_hidden=8, num_shared_experts=1, alignment=4,
                                  router=RouterConfig(scoring="sigmoid", topk=2)))
TRAIN_A = [[0, 1, 2, 3, 0, 1], [3, 2, 1, 0, 2, 2]]
TRAIN_B = [[3, 3, 2, 0, 1, 0], [0, 1, 2, 3, 1, 2]]


def _model(ctx, plan):
    placements = placements_from_phy2log(torch.tensor(plan), num_experts=4, ep_size=ctx.ep_size)
    torch.manual_seed(0)
    dispatcher = AllToAllDispatcher(num_experts=len(plan[0]), group=ctx.ep_group, alignment=4)
    model = TinyDeepSeek(MODEL, dispatcher, ep_rank=ctx.ep_rank, seed=0, placement=placements).to(ctx.device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), placements


def _train(model, optimizer, ctx, steps) -> list[float]:
    """train.py's step: forward, backward, gradient reduction, AdamW, router bias update."""
    losses = []
    for step in steps:
        tokens = torch.randint(0, MODEL.vocab_size, (2, 9),
                               generator=torch.Generator().manual_seed(step * 10 + ctx.rank)).to(ctx.device)
        loss = model.loss(tokens)
        loss.backward()
        average_gradients(model, ctx)
        sync_replica_gradients(model, ctx)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        for moe, load_E in zip(model.moe_layers, global_expert_load(model, ctx)):
            moe.router.update_bias(load_E)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / ctx.world_size)
    return losses


def _logical_experts(model, optimizer, plan) -> tuple[list[dict], bool]:
    states, same = [], True
    for moe, phy2log in zip(model.moe_layers, plan):
        state, ok = _expert_state(moe, optimizer, phy2log)
        states.append(state)
        same &= ok
    return states, same


def _start_on(ctx, plan, model_sd, optimizer_sd, logical) -> tuple:
    """A model built on ``plan`` whose dense state is ``model_sd``/``optimizer_sd`` and whose slots
    hold their logical experts' tensors (indexed here, not moved by ``switch_placement``)."""
    model, optimizer, placements = _model(ctx, plan)
    model_sd, optimizer_sd = copy.deepcopy(model_sd), copy.deepcopy(optimizer_sd)
    index = {id(p): i for i, p in enumerate(model.parameters())}
    names = {id(p): n for n, p in model.named_parameters()}
    for moe, placement, state in zip(model.moe_layers, placements, logical):
        ids = placement.local_experts(ctx.ep_rank)
        for short, p in (("w13", moe.experts.w13_EDI2), ("w2", moe.experts.w2_EID)):
            model_sd[names[id(p)]] = state[f"{short}.weight"][ids].clone()
            for kind in ("exp_avg", "exp_avg_sq"):
                optimizer_sd["state"][index[id(p)]][kind] = state[f"{short}.{kind}"][ids].clone()
    model.load_state_dict(model_sd)
    optimizer.load_state_dict(optimizer_sd)
    return model, optimizer


def check_train(ctx) -> dict:
    model, optimizer, _ = _model(ctx, TRAIN_A)
    first = _train(model, optimizer, ctx, range(1, 3))
    logical, same_a = _logical_experts(model, optimizer, TRAIN_A)
    model_sd, optimizer_sd = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    new = placements_from_phy2log(torch.tensor(TRAIN_B), num_experts=4, ep_size=ctx.ep_size)
    moved = switch_placement(model, optimizer, new, ctx)
    switched = _train(model, optimizer, ctx, range(3, 6))
    final_switched, same_b = _logical_experts(model, optimizer, TRAIN_B)

    fresh_model, fresh_optimizer = _start_on(ctx, TRAIN_B, model_sd, optimizer_sd, logical)
    fresh = _train(fresh_model, fresh_optimizer, ctx, range(3, 6))
    final_fresh, _ = _logical_experts(fresh_model, fresh_optimizer, TRAIN_B)
    dense_equal = all(torch.equal(a, b) for a, b in zip(model.dense_parameters(), fresh_model.dense_parameters()))
    experts_equal = all(torch.equal(a[k], b[k]) for a, b in zip(final_switched, final_fresh) for k in a
                        if not k.endswith(".grad"))
    return {"first": first, "switched": switched, "fresh": fresh, "moved": moved, "replicas_equal": same_a and same_b,
            "dense_equal": dense_equal, "experts_equal": experts_equal}


def placement_suite() -> dict:
    ctx = init_parallel(parallel_config())
    try:
        return {"replicas": check_replicas(ctx), "switch": check_switch(ctx), "train": check_train(ctx)}
    finally:
        dist.destroy_process_group()
