"""``bench kernels`` cases of ``kernels.quant``: the FP8 casts (per token, block, channel), the
cast back, the requantizations (per-token to per-block scales), the per-token FP4 casts (UE8M0
scales; e4m3 scales, the FP4 dispatch wire) and their cast back, SwiGLU (alone, fused with a
per-token cast, and its backward)."""

from __future__ import annotations

import math
from collections.abc import Callable

from .kernels_cases import Case, Inputs, nbytes, tk_peer

def _cast_case(op: str, inp: Inputs, tk, block: tuple[int, int], tk_call) -> Case:
    from kernels import quant
    from kernels.quant import reference

    x = inp.x_TD
    m, n = x.shape
    scales = math.ceil(m / block[0]) * math.ceil(n / block[1])
    ours = {
        "per_token_cast": lambda: quant.per_token_cast(x),
        "per_block_cast": lambda: quant.per_block_cast(x),
        "per_channel_cast": lambda: quant.per_channel_cast(x),
    }[op]
    return Case(
        op, ours, getattr(reference, op), (x,), bytes=nbytes(x) + m * n + scales * 4,
        bytes_note=f"read x [T,D] bf16; write e4m3 [T,D] + f32 scales per {block[0]}x{block[1]}",
        peers=tk_peer(tk, f"tile_kernels.{op}", tk_call),
    )


def _case_per_token_cast(inp: Inputs, tk) -> Case:
    return _cast_case("per_token_cast", inp, tk, (1, 128), lambda tk: tk.quant.per_token_cast(inp.x_TD, "e4m3", 128))


def _case_per_block_cast(inp: Inputs, tk) -> Case:
    return _cast_case(
        "per_block_cast", inp, tk, (128, 128), lambda tk: tk.quant.per_block_cast(inp.x_TD, "e4m3", (128, 128))
    )


def _case_per_channel_cast(inp: Inputs, tk) -> Case:
    return _cast_case(
        "per_channel_cast", inp, tk, (128, 1), lambda tk: tk.quant.per_channel_cast(inp.x_TD, "e4m3", 128)
    )


def _case_cast_back(inp: Inputs, tk) -> Case:
    from kernels import quant
    from kernels.quant import reference

    q, sf = inp.q_TD, inp.sf_TG

    def ref(q_TD, sf_TG):
        return reference.cast_back(q_TD, sf_TG, block=(1, 128))

    return Case(
        "cast_back", lambda: quant.cast_back(q, sf, block=(1, 128)), ref, (q, sf),
        bytes=nbytes(q, sf) + q.numel() * 2, bytes_note="read e4m3 [T,D] + f32 scales [T,D/128]; write bf16 [T,D]",
        peers=tk_peer(tk, "tile_kernels.cast_back", lambda tk: tk.quant.cast_back((q, sf), "bf16", (1, 128))),
    )


def _requant_case(op: str, inp: Inputs, round_sf: bool) -> Case:
    """Per-token (1x128) e4m3 to per-block (128x128) scales: ``requant`` of the shared FP8 input,
    ``per_block_cast_lossless`` of a UE8M0 one."""
    import torch

    from kernels import quant
    from kernels.quant import reference

    q, sf = (inp.q_TD, inp.sf_TG) if not round_sf else reference.per_token_cast(inp.x_TD, round_sf=True)
    m, n = q.shape
    out_bytes = m * n + math.ceil(m / 128) * math.ceil(n / 128) * 4
    if op == "requant":
        def ours():
            return quant.requant(q, sf, in_block=(1, 128), out_block=(128, 128), round_sf=round_sf)

        def ref(q_TD, sf_TG):
            return reference.requant(q_TD, sf_TG, in_block=(1, 128), out_block=(128, 128), round_sf=round_sf)
    else:
        def ours():
            return quant.per_block_cast_lossless(q, sf, in_block=(1, 128))

        def ref(q_TD, sf_TG):
            return reference.per_block_cast_lossless(q_TD, sf_TG, in_block=(1, 128))

    return Case(
        op, ours, ref, (q, sf), bytes=nbytes(q, sf) + out_bytes,
        bytes_note="read e4m3 [T,D] + f32 scales [T,D/128]; write e4m3 [T,D] + f32 scales per 128x128",
        unfused=lambda: quant.per_block_cast(quant.cast_back(q, sf, block=(1, 128), out_dtype=torch.float32),
                                             round_sf=round_sf),
        unfused_bytes=nbytes(q, sf) + 2 * m * n * 4 + out_bytes,
        unfused_note="cast_back to f32 [T,D], then per_block_cast of it",
    )


def _case_requant(inp: Inputs, tk) -> Case:
    return _requant_case("requant", inp, round_sf=False)


def _case_per_block_cast_lossless(inp: Inputs, tk) -> Case:
    return _requant_case("per_block_cast_lossless", inp, round_sf=True)


def _case_per_token_cast_fp4(inp: Inputs, tk) -> Case:
    from kernels import quant
    from kernels.quant import reference

    x = inp.x_TD
    t, d = x.shape
    return Case(
        "per_token_cast_fp4", lambda: quant.per_token_cast_fp4(x), reference.per_token_cast_fp4, (x,),
        bytes=nbytes(x) + t * d // 2 + t * math.ceil(d / 32),
        bytes_note="read x [T,D] bf16; write e2m1 [T,D/2] + ue8m0 scales [T,D/32]",
        peers=tk_peer(tk, "tile_kernels.per_token_cast",
                       lambda tk: tk.quant.per_token_cast(x, "e2m1", 32, round_sf=True)),
    )


def _case_per_token_cast_fp4_e4m3_sf(inp: Inputs, tk) -> Case:
    from kernels import quant
    from kernels.quant import reference

    x = inp.x_TD
    t, d = x.shape
    return Case(
        "per_token_cast_fp4_e4m3_sf", lambda: quant.per_token_cast_fp4_e4m3_sf(x),
        reference.per_token_cast_fp4_e4m3_sf, (x,), bytes=nbytes(x) + t * d // 2 + t * math.ceil(d / 16) + t * 4,
        bytes_note="read x [T,D] bf16; write e2m1 [T,D/2] + e4m3 scales [T,D/16] + f32 [T]",
    )


def _case_cast_back_fp4(inp: Inputs, tk) -> Case:
    from kernels import quant
    from kernels.quant import reference

    q, sf, gsf = reference.per_token_cast_fp4_e4m3_sf(inp.x_TD)

    def ref(q_TH, sf_TG, gsf_T):
        return reference.cast_back_fp4(q_TH, sf_TG, group=16, gsf_T=gsf_T)

    return Case(
        "cast_back_fp4", lambda: quant.cast_back_fp4(q, sf, group=16, gsf_T=gsf), ref, (q, sf, gsf),
        bytes=nbytes(q, sf, gsf) + q.numel() * 4,
        bytes_note="read e2m1 [T,D/2] + e4m3 scales [T,D/16] + f32 [T]; write bf16 [T,D]",
    )


def _case_swiglu(inp: Inputs, tk) -> Case:
    from kernels import quant
    from kernels.quant import reference

    x = inp.x_TI2
    return Case(
        "swiglu", lambda: quant.swiglu(x), reference.swiglu, (x,), bytes=nbytes(x) + x.numel(),
        bytes_note="read [T,2I] bf16; write [T,I] bf16",
        peers=tk_peer(tk, "tile_kernels.swiglu_forward", lambda tk: tk.quant.swiglu_forward(x, "bf16")),
    )


def _case_swiglu_per_token_cast(inp: Inputs, tk) -> Case:
    from kernels import quant
    from kernels.quant import reference

    x = inp.x_TI2
    t, i = x.shape[0], x.shape[1] // 2
    out_bytes = t * i + t * math.ceil(i / 128) * 4
    return Case(
        "swiglu_per_token_cast", lambda: quant.swiglu_per_token_cast(x), reference.swiglu_per_token_cast, (x,),
        bytes=nbytes(x) + out_bytes, bytes_note="read [T,2I] bf16; write e4m3 [T,I] + f32 scales [T,I/128]",
        peers=tk_peer(tk, "tile_kernels.swiglu_forward_and_per_token_cast",
                       lambda tk: tk.quant.swiglu_forward_and_per_token_cast(x, "e4m3", 128)),
        unfused=lambda: quant.per_token_cast(quant.swiglu(x)),
        unfused_bytes=nbytes(x) + t * i * 2 + t * i * 2 + out_bytes,
        unfused_note="swiglu (writes bf16 [T,I]), then per_token_cast (reads it)",
    )


def _case_swiglu_backward(inp: Inputs, tk) -> Case:
    from kernels import quant
    from kernels.quant import reference

    x, g = inp.x_TI2, inp.grad_TI
    return Case(
        "swiglu_backward", lambda: quant.swiglu_backward(x, g), reference.swiglu_backward, (x, g),
        bytes=nbytes(x, g) + nbytes(x), bytes_note="read x [T,2I] + grad [T,I] bf16; write [T,2I] bf16",
        peers=tk_peer(tk, "tile_kernels.swiglu_backward", lambda tk: tk.quant.swiglu_backward(x, g, "bf16")),
    )


CASES: dict[str, Callable[..., Case]] = {
    "per_token_cast": _case_per_token_cast,
    "per_block_cast": _case_per_block_cast,
    "per_channel_cast": _case_per_channel_cast,
    "cast_back": _case_cast_back,
    "requant": _case_requant,
    "per_block_cast_lossless": _case_per_block_cast_lossless,


    "per_token_cast_fp4": _case_per_token_cast_fp4,
    "per_token_cast_fp4_e4m3_sf": _case_per_token_cast_fp4_e4m3_sf,
    "cast_back_fp4": _case_cast_back_fp4,
    "swiglu": _case_swiglu,
    "swiglu_per_token_cast": _case_swiglu_per_token_cast,
    "swiglu_backward": _case_swiglu_backward,
}
