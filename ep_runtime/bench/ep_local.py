"""``bench ep-scaling``'s baseline without communication, and the MoE layer's model FLOPs.

At EP ``n`` a rank holds ``E / n`` experts and computes, on average, the routes of as many tokens as
it dispatches (``T K`` expert rows; exactly that when the load is balanced). The baseline runs the
same layer on one rank alone (EP 1, the identity transport: no token leaves the rank) with those
``E / n`` experts and the same ``T`` tokens: the same expert rows on the same grouped-GEMM shapes,
the FP8 casts of ``--fp8-dispatch`` included. Its router scores ``E / n`` experts, not ``E``
(``T D E (1 - 1/n)`` multiply-adds fewer, under 1% of DeepSeek-V3's layer). What the EP ``n``
layer takes beyond it is communication (and the waits it brings) that nothing hides:

    exposed_comm_ms = layer_ms - local_ms        exposed_comm_pct = 100 * exposed_comm_ms / layer_ms

Both times are medians of the slowest rank per iteration, so the difference can come out slightly
negative where communication is all hidden. EP 1 is its own baseline: exposed 0.

Model FLOPs per rank: ``6 T N`` for forward+backward (2 per weight forward, 4 backward), ``N`` the
weights a token multiplies with in the layer (``metrics.moe_active_params``: router, ``topk``
routed experts, shared experts); ``model_tflops_per_gpu`` divides them by the layer's time.
"""

from __future__ import annotations

from dataclasses import replace

from ..config import MoEConfig


def local_spec(spec, ep: int):
    """The ``BenchSpec`` of EP ``ep``'s baseline: ``num_experts / ep`` experts, the rest as
    ``spec``, plain top-k (one group: group-limited routing bounds the nodes a token's rows travel
    to, and here nothing travels). None where the rank's experts are fewer than the routes per
    token (``topk``), which the router cannot pick distinctly."""
    if not isinstance(ep, int) or ep < 1 or spec.num_experts % ep:
        raise ValueError(f"ep: expected a positive divisor of num_experts={spec.num_experts}, got {ep!r}")
    experts = spec.num_experts // ep
    if spec.topk > experts:
        return None
    return replace(spec, num_experts=experts, num_groups=1, topk_groups=None)


def layer_flops(moe: MoEConfig, hidden: int, tokens: int) -> int:
    """Model FLOPs of the MoE layer's forward+backward over ``tokens`` tokens: ``6 T N``."""
    from ..metrics import moe_active_params  # imports torch, which the CLI's parsing does without

    return 6 * tokens * moe_active_params(moe, hidden)


def comm_figures(layer_ms: float, local_ms: float | None, flops: int) -> dict:
    """The row's fields: ``local_ms``, ``exposed_comm_ms`` and ``exposed_comm_pct`` (None without a
    baseline), and ``model_tflops_per_gpu`` (``flops`` per rank over ``layer_ms``)."""
    exposed = None if local_ms is None else layer_ms - local_ms
    return {"local_ms": local_ms, "exposed_comm_ms": exposed,
            "exposed_comm_pct": None if exposed is None else 100 * exposed / layer_ms,
            "layer_flops_per_rank": flops, "model_tflops_per_gpu": flops / layer_ms / 1e9}
