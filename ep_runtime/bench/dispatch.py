"""``ep-runtime bench dispatch``: dispatch and combine alone, per backend, against the transports
they compete with, measured in the same run.

    ep-runtime bench dispatch                                    # 2 CPU workers, small shape
    torchrun --standalone --nproc-per-node 2 -m ep_runtime.bench.dispatch          # GPUs
    torchrun --standalone --nproc-per-node 2 -m ep_runtime.bench.dispatch --peer vdev
    torchrun --standalone --nproc-per-node 2 -m ep_runtime.bench.dispatch --peer deepep   # the deep_ep package

For each token count (``--tokens``, default 4096 and 128 per rank: DeepSeek-V3's layer and the
small-batch latency case) and backend (``all_to_all``, ``nvlink``): ``dispatch`` (routes in,
tokens out in the local experts' aligned layout, FP8 on the wire with ``--fp8``, the default),
``combine`` (the layout's rows, bf16, weighted-reduced and summed at home), and for ``nvlink`` its
``transport`` alone (the FP8 token rows stored into the peers' buffers, then the barrier) and, on
GPUs, these three, ``to_buffers`` and ``step`` (dispatch then combine in one graph, as a model's
step runs them: one graph launch, not two) replayed as CUDA graphs (``graph``: the steady state without
host overhead; eager calls launch a few dozen kernels each). ``to_buffers`` is dispatch up to
where DeepEP's ends: the rows (FP8 with their scales) in the receive buffers, grouped by source
rank, with the routes, weights and the local experts' layout, but not yet expanded into the
layout's bf16 rows (which writes ``min(K, E_local)`` copies of each row, about 470 MB a rank at
DeepSeek-V3's 4096 tokens on two ranks: the experts' input, not NVLink traffic). Peers
of the same bytes: NCCL ``all_to_all_single`` and the P2P copy ceiling (``copy_`` of a rank's
remote bytes into its peer's symmetric buffer); ``--peer vdev`` runs only
``torch.ops.symm_mem.all_to_all_vdev`` (NVSHMEM, which must be chosen before any symmetric
allocation: a run of its own) and writes ``dispatch_vdev.json``, which a later default run in
the same ``--out`` folds into its table. ``--peer deepep`` adds DeepEP (``--deepep-module``, default
the ``deep_ep`` package) to the same run: the ``deepep`` backend (ep-runtime's dispatch and combine
through DeepEP's ``Buffer``, into the same layout), and ``deepep_buffer`` (DeepEP's own
``get_dispatch_layout`` + ``dispatch`` of the cast tokens, and ``combine`` of the bf16 rows it
received, as DeepEP's tests time them: where ``to_buffers`` and ``combine`` compare). Eager only:
DeepEP's dispatch waits on the host for the counts of a fresh layout.

Routing: each token picks ``topk`` distinct experts uniformly at random (a balanced load; every
rank's token goes to each other rank with probability about 1 - (1 - 1/W)^K).

Bytes counted per rank: rows sent to *other* ranks (one per token per destination rank) as they
travel: ``hidden`` FP8 bytes plus ``ceil(hidden / 128)`` float32 scales for dispatch with
``--fp8``, ``hidden`` bf16 elements for combine (FP8 bytes and scales with ``--fp8-combine``,
against NCCL moving those bytes); the routes and weights (2K words a token, to
every rank under nvlink), the counts and rows a rank keeps are not counted. GB/s = those bytes /
time. Times: median over ``--iters`` (after ``--warmup``) of the slowest rank per iteration, each
iteration started from a barrier, measured with CUDA events (host timers on CPU). On GPUs the
graphs and the peers are timed as the GPU runs them: the GPU spins ~1 ms after the barrier, so
their launches are queued before it reaches them, as in a model's steady state (otherwise the
host-side launch, a few microseconds, would count: much of the time at 128 tokens), then an
all-reduce of one element on the stream lines the ranks' GPUs up (otherwise a rank's time would
include waiting for a peer whose host left the barrier later). The eager entries keep the host's
launches in their time: their Python is what an eager call costs.

Each entry is printed with its eager and graph times side by side. Targets, printed per row of a
GPU run (``bars`` in the JSON): eager ``nvlink`` dispatch and combine within 1.15x their graphs
plus 20 us; the whole dispatch and the bf16 combine (graphs) at >= 1.0x NCCL's rate on the same
bytes; ``to_buffers`` at >= 90% of the P2P copy's rate; dispatch + combine as one graph under 40 us
at 128 tokens per rank; and with ``--peer deepep``, dispatch + combine against DeepEP's own
``Buffer`` calls (eager against eager, and our graph against them), >= 1.0x.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
from pathlib import Path

from . import StartWorkers, need_start
from .ep_scaling import rows_per_rank
from .record import device_name, head_commit
from .timer import EventTimer, capture_graphs

BACKENDS = ("all_to_all", "nvlink")


def _routing(tokens: int, num_experts: int, topk: int, seed: int, device):
    import torch

    g = torch.Generator(device).manual_seed(seed)
    # contiguous, as a router returns them (a column slice would cost each call a copy)
    idx_TK = torch.rand(tokens, num_experts, generator=g, device=device).argsort(1)[:, :topk].contiguous()
    weights_TK = torch.rand(tokens, topk, generator=g, device=device)
    return idx_TK, weights_TK / weights_TK.sum(1, keepdim=True)


def bench_worker(a: argparse.Namespace) -> dict | None:
    import torch
    import torch.distributed as dist

    from ..config import ParallelConfig
    from ..dispatch import AllToAllDispatcher, DeepEPDispatcher, NVLinkDispatcher
    from ..parallel import init_parallel

    if a.peer == "vdev":
        from torch.distributed import _symmetric_memory as symm_mem

        symm_mem.set_backend("NVSHMEM")  # before any symmetric allocation, in this process only
    ctx = init_parallel(ParallelConfig())
    device, group, world, rank = ctx.device, ctx.ep_group, ctx.world_size, ctx.rank
    on_gpu = device.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    num_local = a.experts // world
    median_ms, time_ms = timers(group, device, a.warmup, a.iters)

    rows = []
    for tokens in a.tokens:
        idx_TK, w_TK = _routing(tokens, a.experts, a.topk, a.seed * 7919 + rank, device)
        x_TD = torch.randn(tokens, a.hidden, device=device, dtype=dtype)
        sent = rows_per_rank(idx_TK, num_local, world)
        sent[rank] = 0  # rows a rank keeps are not counted
        wire_bytes = {True: a.hidden + math.ceil(a.hidden / 128) * 4, False: a.hidden * x_TD.element_size()}
        token_bytes, home_bytes = wire_bytes[a.fp8], wire_bytes[a.fp8_combine]  # a row as it travels
        worst_sent = torch.tensor([sum(sent)], device=device)
        dist.all_reduce(worst_sent, op=dist.ReduceOp.MAX, group=group)
        dispatch_bytes, combine_bytes = int(worst_sent) * token_bytes, int(worst_sent) * home_bytes
        row = {"tokens_per_rank": tokens, "dispatch_bytes_per_rank": dispatch_bytes,
               "combine_bytes_per_rank": combine_bytes}
        if a.peer == "vdev":
            row["vdev_dispatch_ms"] = _vdev_ms(median_ms, sent, token_bytes, group, device)
            row["vdev_combine_ms"] = _vdev_ms(median_ms, sent, home_bytes, group, device)
            rows.append(row)
            continue
        for backend in BACKENDS + (("deepep",) if a.peer == "deepep" else ()):
            if backend == "all_to_all":
                d = AllToAllDispatcher(num_experts=a.experts, group=group, alignment=a.alignment,
                                       dispatch_format="e4m3" if a.fp8 else "bf16", fp8_combine=a.fp8_combine)
            elif backend == "nvlink":
                d = NVLinkDispatcher(num_experts=a.experts, group=group, device=device, max_tokens_per_rank=tokens,
                                     alignment=a.alignment, fp8=a.fp8, fp8_combine=a.fp8_combine)
            else:
                d = DeepEPDispatcher(num_experts=a.experts, group=group, alignment=a.alignment, fp8=a.fp8,
                                     buffer_api=deepep_api(a.deepep_module))
            with torch.no_grad():
                row.update(_time_backend(backend, d, x_TD, idx_TK, w_TK, token_bytes, (median_ms, time_ms), a,
                                         rank == 0))
                if backend == "deepep":
                    row.update(_time_deepep_buffer(d, x_TD, idx_TK, w_TK, a, median_ms))
        collective = dist.get_backend(group)  # nccl on GPUs, gloo on the CPU: the label says which ran
        recv_t = torch.tensor(sent, device=device)
        got_t = torch.empty_like(recv_t)
        dist.all_to_all_single(got_t, recv_t, group=group)
        recv = got_t.tolist()
        for name, nbytes in (("dispatch", token_bytes), ("combine", home_bytes)):
            send_buf = torch.empty(sum(sent) * nbytes, dtype=torch.uint8, device=device)
            recv_buf = torch.empty(sum(recv) * nbytes, dtype=torch.uint8, device=device)
            row[f"{collective}_a2a_{name}_ms"] = median_ms(lambda s=send_buf, r=recv_buf, n=nbytes: dist.all_to_all_single(
                r, s, [x * n for x in recv], [x * n for x in sent], group=group))
        if on_gpu:
            row["p2p_copy_ms"] = _p2p_copy_ms(median_ms, dispatch_bytes, group, device)
        rows.append(row)
    result = {"device": device_name(device), "world_size": world, "rows": rows}
    dist.destroy_process_group()
    return result if rank == 0 else None


def timers(group, device, warmup: int, iters: int):
    """``(median_ms, time_ms)`` over ``group``: ``time_ms(fn, head_start=True)`` times one call of
    ``fn`` from a host barrier (on GPUs after the head start, the ranks' GPUs lined up by an
    on-stream all-reduce); ``median_ms`` the median over ``iters`` (after ``warmup``) of the
    slowest rank's time."""
    import torch
    import torch.distributed as dist

    on_gpu, world = device.type == "cuda", dist.get_world_size(group)
    timer, flag = EventTimer(device), torch.zeros(1, device=device)

    def align():  # on the stream, after the GPU's head start: every rank's GPU starts the call together
        dist.all_reduce(flag, group=group)

    def time_ms(fn, head_start: bool = True) -> float:
        dist.barrier(group=group, **({"device_ids": [device.index]} if on_gpu else {}))
        return timer.time(fn, head_start, align if on_gpu and world > 1 else None)

    def median_ms(fn, head_start: bool = True) -> float:
        samples = [time_ms(fn, head_start) for _ in range(warmup + iters)][warmup:]
        worst = torch.tensor(samples, dtype=torch.float64, device=device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
        return statistics.median(worst.tolist())

    return median_ms, time_ms


def _time_backend(backend: str, d, x_TD, idx_TK, w_TK, token_bytes: int, timers, a, show: bool) -> dict:
    """Dispatch and combine of one backend; for nvlink also its transport alone and, on GPUs, these,
    dispatch to the receive buffers and dispatch + combine replayed as CUDA graphs (and, with
    ``--profile``, the eager calls' profile and each graph's kernel timeline).
    ``timers``: ``(median_ms, time_ms)``, the median of many timed calls and one timed call."""
    import torch

    median_ms, time_ms = timers
    out = {}

    def dispatch():
        out["x_PD"], _, out["handle"] = d.dispatch(x_TD, idx_TK, w_TK)

    def combine():
        d.combine(out["x_PD"], out["handle"])

    # Eager calls are timed with the host's launches (their Python is most of a small batch's time).
    times = {f"{backend}_dispatch_ms": median_ms(dispatch, False), f"{backend}_combine_ms": median_ms(combine, False)}
    if backend != "nvlink":
        return times
    q_TD = torch.empty(x_TD.shape[0], token_bytes, dtype=torch.uint8, device=x_TD.device)
    steps = {"dispatch": dispatch, "combine": combine, "transport": lambda: d.scatter(q_TD, out["handle"].route),
             "to_buffers": lambda: d.move_tokens(x_TD, idx_TK, w_TK), "step": lambda: (dispatch(), combine())}
    times["nvlink_transport_ms"] = median_ms(steps["transport"], False)
    if x_TD.is_cuda:
        graphs = dict(zip(steps, capture_graphs(*steps.values())))
        for name, graph in graphs.items():
            times[f"nvlink_graph_{name}_ms"] = median_ms(graph.replay)
        if a.profile:  # every rank runs it (the barriers), rank 0 prints
            _profile(dispatch, combine, x_TD.shape[0], show)
            for name in ("dispatch", "combine"):
                _timeline(name, steps[name], time_ms, x_TD.shape[0], show)
    return times


def _profile(dispatch, combine, tokens: int, show: bool) -> None:
    """Where eager dispatch and combine spend their time, printed if ``show``: kernels launched per
    call (what a small batch's latency is made of), each kernel's time, and the Python lines that
    launched torch's own kernels (copies, fills) rather than ours."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    calls = 5
    for name, step in (("dispatch", dispatch), ("combine", combine)):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
            for _ in range(calls):
                step()
            torch.cuda.synchronize()
        if not show:
            continue
        kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
        print(f"profile of {calls} x nvlink {name}, {tokens} tokens per rank: {len(kernels) / calls:.0f} kernels a call")
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=20))
        print(prof.key_averages(group_by_stack_n=4).table(sort_by="self_cuda_time_total", row_limit=12))


def _timeline(name: str, step, time_ms, tokens: int, show: bool) -> None:
    """``step``'s kernels as the GPU runs them in a CUDA graph, printed if ``show``: each kernel's
    median start and end (us from the replay's first kernel start) and stream, over a few timed
    replays. What the eager profile cannot show: a chained kernel (``kernels.pdl``) starts before the
    one it waits for ends, so its own time there includes that wait; and work beside the rows
    overlaps them. The graph is captured under the profiler: CUPTI does not see the kernels of a
    graph instantiated before it started (it saw only one of a dispatch's 10 kernels)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    replays = 7
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        (graph,) = capture_graphs(step)
        for _ in range(replays):
            time_ms(graph.replay)  # as timed: after the head start, the ranks' GPUs lined up
    kernels = sorted((e for e in prof.profiler.kineto_results.events() if e.device_type() == DeviceType.CUDA
                      and not any(word in e.name() for word in ("nccl", "spin_kernel", "Memcpy", "Memset"))),
                     key=lambda e: e.start_ns())
    if not show or not kernels:
        return
    # Replays are the runs of kernels between the head starts (~1 ms spins, left out).
    runs, end = [], None
    for e in kernels:
        if end is None or e.start_ns() - end > 20_000:
            runs.append([])
        runs[-1].append(e)
        end = e.end_ns() if end is None else max(end, e.end_ns())
    runs = runs[-replays:]  # the capture's warm-up call ran first
    size = statistics.mode(len(r) for r in runs)
    runs = [r for r in runs if len(r) == size]
    spans = {}  # (name, n-th of that name in the replay) -> [(start, end, stream)] over replays, us
    for run in runs:
        seen = {}
        for e in run:
            seen[e.name()] = seen.get(e.name(), -1) + 1
            spans.setdefault((e.name(), seen[e.name()]), []).append(
                ((e.start_ns() - run[0].start_ns()) / 1e3, (e.end_ns() - run[0].start_ns()) / 1e3,
                 e.device_resource_id()))
    print(f"timeline of nvlink {name} as a CUDA graph, {tokens} tokens per rank ({len(runs)} replays of {size} "
          "kernels; median start and end, us from the first kernel's start):")
    rows = [(statistics.median(s for s, _, _ in v), statistics.median(e for _, e, _ in v), v[0][2], key[0])
            for key, v in spans.items()]
    for start, stop, stream, kernel in sorted(rows):
        print(f"  {start:8.1f} {stop:8.1f}  stream {stream:<3} {kernel[:70]}")


def deepep_api(module: str):
    """The module named by ``--deepep-module``, checked: ``None`` for the ``deep_ep`` package (the
    adapter imports it, and knows its kernels combine bf16 only), else that module (the facade)."""
    import importlib

    try:
        api = importlib.import_module(module)
    except (ImportError, OSError) as e:  # OSError: a built module whose shared libraries do not load
        raise ValueError(f"--deepep-module: expected an importable module with DeepEP's Buffer API, got {module!r} "
                         f"({e}); ep_runtime.compat.deep_ep is ep-runtime's facade of it") from None
    if not hasattr(api, "Buffer"):
        raise ValueError(f"--deepep-module: expected a module with DeepEP's Buffer API, got {module!r} (no Buffer)")
    return None if module == "deep_ep" else api


def _time_deepep_buffer(d, x_TD, idx_TK, w_TK, a: argparse.Namespace, median_ms) -> dict:
    """DeepEP's own calls on ``d``'s buffer: the layout and the dispatch of the tokens (cast to FP8
    beforehand with ``--fp8``, as a DeepEP user does), and the combine of bf16 rows received."""
    import torch

    from kernels.quant import per_token_cast

    idx = idx_TK.to(torch.int64)
    x = per_token_cast(x_TD) if a.fp8 else x_TD
    got = {}

    def dispatch():
        per_rank, _, per_expert, in_rank, _ = d.buffer.get_dispatch_layout(idx, a.experts)
        got["recv"] = d.buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                        num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w_TK)

    times = {"deepep_buffer_dispatch_ms": median_ms(dispatch, False)}
    recv_x, _, recv_weights, _, handle, _ = got["recv"]
    rows = torch.randn((recv_x[0] if a.fp8 else recv_x).shape[0], a.hidden, dtype=x_TD.dtype, device=x_TD.device)
    times["deepep_buffer_combine_ms"] = median_ms(lambda: d.buffer.combine(rows, handle, topk_weights=recv_weights),
                                                  False)
    return times


def _p2p_copy_ms(median_ms, nbytes: int, group, device) -> float:
    """``copy_`` of ``nbytes`` into the next rank's symmetric buffer: the ceiling of a store."""
    import torch

    from ..dispatch.symmetric import CudaHeap

    heap = CudaHeap(max(nbytes, 1), group, device)
    peer = (heap.rank + 1) % heap.world
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def copy():
        heap.heaps[peer][:nbytes].copy_(src)
        heap.barrier()

    return median_ms(copy)


def _vdev_ms(median_ms, sent_rows: list[int], row_bytes: int, group, device) -> float:
    """``torch.ops.symm_mem.all_to_all_vdev`` of the same bytes (NVSHMEM symmetric tensors)."""
    import torch
    from torch.distributed import _symmetric_memory as symm_mem

    world = len(sent_rows)
    most = max(sum(sent_rows), 1) * row_bytes
    inp = symm_mem.empty(most, dtype=torch.uint8, device=device)
    out = symm_mem.empty(most * world, dtype=torch.uint8, device=device)
    in_splits = symm_mem.empty(world, dtype=torch.int64, device=device)
    out_splits_offsets = symm_mem.empty((2, world), dtype=torch.int64, device=device)
    in_splits.copy_(torch.tensor([r * row_bytes for r in sent_rows]))
    for t in (inp, out, in_splits, out_splits_offsets):
        symm_mem.rendezvous(t, group)
    return median_ms(lambda: torch.ops.symm_mem.all_to_all_vdev(inp, out, in_splits, out_splits_offsets,
                                                                 group.group_name))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ep-runtime bench dispatch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=lambda s: [int(t) for t in s.split(",")],
                   help="tokens per rank, comma-separated (default 4096,128 on GPU, 256 on CPU)")
    p.add_argument("--hidden", type=int, help="default 7168 on GPU, 128 on CPU")
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--alignment", type=int, default=8,
                   help="rows per expert segment (default 8, what the bf16 grouped GEMM needs)")
    p.add_argument("--fp8", action=argparse.BooleanOptionalAction, default=True, help="FP8 tokens on the wire")
    p.add_argument("--fp8-combine", action=argparse.BooleanOptionalAction, default=False,
                   help="FP8 rows home too (the combine targets are for a bf16 combine)")
    p.add_argument("--peer", choices=("vdev", "deepep"),
                   help="vdev: measure only torch's NVSHMEM all_to_all_vdev (a run of its own); deepep: add DeepEP")
    p.add_argument("--deepep-module", default="deep_ep",
                   help="the module with DeepEP's Buffer API that --peer deepep times (default deep_ep; "
                        "ep_runtime.compat.deep_ep times ep-runtime's facade of it)")
    p.add_argument("--profile", action="store_true", help="print a profile of nvlink dispatch + combine (GPU)")
    p.add_argument("--num-workers", type=int, default=2, help="CPU workers without torchrun (default 2)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/bench", help="output directory (default runs/bench)")
    p.add_argument("--commit", help="the commit measured (default: git rev-parse HEAD)")
    return p


def main(argv: list[str] | None = None, *, start: StartWorkers | None = None) -> dict | None:
    import torch

    a = parser().parse_args(argv)
    on_gpu = torch.cuda.is_available()
    a.tokens = a.tokens or ([4096, 128] if on_gpu else [256])
    a.hidden = a.hidden or (7168 if on_gpu else 128)
    if a.peer == "deepep":  # named here, before any worker starts
        if a.fp8_combine:
            raise SystemExit("ep-runtime bench dispatch: --fp8-combine: expected a bf16 combine with --peer deepep "
                             "(DeepEP combines bf16 rows only)")
        try:
            deepep_api(a.deepep_module)
        except ValueError as e:
            raise SystemExit(f"ep-runtime bench dispatch: {e}") from None
    if "WORLD_SIZE" in os.environ:
        result = bench_worker(a)
        if result is None:
            return None
    else:
        result = need_start(start, "dispatch")(bench_worker, a, num_workers=a.num_workers)[0]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.peer == "vdev":
        path = out / "dispatch_vdev.json"
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}")
        return result
    report = _report(a, result, out / "dispatch_vdev.json")
    path = out / "dispatch.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"dispatch/combine on {report['device']}, {report['world_size']} ranks, hidden {a.hidden}, "
          f"{a.experts} experts, top-{a.topk}, {'FP8' if a.fp8 else 'bf16'} dispatch, "
          f"{'FP8' if a.fp8_combine else 'bf16'} combine:")
    for row in report["rows"]:
        print(f"  {row['tokens_per_rank']} tokens/rank, {row['dispatch_bytes_per_rank'] / 1e6:.1f} MB dispatch, "
              f"{row['combine_bytes_per_rank'] / 1e6:.1f} MB combine per rank:")
        print_side_by_side(row)
    print(f"wrote {path}")
    return report


EAGER_SLACK, EAGER_EXTRA_MS = 1.15, 0.020  # eager within 1.15x its graph plus 20 us


def bars(row: dict) -> dict:
    """The targets from one row of a GPU run (each where the row has its entries): eager nvlink
    dispatch and combine in us beside their bars (1.15x the graph + 20 us); the whole dispatch and
    the combine (graphs) as multiples of NCCL's rate on the same bytes (bar 1.0); ``to_buffers``
    (dispatch up to where DeepEP's ends) as a percentage of the P2P copy's rate (bar 90); dispatch +
    combine as one graph in us (bar: under 40 at 128 tokens per rank); and DeepEP's dispatch +
    combine time over ours, eager and graph (bar 1.0)."""
    ms = {key[:-3]: value for key, value in row.items() if key.endswith("_ms") and value}
    out = {}
    for op in ("dispatch", "combine"):
        if {f"nvlink_{op}", f"nvlink_graph_{op}"} <= ms.keys():
            out[f"eager_{op}_us"] = 1e3 * ms[f"nvlink_{op}"]
            out[f"eager_{op}_bar_us"] = 1e3 * (EAGER_SLACK * ms[f"nvlink_graph_{op}"] + EAGER_EXTRA_MS)
        if {f"nvlink_graph_{op}", f"nccl_a2a_{op}"} <= ms.keys():
            out[f"{op}_x_nccl"] = ms[f"nccl_a2a_{op}"] / ms[f"nvlink_graph_{op}"]
    if {"nvlink_graph_to_buffers", "p2p_copy"} <= ms.keys():
        out["to_buffers_pct_of_p2p_copy"] = 100 * ms["p2p_copy"] / ms["nvlink_graph_to_buffers"]
    if "nvlink_graph_step" in ms:
        out["step_us"] = 1e3 * ms["nvlink_graph_step"]
    if {"deepep_buffer_dispatch", "deepep_buffer_combine", "nvlink_dispatch", "nvlink_combine"} <= ms.keys():
        deepep = ms["deepep_buffer_dispatch"] + ms["deepep_buffer_combine"]
        out["eager_x_deepep"] = deepep / (ms["nvlink_dispatch"] + ms["nvlink_combine"])
        if "nvlink_graph_step" in ms:
            out["graph_x_deepep"] = deepep / ms["nvlink_graph_step"]
    return out


def print_side_by_side(row: dict) -> None:
    """The row's entries, eager and graph times side by side (``X_graph_Y`` beside ``X_Y``), the
    rate of the graph where there is one, then the targets (``bars``)."""
    entries: dict[str, dict] = {}
    for name, ms, gbps in row["table"]:
        eager_name = name.replace("_graph_", "_", 1)
        entries.setdefault(eager_name, {})["graph" if eager_name != name else "eager"] = (ms, gbps)
    print(f"    {'':<24} {'eager us':>10} {'graph us':>10}" + ("   GB/s" if row["dispatch_bytes_per_rank"] else ""))
    for name, times in entries.items():
        cells = [f"{times[k][0] * 1e3:10.1f}" if k in times else f"{'-':>10}" for k in ("eager", "graph")]
        gbps = (times.get("graph") or times["eager"])[1]
        rate = f" {gbps:7.1f}" if row["dispatch_bytes_per_rank"] else ""  # one rank sends nothing to others
        print(f"    {name:<24} {' '.join(cells)}{rate}")
    b, targets = row["bars"], []
    for op in ("dispatch", "combine"):
        if f"eager_{op}_us" in b:
            targets.append(f"eager {op} {b[f'eager_{op}_us']:.1f} us (<= {b[f'eager_{op}_bar_us']:.1f})")
    targets += [f"{op} {b[f'{op}_x_nccl']:.2f}x NCCL (>= 1.0)" for op in ("dispatch", "combine") if f"{op}_x_nccl" in b]
    if "to_buffers_pct_of_p2p_copy" in b:
        targets.append(f"to_buffers {b['to_buffers_pct_of_p2p_copy']:.0f}% of the P2P copy (>= 90)")
    if "step_us" in b:
        targets.append(f"dispatch + combine graph {b['step_us']:.1f} us (< 40 at 128 tokens)")
    targets += [f"{kind} {b[f'{kind}_x_deepep']:.2f}x DeepEP (>= 1.0)" for kind in ("eager", "graph")
                if f"{kind}_x_deepep" in b]
    if targets:
        print("    targets: " + "; ".join(targets))


def _report(a: argparse.Namespace, result: dict, vdev_path: Path) -> dict:
    """Adds GB/s per entry (and the vdev run's rows, when there is one) as a table per row."""
    vdev = json.loads(vdev_path.read_text())["rows"] if vdev_path.exists() else []
    for row in result["rows"]:
        row.update(next((v for v in vdev if v["tokens_per_rank"] == row["tokens_per_rank"]), {}))
        table = []
        for key, ms in list(row.items()):
            if key.endswith("_ms") and ms:
                if key.endswith("step_ms"):  # dispatch + combine
                    bytes_ = row["dispatch_bytes_per_rank"] + row["combine_bytes_per_rank"]
                else:
                    bytes_ = row["combine_bytes_per_rank"] if "combine" in key else row["dispatch_bytes_per_rank"]
                row[key[:-3] + "_gbps"] = bytes_ / ms / 1e6
                table.append((key[:-3], ms, bytes_ / ms / 1e6))
        row["table"] = table
        row["bars"] = bars(row) if row["dispatch_bytes_per_rank"] else {}
    return {
        "benchmark": "dispatch", "device": result["device"], "world_size": result["world_size"],
        "commit": a.commit or head_commit(), "time": datetime.datetime.now().isoformat(timespec="seconds"),
        "torch": __import__("torch").__version__,
        "spec": {k: v for k, v in vars(a).items() if k not in ("out",)},
        "bytes_counted": "per rank: rows sent to other ranks (one per token per destination rank); dispatch "
                         "= hidden FP8 bytes + float32 1x128 scales with fp8, combine = hidden bf16 elements (the "
                         "FP8 bytes and scales with fp8_combine); "
                         "routes, weights, counts and rows kept on the rank not counted",
        "timing": "median over iters (after warmup) of the slowest rank per iteration; CUDA events on GPU",
        "rows": result["rows"],
    }


if __name__ == "__main__":
    main()
