"""The dispatcher conformance suite, run inside each worker process: every backend against the
definition of dispatch + combine (and its gradients), and against each other."""

from __future__ import annotations

import traceback

import torch
import torch.distributed as dist
from gpus import parallel_config

from ep_runtime.compat import deep_ep as deep_ep_facade
from ep_runtime.dispatch import AllToAllDispatcher, DeepEPDispatcher, HierarchicalDispatcher, NVLinkDispatcher
from ep_runtime.parallel import init_parallel

HIDDEN = 160  # not a multiple of the FP8 group (128): a ragged last group
TOPK = 4


FP8_COMBINE = ("all_to_all", "nvlink", "hierarchical")  # the backends with an FP8 combine
FP4_DISPATCH = ("all_to_all",)  # the backends that carry e2m1 tokens (the others refuse them in the config)
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def carries(backend: str, fp8: bool | str) -> bool:
    """Whether ``backend`` runs the payload ``fp8`` names (see :func:`make_dispatcher`)."""
    return (fp8 != "combine" or backend in FP8_COMBINE) and (fp8 != "e2m1" or backend in FP4_DISPATCH)


def _error_of(error_type: type[Exception], call) -> str:
    """The message of the ``error_type`` that ``call()`` raises, or "no error"; the process group is
    torn down either way."""
    try:
        call()
    except error_type as error:
        return str(error)
    finally:
        dist.destroy_process_group()
    return "no error"


def file_heap_across_hosts() -> str:
    """A ``FileHeap`` whose rank 1 cannot see rank 0's shared-memory file (as on another host):
    the error each rank raises."""
    from unittest import mock

    from ep_runtime.dispatch import symmetric

    dist.init_process_group("gloo")
    exists = symmetric.os.path.exists
    hidden = (lambda path: exists(path) and not path.endswith("_0")) if dist.get_rank() == 1 else exists

    def map_heap():
        with mock.patch.object(symmetric.os.path, "exists", hidden):
            symmetric.FileHeap(1024, dist.group.WORLD)

    return _error_of(RuntimeError, map_heap)


def nvlink_without_routes() -> str:
    """The error of an ``nvlink`` dispatch of tokens with no route columns (K = 0)."""
    ctx = init_parallel(parallel_config())
    dispatcher = make_dispatcher("nvlink", ctx, 4 * ctx.world_size, False, 8)
    return _error_of(ValueError, lambda: dispatcher.dispatch(
        torch.randn(3, HIDDEN, device=ctx.device), torch.empty(3, 0, dtype=torch.int64, device=ctx.device),
        torch.empty(3, 0, device=ctx.device)))


def one_rank_with_bad_routes() -> str:
    """The error of each rank's ``all_to_all`` dispatch when rank 0's routes name an expert out of
    range and the other ranks' are valid."""
    ctx = init_parallel(parallel_config())
    num_experts = 4 * ctx.world_size
    dispatcher = make_dispatcher("all_to_all", ctx, num_experts, False, 8)
    idx, weights = routing("balanced", ctx.rank, 4, num_experts, ctx.device)
    if ctx.rank == 0:
        idx[1, 0] = num_experts
    return _error_of(ValueError, lambda: dispatcher.dispatch(torch.randn(4, HIDDEN, device=ctx.device), idx, weights))


def deepep_combine_of_float32_rows() -> str:
    """The error of a ``deepep`` combine of float32 expert rows where the Buffer is DeepEP's own
    (bf16 rows only; the facade stands in for it)."""
    ctx = init_parallel(parallel_config())
    dispatcher = make_dispatcher("deepep", ctx, 4 * ctx.world_size, False, 8)
    dispatcher.bf16_only = True  # as over deep_ep itself
    x_TD = torch.randn(3, HIDDEN, device=ctx.device, dtype=torch.bfloat16)
    topk_idx_TK = torch.tensor([[0, 1], [2, -1], [3, 0]], device=ctx.device)

    def dispatch_and_combine_float32():
        y_PD, _, handle = dispatcher.dispatch(x_TD, topk_idx_TK, torch.rand(3, 2, device=ctx.device))
        dispatcher.combine(y_PD.float(), handle)

    return _error_of(TypeError, dispatch_and_combine_float32)


def make_dispatcher(backend: str, ctx, num_experts: int, fp8: bool | str, max_tokens: int):
    """``fp8``: False, True (FP8 dispatch), "combine" (FP8 dispatch and combine) or "e2m1" (FP4
    dispatch, ``FP4_DISPATCH`` only)."""
    if backend == "all_to_all":
        wire = "e2m1" if fp8 == "e2m1" else "e4m3" if fp8 else "bf16"
        return AllToAllDispatcher(num_experts=num_experts, group=ctx.ep_group, alignment=8, dispatch_format=wire,
                                  fp8_combine=fp8 == "combine")
    fp8, fp8_combine = bool(fp8), fp8 == "combine"
    if backend == "deepep":  # the adapter, over ep-runtime's facade of DeepEP's Buffer
        return DeepEPDispatcher(num_experts=num_experts, group=ctx.ep_group, alignment=8, fp8=fp8,
                                buffer_api=deep_ep_facade)
    if backend == "hierarchical":
        return HierarchicalDispatcher(num_experts=num_experts, group=ctx.ep_group, rail_group=ctx.ep_rail_group,
                                      node_group=ctx.ep_node_group, device=ctx.device, max_tokens_per_rank=max_tokens,
                                      alignment=8, fp8=fp8, fp8_combine=fp8_combine)
    return NVLinkDispatcher(num_experts=num_experts, group=ctx.ep_group, device=ctx.device,
                            max_tokens_per_rank=max_tokens, alignment=8, fp8=fp8, fp8_combine=fp8_combine)


def routing(case: str, rank: int, num_tokens: int, num_experts: int, device):
    """(topk_idx_TK, topk_weights_TK) of one case; drawn per rank, distinct experts per token."""
    g = torch.Generator().manual_seed(1000 + rank)
    idx = torch.rand(num_tokens, num_experts, generator=g).argsort(1)[:, :TOPK]
    if case == "skewed":  # every token to expert 1, the other routes to odd experts: even ones get nothing
        others = torch.rand(num_tokens, num_experts // 2 - 1, generator=g).argsort(1)[:, :TOPK - 1] * 2 + 3
        idx = torch.cat([torch.ones(num_tokens, 1, dtype=torch.long), others], 1)
    if case == "masked":  # -1 routes, and whole tokens without any route
        idx[torch.rand(num_tokens, TOPK, generator=g) < 0.3] = -1
        idx[::5] = -1
    weights = torch.rand(num_tokens, TOPK, generator=g) * (idx >= 0)
    return idx.to(device), weights.to(device)


def _max_abs(t: torch.Tensor) -> float:
    return float(t.abs().max()) if t.numel() else 0.0


def expected(x_TD, idx_TK, weights_TK):
    """out[t] = sum over routes of w * (e + 1) * x[t]: what combine(dispatch) gives when expert e
    multiplies its rows by e + 1."""
    factor_TK = torch.where(idx_TK >= 0, idx_TK + 1, 0).double() * weights_TK.double()
    return (factor_TK.sum(1, keepdim=True) * x_TD.double()).to(x_TD.dtype)


def run_case(dispatcher, x_TD, idx_TK, weights_TK, first_expert: int):
    """dispatch -> expert e multiplies by e + 1 -> combine, forward and backward. Returns the
    output, both gradients and the tokens each local expert received (their first column)."""
    x_TD = x_TD.clone().requires_grad_()
    w_TK = weights_TK.clone().requires_grad_()
    x_PD, layout, handle = dispatcher.dispatch(x_TD, idx_TK, w_TK)
    ends = layout.offsets_E.tolist()
    starts = [0] + ends[:-1]
    factor_P = torch.zeros(x_PD.shape[0], dtype=x_PD.dtype, device=x_PD.device)
    rows_E = []
    for e, (s, n) in enumerate(zip(starts, layout.counts_E.tolist())):
        factor_P[s:s + n] = first_expert + e + 1
        rows_E.append(x_PD[s:s + n, 0].detach().clone())
    # Padding inside the segments is zero; rows past the last one (a static capacity's unused
    # rows) are unspecified.
    pad = torch.arange(x_PD.shape[0], device=x_PD.device) < (ends[-1] if ends else 0)
    for s, n in zip(starts, layout.counts_E.tolist()):
        pad[s:s + n] = False
    out_TD = dispatcher.combine(x_PD * factor_P[:, None], handle)
    g_TD = torch.linspace(-1, 1, out_TD.numel(), device=x_TD.device).view_as(out_TD)
    (out_TD * g_TD).sum().backward()
    return {"out": out_TD.detach(), "grad_x": x_TD.grad, "grad_w": w_TK.grad, "rows_E": rows_E,
            "padding_zero": bool((x_PD[pad] == 0).all())}


def conformance(cases: list[tuple[str, int, bool | str]], ranks_per_node: int, backends: tuple[str, ...]) -> dict:
    """For each (routing, tokens per rank, fp8) case (``fp8`` "combine": both ways as FP8, on the
    backends of ``FP8_COMBINE`` only) and backend (``all_to_all`` first): the
    largest error of out, grad_x and grad_w against the definition (exact arithmetic in float64);
    whether ``nvlink`` and ``deepep`` (the adapter, over ep-runtime's facade of DeepEP's Buffer)
    gave ``all_to_all``'s bits and rows per expert in the same order, and ``hierarchical`` (the
    EP group declared ``ranks_per_node`` ranks per node) the same rows per expert in some order;
    the overflow error's message; the errors for an expert out of range and for one named twice by
    a token (every rank's routes bad alike, so that no rank waits in a collective; ``nvlink`` on
    GPUs checks them on the device, where a failed check ends the process)."""
    assert backends[0] == "all_to_all", backends
    ctx = init_parallel(parallel_config(ranks_per_node=ranks_per_node))
    world = ctx.world_size
    num_experts = 4 * world
    results = {}
    max_tokens = max(t for _, t, _ in cases)
    dispatchers = {(backend, fp8): make_dispatcher(backend, ctx, num_experts, fp8, max_tokens)
                   for _, _, fp8 in cases for backend in backends if carries(backend, fp8)}
    for case, num_tokens, fp8 in cases:
        name = case_name(case, num_tokens, fp8)
        if case == "idle" and ctx.rank == 0:  # one rank with no tokens (it still receives)
            num_tokens = 0
        idx, weights = routing(case, ctx.rank, num_tokens, num_experts, ctx.device)
        g = torch.Generator().manual_seed(7 + ctx.rank)
        # Token t of rank r carries r * 1000 + t in column 0, so rows say where they came from.
        x = torch.randn(num_tokens, HIDDEN, generator=g).to(ctx.device)
        x[:, 0] = ctx.rank * 1000 + torch.arange(num_tokens, device=ctx.device)
        if fp8 == "e2m1":  # e2m1 magnitudes with a 6 in every 16-group: each group's scale is 1 up to its
            # float32 rounding (448 * 6 / 2688), so the cast errs by that rounding only
            grid = torch.tensor(E2M1_MAGNITUDES)
            signs = torch.randint(2, x.shape, generator=g) * 2 - 1
            x = (grid[torch.randint(len(grid), x.shape, generator=g)] * signs).to(ctx.device)
            x[:, 0], x[:, 1::16] = torch.arange(num_tokens, device=ctx.device) % 8 - 4, 6
        elif fp8:  # integers in [-7, 7] with a 7 in every 128-group: scale 7/448 = 2^-6, no cast error
            x = (x * 3).round().clamp(-7, 7)
            x[:, 0], x[:, 1], x[:, 128] = torch.arange(num_tokens, device=ctx.device) % 8 - 4, 7, -7
        want = expected(x, idx, weights)
        got = {}
        for backend in (b for b in backends if (b, fp8) in dispatchers):
            got[backend] = run_case(dispatchers[backend, fp8], x, idx, weights,
                                    first_expert=ctx.ep_rank * (num_experts // world))
        base = got["all_to_all"]
        same_bits = [got[b] for b in ("nvlink", "deepep") if b in got]
        same_sets = [got[b] for b in ("hierarchical",) if b in got]
        x_g = x.double()
        g_TD = torch.linspace(-1, 1, want.numel(), device=x.device).view_as(want).double()
        grad_w_want = torch.where(idx >= 0, idx + 1, 0).double() * (x_g * g_TD).sum(1, keepdim=True)
        factor = (torch.where(idx >= 0, idx + 1, 0).double() * weights.double()).sum(1, keepdim=True)
        grad_x_want = factor * g_TD
        scale = max(_max_abs(want), 1.0)
        results[name] = {
            backend: {"out": _max_abs(r["out"].double() - want.double()) / scale,
                      "grad_x": _max_abs(r["grad_x"].double() - grad_x_want),
                      "grad_w": _max_abs(r["grad_w"].double() - grad_w_want) / max(_max_abs(grad_w_want), 1.0),
                      "padding_zero": r["padding_zero"]}
            for backend, r in got.items()} | {
            "same_out": all(torch.equal(base["out"], r["out"]) for r in same_bits),
            "same_rows": all(torch.equal(p, q) for r in same_bits for p, q in zip(base["rows_E"], r["rows_E"])),
            "same_row_sets": all(torch.equal(p.sort().values, q.sort().values)
                                 for r in same_sets for p, q in zip(base["rows_E"], r["rows_E"])),
            "routes_received": sum(len(r) for r in base["rows_E"]),
        }
    x = torch.zeros(max_tokens + 1, HIDDEN, device=ctx.device)
    idx, weights = routing("balanced", ctx.rank, max_tokens + 1, num_experts, ctx.device)
    for backend in {"nvlink", "hierarchical"} & set(backends):
        try:
            dispatchers[backend, False].dispatch(x, idx, weights)
            results[f"overflow-{backend}"] = None
        except ValueError as e:
            results[f"overflow-{backend}"] = str(e)
    idx, weights = routing("balanced", ctx.rank, 4, num_experts, ctx.device)
    out_of_range, repeated = idx.clone(), idx.clone()
    out_of_range[1, 0], repeated[2, 1] = num_experts, idx[2, 0]
    for backend in backends:
        if backend == "nvlink" and ctx.device.type == "cuda":
            continue
        results[f"bad-routes-{backend}"] = []
        for bad in (out_of_range, repeated):
            try:
                dispatchers[backend, False].dispatch(x[:4], bad, weights)
                results[f"bad-routes-{backend}"].append(None)
            except ValueError as e:
                results[f"bad-routes-{backend}"].append(str(e))
    dist.destroy_process_group()
    return results


def case_name(case: str, num_tokens: int, fp8: bool | str) -> str:
    return f"{case}-{num_tokens}" + {False: "", True: "-fp8", "combine": "-fp8-combine", "e2m1": "-e2m1"}[fp8]


def nvlink_steady_state(tokens: int, hidden: int, num_experts: int, topk: int) -> dict:
    """On GPUs: the nvlink backend's dispatch + combine (FP8 both ways, and bf16) with CUDA's sync debug mode
    set to error (any host synchronization raises), then captured in a CUDA graph and replayed on
    new inputs copied into the captured ones; the replays must give the eager results."""
    ctx = init_parallel(parallel_config())
    results = {}
    for fp8 in (False, True):
        d = NVLinkDispatcher(num_experts=num_experts, group=ctx.ep_group, device=ctx.device,
                             max_tokens_per_rank=tokens, alignment=128, fp8=fp8, fp8_combine=fp8)
        static = {}

        def step(x_TD, idx_TK, w_TK):
            x_PD, layout, handle = d.dispatch(x_TD, idx_TK, w_TK)
            return d.combine(x_PD, handle)

        def inputs(seed):
            idx, w = routing("masked", ctx.rank + seed, tokens, num_experts, ctx.device)
            g = torch.Generator(device=ctx.device).manual_seed(seed * 31 + ctx.rank)
            return torch.randn(tokens, hidden, generator=g, device=ctx.device, dtype=torch.bfloat16), idx, w

        with torch.no_grad():
            for seed in range(3):  # warm-up: compiles kernels, allocates and rendezvouses the heap
                step(*inputs(seed))
            steady = [inputs(seed) for seed in (10, 11)]
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                eager = [step(*args) for args in steady]
                synced = None
            except RuntimeError as e:  # name the line of ours that synchronized
                ours = [f for f in traceback.extract_tb(e.__traceback__) if "/ep_runtime/" in f.filename
                        or "/kernels/" in f.filename]
                synced = f"{str(e).splitlines()[0]} at " + " <- ".join(f"{f.filename}:{f.lineno}" for f in ours[::-1])
            finally:
                torch.cuda.set_sync_debug_mode("default")
            static["x"], static["idx"], static["w"] = inputs(10)
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                step(static["x"], static["idx"], static["w"])  # warm-up on the capture stream
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static["out"] = step(static["x"], static["idx"], static["w"])
            replayed = []
            for args in steady:
                for name, t in zip(("x", "idx", "w"), args):
                    static[name].copy_(t)
                graph.replay()
                replayed.append(static["out"].clone())
            torch.cuda.synchronize()
        results["fp8" if fp8 else "bf16"] = {
            "host_sync": synced,
            "graph_matches_eager": synced is None and all(torch.equal(a, b) for a, b in zip(replayed, eager)),
            "nonzero": bool(replayed[0].abs().sum() > 0),
        }
    dist.destroy_process_group()
    return results


def groups_of_two_sizes(num_tokens: int) -> dict:
    """``nvlink`` over EP groups of half the ranks and of all of them in one process (over 2 ranks,
    the whole group alone: an EP group of one rank has no heap), a bf16 and an FP8 dispatcher over
    each, their heaps reserved in one pool (``nvlink.reserve_heaps``), each group's dispatch +
    combine after the other's, twice, FP8 dispatch in the second round: per group size, the
    largest error against the definition and whether the rows and outputs are ``all_to_all``'s bits
    over the same group."""
    from ep_runtime.dispatch.nvlink import reserve_heaps
    from ep_runtime.parallel import block_group

    ctx = init_parallel(parallel_config())
    world = ctx.world_size
    groups = {world // 2: block_group(world // 2)} if world > 2 else {}
    groups[world] = dist.group.WORLD
    made = {(size, fp8): NVLinkDispatcher(num_experts=4 * size, group=g, device=ctx.device,
                                          max_tokens_per_rank=num_tokens, alignment=8, fp8=fp8)
            for size, g in groups.items() for fp8 in (False, True)}
    reserve_heaps(made.values(), hidden=HIDDEN, topk=TOPK, dtype=torch.float32, over=dist.group.WORLD,
                  device=ctx.device)
    results = {}
    for fp8 in (False, True):
        for size, group in groups.items():
            rank = dist.get_rank(group)
            idx, weights = routing("balanced", ctx.rank, num_tokens, 4 * size, ctx.device)
            g = torch.Generator().manual_seed(11 + ctx.rank)
            x = (torch.randn(num_tokens, HIDDEN, generator=g) * 3).round().clamp(-7, 7).to(ctx.device)
            x[:, 1], x[:, 128] = 7, -7  # a scale of 2^-6 in both FP8 groups: no cast error
            reference = AllToAllDispatcher(num_experts=4 * size, group=group, alignment=8,
                                           dispatch_format="e4m3" if fp8 else "bf16")
            got = run_case(made[size, fp8], x, idx, weights, first_expert=rank * 4)
            base = run_case(reference, x, idx, weights, first_expert=rank * 4)
            want = expected(x, idx, weights)
            results[size, fp8] = {"out": _max_abs(got["out"].double() - want.double()) / max(_max_abs(want), 1.0),
                                  "same_out": torch.equal(got["out"], base["out"]),
                                  "same_rows": all(torch.equal(p, q) for p, q in zip(got["rows_E"], base["rows_E"])),
                                  "same_grad_x": torch.equal(got["grad_x"], base["grad_x"]),
                                  "pooled": type(made[size, fp8].heap).__name__}
    dist.destroy_process_group()
    return results


def pool_over_a_group_too_small() -> str:
    """The error of ``reserve_heaps`` over pairs of ranks for a dispatcher over all four (every
    rank's, none left waiting in the pool's collective)."""
    from ep_runtime.dispatch.nvlink import reserve_heaps
    from ep_runtime.parallel import block_group

    ctx = init_parallel(parallel_config())
    pair = block_group(2)
    dispatcher = NVLinkDispatcher(num_experts=8, group=dist.group.WORLD, device=ctx.device, max_tokens_per_rank=4)
    return _error_of(ValueError, lambda: reserve_heaps([dispatcher], hidden=HIDDEN, topk=TOPK, dtype=torch.float32,
                                                       over=pair, device=ctx.device))
