"""The DeepEP facade's low-latency API exercised the way DeepEP's test_low_latency.py does, inside
each worker process, against a layout computed here from every rank's routes."""

from __future__ import annotations

import torch
import torch.distributed as dist
from gpus import parallel_config

from ep_runtime.compat import deep_ep
from ep_runtime.parallel import init_parallel
from kernels.quant.reference import cast_back, per_token_cast

MODES = {"bf16": dict(use_fp8=False), "fp8": dict(use_fp8=True),
         "fp8-round": dict(use_fp8=True, round_scale=True),
         "fp8-ue8m0": dict(use_fp8=True, round_scale=True, use_ue8m0=True)}


def gathered(t: torch.Tensor, rows: int, fill, group, device: torch.device) -> torch.Tensor:
    """``[W, rows, ...]`` on the CPU: every rank's ``t`` padded to ``rows`` rows with ``fill``."""
    padded = torch.full((rows, *t.shape[1:]), fill, dtype=t.dtype, device=device)
    padded[:t.shape[0]] = t
    out = padded.new_empty((dist.get_world_size(group) * rows, *padded.shape[1:]))
    dist.all_gather_into_tensor(out, padded, group=group)
    return out.view(-1, *padded.shape).cpu()


def unpack_scales(sf: torch.Tensor) -> torch.Tensor:
    """``[N, G]`` float32 from float32 scales or int32 words of 4 UE8M0 exponents (low byte first)."""
    if sf.dtype == torch.float32:
        return sf
    return (sf.contiguous().view(torch.uint8).to(torch.int32) << 23).view(torch.float32)


def low_latency_checks(num_tokens: int, hidden: int, num_experts: int, topk: int, max_tokens: int) -> list[str]:
    """Dispatch in every format, with and without the hook, and combine (plain, ``out``, zero-copy);
    returns the names of the checks that held (the test wants all of them)."""
    ctx = init_parallel(parallel_config())
    rank, world, group, device = ctx.rank, ctx.world_size, ctx.ep_group, ctx.device
    local = num_experts // world
    buffer = deep_ep.Buffer(group, num_rdma_bytes=deep_ep.Buffer.get_low_latency_rdma_size_hint(
        max_tokens, hidden, world, num_experts), low_latency_mode=True, num_qps_per_rank=local, explicitly_destroy=True)
    g = torch.Generator().manual_seed(rank)
    tokens = num_tokens - rank  # ranks dispatch different numbers of tokens, all at most max_tokens
    scores = torch.rand(tokens, num_experts, generator=g) + 1
    topk_idx = scores.topk(topk, dim=1).indices.to(deep_ep.topk_idx_t)
    topk_idx[torch.rand(tokens, topk, generator=g) < 0.2] = -1
    topk_weights = torch.rand(tokens, topk, generator=g)
    x_rank = torch.full((tokens, hidden), rank - 128.0, dtype=torch.bfloat16)  # DeepEP's test's rows
    x_rank[:, -128:] = torch.arange(tokens, dtype=torch.bfloat16)[:, None]
    x_rand = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    all_idx = gathered(topk_idx, max_tokens, -1, group, device)  # the reference works on the CPU, the facade on device
    idx_dev, weights_dev = topk_idx.to(device), topk_weights.to(device)
    factor_E = 1 + torch.arange(num_experts) / num_experts  # each expert scales its rows by its own factor
    passed = []

    def check(name: str, ok: bool) -> None:
        if ok:
            passed.append(name)

    # What every local expert receives, from every source rank (tokens ascending).
    want_tokens = [[(all_idx[j] == rank * local + i).any(1).nonzero().flatten() for j in range(world)]
                   for i in range(local)]
    want_count = torch.tensor([sum(t.numel() for t in per_source) for per_source in want_tokens], dtype=torch.int32)
    for x_name, x in (("rank", x_rank), ("rand", x_rand)):
        all_x = gathered(x, max_tokens, 0, group, device)
        for mode, flags in MODES.items():
            for hooked in (False, True):
                tag = f"{x_name} {mode}{' hook' if hooked else ''}"
                stats = torch.zeros(local, dtype=torch.int32, device=device)
                for _ in range(2):  # the statistics accumulate over calls
                    recv_x, recv_count, handle, event, hook = buffer.low_latency_dispatch(
                        x.to(device), idx_dev, max_tokens, num_experts, cumulative_local_expert_recv_stats=stats,
                        async_finish=not hooked, return_recv_hook=hooked, **flags)
                    hook() if hooked else event.current_stream_wait()
                check(f"{tag}: hook", callable(hook) if hooked else hook is None)
                if flags["use_fp8"]:
                    check(f"{tag}: scales column-major", recv_x[1].stride()[1:] == (1, world * max_tokens)
                          and recv_x[1].dtype == (torch.int32 if "ue8m0" in mode else torch.float32))
                recv_x = tuple(t.cpu() for t in recv_x) if flags["use_fp8"] else recv_x.cpu()
                recv_count, stats = recv_count.cpu(), stats.cpu()
                src_info, layout_range, *sizes = (t.cpu() if isinstance(t, torch.Tensor) else t for t in handle)
                check(f"{tag}: counts", torch.equal(recv_count, want_count) and torch.equal(stats, 2 * want_count)
                      and sizes == [max_tokens, hidden, num_experts])
                begin = layout_range >> 32
                check(f"{tag}: layout", torch.equal(layout_range & (2**32 - 1), torch.tensor(
                    [[t.numel() for t in per_source] for per_source in want_tokens]))
                    and torch.equal(begin, (layout_range & (2**32 - 1)).cumsum(1) - (layout_range & (2**32 - 1))))
                check(f"{tag}: src_info", all(torch.equal(src_info[i, int(begin[i, j]):int(begin[i, j]) + t.numel()],
                                                          t.to(torch.int32))
                                              for i, per_source in enumerate(want_tokens)
                                              for j, t in enumerate(per_source)))
                want_rows = [torch.cat([all_x[j, t] for j, t in enumerate(per_source)]) for per_source in want_tokens]
                if flags["use_fp8"]:
                    data, scales = recv_x
                    rows_ok = True
                    for i, want in enumerate(want_rows):
                        n = want.shape[0]
                        q, sf = per_token_cast(want, round_sf=flags.get("round_scale", False),
                                               pack_sf=flags.get("use_ue8m0", False))
                        got_sf = scales[i, :n].contiguous()
                        got_sf = got_sf.view(torch.uint8) if "ue8m0" in mode else got_sf
                        back = cast_back(data[i, :n], unpack_scales(scales[i, :n]), block=(1, 128),
                                         out_dtype=torch.float32)
                        error_ok = bool(((back - want.float()).abs() <= want.float().abs() / 16 +  # e4m3's rounding
                                         unpack_scales(scales[i, :n]).repeat_interleave(128, 1) / 2**9).all())
                        rows_ok &= torch.equal(data[i, :n].view(torch.uint8), q.view(torch.uint8)) \
                            and torch.equal(got_sf, sf) and error_ok
                    check(f"{tag}: rows", rows_ok)
                    simulated = cast_back(data.view(-1, hidden), unpack_scales(scales.reshape(-1, scales.shape[2])),
                                          block=(1, 128)).view(data.shape)
                else:
                    check(f"{tag}: rows", all(torch.equal(recv_x[i, :w.shape[0]], w) for i, w in enumerate(want_rows)))
                    simulated = recv_x
                if x_name == "rank" and not flags.get("round_scale"):  # DeepEP's: rank j's block holds j - 128
                    by_source = True  # and its last column the token index that src_info gives
                    for i in range(local):
                        for j, (b, n) in enumerate(zip(begin[i].tolist(), (layout_range[i] & (2**32 - 1)).tolist())):
                            block = simulated[i, b:b + n]
                            by_source &= bool((block[:, :-128] == j - 128).all()) \
                                and torch.equal(block[:, -1], src_info[i, b:b + n].to(torch.bfloat16))
                    check(f"{tag}: by source", by_source)

                y = (simulated.float() * factor_E[rank * local:(rank + 1) * local, None, None]).to(torch.bfloat16)
                mine = simulated_rows(x, flags)
                want = torch.zeros(tokens, hidden)
                for k in range(topk):  # float32 in route order, as combine sums
                    e = topk_idx[:, k]
                    term = (mine.float() * factor_E[e.clamp(min=0), None]).to(torch.bfloat16).float()
                    want += torch.where(e[:, None] >= 0, topk_weights[:, k, None] * term, 0.0)
                y = y.to(device)
                combined, event, hook = buffer.low_latency_combine(y, idx_dev, weights_dev, handle,
                                                                   async_finish=not hooked, return_recv_hook=hooked)
                hook() if hooked else event.current_stream_wait()
                check(f"{tag}: combine", torch.equal(combined.cpu(), want.to(torch.bfloat16)) if device.type == "cpu"
                      else torch.allclose(combined.cpu().float(), want, rtol=1e-2, atol=1e-2))  # GPU: a kernel's sum
                out = torch.empty_like(combined)
                buffer.get_next_low_latency_combine_buffer(handle)[:] = y
                again, _, _ = buffer.low_latency_combine(torch.zeros_like(y), idx_dev, weights_dev, handle,
                                                         zero_copy=True, out=out)
                check(f"{tag}: zero-copy out", again.data_ptr() == out.data_ptr() and torch.equal(again, combined))
    passed += error_checks(buffer, x_rand.to(device), idx_dev, weights_dev, max_tokens, num_experts, group)
    buffer.destroy()
    dist.destroy_process_group()
    return passed


def simulated_rows(x: torch.Tensor, flags: dict) -> torch.Tensor:
    """``x`` as an expert sees it: bf16, or cast to e4m3 and back as dispatch casts it."""
    if not flags["use_fp8"]:
        return x
    return cast_back(*per_token_cast(x, round_sf=flags.get("round_scale", False)), block=(1, 128))


def error_checks(buffer, x, topk_idx, topk_weights, max_tokens: int, num_experts: int, group) -> list[str]:
    """Bad arguments, each named (every rank alike: the errors come before any collective)."""
    passed = []
    _, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, max_tokens, num_experts, use_fp8=False)
    rows = torch.zeros(num_experts // dist.get_world_size(group), dist.get_world_size(group) * max_tokens, x.shape[1],
                       dtype=torch.bfloat16, device=x.device)
    past = topk_idx.clone()
    past[0, 0] = num_experts
    cases = {  # name: (call, exception, the message's start)
        "too many tokens": (lambda: buffer.low_latency_dispatch(x, topk_idx, x.shape[0] - 1, num_experts),
                            ValueError, "x: expected at most num_max_dispatch_tokens_per_rank"),
        "hidden for fp8": (lambda: buffer.low_latency_dispatch(x[:, :384], topk_idx, max_tokens, num_experts),
                           ValueError, "x: expected hidden a multiple of 512"),
        "ue8m0 unrounded": (lambda: buffer.low_latency_dispatch(x, topk_idx, max_tokens, num_experts, use_ue8m0=True),
                            ValueError, "use_ue8m0: expected round_scale=True"),
        "hook and async": (lambda: buffer.low_latency_dispatch(x, topk_idx, max_tokens, num_experts, async_finish=True,
                                                               return_recv_hook=True),
                           ValueError, "async_finish, return_recv_hook: expected at most one"),
        "stats dtype": (lambda: buffer.low_latency_dispatch(
            x, topk_idx, max_tokens, num_experts,
            cumulative_local_expert_recv_stats=torch.zeros(rows.shape[0], device=x.device)),
            TypeError, "cumulative_local_expert_recv_stats: expected dtype torch.int32"),
        "wait stats": (lambda: buffer.low_latency_dispatch(
            x, topk_idx, max_tokens, num_experts, dispatch_wait_recv_cost_stats=torch.zeros(2, dtype=torch.int64,
                                                                                            device=x.device)),
            NotImplementedError, "dispatch_wait_recv_cost_stats:"),
        "logfmt": (lambda: buffer.low_latency_combine(rows, topk_idx, topk_weights, handle, use_logfmt=True),
                   NotImplementedError, "use_logfmt:"),
        "combine rows": (lambda: buffer.low_latency_combine(rows[:, 1:], topk_idx, topk_weights, handle),
                         ValueError, "x: expected shape"),
        "combine weights": (lambda: buffer.low_latency_combine(rows, topk_idx, topk_weights[:, 1:], handle),
                            ValueError, "topk_weights: expected shape"),
        "out shape": (lambda: buffer.low_latency_combine(rows, topk_idx, topk_weights, handle,
                                                         out=rows[0, :1]),
                      ValueError, "out: expected shape"),
        "zero-copy of another shape": (lambda: deep_ep.Buffer(group).low_latency_combine(
            rows, topk_idx, topk_weights, handle, zero_copy=True), ValueError, "zero_copy: expected rows written"),
        "shrink": (lambda: deep_ep.Buffer(group, low_latency_mode=True, enable_shrink=True),
                   NotImplementedError, "enable_shrink:"),
    }
    if x.device.type == "cpu":  # on a GPU a device-side assert, which ends the process
        cases["id past the experts"] = (lambda: buffer.low_latency_dispatch(x, past, max_tokens, num_experts),
                                        ValueError, "topk_idx: expected entries in -1 or ")
    for name, (call, error, message) in cases.items():
        try:
            call()
        except error as raised:
            if str(raised).startswith(message):
                passed.append(f"error: {name}")
    return passed
