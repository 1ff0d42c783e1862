"""Gradient averaging over the ranks that hold copies of a parameter.

Dense parameters are replicated on every rank of a pipeline stage: their gradients are averaged
over the stage. Each expert's gradient, and each Engram table shard's, already sums the
contributions of every rank of its EP group (through combine's or the lookup's backward), so it is
summed over the ``dp`` replicas and divided by the stage's size. A parameter that got no gradient
on a rank (an expert no token reached) takes part with zeros, so every rank reduces tensors of the
same size.

``GradientBuckets`` keeps gradients in flat buckets, each parameter's ``.grad`` a view of its
bucket (as torch's DDP does with ``gradient_as_bucket_view``): backward accumulates into them in
place, so the all-reduce needs no copy in or out. With ``overlap``, a bucket's all-reduce starts
while backward still runs, once its last gradient is in.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from .model import TinyDeepSeek
from .parallel import ParallelContext

# Gradients are reduced a bucket of about this many elements (1 GiB of float32) at a time: a bucket's
# all-reduce starts once backward has filled it, and a copy of a v3-layer stage's 5 billion
# gradients into one buffer did not fit beside them on an H200.
REDUCE_BUCKET_ELEMENTS = 1 << 28


def _buckets(tensors: list[torch.Tensor], size: int) -> list[list[torch.Tensor]]:
    """``tensors`` in order, split into runs of about ``size`` elements (a larger tensor alone) and
    of one dtype."""
    runs, run, count = [], [], 0
    for t in tensors:
        if run and (count + t.numel() > size or t.dtype != run[0].dtype):
            runs.append(run)
            run, count = [], 0
        run.append(t)
        count += t.numel()
    return runs + [run] if run else runs


class _Bucket:
    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.flat: torch.Tensor | None = None  # made at first use: one bucket at a time beside the gradients
        self.views: list[torch.Tensor] = []
        self.pending = len(params)  # gradients still to come in this backward

    def allocate(self) -> None:
        if self.flat is None:
            first = self.params[0]
            self.flat = torch.zeros(sum(p.numel() for p in self.params), dtype=first.dtype, device=first.device)
            self.views = [chunk.view_as(p) for p, chunk in zip(self.params, self.flat.split(
                [p.numel() for p in self.params]))]

    def gather(self) -> None:
        """Makes each parameter's ``.grad`` its view, copying in a gradient that is not (zeros for none)."""
        self.allocate()
        for p, view in zip(self.params, self.views):
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
            p.grad = view


class GradientBuckets:
    """The gradients of ``params`` summed over ``group`` and divided by ``divisor``.

    ``attach`` (before a step's backward) zeroes the buckets and makes them the gradients. With
    ``overlap`` (for one backward a step), a bucket's all-reduce is started by the post-accumulate
    hook of its last parameter to get its gradient, buckets in the same order on every rank (their
    collectives must match). ``reduce`` (after backward) starts the others, waits for all and
    divides. Without ``attach``, ``reduce`` copies the gradients in and reduces them all then."""

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup | None, divisor: int, *,
                 overlap: bool = False, bucket_elements: int = REDUCE_BUCKET_ELEMENTS):
        self.params, self.group, self.divisor = params, group, divisor
        alone = dist.get_world_size(group) == 1  # None: the default group
        # Last parameters first: backward makes the last layers' gradients first.
        self.buckets = [] if alone else [_Bucket(run) for run in _buckets(params[::-1], bucket_elements)]
        self._works: list[dist.Work] = []
        self._started = 0  # buckets started this step, in order
        self._armed = False  # between attach and reduce: the hooks start buckets
        if overlap:
            for index, bucket in enumerate(self.buckets):
                for p in bucket.params:
                    p.register_post_accumulate_grad_hook(functools.partial(self._accumulated, index))

    def attach(self) -> None:
        for bucket in self.buckets:
            bucket.allocate()
            bucket.flat.zero_()
            for p, view in zip(bucket.params, bucket.views):
                p.grad = view
            bucket.pending = len(bucket.params)
        self._works, self._started, self._armed = [], 0, True

    def _accumulated(self, index: int, _param: nn.Parameter) -> None:
        if not self._armed:
            return
        bucket = self.buckets[index]
        bucket.pending -= 1
        if bucket.pending < 0:  # its all-reduce may have run: the sum would miss this gradient
            raise RuntimeError("GradientBuckets(overlap=True): a second backward before reduce; overlap is for "
                               "one backward a step")
        while self._started < len(self.buckets) and self.buckets[self._started].pending == 0:
            self._start()

    def _start(self) -> None:
        bucket = self.buckets[self._started]
        self._works.append(dist.all_reduce(bucket.flat, group=self.group, async_op=True))
        self._started += 1

    def reduce(self, ctx: ParallelContext) -> None:
        self._armed = False
        if not self.buckets:  # nothing to add up: no copies into buckets and back
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            if self.divisor > 1 and self.params:
                torch._foreach_div_([p.grad for p in self.params], self.divisor)
            return
        while self._started < len(self.buckets):
            self.buckets[self._started].gather()
            self._start()
        with ctx.activity("the gradient all-reduce"):
            for work in self._works:
                work.wait()
        self._works = []
        for bucket in self.buckets:
            bucket.flat /= self.divisor


def average_gradients(model: TinyDeepSeek, ctx: ParallelContext, dense: GradientBuckets | None = None) -> None:
    """Makes every rank's gradient that of the mean loss over the data ranks of its pipeline stage
    (all ranks without pipelining; ``model`` holds this stage's blocks). ``dense``: the dense
    parameters' buckets, attached before the backward; None: made here."""
    if not ctx.distributed:
        return
    data_ranks = ctx.world_size // ctx.pp_size
    dense = dense or GradientBuckets(model.dense_parameters(), ctx.stage_group, data_ranks)
    sharded = GradientBuckets(model.expert_parameters() + model.sharded_parameters(), ctx.dp_group, data_ranks)
    for buckets in (dense, sharded):
        buckets.reduce(ctx)
