"""The contract every dispatch/combine backend meets.

Shape letters: T tokens on this rank, K routes per token (top-k), D hidden, R rows this rank
receives (one per token per destination rank), P rows of the expert-major layout.

Backends subclass ``Dispatcher`` and register under the name ``model.moe.dispatcher`` gives
(``class NVLinkDispatcher(Dispatcher, name="nvlink")``): ``all_to_all`` (``all_to_all_single``),
``nvlink`` (a symmetric heap, no host sync; two-stage, ``hierarchical``, when the EP group spans
nodes), ``deepep`` (DeepEP's ``Buffer``). Each supplies ``dispatch``, ``combine`` and the transport
hooks the shared autograd of ``autograd.py`` calls (``scatter``, ``gather_home``, ``reduce_home``);
one conformance suite (``tests/runtime/test_dispatch_conformance.py``) holds them to this contract.

``dispatch`` puts each token once on every EP rank that owns one of its experts (once per rank,
not per route: link bytes are the scarce resource) and hands the local experts an expert-major
layout, aligned for grouped GEMM and expanded on the receiver. ``combine`` reduces, on each rank,
its experts' outputs per token with the router weights, sends one row per token home and sums
there. Both are differentiable in ``x``, ``y`` and the router weights.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch

from kernels.permute import ExpertLayout
from kernels.validate import check_positive, check_tensor, per_signature

if TYPE_CHECKING:
    from ..config import MoEConfig
    from ..parallel import ParallelContext

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Route(Protocol):
    """Where a backend's ``dispatch`` sent the rows (its own fields besides these); read-only."""

    layout: ExpertLayout  # of the received routes over the local experts (``pos_TK`` is [R, K])
    num_tokens: int  # T, the tokens this rank dispatched


@dataclass(frozen=True)
class DispatchHandle:
    """What combine needs to bring expert outputs home. Made by ``dispatch``; read-only.

    Attributes:
        route: where the rows went.
        recv_weights_RK: float32 [R, K], router weight of each received row's route to a local
            expert, 0 for routes elsewhere or masked (-1). Part of the autograd graph.
    """

    route: Route
    recv_weights_RK: torch.Tensor


class Dispatcher(abc.ABC):
    """Moves tokens to the ranks of their experts and their results back. Not an nn.Module.

    A subclass given a ``name`` (``class X(Dispatcher, name="x")``) is the backend of that
    ``model.moe.dispatcher``; ``from_config`` builds it over a rank's EP group."""

    backends: ClassVar[dict[str, type[Dispatcher]]] = {}  # by name, filled as subclasses are defined
    fp8_combine_capable: ClassVar[bool] = False  # combine can send expert outputs home as FP8

    num_experts: int  # global (physical) experts over the EP group
    num_local_experts: int
    ep_rank: int  # this process's rank in the EP group: it holds experts [ep_rank * E_local, (ep_rank + 1) * E_local)

    def __init_subclass__(cls, name: str | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if name is not None:
            Dispatcher.backends[name] = cls

    @classmethod
    @abc.abstractmethod
    def from_config(cls, cfg: MoEConfig, ctx: ParallelContext) -> Dispatcher:
        """This backend over ``ctx``'s EP group, as ``cfg`` asks (raises ``ValueError`` naming the
        setting where the group does not suit it)."""

    @abc.abstractmethod
    def dispatch(
        self, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_weights_TK: torch.Tensor
    ) -> tuple[torch.Tensor, ExpertLayout, DispatchHandle]:
        """Args:
            x_TD: [T, D] tokens (float32, bfloat16 or float16).
            topk_idx_TK: [T, K] int64 or int32 expert ids in [0, num_experts), -1 = no route; a
                token's ids are distinct experts (what a top-k router gives: ``nvlink``'s receive
                buffers count on it). Checked: by :func:`kernels.validate.check_routes` in backends
                that sync anyway, by ``nvlink``'s send kernels on GPUs (a device-side assert, no
                host sync: the process stops at its next sync).
            topk_weights_TK: [T, K] float32 router weights (ignored where the id is -1).
        Returns:
            x_PD: [P, D] received tokens in the local experts' aligned expert-major layout
                (padding rows zero), dtype of ``x_TD``.
            layout: counts/offsets of that layout over the local experts (``offsets_E`` is what
                ``torch._grouped_mm`` takes as ``offs``).
            handle: for ``combine``.
        """
        ...

    @abc.abstractmethod
    def combine(self, y_PD: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """``y_PD`` [P, D] expert outputs in the layout of ``dispatch`` -> ``out_TD`` [T, D]:
        ``out[t] = sum_k w[t, k] * expert_k(x[t])`` over routes not masked (zero rows for tokens
        with no route)."""

    # The transport over a route the backend planned, which the autograd of ``autograd.py`` calls.
    @abc.abstractmethod
    def scatter(self, rows_TX: torch.Tensor, route: Route) -> torch.Tensor:
        """[T, X] token rows -> [R, X] rows received (valid until this transport's next call)."""

    @abc.abstractmethod
    def gather_home(self, rows_RX: torch.Tensor, route: Route) -> torch.Tensor:
        """[R, X] received rows -> [T, X]: each token's rows from every rank, summed in float32."""

    def gather_weights_home(self, weights_RK: torch.Tensor, route: Route) -> torch.Tensor:
        """The router weights' gradients ([R, K] float32) home, summed: ``gather_home`` unless a
        backend moves them otherwise (``deepep``: combine's ``topk_weights``)."""
        return self.gather_home(weights_RK, route)

    @abc.abstractmethod
    def reduce_home(self, y_PD: torch.Tensor, weights_RK: torch.Tensor, route: Route, *,
                    fp8: bool = False) -> torch.Tensor:
        """Combine's forward: each received row's routes in ``y_PD`` reduced with their weights
        (float32 sums, in y's dtype; ``kernels.reduce.weighted_reduce``), then home as
        ``gather_home`` brings them (a backend may fuse the two). With ``fp8`` (backends that are
        ``fp8_combine_capable``) a row that travels to another rank goes as e4m3 with per-token
        1 x 128 scales and is dequantized (``q * sf``, float32) into the home sum; a rank's rows for
        itself stay in y's dtype; the sum is in y's dtype."""


@per_signature  # checked once per signature: an eager call's host time is the small batch's limit
def check_dispatch_args(x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_weights_TK: torch.Tensor) -> None:
    """Dtypes, shapes and devices of ``Dispatcher.dispatch``'s arguments (values are the backend's
    business: checking them on the host costs a sync)."""
    check_tensor("x_TD", x_TD, ndim=2, dtype=FLOAT_DTYPES)
    check_tensor("topk_idx_TK", topk_idx_TK, dtype=(torch.int64, torch.int32), shape=(x_TD.shape[0], None),
                 device=x_TD.device)
    check_tensor("topk_weights_TK", topk_weights_TK, dtype=torch.float32, shape=tuple(topk_idx_TK.shape),
                 device=x_TD.device)


def local_experts(num_experts: int, ep_size: int) -> int:
    """Experts per rank of an EP group of ``ep_size``; every backend's constructor checks this."""
    check_positive("num_experts", num_experts)
    if num_experts % ep_size:
        raise ValueError(f"num_experts: expected a multiple of the EP size {ep_size}, got {num_experts}")
    return num_experts // ep_size


def check_combine_args(y_PD: torch.Tensor, handle: object) -> None:
    if not isinstance(handle, DispatchHandle):
        raise TypeError(f"handle: expected the DispatchHandle from dispatch, got {type(handle).__name__}")
    _check_y(y_PD, handle.route.layout.num_rows)


@per_signature
def _check_y(y_PD: torch.Tensor, num_rows: int) -> None:
    check_tensor("y_PD", y_PD, shape=(num_rows, None), dtype=FLOAT_DTYPES)
