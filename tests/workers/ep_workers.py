"""Functions run inside spawned worker processes by the multi-process runtime tests."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from gpus import parallel_config

from moe_spec import F64, RouterSpec, moe_layer, params_of, scaled_error

from ep_runtime.compat import deep_ep as deep_ep_facade
from ep_runtime.config import MoEConfig, RouterConfig
from ep_runtime.dispatch import DeepEPDispatcher, make_dispatcher
from ep_runtime.moe import MoELayer
from ep_runtime.parallel import init_parallel, single_process

TOKENS, HIDDEN = 24, 32


def moe_config(routing: str, fp8: bool, dispatcher: str = "all_to_all") -> MoEConfig:
    # hidden 32 < one FP8 group: a ragged group; alignment 4 gives padding rows.
    return MoEConfig(num_experts=8, expert_hidden=16, num_shared_experts=1, alignment=4,
                     dispatch_format="e4m3" if fp8 else "bf16",
                     dispatcher=dispatcher, max_tokens_per_rank=TOKENS,
                     router=RouterConfig(scoring="sigmoid", topk=2 if routing != "skewed" else 1,
                                         num_groups=2, topk_groups=2))


def masked_routes(x_D: torch.Tensor) -> set[int]:
    """The routes the "masked" case drops for a token: the second where x[0] > 0, all where x[1] > 0.8."""
    return {0, 1} if x_D[1] > 0.8 else {1} if x_D[0] > 0 else set()


def build_layer(cfg: MoEConfig, ctx, routing: str) -> MoELayer:
    torch.manual_seed(1234)
    if cfg.dispatcher == "deepep" and ctx.ep_group is not None:  # the adapter over ep-runtime's facade of DeepEP
        dispatcher = DeepEPDispatcher(num_experts=cfg.num_experts, group=ctx.ep_group, alignment=cfg.alignment,
                                      fp8=cfg.dispatch_format == "e4m3", buffer_api=deep_ep_facade)
    else:
        dispatcher = make_dispatcher(cfg, ctx)
    layer = MoELayer(cfg, HIDDEN, dispatcher, ep_rank=ctx.ep_rank, seed=7).to(ctx.device)
    if routing == "skewed":  # every token to expert 5
        layer.router.bias_E[5] = 100.0
    if routing == "masked":  # some routes masked, and whole tokens without any route
        forward = layer.router.forward

        def masked(x_TD, **options):  # chosen by the token's values, so EP and single process mask alike
            r = forward(x_TD, **options)  # no placement: the physical routes are the logical ones
            idx = r.topk_idx_TK.clone()
            for t in range(x_TD.shape[0]):
                idx[t, sorted(masked_routes(x_TD[t]))] = -1
            counts = torch.bincount(idx[idx >= 0], minlength=cfg.num_experts).int()
            return dataclasses.replace(r, topk_idx_TK=idx, physical_idx_TK=idx, counts_E=counts,
                                       topk_weights_TK=r.topk_weights_TK * (idx >= 0))

        layer.router.forward = masked
    return layer


def inputs(rank: int, device: torch.device):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(TOKENS, HIDDEN, generator=g).to(device), torch.randn(TOKENS, HIDDEN, generator=g).to(device)


def forward_backward(layer: MoELayer, x_TD, g_TD):
    x_TD = x_TD.clone().requires_grad_()
    out = layer(x_TD[None])[0]
    (out * g_TD).sum().backward()
    return out.detach(), x_TD.grad


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-30))


def _grad(p: torch.nn.Parameter) -> torch.Tensor:
    """An expert no token reached has no gradient: zeros."""
    return p.grad if p.grad is not None else torch.zeros_like(p)


def case_name(routing: str, fp8: bool, dispatcher: str) -> str:
    return f"{routing}{'-fp8' if fp8 else ''}/{dispatcher}"


def spec_errors(layer: MoELayer, ep, x_TD, g_TD, out, grad_x, routing: str) -> dict[str, float]:
    """This rank's output and gradients against the specification (``moe_spec``) of its tokens
    (``ep``: the EP group),
    with every rank's experts gathered; the routed experts' gradients are the spec's summed over
    the EP group (every rank's tokens reach them). ``moe_spec.scaled_error`` per quantity."""
    w13, w2 = layer.experts.w13_EDI2.detach(), layer.experts.w2_EID.detach()
    world = layer.ep_size
    if world > 1:
        parts13, parts2 = [torch.empty_like(w13) for _ in range(world)], [torch.empty_like(w2) for _ in range(world)]
        dist.all_gather(parts13, w13.contiguous(), group=ep)
        dist.all_gather(parts2, w2.contiguous(), group=ep)
        w13, w2 = torch.cat(parts13), torch.cat(parts2)
    p = params_of(layer, w13, w2)
    x = x_TD.detach().cpu().to(F64).requires_grad_()
    want, _ = moe_layer(x, p, RouterSpec.of(layer.cfg.router), wire=layer.cfg.dispatch_format,
                        masked=masked_routes if routing == "masked" else None)
    (want * g_TD.cpu().to(F64)).sum().backward()
    grads = {name: t.grad if t.grad is not None else torch.zeros_like(t) for name, t in p.leaves().items()}
    expert_grads = torch.stack([torch.cat([grads[f"expert{e}.gate"], grads[f"expert{e}.up"]], 1)
                                for e in range(w13.shape[0])])
    down_grads = torch.stack([grads[f"expert{e}.down"] for e in range(w13.shape[0])])
    if world > 1:  # on the group's device: NCCL reduces no CPU tensors
        device = w13.device
        expert_grads, down_grads = expert_grads.to(device), down_grads.to(device)
        dist.all_reduce(expert_grads, group=ep)
        dist.all_reduce(down_grads, group=ep)
        expert_grads, down_grads = expert_grads.cpu(), down_grads.cpu()
    mine = slice(layer.ep_rank * layer.experts.w13_EDI2.shape[0], (layer.ep_rank + 1) * layer.experts.w13_EDI2.shape[0])
    shared13 = layer.shared.w13.weight.grad.T
    errors = {"out": scaled_error(out.cpu(), want), "grad_x": scaled_error(grad_x.cpu(), x.grad),
              "w13": scaled_error(_grad(layer.experts.w13_EDI2).cpu(), expert_grads[mine]),
              "w2": scaled_error(_grad(layer.experts.w2_EID).cpu(), down_grads[mine]),
              "shared.gate": scaled_error(shared13[:, :shared13.shape[1] // 2].cpu(), grads["shared.gate"]),
              "shared.up": scaled_error(shared13[:, shared13.shape[1] // 2:].cpu(), grads["shared.up"]),
              "shared.down": scaled_error(layer.shared.w2.weight.grad.T.cpu(), grads["shared.down"])}
    if layer.cfg.router.topk > 1:  # one normalized route weighs 1: no router gradient to compare
        errors["router"] = scaled_error(layer.router.weight.grad.cpu(), grads["router"])
    return errors


def ep_matches_single_process(cases: list[tuple[str, bool, str]], ranks_per_node: int | None = None) -> dict:
    """For each (routing, fp8, dispatcher) case: run the layer over the EP group, compare this
    rank's outputs and gradients with the specification (``spec_errors``), gather everything on every
    rank, and compare with one process holding all experts over all ranks' tokens (on this rank's
    device: gloo on CPU, NCCL on GPU). Returns per case and quantity the largest absolute error
    relative to the largest expected magnitude (``single``) and the scaled errors against the
    specification (``spec``)."""
    ctx = init_parallel(parallel_config(ranks_per_node=ranks_per_node))
    world = ctx.world_size
    errors = {}
    for routing, fp8, dispatcher in cases:
        cfg = moe_config(routing, fp8, dispatcher)
        layer = build_layer(cfg, ctx, routing)
        x, g = inputs(ctx.rank, ctx.device)
        out, grad_x = forward_backward(layer, x, g)
        against_spec = spec_errors(layer, ctx.ep_group, x, g, out, grad_x, routing)
        router_grad = layer.router.weight.grad.clone()
        dist.all_reduce(router_grad)  # the router is replicated: its gradient is the sum over ranks
        gathered = {}
        for name, t in (("out", out), ("grad_x", grad_x), ("grad_w13", _grad(layer.experts.w13_EDI2)),
                        ("grad_w2", _grad(layer.experts.w2_EID)), ("load", layer.load_E)):
            parts = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(parts, t.contiguous())
            gathered[name] = torch.cat(parts)
        gathered["load"] = gathered["load"].view(world, -1).sum(0)

        ref = build_layer(cfg, single_process(ctx.device), routing)
        pairs = [inputs(r, ctx.device) for r in range(world)]
        ref_out, ref_grad_x = forward_backward(ref, torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs]))
        expected = {"out": ref_out, "grad_x": ref_grad_x, "grad_w13": _grad(ref.experts.w13_EDI2),
                    "grad_w2": _grad(ref.experts.w2_EID), "load": ref.load_E}
        case = case_name(routing, fp8, dispatcher)
        expected["router"], gathered["router"] = ref.router.weight.grad, router_grad
        errors[case] = {k: _relative_error(gathered[k], expected[k]) for k in expected}
        errors[case]["nonzero_out"] = bool(gathered["out"].abs().sum() > 0)
        errors[case] = {"single": errors[case], "spec": against_spec}
    dist.destroy_process_group()
    return errors
