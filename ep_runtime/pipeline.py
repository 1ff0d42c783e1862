"""Pipeline parallelism with expert parallelism inside each stage (``pipeline.md`` has the placement
table and the 1F1B phase diagram).

``TinyDeepSeek`` is cut into ``pp`` stages of whole blocks (``stage_layers``): stage 0 also holds the
embeddings (and the mHC widening), the last stage the mHC head, final norm, LM head and loss. Each
stage's MoE layers run expert parallelism over the stage's own EP group and its Engram tables are
sharded within it (both come from the ``ParallelContext``, whose groups are per stage).

What travels between stages, micro-batch by micro-batch, is the residual stream: ``[M_b, S, D]``,
or ``[M_b, S, N, D]`` with mHC (``Boundary``, its shape declared once per step), forward as
activations and backward as their gradients (bf16 between GPUs, float32 on CPU), by point-to-point
``isend``/``irecv`` over the ``pp`` group. Token ids do not travel: every stage is given the same batch (the last stage needs it for
its targets and an Engram layer in any stage for its hashes), as a data loader replicated along
``pp`` would give it.

Schedules (``schedule_ops``, run by ``PipelineSchedule.step``): ``"1f1b"`` (warmup forwards, steady
one-forward-one-backward, cooldown backwards), ``"gpipe"`` (every forward, then every backward),
``"interleaved"`` (1F1B over ``V`` model chunks per stage) and ``"overlap"`` (two 1F1B pipelines,
over the even and the odd micro-batches, their ops issued alternately by one thread onto two
CUDA streams, so that one micro-batch's forward, EP all-to-alls included, runs on the GPU while
another's backward computes; each lane has its own EP and point-to-point groups and stream,
``ep_runtime.lanes``), computing
the same gradients. The loss of a step is the mean over its micro-batches, each micro-batch's backward
scaled by ``1 / num_microbatches``; ``gradients.average_gradients`` then averages over the stage's data
ranks.

Shape letters: B sequences of this rank, M number of micro-batches, M_b = B / M sequences per
micro-batch, S sequence length (the batch's minus one), D hidden, N mHC streams.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from . import lanes
from .config import PIPELINE_SCHEDULES
from .model import TinyDeepSeek
from .moe import MoELayer
from .parallel import ParallelContext

SCHEDULES = PIPELINE_SCHEDULES


def stage_layers(num_layers: int, pp: int) -> list[range]:
    """The blocks of each stage: ``num_layers`` whole blocks split into ``pp`` contiguous runs,
    earlier stages taking one more when they do not divide evenly."""
    if pp < 1 or num_layers < pp:
        raise ValueError(f"parallel.pp: expected 1..model.num_layers={num_layers} stages, got {pp}")
    base, extra = divmod(num_layers, pp)
    bounds = [0]
    for s in range(pp):
        bounds.append(bounds[-1] + base + (s < extra))
    return [range(lo, hi) for lo, hi in zip(bounds, bounds[1:])]


def split_microbatches(tokens_BS: torch.Tensor, num_microbatches: int) -> list[torch.Tensor]:
    """``[B, S+1]`` -> ``num_microbatches`` chunks ``[B / M, S+1]``; raises unless M divides B."""
    batch = tokens_BS.shape[0]
    if not isinstance(num_microbatches, int) or num_microbatches < 1 or batch % num_microbatches:
        raise ValueError(f"num_microbatches: expected a divisor of the batch size {batch} (sequences per rank), "
                         f"got {num_microbatches!r}")
    return list(tokens_BS.chunk(num_microbatches))


class _OnAnotherStage(nn.Module):
    """Stands in for a block that another stage holds (no parameters, no FFN, no Engram)."""

    ffn = None
    engram = None


class PipelineStage(nn.Module):
    """This rank's part of ``model``: the blocks of its virtual stages (``stage``, ``stage + P``,
    ... for ``chunks`` model chunks, ``P = num_stages``; one chunk without interleaving; others are
    replaced by a parameterless stand-in so parameter names stay those of the whole model), the
    embeddings on the first stage, the mHC head, final norm and LM head on the last. Build
    ``model`` under the same seed on every rank, with this rank's stage-local dispatcher and EP
    rank."""

    def __init__(self, model: TinyDeepSeek, *, stage: int, num_stages: int, chunks: int = 1):
        super().__init__()
        if num_stages > 1 and model.cfg.moe.router.aux_loss_coef > 0:  # each stage would need its own term
            raise ValueError("model.moe.router.aux_loss_coef: expected 0 with pipeline stages (parallel.pp > 1; "
                             f"not supported yet), got {model.cfg.moe.router.aux_loss_coef}")
        if not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"parallel.virtual_stages: expected an int >= 1, got {chunks!r}")
        if chunks > 1 and num_stages * chunks > model.cfg.num_layers:
            raise ValueError(f"parallel.virtual_stages: expected pp x virtual_stages <= model.num_layers="
                             f"{model.cfg.num_layers} (a block per virtual stage at least), got {num_stages} x {chunks}")
        self.cfg = model.cfg
        self.stage, self.num_stages, self.chunks = stage, num_stages, chunks
        every = stage_layers(model.cfg.num_layers, num_stages * chunks)
        self.chunk_layers = [every[c * num_stages + stage] for c in range(chunks)]
        self.layers = [i for layers in self.chunk_layers for i in layers]
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        for i in range(model.cfg.num_layers):
            if i not in self.layers:
                model.blocks[i] = _OnAnotherStage()
        if not self.is_first:
            model.embed = model.pos_embed = None
        if not self.is_last:
            model.mhc_head = model.norm = model.head = None
        self.model = model

    def moe_layers(self, chunk: int) -> list[MoELayer]:
        return [self.model.blocks[i].ffn for i in self.chunk_layers[chunk]
                if isinstance(self.model.blocks[i].ffn, MoELayer)]

    def forward(self, x: torch.Tensor | None, tokens_BS: torch.Tensor, chunk: int = 0) -> torch.Tensor:
        """The first virtual stage: ``x`` is None, the stream starts from ``tokens_BS[:, :-1]``.
        Returns the stream for the next virtual stage, or on the last the micro-batch's mean
        loss."""
        m = self.model
        inputs_BS = tokens_BS[:, :-1]
        first, last = self.is_first and chunk == 0, self.is_last and chunk == self.chunks - 1
        if first:
            x = m.embed_tokens(inputs_BS)
        for i in self.chunk_layers[chunk]:
            x = m.blocks[i](x, inputs_BS)
        if not last:
            return x
        return m.next_token_loss(m.logits(x), tokens_BS[:, 1:])  # balance losses: one stage (checked above)


@dataclass(frozen=True)
class Boundary:
    """The stream that crosses a stage boundary, declared once per step: ``[M_b, S, D]`` or with
    mHC ``[M_b, S, N, D]``. It travels as ``wire_dtype`` (bf16 between GPUs: half the bytes of
    float32 activations and their gradients) and is computed on as ``dtype``."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    wire_dtype: torch.dtype
    device: torch.device

    def empty(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.wire_dtype, device=self.device)


def schedule_ops(schedule: str, *, stage: int, num_stages: int, num_microbatches: int,
                 chunks: int = 1) -> list[tuple[str, int, int]]:
    """The order in which ``stage`` runs its forwards and backwards: ``("F" or "B", chunk,
    micro-batch)``, phase by phase as ``pipeline.md`` draws them."""
    p, m, s = num_stages, num_microbatches, stage
    if schedule == "gpipe":  # phase 1: every forward; phase 2: every backward
        return [("F", 0, i) for i in range(m)] + [("B", 0, i) for i in range(m)]
    if schedule == "1f1b":
        warmup = min(p - 1 - s, m)
        ops = [("F", 0, i) for i in range(warmup)]  # phase 1, warmup: fill the pipeline below
        for i in range(warmup, m):  # phase 2, steady state: one forward, the oldest backward
            ops += [("F", 0, i), ("B", 0, i - warmup)]
        return ops + [("B", 0, i) for i in range(m - warmup, m)]  # phase 3, cooldown: drain
    # interleaved: forward k runs chunk (k // P) % V on micro-batch (k // (P V)) P + k % P, so
    # each group of P micro-batches passes every chunk in turn; backwards the chunks in reverse.
    if m % p:
        raise ValueError(f"num_microbatches: expected a multiple of the {p} stages with the interleaved schedule, "
                         f"got {m}")
    total = m * chunks

    def op(kind: str, k: int) -> tuple[str, int, int]:
        chunk = (k // p) % chunks
        return kind, chunk if kind == "F" else chunks - 1 - chunk, (k // (p * chunks)) * p + k % p

    warmup = min((p - s - 1) * 2 + (chunks - 1) * p, total)
    ops = [op("F", k) for k in range(warmup)]  # phase 1, warmup
    for k in range(warmup, total):  # phase 2, steady state
        ops += [op("F", k), op("B", k - warmup)]
    return ops + [op("B", k) for k in range(total - warmup, total)]  # phase 3, cooldown


def overlap_lanes(*, stage: int, num_stages: int, num_microbatches: int) -> list[list[tuple[str, int, int]]]:
    """The ``overlap`` schedule's lanes: lane ``l`` runs 1F1B over micro-batches ``l, l + 2, ...``."""
    if num_microbatches % 2:
        raise ValueError(f"num_microbatches: expected an even number with the overlap schedule (two lanes), "
                         f"got {num_microbatches}")
    ops = schedule_ops("1f1b", stage=stage, num_stages=num_stages, num_microbatches=num_microbatches // 2)
    return [[(kind, chunk, 2 * i + lane) for kind, chunk, i in ops] for lane in range(2)]


def overlap_ops(*, stage: int, num_stages: int, num_microbatches: int) -> list[tuple[str, int, int, int]]:
    """The order in which one thread issues the ``overlap`` schedule: ``(kind, chunk, micro-batch,
    lane)``, the two lanes' ops alternating with lane 1 one op behind lane 0 (``pipeline.md``
    draws it). Every rank issues its collectives in an order fixed by the schedule, so the
    ranks of an EP group meet in the same order on every lane's groups; the test checks the order
    for deadlocks as if every receive blocked."""
    first, second = overlap_lanes(stage=stage, num_stages=num_stages, num_microbatches=num_microbatches)
    ops = []
    for k in range(len(first) + 1):
        if k < len(first):
            ops.append((*first[k], 0))
        if k > 0:
            ops.append((*second[k - 1], 1))
    return ops


class PipelineSchedule:
    """Runs one training step's forwards and backwards for this rank's ``stage``.

    ``ctx`` gives the stage (``pp_rank``, ``pp_size``); the neighbouring virtual stages are this
    rank's neighbours in the ``pp`` group (the last stage's next is the first stage's next chunk).
    Activations travel in one process group and gradients in another, so each direction's
    messages between two ranks are matched in the order they were sent, whatever the schedule
    interleaves. With ``pp_size == 1`` it is plain gradient accumulation over micro-batches."""

    def __init__(self, stage: PipelineStage, ctx: ParallelContext, *, num_microbatches: int,
                 schedule: str = "1f1b", timed: bool = False):
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule: expected one of {SCHEDULES}, got {schedule!r}")
        if not isinstance(num_microbatches, int) or num_microbatches < 1:
            raise ValueError(f"num_microbatches: expected an int >= 1, got {num_microbatches!r}")
        if (stage.stage, stage.num_stages) != (ctx.pp_rank, ctx.pp_size):
            raise ValueError(f"stage: expected stage {ctx.pp_rank} of {ctx.pp_size} (the context's), got "
                             f"{stage.stage} of {stage.num_stages}")
        if (schedule == "interleaved") != (stage.chunks > 1):
            raise ValueError(f"parallel.virtual_stages: expected > 1 with the interleaved schedule and 1 otherwise, "
                             f"got {stage.chunks} with {schedule!r}")
        if schedule == "interleaved" and stage.num_stages == 1:
            raise ValueError("parallel.pp: expected more than one stage with the interleaved schedule, got 1")
        self.lanes = 2 if schedule == "overlap" else 1
        if self.lanes > 1:
            overlap_lanes(stage=0, num_stages=1, num_microbatches=num_microbatches)  # checks M
            _check_lanes(stage, ctx, self.lanes)
        else:  # checks M now, not at the first step
            schedule_ops(schedule, stage=stage.stage, num_stages=stage.num_stages, num_microbatches=num_microbatches,
                         chunks=stage.chunks)
        self.stage, self.ctx = stage, ctx
        self.num_microbatches, self.schedule = num_microbatches, schedule
        self.timed = timed  # on GPUs: synchronize around receives, so that wait_s is the waiting
        self.per_stage = ctx.world_size // ctx.pp_size
        self.groups = [{"F": None, "B": None} for _ in range(self.lanes)]  # per lane
        if ctx.distributed and ctx.pp_size > 1:
            self.groups = [{kind: _pair_group(ctx) for kind in "FB"} for _ in range(self.lanes)]
            for group in (g for per_lane in self.groups for g in per_lane.values()):
                _connect(group, ctx.device)
        on_gpu = ctx.device.type == "cuda" and self.lanes > 1
        self._streams = [torch.cuda.Stream(ctx.device) if on_gpu else None for _ in range(self.lanes)]  # per lane

    def _neighbour(self, chunk: int, step: int) -> tuple[int, int] | None:
        """``(rank, chunk)`` of the virtual stage ``step`` (+1 or -1) away, None past either end."""
        p, s = self.stage.num_stages, self.stage.stage
        chunk += (s + step) // p  # -1 or +1 at the ends of a pass over the stages
        if not 0 <= chunk < self.stage.chunks:
            return None
        return self.ctx.rank + ((s + step) % p - s) * self.per_stage, chunk

    def boundary(self, tokens_BS: torch.Tensor) -> Boundary:
        cfg = self.stage.cfg
        rows, seq = tokens_BS.shape[0] // self.num_microbatches, tokens_BS.shape[1] - 1
        streams = (cfg.mhc.n,) if cfg.mhc else ()
        wire = torch.bfloat16 if self.ctx.device.type == "cuda" else torch.float32
        return Boundary((rows, seq, *streams, cfg.hidden), torch.float32, wire, self.ctx.device)

    def step(self, tokens_BS: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward of every micro-batch of ``tokens_BS`` (int64 ``[B, S+1]``, the same
        on every stage of a pipeline). Accumulates gradients into this stage's parameters; returns
        the mean loss over the micro-batches (detached) on the last stage, None elsewhere. Each MoE
        layer's ``load_E`` then holds the routes of every micro-batch (as one forward of the batch),
        and ``wait_s`` the seconds this rank waited on its neighbours (``ep-runtime bench pipeline``
        divides it by the step's time: the measured bubble; on GPUs only with ``timed``, which
        synchronizes the stream around every receive and is off in training)."""
        micro = split_microbatches(tokens_BS, self.num_microbatches)
        sizes = dict(stage=self.stage.stage, num_stages=self.stage.num_stages, num_microbatches=self.num_microbatches)
        if self.lanes > 1:
            ops = overlap_ops(**sizes)
        else:
            ops = [(*op, 0) for op in schedule_ops(self.schedule, **sizes, chunks=self.stage.chunks)]
        self._shape = self.boundary(tokens_BS)
        self.wait_s = 0.0
        self._saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []
        self._losses: dict[int, torch.Tensor] = {}
        self._load = {moe: torch.zeros_like(moe.load_E) for moe in self.stage.model.moe_layers}
        self._run(ops, micro)
        with self.ctx.activity("the pipeline sends' completion"):
            for work, _ in self._sends:
                work.wait()
        for moe, load_E in self._load.items():
            moe.load_E = load_E
        losses = [self._losses[i] for i in sorted(self._losses)]
        self._saved, self._sends, self._losses = {}, [], {}
        return torch.stack(losses).mean() if losses else None

    def _run(self, ops: list[tuple[str, int, int, int]], micro: list[torch.Tensor]) -> None:
        """Issues ``ops`` in order, each on its lane's groups and (on GPUs, with two lanes) its
        lane's CUDA stream, which start behind the caller's stream and join it at the end."""
        streams = [s for s in self._streams if s is not None]
        caller = torch.cuda.current_stream(self.ctx.device) if streams else None
        for stream in streams:
            stream.wait_stream(caller)  # the optimizer's last update
        for kind, chunk, i, lane in ops:
            stream = self._streams[lane]
            with lanes.lane(lane), torch.cuda.stream(stream) if stream else contextlib.nullcontext():
                if kind == "F":
                    self._forward(chunk, i, micro[i])
                else:
                    self._backward(chunk, i)
        for stream in streams:
            caller.wait_stream(stream)

    def _recv(self, src: int, kind: str) -> torch.Tensor:
        """The next stream (``kind`` "F") or gradient ("B") from ``src``; the time this rank sat
        waiting for it (its share of the pipeline's bubble) adds to ``wait_s``."""
        t = self._shape.empty()
        synchronize = self.timed and t.is_cuda
        if synchronize:  # this rank's own work is not waiting
            torch.cuda.current_stream().synchronize()
        start = time.perf_counter()
        with self.ctx.activity(f"the pipeline recv from rank {src}"):
            dist.irecv(t, src, group=self.groups[lanes.current()][kind]).wait()
        if synchronize:  # NCCL receives complete on the stream
            torch.cuda.current_stream().synchronize()
        self.wait_s += time.perf_counter() - start
        return t.to(self._shape.dtype)

    def _forward(self, chunk: int, i: int, tokens_BS: torch.Tensor) -> None:
        prev, nxt = self._neighbour(chunk, -1), self._neighbour(chunk, +1)
        x = self._recv(prev[0], "F").requires_grad_() if prev else None
        out = self.stage(x, tokens_BS, chunk)
        for moe in self.stage.moe_layers(chunk):  # a forward leaves its own routes only (per lane)
            self._load[moe] += moe.load_E.to(self._load[moe].device)
        if nxt:
            self._send(out.detach(), nxt[0], "F")
        else:
            self._losses[i] = out.detach()
        self._saved[chunk, i] = (x, out)

    def _backward(self, chunk: int, i: int) -> None:
        x, out = self._saved.pop((chunk, i))
        prev, nxt = self._neighbour(chunk, -1), self._neighbour(chunk, +1)
        if nxt is None:
            (out / self.num_microbatches).backward()
        else:
            torch.autograd.backward(out, self._recv(nxt[0], "B"))
        if prev:
            self._send(x.grad, prev[0], "B")

    def _send(self, t: torch.Tensor, dst: int, kind: str) -> None:
        t = t.to(self._shape.wire_dtype).contiguous()
        with self.ctx.activity(f"the pipeline send to rank {dst}"):  # NCCL may block a first send
            self._sends.append((dist.isend(t, dst, group=self.groups[lanes.current()][kind]), t))  # alive until done


def _check_lanes(stage: PipelineStage, ctx: ParallelContext, num_lanes: int) -> None:
    """Every MoE layer's dispatcher and Engram table of ``stage`` has a member per lane (each over
    its own EP group), or none that travels: no EP group, or a transport and table without a group
    (an EP group of one rank: ``make_dispatcher``'s identity, which every lane may share)."""
    if ctx.ep_group is None:
        return
    model = stage.model
    moe = [i for i in stage.layers if isinstance(model.blocks[i].ffn, MoELayer)]
    shared = [f"blocks.{i}.ffn.dispatcher" for i in moe if lanes.attribute(model.blocks[i].ffn.dispatcher, "group")
              is not None and lanes.lanes_of(model.blocks[i].ffn.dispatcher) != num_lanes]
    shared += [f"blocks.{i}.engram.table.group" for i in stage.layers if model.blocks[i].engram is not None
               and model.blocks[i].engram.table.group is not None
               and lanes.lanes_of(model.blocks[i].engram.table.group) != num_lanes]
    if shared:
        raise ValueError(f"schedule: 'overlap' runs {num_lanes} lanes at once, each needing its own EP groups; "
                         f"{shared[0]} is one for all lanes (build the model with make_dispatcher(cfg, ctx, "
                         f"lanes={num_lanes}))")


def _connect(group: dist.ProcessGroup, device: torch.device) -> None:
    """One message each way between every two ranks of ``group``, all in one batch. NCCL connects
    two ranks on their first message, and that first send blocks the host until the peer's matching
    call: with the overlap schedule's four groups a stage could block on one group's first send
    while its neighbour blocked on another's (the overlap schedule hung so on four H200s).
    Connected here, at construction, in one order on every rank, the schedule's first sends find
    their peers connected."""
    me = dist.get_rank()
    peers = [r for r in dist.get_process_group_ranks(group) if r != me]
    out, into = torch.zeros(1, device=device), torch.zeros(len(peers), device=device)
    ops = [op for k, peer in enumerate(peers) for op in (dist.P2POp(dist.isend, out, peer, group),
                                                            dist.P2POp(dist.irecv, into[k:k + 1], peer, group))]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def _pair_group(ctx: ParallelContext) -> dist.ProcessGroup:
    """A new group of this rank's ``pp`` group's ranks (one ``(dp, ep)`` position on every stage):
    point-to-point messages then share a communicator with nothing but their own pipeline's.
    Collective: every rank makes every position's group, in one order."""
    per_stage = ctx.world_size // ctx.pp_size
    mine = None
    for position in range(per_stage):
        group = dist.new_group(list(range(position, ctx.world_size, per_stage)))
        if ctx.rank % per_stage == position:
            mine = group
    return mine
