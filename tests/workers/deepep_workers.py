"""The DeepEP facade exercised the way DeepEP's intranode test does, inside each worker process."""

from __future__ import annotations

import torch
import torch.distributed as dist
from gpus import parallel_config

from ep_runtime.compat import deep_ep
from ep_runtime.parallel import init_parallel
from kernels.quant.reference import cast_back, per_token_cast


def facade_checks(num_tokens: int, hidden: int, num_experts: int, topk: int) -> list[str]:
    """Runs layout, dispatch (bf16, FP8, with and without top-k, worst-case padded, cached) and
    combine; returns the names of the checks that held (the test wants all of them)."""
    ctx = init_parallel(parallel_config())
    rank, world, device = ctx.rank, ctx.world_size, ctx.device
    group = ctx.ep_group
    buffer = deep_ep.Buffer(group, int(1e9), 0, explicitly_destroy=True)
    g = torch.Generator().manual_seed(rank)
    local = num_experts // world
    scores = torch.rand(num_tokens, num_experts, generator=g) + 1
    topk_idx = scores.topk(topk, dim=1).indices.to(deep_ep.topk_idx_t)
    topk_idx[torch.rand(num_tokens, topk, generator=g) < 0.2] = -1  # masked routes
    topk_idx, scores = topk_idx.to(device), scores.to(device)
    x = torch.full((num_tokens, hidden), float(rank), dtype=torch.bfloat16, device=device)
    x_rand = torch.randn(num_tokens, hidden, generator=g).to(device, torch.bfloat16)
    weights_rand = torch.randn(num_tokens, topk, generator=g).to(device)
    passed = []

    def check(name: str, ok: bool) -> None:
        if ok:
            passed.append(name)

    per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    want_in_rank = torch.zeros(num_tokens, world, dtype=torch.bool, device=device)
    for r in range(world):
        want_in_rank[:, r] = ((topk_idx >= r * local) & (topk_idx < (r + 1) * local)).any(1)
    want_expert = torch.stack([(topk_idx == e).sum() for e in range(num_experts)]).to(torch.int32)
    check("layout", per_rdma is None and in_rank.dtype == torch.bool and per_rank.dtype == torch.int32
          and torch.equal(in_rank, want_in_rank) and torch.equal(per_expert, want_expert)
          and torch.equal(per_rank, want_in_rank.sum(0, dtype=torch.int32)))
    gbl_expert = per_expert.clone()
    dist.all_reduce(gbl_expert, group=group)
    gbl_rank = per_rank.clone()
    dist.all_reduce(gbl_rank, group=group)

    q, sf = per_token_cast(x)
    for name, current in (("rand", x_rand), ("rank", x), ("fp8", (q, sf.T.contiguous().T))):
        for with_topk in (False, True):
            tag = f"{name}{'-topk' if with_topk else ''}"
            args = dict(x=current, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                        num_tokens_per_expert=per_expert, config=deep_ep.Config(24, 8, 256), async_finish=with_topk)
            if with_topk:
                args.update(topk_idx=topk_idx, topk_weights=weights_rand if name == "rand" else
                            torch.full((num_tokens, topk), float(rank), device=device))
            recv_x, recv_idx, recv_w, counts, handle, event = buffer.dispatch(**args)
            if with_topk:
                event.current_stream_wait()
            recv = cast_back(*recv_x, block=(1, 128)) if isinstance(recv_x, tuple) else recv_x
            n = recv.shape[0]
            check(f"{tag}: rows", n == int(gbl_rank[rank]))
            check(f"{tag}: counts", counts == gbl_expert.view(world, -1)[rank].tolist())
            prefix = handle.rank_prefix_matrix[:, rank].tolist()
            if name != "rand":  # rows grouped by source rank, in rank order: block i holds i
                starts = [0] + prefix[:-1]
                check(f"{tag}: by source", all(bool((recv[s:e].float() == i).all())
                                               for i, (s, e) in enumerate(zip(starts, prefix))))
            if with_topk:
                check(f"{tag}: local idx", bool(((recv_idx == -1) | ((recv_idx >= 0) & (recv_idx < local))).all())
                      and all(int((recv_idx == e).sum()) == counts[e] for e in range(local))
                      and bool((recv_w[recv_idx == -1] == 0).all()))
                worst = buffer.dispatch(**args, num_worst_tokens=num_tokens * world)
                worst_x = worst[0][0] if isinstance(worst[0], tuple) else worst[0]
                got_x = recv_x[0] if isinstance(recv_x, tuple) else recv_x
                check(f"{tag}: worst", worst[3] == [] and worst_x.shape[0] == num_tokens * world
                      and torch.equal(worst_x[:n].view(torch.uint8), got_x.view(torch.uint8))
                      and torch.equal(worst[1][:n], recv_idx) and bool((worst[1][n:] == -1).all())
                      and torch.equal(worst[2][:n], recv_w))
                padded = cast_back(*worst[0], block=(1, 128)) if isinstance(worst[0], tuple) else worst[0]
                check(f"{tag}: worst combine", torch.equal(buffer.combine(x=padded, handle=worst[4])[0],
                                                           buffer.combine(x=recv, handle=handle)[0]))
                again = buffer.dispatch(x=current, handle=worst[4])[0]
                again = again[0] if isinstance(again, tuple) else again
                check(f"{tag}: worst cached", torch.equal(again.view(torch.uint8), worst_x.view(torch.uint8)))
            else:
                cached, *rest = buffer.dispatch(x=current, handle=handle, previous_event=buffer.capture())
                cached = cast_back(*cached, block=(1, 128)) if isinstance(cached, tuple) else cached
                check(f"{tag}: cached", torch.equal(cached, recv) and rest[:4] == [None] * 4)
                bias = torch.randn(num_tokens, recv.shape[1], generator=torch.Generator().manual_seed(rank)).to(device)
                summed = buffer.combine(x=recv.float(), handle=handle)[0]  # float32 rows: the sum in float32
                check(f"{tag}: bias", torch.equal(buffer.combine(x=recv, handle=handle, bias=(bias, bias))[0],
                                                  (summed + bias + bias).to(recv.dtype)))
            combined, combined_w, _ = buffer.combine(x=recv, handle=handle, topk_weights=recv_w)
            source = x_rand if name == "rand" else x
            copies = in_rank.sum(1, keepdim=True).float()
            want = torch.where(copies > 0, source.float(), 0.0)
            check(f"{tag}: combine", torch.allclose(combined.float() / copies.clamp(min=1), want, atol=1e-2, rtol=1e-2))
            if with_topk:
                sent = args["topk_weights"] * (topk_idx >= 0)
                check(f"{tag}: combined weights", torch.allclose(combined_w, sent))
    base = dict(x=x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=topk_idx, topk_weights=weights_rand)
    t = int((topk_idx >= 0).any(1).nonzero()[0, 0])  # a token with a route, and that route's rank
    dropped = in_rank.clone()
    dropped[t, int(topk_idx[t][topk_idx[t] >= 0][0]) // local] = False
    past = topk_idx.clone()
    past[t, 0] = num_experts
    for name, bad, message in (  # every rank alike: the errors come before any collective
            ("id past the experts", dict(topk_idx=past), "topk_idx: expected entries in -1 or "),
            ("route the layout drops", dict(is_token_in_rank=dropped), f"is_token_in_rank: token {t} routes to"),
            ("counts of half the experts", dict(num_tokens_per_expert=per_expert[:num_experts // 2]),
             f"topk_idx: expected entries in -1 or [0, {num_experts // 2})"),
            ("alignment", dict(expert_alignment=0), "expert_alignment: expected a positive int"),
            ("weights' shape", dict(topk_weights=weights_rand[:, :1]), "topk_weights: expected shape")):
        try:
            buffer.dispatch(**(base | bad))
        except ValueError as error:
            check(f"error: {name}", str(error).startswith(message))
    _, _, _, _, handle, _ = buffer.dispatch(**base)
    try:
        buffer.combine(x=torch.zeros(sum(handle.recv_splits), hidden, dtype=torch.bfloat16, device=device),
                       handle=handle, topk_weights=torch.zeros(sum(handle.recv_splits) + 1, topk, device=device))
    except ValueError as error:
        check("error: combine weights' rows", str(error).startswith("topk_weights: expected the dispatch's"))
    buffer.destroy()
    dist.destroy_process_group()
    return passed
