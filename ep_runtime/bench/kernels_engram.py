"""``bench kernels`` cases of ``kernels.engram``: the gate, forward and backward, and the n-gram hash."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from .kernels_cases import (ENGRAM_HASH, ENGRAM_PAD_ID, Case, StreamInputs, backward_op, nbytes, reference_grads,
                            tk_peer)

def _case_engram_gate(inp: StreamInputs, tk) -> Case:
    from kernels import engram
    from kernels.engram import reference

    x, k, v, wh, we = inp.x_TND, inp.k_TND, inp.v_TD, inp.wh_ND, inp.we_ND
    kv = torch.cat([k, v[:, None]], 1)  # its keys and value in one tensor

    def tk_call(tk):
        return tk.engram.engram_gate_fwd(x, kv, wh * we, 1e-6, 1e-6, save_for_backward=False)[0]

    return Case("engram_gate", lambda: engram.gate(x, k, v, wh, we), reference.gate, (x, k, v, wh, we),
                bytes=nbytes(x, k, v, wh, we) + nbytes(x),
                bytes_note="read x, k [T,N,D] + v [T,D] bf16 + wh, we [N,D] f32; write out [T,N,D] bf16",
                exact=False, peers=tk_peer(tk, "tile_kernels", tk_call))


def _case_engram_gate_backward(inp: StreamInputs, tk) -> Case:
    from kernels.engram import reference
    from kernels.engram.gate_backward_kernel import backward_excess, gate_backward
    from kernels.engram.gate_kernel import gate

    x, k, v, wh, we, g = inp.x_TND, inp.k_TND, inp.v_TD, inp.wh_ND, inp.we_ND, inp.g_TND
    kv = torch.cat([k, v[:, None]], 1)
    w = wh * we
    # tile-kernels' forward keeps dot, gate, rstd_x, rstd_k for its backward (run at the first call)
    saved = functools.cache(lambda: tk.engram.engram_gate_fwd(x, kv, w, 1e-6, 1e-6, save_for_backward=True)[1:])

    def tk_call(tk):
        grad_x, grad_kv, partial = tk.engram.engram_gate_bwd(g, x, kv, w, *saved(), 1e-6)
        grad_w = partial.sum(0)
        return grad_x, grad_kv, grad_w * we, grad_w * wh

    stats = functools.cache(lambda: gate(x, k, v, wh, we, return_stats=True)[1])  # ours, likewise: its row statistics

    def ours(*args):
        return gate_backward(*args, stats())

    return Case("engram_gate_backward", backward_op(ours, reference.gate, (x, k, v, wh, we, g)),
                reference_grads(reference.gate),
                (x, k, v, wh, we, g), bytes=2 * nbytes(x, k, v, wh, we) + nbytes(g),
                bytes_note="read x, k, g [T,N,D] + v [T,D] bf16 + wh, we f32; write grad_x, grad_k, grad_v, grad_wh, "
                "grad_we (both from their forward's saved row statistics)",
                exact=False, within=lambda got, want: all(e <= 0 for e in backward_excess(got, want).values()),
                compile_peer=False, peers=tk_peer(tk, "tile_kernels", tk_call))


def _case_engram_hash(inp: StreamInputs, tk) -> Case:
    # tile-kernels' engram_hash is our hash over an n-gram window its caller gathers: with
    # ngram_TW[t, k] our tok[s - k] (compressed ids, the padding before a sequence's start), it
    # mixes h = XOR_{k<n} ngram[t, k] * mult[k] in int64 and writes column (n - 2) * K + head as
    # h mod sizes[n - 2][head] + offsets[column]: our indices, as int32 (a layer's ~10.3M rows fit).
    # It takes every layer's multipliers and tables at once; here the one layer ours hashes. Its
    # window is gathered once, before timing: the compress map's lookup and the shift by position
    # are work ours does in its kernel.
    from kernels.engram import reference
    from kernels.engram.hash_kernel import hash_indices
    from kernels.select import use_tilelang

    ids, compress = inp.ids_BS, inp.compress_V
    b, s = ids.shape
    config = reference.make_hash_config(ENGRAM_HASH["layer_ids"][0], **ENGRAM_HASH)
    w, c = config.max_ngram, config.num_columns

    def ref(ids_BS, compress_V):
        return reference.ngram_hash(ids_BS, config, compress_V=compress_V, pad_id=ENGRAM_PAD_ID)

    # Where TileLang runs, the kernel alone: kernels.engram.ngram_hash first checks the ids' and the
    # map's values (a read of both and a host sync), as the other cases time the kernel wrappers.
    hash_fn = hash_indices if use_tilelang(ids.device) else reference.ngram_hash

    tok_BS = compress[ids]
    padded_BS = torch.nn.functional.pad(tok_BS, (w - 1, 0), value=int(compress[ENGRAM_PAD_ID]))
    ngram_TW = padded_BS.unfold(1, w, 1).flip(-1).reshape(b * s, w).to(torch.int32).contiguous()
    mult_LW = torch.tensor([config.multipliers], dtype=torch.int64, device=ids.device)
    sizes_LOK = torch.tensor([config.table_sizes], dtype=torch.int32, device=ids.device)
    offsets_LC = torch.tensor([config.offsets], dtype=torch.int32, device=ids.device)

    def tk_call(tk):
        return tk.engram.engram_hash(ngram_TW, mult_LW, sizes_LOK, offsets_LC).view(b, s, c)

    return Case("engram_hash", lambda: hash_fn(ids, config, compress_V=compress, pad_id=ENGRAM_PAD_ID), ref,
                (ids, compress), bytes=nbytes(ids) + ids.unique().numel() * compress.element_size() + b * s * c * 8,
                bytes_note="read ids [B,S] i64 + the compress map's entries they name (each once); write idx "
                "[B,S,C] i64 (tile-kernels reads an n-gram window [T,W] i32 gathered before timing and writes "
                "int32: half the output bytes)", peers=tk_peer(tk, "tile_kernels", tk_call))


CASES: dict[str, Callable[..., Case]] = {
    "engram_gate": _case_engram_gate,
    "engram_gate_backward": _case_engram_gate_backward,
    "engram_hash": _case_engram_hash,
}
