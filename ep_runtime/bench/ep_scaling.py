"""``ep-runtime bench ep-scaling``: the MoE layer and its bare dispatch/combine at EP sizes 1, 2, 4, ...

For each EP size (the job cut into EP groups of that size that run side by side, see
``parallel.block_group``; rank 0's group is reported) and each scaling mode it measures:

- ``weak``: a fixed load per rank (``--tokens-per-rank``): ideally the time stays flat;
  efficiency = t(EP 1) / t(EP n).
- ``strong``: a fixed global load (``--tokens-per-rank`` x the largest EP size, split over the
  group): ideally the time falls as 1/n; efficiency = t(EP 1) / (n * t(EP n)).

Per size: the MoE layer's forward+backward time (router, dispatch, experts, combine, shared
expert) and tokens/s over the group; dispatch and combine alone (no autograd, expert outputs
replaced by the received tokens) with GB/s per rank, eager and (``nvlink`` on GPUs) replayed as CUDA
graphs side by side; ``all_to_all_single`` of the same bytes for
comparison; load imbalance (max/mean routes per rank and per expert). Against communication: the
same layer with no token leaving the rank (``ep_local.py``: every rank alone at EP 1 with its
``E / n`` experts, fed its same tokens, so it computes the same expert rows) as ``local_ms``; the
exposed communication ``exposed_comm_ms = layer_ms - local_ms`` and ``exposed_comm_pct`` of
``layer_ms`` (None where ``E / n`` < top-k; 0 at EP 1, its own baseline); and
``model_tflops_per_gpu``, the layer's forward+backward model FLOPs per rank (router, top-k routed
and the shared expert: ``metrics.moe_active_params``) over ``layer_ms``. Efficiency against EP 1 mixes the links'
cost with the GEMM shapes (an EP 1 expert gets 1/n of the rows an EP n expert gets); the baseline
has EP n's shapes.

Bytes counted per rank: dispatch, the token rows this rank sends to *other* ranks (one row per
token per destination rank) as they travel: ``hidden`` bytes of FP8 plus ``ceil(hidden/128)``
float32 scales when ``--fp8-dispatch``, else ``hidden`` elements of the activation dtype; combine,
the rows it sends back to other ranks (``hidden`` elements of the activation dtype, BF16 on GPU).
Router weights and counts (a few bytes per row) are not counted; rows a rank keeps are not
counted (no link carries them), so EP 1 moves 0 bytes. Times are the median over ``--iters``
iterations (after ``--warmup``) of the slowest rank of the group; on GPU from CUDA events.

Launchers: ``--launcher local`` (processes on this machine: one per GPU, else 2 CPU workers),
``ray`` (actors on a Ray cluster, ``--address``), ``torchrun-env`` (this process is one rank of a
torchrun job; the default when ``WORLD_SIZE`` is set):

    ep-runtime bench ep-scaling                       # small shape, 2 CPU workers
    torchrun --standalone --nproc-per-node 2 -m ep_runtime.bench.ep_scaling --shape deepseek-v3

Writes ``ep_scaling_<shape>.json`` and ``.png`` (throughput and efficiency against EP size;
``ep_scaling_<shape>_nvlink.*`` with ``--dispatcher nvlink``) under ``--out``.

Shape letters: T tokens, D hidden, K routes per token, E experts, P layout rows.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import math
import os
import signal
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from . import StartWorkers, need_start
from .ep_local import comm_figures, layer_flops, local_spec
from .progress import Progress
from .record import device_name, head_commit
from .timer import EventTimer, capture_graphs

SHAPES = {
    # DeepSeek-V3's MoE layer: 256 routed experts (8 groups, 4 kept), top-8, one shared expert;
    # segments aligned to 8 rows, what the bf16 grouped GEMM needs (--alignment changes it).
    "deepseek-v3": dict(hidden=7168, num_experts=256, topk=8, num_groups=8, topk_groups=4, expert_hidden=2048,
                        tokens_per_rank=4096, fp8_dispatch=True, alignment=8, routed_scaling_factor=2.5),
    # For CPU workers (gloo): the shape of the curve in seconds.
    "small": dict(hidden=128, num_experts=8, topk=2, num_groups=1, topk_groups=None, expert_hidden=128,
                  tokens_per_rank=256, fp8_dispatch=False, alignment=8, routed_scaling_factor=1.0),
}
MODES = ("weak", "strong")


@dataclass(frozen=True, kw_only=True)
class BenchSpec:
    shape: str
    hidden: int
    num_experts: int
    topk: int
    num_groups: int
    topk_groups: int | None
    expert_hidden: int
    tokens_per_rank: int
    fp8_dispatch: bool
    alignment: int
    routed_scaling_factor: float
    dispatcher: str = "all_to_all"  # or "nvlink" (EP 1 has no transport: all_to_all's identity)
    fp8_experts: bool = False  # the routed experts' GEMMs in FP8 (model.moe.fp8_experts)
    max_ep: int | None = None  # None: the world size
    only_ep: int | None = None  # measure this EP size alone
    modes: tuple[str, ...] = MODES
    warmup: int = 2
    iters: int = 5
    timeout_s: float = 600.0
    seed: int = 0

    def __post_init__(self):
        for name in ("hidden", "num_experts", "topk", "expert_hidden", "tokens_per_rank", "iters"):
            if getattr(self, name) < 1:
                raise ValueError(f"bench.{name}: expected >= 1, got {getattr(self, name)!r}")
        if self.warmup < 0:
            raise ValueError(f"bench.warmup: expected >= 0, got {self.warmup!r}")
        if self.max_ep is not None and self.max_ep < 1:
            raise ValueError(f"bench.max_ep: expected >= 1, got {self.max_ep!r}")
        if self.dispatcher not in ("all_to_all", "nvlink"):
            raise ValueError(f"bench.dispatcher: expected 'all_to_all' or 'nvlink', got {self.dispatcher!r}")
        if self.fp8_experts and self.alignment % 128:
            raise ValueError(f"bench.alignment: expected a multiple of 128 with --fp8-experts (an FP8 GEMM tile's "
                             f"rows), got {self.alignment}")
        if not self.modes or any(m not in MODES for m in self.modes):
            raise ValueError(f"bench.modes: expected a non-empty subset of {MODES}, got {self.modes!r}")

    def sweep(self, world: int) -> list[int]:
        """1, 2, 4, ... up to ``max_ep`` (and ``max_ep`` itself), those that divide the experts."""
        top = min(self.max_ep or world, world)
        sizes = sorted({2**i for i in range(int(math.log2(top)) + 1)} | {top})
        return [s for s in sizes if self.num_experts % s == 0]

    def ep_sizes(self, world: int) -> list[int]:
        """The sizes one process set measures: the sweep, or ``only_ep`` alone when set."""
        sizes = self.sweep(world)
        if self.only_ep is not None:
            if self.only_ep not in sizes:
                raise ValueError(f"bench.only_ep: expected one of {sizes}, got {self.only_ep!r}")
            return [self.only_ep]
        return sizes


# ---------------------------------------------------------------------------------------------
# The worker (one per rank, under any launcher).


def bench_worker(spec: BenchSpec) -> dict | None:
    """Measures every (mode, EP size); rank 0 returns the results, the others None."""
    import torch
    import torch.distributed as dist

    from ..config import ParallelConfig
    from ..dispatch.nvlink import NVLinkDispatcher, reserve_heaps
    from ..parallel import block_group, init_parallel

    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)  # a hung rank says where
    ctx = init_parallel(ParallelConfig(timeout_s=spec.timeout_s))
    if ctx.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    sizes = spec.ep_sizes(ctx.world_size)
    points = [(mode, size) for mode in spec.modes for size in sizes]
    progress = Progress("ep-scaling", len(points), enabled=ctx.rank == 0)
    rows = []
    groups = {size: block_group(size) if ctx.distributed else None for size in sizes}  # collective: all ranks
    def tokens_per_rank(mode: str, size: int) -> int:
        return spec.tokens_per_rank if mode == "weak" else spec.tokens_per_rank * max(spec.sweep(ctx.world_size)) // size

    # One dispatcher per EP size for all modes (its receive buffers sized for the largest): a
    # second nvlink dispatcher's heap over the same group hung on 4 H200s.
    dispatchers = {size: _make_dispatcher(spec, groups[size], ctx.device, max(tokens_per_rank(m, size) for m in spec.modes))
                   for size in sizes if groups[size] is not None or size == 1}
    if spec.dispatcher == "nvlink" and sum(s > 1 for s in sizes) > 1:
        # EP groups of several sizes: a process's symmetric memory goes over one set of ranks, so
        # their heaps come from one pool over the node (every rank takes part, with or without groups)
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", ctx.world_size))
        node = dist.group.WORLD if per_node >= ctx.world_size else block_group(per_node)
        reserve_heaps([d for d in dispatchers.values() if isinstance(d, NVLinkDispatcher)], hidden=spec.hidden,
                      topk=spec.topk, dtype=torch.bfloat16 if ctx.device.type == "cuda" else torch.float32,
                      over=node, device=ctx.device)
    for mode, size in points:
        group = groups[size]
        if size in dispatchers:
            row = _measure(spec, ctx, group, dispatchers[size], tokens_per_rank(mode, size))
            if ctx.device.type == "cuda":
                torch.cuda.empty_cache()  # the layer of this size is gone; the next one may be larger
            row["mode"] = mode
            rows.append(row)
        progress.advance(f"{mode} EP {size}")
        if ctx.distributed:
            dist.barrier()
    progress.close()
    result = {"device": device_name(ctx.device), "world_size": ctx.world_size, "rows": rows}
    if ctx.distributed:
        dist.destroy_process_group()
    return result if ctx.rank == 0 else None


def _make_dispatcher(spec: BenchSpec, group, device, max_tokens: int):
    from ..dispatch import AllToAllDispatcher, NVLinkDispatcher

    if spec.dispatcher == "nvlink" and group is not None:
        return NVLinkDispatcher(num_experts=spec.num_experts, group=group, device=device, max_tokens_per_rank=max_tokens,
                                alignment=spec.alignment, fp8=spec.fp8_dispatch)
    # One rank needs no transport.
    return AllToAllDispatcher(num_experts=spec.num_experts, group=group, alignment=spec.alignment,
                              dispatch_format="e4m3" if spec.fp8_dispatch else "bf16")


def _measure(spec: BenchSpec, ctx, group, dispatcher, tokens: int) -> dict:
    """One EP group, ``tokens`` tokens per rank: the layer, then dispatch/combine."""
    import torch
    import torch.distributed as dist

    device = ctx.device
    size = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0  # within the EP group
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    layer = _build_layer(spec, dispatcher, ep_rank=rank, device=device, dtype=dtype)
    g = torch.Generator(device).manual_seed(spec.seed * 7919 + rank)
    x_TD = torch.randn(tokens, spec.hidden, generator=g, device=device, dtype=dtype)
    grad_TD = torch.randn(tokens, spec.hidden, generator=g, device=device, dtype=dtype)
    timer = EventTimer(device)

    def sync():
        if group is not None:
            dist.barrier(group=group, **({"device_ids": [device.index]} if device.type == "cuda" else {}))

    layer_ms = _time_layer(spec, layer, x_TD, grad_TD, timer, sync)
    load_E = layer.load_E.to(device=device, dtype=torch.int64)

    out = {}

    def dispatch():
        out["x_PD"], out["layout"], out["handle"] = dispatcher.dispatch(x_TD, idx_TK, w_TK)

    with torch.no_grad():
        routing = layer.router(x_TD)
        idx_TK, w_TK = routing.topk_idx_TK, routing.topk_weights_TK
        dispatch_ms, combine_ms, a2a_ms = [], [], []
        for i in range(spec.warmup + spec.iters):
            sync()
            d_ms = timer.time(dispatch)
            sync()
            c_ms = timer.time(lambda: dispatcher.combine(out["x_PD"], out["handle"]))
            if i >= spec.warmup:
                dispatch_ms.append(d_ms)
                combine_ms.append(c_ms)
        routes_here = int(out["layout"].counts_E.sum())
        graph_ms = _time_graphs(spec, dispatcher, dispatch, lambda: dispatcher.combine(out["x_PD"], out["handle"]),
                                timer, sync)
        out.clear()  # the graphs' outputs hold their memory pool's segments
        # Rows to each rank (a token once per destination rank), and from each.
        send_W = torch.tensor(rows_per_rank(idx_TK, dispatcher.num_local_experts, size), device=device)
        recv_W = send_W.clone()
        if group is not None:
            dist.all_to_all_single(recv_W, send_W, group=group)
        send_rows, recv_rows = send_W.tolist(), recv_W.tolist()
        if group is not None:  # all_to_all_single of the dispatch's token bytes, for comparison
            row_bytes = _dispatch_row_bytes(spec, dtype)
            send = torch.empty(sum(send_rows) * row_bytes, dtype=torch.uint8, device=device)
            recv = torch.empty(sum(recv_rows) * row_bytes, dtype=torch.uint8, device=device)
            a2a_ms = _series(spec, lambda: dist.all_to_all_single(recv, send, [r * row_bytes for r in recv_rows],
                                                                  [s * row_bytes for s in send_rows], group=group),
                             timer, sync)

    # The baseline without communication (ep_local.py), every rank at once, on the same tokens.
    del layer  # DeepSeek-V3's experts at EP 2 take 22 GB with their gradients: one layer at a time
    local = local_spec(spec, size) if size > 1 else None
    local_ms = [0.0] * spec.iters
    if local is not None:
        baseline = _build_layer(local, _make_dispatcher(local, None, device, tokens), ep_rank=0, device=device,
                                dtype=dtype)
        local_ms = _time_layer(spec, baseline, x_TD, grad_TD, timer, sync)

    # The slowest rank of the group sets the pace: max over ranks per iteration, then the median.
    times = torch.tensor([layer_ms, dispatch_ms, combine_ms, a2a_ms or [0.0] * spec.iters, local_ms,
                          *(graph_ms or [[0.0] * spec.iters] * 2)], dtype=torch.float64, device=device)
    counts = torch.tensor([sum(send_rows) - send_rows[rank], sum(recv_rows) - recv_rows[rank], routes_here],
                          dtype=torch.float64, device=device)
    per_rank = torch.zeros(size, 3, dtype=torch.float64, device=device)
    per_rank[rank] = counts
    if group is not None:
        dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(per_rank, group=group)
        dist.all_reduce(load_E, group=group)
    layer_t, dispatch_t, combine_t, a2a_t, local_t, *graph_t = (statistics.median(r) for r in times.tolist())
    sent_rows, back_rows, routes = per_rank.T.tolist()
    dispatch_bytes = max(sent_rows) * _dispatch_row_bytes(spec, dtype)
    combine_bytes = max(back_rows) * spec.hidden * torch.empty((), dtype=dtype).element_size()
    row = {
        "ep": size, "tokens_per_rank": tokens, "global_tokens": tokens * size,
        "layer_ms": layer_t, "layer_tokens_per_s": tokens * size / layer_t * 1e3,
        "dispatch_ms": dispatch_t, "combine_ms": combine_t,
        # the same calls replayed as CUDA graphs, where the backend can be captured (None elsewhere)
        "dispatch_graph_ms": graph_t[0] if graph_ms else None, "combine_graph_ms": graph_t[1] if graph_ms else None,
        "dispatch_combine_tokens_per_s": tokens * size / (dispatch_t + combine_t) * 1e3,
        "dispatch_bytes_per_rank": dispatch_bytes, "combine_bytes_per_rank": combine_bytes,
        "dispatch_gbps_per_rank": dispatch_bytes / dispatch_t / 1e6,
        "combine_gbps_per_rank": combine_bytes / combine_t / 1e6,
        "a2a_same_bytes_ms": a2a_t if group is not None else None,
        "a2a_same_bytes_gbps_per_rank": dispatch_bytes / a2a_t / 1e6 if group is not None else None,
        "rank_imbalance": max(routes) / (sum(routes) / len(routes)) if sum(routes) else 1.0,
        "expert_imbalance": float(load_E.max() / load_E.float().mean()) if int(load_E.sum()) else 1.0,
        # EP 1 is its own baseline; None where the rank's experts are fewer than top-k
        **comm_figures(layer_t, layer_t if size == 1 else local_t if local is not None else None,
                       layer_flops(_moe_config(spec), spec.hidden, tokens)),
    }
    return row


def _time_graphs(spec: BenchSpec, dispatcher, dispatch, combine, timer: EventTimer, sync) -> list[list[float]] | None:
    """Dispatch and combine replayed as CUDA graphs (ms per iteration, each), beside their eager
    times: on GPUs, for the ``nvlink`` backend (no host sync, so a graph can hold it); else None."""
    from ..dispatch import NVLinkDispatcher

    if type(dispatcher) is not NVLinkDispatcher or dispatcher.device.type != "cuda":
        return None
    return [_series(spec, graph.replay, timer, sync) for graph in capture_graphs(dispatch, combine)]


def _time_layer(spec: BenchSpec, layer, x_TD, grad_TD, timer: EventTimer, sync) -> list[float]:
    """``layer``'s forward+backward on ``x_TD`` (gradient ``grad_TD``), ms per iteration."""
    def step():
        x = x_TD.detach().requires_grad_()
        layer(x[None]).backward(grad_TD[None])
        for p in layer.parameters():
            p.grad = None

    return _series(spec, step, timer, sync)


def _series(spec: BenchSpec, fn, timer: EventTimer, sync) -> list[float]:
    """``fn``'s time, ms: the ``spec.iters`` iterations after ``spec.warmup``, each after ``sync()``."""
    times = []
    for i in range(spec.warmup + spec.iters):
        sync()
        ms = timer.time(fn)
        if i >= spec.warmup:
            times.append(ms)
    return times


def rows_per_rank(idx_TK, num_local_experts: int, world: int) -> list[int]:
    """Rows a rank sends to each rank of its EP group: a token once per rank holding one of its
    experts (-1 routes go nowhere)."""
    import torch

    ranks_W = torch.arange(world, device=idx_TK.device)
    return ((idx_TK // num_local_experts)[:, :, None] == ranks_W).any(1).sum(0).tolist()


def _dispatch_row_bytes(spec: BenchSpec, dtype) -> int:
    import torch

    if spec.fp8_dispatch:
        return spec.hidden + math.ceil(spec.hidden / 128) * 4
    return spec.hidden * torch.empty((), dtype=dtype).element_size()


def _build_layer(spec: BenchSpec, dispatcher, *, ep_rank: int, device, dtype):
    """The MoE layer, built on the meta device and initialised in place on ``device`` in ``dtype``
    (DeepSeek-V3's 256 experts would take 45 GB of host memory in float32 first)."""
    import torch

    from ..moe import MoELayer

    with torch.device("meta"):
        layer = MoELayer(_moe_config(spec), spec.hidden, dispatcher, ep_rank=ep_rank, seed=spec.seed)
    layer = layer.to(dtype=dtype).to_empty(device=device)
    g = torch.Generator(device).manual_seed(spec.seed * 1_000_003 + ep_rank)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            # Expert weights are [E, in, out], linear layers' [out, in].
            fan_in = p.shape[-2] if name.startswith("experts.") else p.shape[-1]
            p.normal_(0.0, fan_in**-0.5, generator=g)
        for b in layer.buffers():
            b.zero_()
    layer.load_E = torch.zeros(spec.num_experts, dtype=torch.int32)
    return layer


def _moe_config(spec: BenchSpec):
    from ..config import MoEConfig, RouterConfig

    router = RouterConfig(scoring="sigmoid", topk=spec.topk, num_groups=spec.num_groups,
                          topk_groups=spec.topk_groups, routed_scaling_factor=spec.routed_scaling_factor,
                          bias_update_rate=0.0)
    return MoEConfig(num_experts=spec.num_experts, expert_hidden=spec.expert_hidden, num_shared_experts=1,
                     alignment=spec.alignment, dispatch_format="e4m3" if spec.fp8_dispatch else "bf16", router=router,
                     fp8_experts=spec.fp8_experts)


def _row_line(r: dict) -> str:
    a2a = _or_dash(r["a2a_same_bytes_gbps_per_rank"], "7.2f")
    return (f"{r['mode']:>6} EP {r['ep']:>3} {r['tokens_per_rank']:>7} tok/rank | layer {r['layer_ms']:9.3f} ms "
            f"{r['layer_tokens_per_s']:12.0f} tok/s | dispatch {r['dispatch_ms']:8.3f} ms "
            f"(graph {_or_dash(r['dispatch_graph_ms'], '8.3f')}) {r['dispatch_gbps_per_rank']:7.2f} GB/s | combine "
            f"{r['combine_ms']:8.3f} ms (graph {_or_dash(r['combine_graph_ms'], '8.3f')}) "
            f"{r['combine_gbps_per_rank']:7.2f} GB/s | a2a {a2a} GB/s | imbalance rank {r['rank_imbalance']:.2f} "
            f"expert {r['expert_imbalance']:.2f} | local {_or_dash(r['local_ms'], '8.3f')} ms exposed comm "
            f"{_or_dash(r['exposed_comm_ms'], '8.3f')} ms {_or_dash(r['exposed_comm_pct'], '5.1f')} % | "
            f"{r['model_tflops_per_gpu']:7.3f} TFLOP/s/GPU")


def _or_dash(value: float | None, fmt: str) -> str:
    return format(value, fmt) if value is not None else "-".rjust(int(fmt.split(".")[0]))


# ---------------------------------------------------------------------------------------------
# The program: parse, launch, add efficiencies, print, write JSON and the plot.


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ep-runtime bench ep-scaling", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--launcher", choices=("local", "ray", "torchrun-env"),
                   help="default: torchrun-env under torchrun (WORLD_SIZE set), else local")
    p.add_argument("--num-workers", type=int, help="workers to start (local, ray): default one per GPU, else 2")
    p.add_argument("--address", help="Ray cluster address (ray launcher): auto or HOST:PORT")
    p.add_argument("--gpus-per-worker", type=float, help="ray launcher: default 1 if the cluster has GPUs")
    p.add_argument("--shape", choices=sorted(SHAPES), help="layer shape: small (default on CPU), deepseek-v3 "
                   "(hidden 7168, 256 experts, top-8, 4096 tokens per rank, FP8 dispatch; default on GPU)")
    for name in ("hidden", "experts", "topk", "expert-hidden", "tokens-per-rank", "alignment"):
        p.add_argument(f"--{name}", type=int, help="override the shape's value")
    p.add_argument("--fp8-dispatch", action=argparse.BooleanOptionalAction, default=None,
                   help="tokens travel as FP8 e4m3 with 1x128 scales (default: the shape's)")
    p.add_argument("--dispatcher", choices=("all_to_all", "nvlink"), default="all_to_all",
                   help="the dispatch/combine backend (default all_to_all)")
    p.add_argument("--fp8-experts", action="store_true",
                   help="the routed experts' GEMMs in FP8 (alignment 128 unless --alignment says otherwise)")
    p.add_argument("--max-ep", type=int, help="largest EP size (default: all workers)")
    p.add_argument("--only-ep", type=int, help="measure this EP size alone (the efficiency then needs EP 1 too)")
    p.add_argument("--modes", default=",".join(MODES), help="weak,strong (default both)")
    p.add_argument("--warmup", type=int, default=BenchSpec.warmup)
    p.add_argument("--iters", type=int, default=BenchSpec.iters)
    p.add_argument("--timeout", type=float, default=BenchSpec.timeout_s, help="collective timeout, s")
    p.add_argument("--out", default="runs/bench", help="output directory (default runs/bench)")
    p.add_argument("--commit", help="the commit measured (default: git rev-parse HEAD)")
    return p


def spec_from_args(a: argparse.Namespace, *, on_gpu: bool) -> BenchSpec:
    shape = a.shape or ("deepseek-v3" if on_gpu else "small")
    values = dict(SHAPES[shape])
    for key, value in (("hidden", a.hidden), ("num_experts", a.experts), ("topk", a.topk),
                       ("expert_hidden", a.expert_hidden), ("tokens_per_rank", a.tokens_per_rank),
                       ("alignment", a.alignment), ("fp8_dispatch", a.fp8_dispatch)):
        if value is not None:
            values[key] = value
    if a.fp8_experts and a.alignment is None:  # an FP8 GEMM tile's rows
        values["alignment"] = 128
    if values["num_experts"] % values["num_groups"]:  # an override of the experts: one group
        values.update(num_groups=1, topk_groups=None)
    return BenchSpec(shape=shape, **values, dispatcher=a.dispatcher, fp8_experts=a.fp8_experts, max_ep=a.max_ep,
                     only_ep=a.only_ep, modes=tuple(m for m in a.modes.split(",") if m), warmup=a.warmup,
                     iters=a.iters, timeout_s=a.timeout)


def main(argv: list[str] | None = None, *, start: StartWorkers | None = None) -> dict | None:
    import torch

    a = parser().parse_args(argv)
    launcher = a.launcher or ("torchrun-env" if "WORLD_SIZE" in os.environ else "local")
    spec = spec_from_args(a, on_gpu=torch.cuda.is_available())
    world = int(os.environ["WORLD_SIZE"]) if launcher == "torchrun-env" else a.num_workers or torch.cuda.device_count() or 2
    spec.ep_sizes(world)  # bad sizes fail here, not in every worker
    if launcher == "torchrun-env":
        result = bench_worker(spec)
        if result is None:  # not rank 0
            return None
    else:
        start = need_start(start, "ep-scaling")
        options = {"address": a.address, "gpus_per_worker": a.gpus_per_worker} if launcher == "ray" else {}

        result = start(bench_worker, spec, launcher=launcher, num_workers=world, **options)[0]
    report = _report(spec, result, launcher, a.commit)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = (f"ep_scaling_{spec.shape}" + ("" if spec.dispatcher == "all_to_all" else f"_{spec.dispatcher}")
            + ("_fp8_experts" if spec.fp8_experts else ""))
    json_path = out / f"{stem}.json"
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    png_path = plot(report, out / f"{stem}.png")
    print(f"ep-scaling on {report['device']} ({launcher}, {report['world_size']} workers), shape {spec.shape}:")
    for row in report["rows"]:
        eff = row["layer_efficiency"]
        print(_row_line(row) + (f" | efficiency layer {eff:.2f}" if eff is not None else ""))
    print(f"wrote {json_path}" + (f" and {png_path}" if png_path else " (no plot: matplotlib is not installed)"))
    return report


def _report(spec: BenchSpec, result: dict, launcher: str, commit: str | None = None) -> dict:
    """Adds efficiencies against EP 1 of the same mode."""
    rows = result["rows"]
    for row in rows:
        base = next((r for r in rows if r["mode"] == row["mode"] and r["ep"] == 1), None)
        if base is None:  # --only-ep without EP 1
            row["layer_efficiency"] = row["dispatch_combine_efficiency"] = None
            continue
        scale = 1 if row["mode"] == "weak" else row["ep"]
        row["layer_efficiency"] = base["layer_ms"] / (scale * row["layer_ms"])
        row["dispatch_combine_efficiency"] = ((base["dispatch_ms"] + base["combine_ms"])
                                              / (scale * (row["dispatch_ms"] + row["combine_ms"])))
    return {
        "benchmark": "ep-scaling", "device": result["device"], "world_size": result["world_size"],
        "launcher": launcher, "commit": commit or head_commit(), "time": datetime.datetime.now().isoformat(timespec="seconds"),
        "torch": __import__("torch").__version__, "spec": asdict(spec),
        "bytes_counted": "per rank: dispatch = token rows sent to other ranks (FP8 bytes + float32 1x128 scales "
                         "with fp8_dispatch, else activation dtype); combine = rows sent back to other ranks "
                         "(activation dtype); router weights, counts and rows kept on the rank not counted",
        "timing": "median over iters (after warmup) of the slowest rank per iteration; CUDA events on GPU",
        "rows": rows,
    }


def plot(report: dict, png_path: Path) -> Path | None:
    """Throughput (tokens/s) and efficiency against EP size, weak and strong scaling; None (and
    no plot) where matplotlib is not installed: the JSON is the result."""
    try:
        import matplotlib
    except ImportError:
        return None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tput, ax_eff) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, style in (("weak", "-o"), ("strong", "--s")):
        rows = sorted((r for r in report["rows"] if r["mode"] == mode), key=lambda r: r["ep"])
        if not rows:
            continue
        eps = [r["ep"] for r in rows]
        ax_tput.plot(eps, [r["layer_tokens_per_s"] for r in rows], style, color="C0",
                     label=f"MoE layer fwd+bwd, {mode}")
        ax_tput.plot(eps, [r["dispatch_combine_tokens_per_s"] for r in rows], style, color="C1",
                     label=f"dispatch+combine, {mode}")
        if rows[0]["layer_efficiency"] is None:  # --only-ep without EP 1
            continue
        ax_eff.plot(eps, [r["layer_efficiency"] for r in rows], style, color="C0", label=f"MoE layer, {mode}")
        ax_eff.plot(eps, [r["dispatch_combine_efficiency"] for r in rows], style, color="C1",
                    label=f"dispatch+combine, {mode}")
    ax_tput.set(xlabel="EP size", ylabel="tokens/s (whole group)", xscale="log", yscale="log",
                title="throughput")
    ax_eff.axhline(1.0, color="gray", linewidth=0.8)
    ax_eff.set(xlabel="EP size", ylabel="efficiency vs EP 1", xscale="log", title="scaling efficiency")
    for ax in (ax_tput, ax_eff):
        eps = sorted({r["ep"] for r in report["rows"]})
        ax.set_xticks(eps, [str(e) for e in eps])
        ax.set_xticks([], minor=True)  # a log axis labels its minor ticks too (3x10^0, 6x10^0)
        ax.legend(fontsize=7)
    spec = report["spec"]
    fig.suptitle(f"ep-scaling ({spec['dispatcher']}), {report['device']}: hidden {spec['hidden']}, {spec['num_experts']} experts, "
                 f"top-{spec['topk']}, {spec['tokens_per_rank']} tokens/rank, "
                 f"{'FP8' if spec['fp8_dispatch'] else 'no FP8'} dispatch", fontsize=9)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path


if __name__ == "__main__":
    main()
