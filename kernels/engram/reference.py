"""Engram (conditional memory by hashed n-gram lookup) in plain PyTorch: the specification.

Three ops; the layer (embedding lookup, key/value projections, sharded tables) is built on them:

* :func:`ngram_hash`: for token ids ``[B, S]`` (optionally compressed by a token-id map), each n-gram
  order ``n`` in ``2..N`` and each of ``K`` heads, the index of the n-gram's row in one concatenated
  embedding table. The n-gram ending at position ``s`` is ``ids[s-n+1 .. s]`` (positions before the
  start of the sequence hold ``pad_id``); it is mixed by multiplicative XOR,
  ``h_n = XOR_{k<n} (ids[s-k] * mult[k])`` with the layer's odd multipliers, then
  ``index = h_n mod prime[n][head] + offset[n][head]``. Multipliers are bounded so that every product
  stays below ``2**63``: hashes are non-negative and the modulo is the same in every language.
* :func:`make_hash_config` builds one layer's multipliers and prime table sizes, deterministically;
  the primes are distinct across heads, orders and layers.
* :func:`gate`: per mHC stream ``h``,
  ``dot = sum_d x_hd * wh_hd * k_hd * we_hd * rstd(x_h) * rstd(k_h) / sqrt(D)``,
  ``gate = sigmoid(sign(dot) * sqrt(max(|dot|, clamp)))``, ``out = x + gate * v`` (or ``gate * v``),
  with an explicit backward; the weight gradients are reduced over tokens.
* :func:`short_conv`: the depthwise causal convolution (kernel 4, dilation = the largest n-gram
  order) with SiLU that follows the gate.

Shapes (suffixes of tensor names):
    B  sequences            S  positions in a sequence        T  tokens (B * S, flattened)
    N  mHC streams          D  hidden size of one stream      C  hash columns, (max_ngram - 1) * K
    V  token-id vocabulary before compression                 W  convolution taps (kernel size)

Dtypes: ids int32/int64, indices int64; activations bfloat16/float16/float32/float64, computed in
float32 (float64 when any input is float64), outputs in the activation's dtype.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kernels.validate import check_finite, check_index_range, check_positive, check_tensor

__all__ = ["HashConfig", "gate", "make_hash_config", "ngram_hash", "short_conv"]

ID_DTYPES = (torch.int32, torch.int64)
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_INT64_MAX = 2**63 - 1
_MASK64 = 2**64 - 1


# ---------------------------------------------------------------------------------------------
# Hash configuration.


@dataclasses.dataclass(frozen=True, kw_only=True)
class HashConfig:
    """The hash of one Engram layer: what :func:`ngram_hash` needs (see :func:`make_hash_config`).

    Attributes:
        layer_id: the transformer layer this table belongs to.
        vocab_size: token ids (after compression) lie in ``[0, vocab_size)``.
        multipliers: ``max_ngram`` odd multipliers, one per n-gram position (``k = 0`` is the
            current token), each ``<= (2**63 - 1) // vocab_size``.
        table_sizes: ``max_ngram - 1`` tuples (orders ``2..max_ngram``) of ``K`` primes, the rows of
            each head's table.
    """

    layer_id: int
    vocab_size: int
    multipliers: tuple[int, ...]
    table_sizes: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if len(self.multipliers) < 2 or len(self.table_sizes) != len(self.multipliers) - 1:
            raise ValueError(
                f"table_sizes: expected len(multipliers) - 1 orders with at least one order, got "
                f"{len(self.table_sizes)} orders for {len(self.multipliers)} multipliers"
            )
        if len({len(sizes) for sizes in self.table_sizes}) != 1 or not self.table_sizes[0]:
            raise ValueError(f"table_sizes: expected the same number K >= 1 of heads per order, got {self.table_sizes}")
        check_positive("vocab_size", self.vocab_size)
        bound = _INT64_MAX // self.vocab_size
        for m in self.multipliers:
            if not isinstance(m, int) or m < 1 or m % 2 == 0 or m > bound:
                raise ValueError(f"multipliers: expected odd ints in [1, {bound}], got {self.multipliers}")
        for size in (s for sizes in self.table_sizes for s in sizes):
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"table_sizes: expected positive ints, got {self.table_sizes}")

    @property
    def max_ngram(self) -> int:
        """N, the largest n-gram order (orders are 2..N); also the short conv's dilation."""
        return len(self.multipliers)

    @property
    def num_heads(self) -> int:
        """K, the heads (tables) per n-gram order."""
        return len(self.table_sizes[0])

    @property
    def num_columns(self) -> int:
        """C = (N - 1) * K; column ``(n - 2) * K + head`` holds order ``n``, that head."""
        return len(self.table_sizes) * self.num_heads

    @property
    def column_sizes(self) -> tuple[int, ...]:
        """Rows of each column's table, in column order."""
        return tuple(s for sizes in self.table_sizes for s in sizes)

    @property
    def offsets(self) -> tuple[int, ...]:
        """First row of each column's table in the concatenated table (exclusive prefix sum)."""
        sizes = self.column_sizes
        return tuple(sum(sizes[:c]) for c in range(len(sizes)))

    @property
    def num_rows(self) -> int:
        """Rows of the concatenated table: the sum of all table sizes."""
        return sum(self.column_sizes)


def _is_prime(p: int) -> bool:
    """Deterministic Miller-Rabin, exact for p < 3.3e24 with these bases."""
    if p < 2:
        return False
    bases = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    for b in bases:
        if p % b == 0:
            return p == b
    d, r = p - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for b in bases:
        y = pow(b, d, p)
        if y in (1, p - 1):
            continue
        for _ in range(r - 1):
            y = y * y % p
            if y == p - 1:
                break
        else:
            return False
    return True


def _splitmix64(state: int) -> tuple[int, int]:
    """One step of the SplitMix64 generator: (next state, 64-bit output)."""
    state = (state + 0x9E3779B97F4A7C15) & _MASK64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return state, z ^ (z >> 31)


def make_hash_config(
    layer_id: int,
    *,
    layer_ids: Sequence[int],
    vocab_size: int,
    max_ngram: int,
    num_heads: int,
    table_size: int | Sequence[int],
    seed: int = 0,
) -> HashConfig:
    """Builds the hash configuration of Engram layer ``layer_id``, deterministically.

    Primes: walking the layers in ascending ``layer_ids``, then orders ``2..max_ngram``, then heads,
    each head takes the smallest prime ``>= table_size`` of its order not taken before, so primes are
    distinct across heads, orders and layers (and increase with the head within an order). The
    configuration of a layer depends on all of ``layer_ids``: build every layer's from the same list.

    Multipliers: ``max_ngram`` odd numbers in ``[1, (2**63 - 1) // vocab_size]`` drawn from a
    SplitMix64 stream seeded with ``(seed, layer_id)``.

    Args:
        layer_id: one of ``layer_ids``.
        layer_ids: every layer that has an Engram (distinct ints).
        vocab_size: token ids after compression lie in ``[0, vocab_size)``.
        max_ngram: N >= 2; orders ``2..N`` are hashed.
        num_heads: K >= 1 tables per order.
        table_size: smallest table size, one int for every order or one per order ``2..N``; >= 2.
        seed: any int.

    Returns:
        The layer's :class:`HashConfig`.
    """
    ids = list(layer_ids)
    if len(set(ids)) != len(ids) or not all(isinstance(i, int) for i in ids):
        raise ValueError(f"layer_ids: expected distinct ints, got {layer_ids!r}")
    if layer_id not in ids:
        raise ValueError(f"layer_id: expected one of layer_ids {sorted(ids)}, got {layer_id!r}")
    check_positive("vocab_size", vocab_size)
    check_positive("num_heads", num_heads)
    if isinstance(max_ngram, bool) or not isinstance(max_ngram, int) or max_ngram < 2:
        raise ValueError(f"max_ngram: expected an int >= 2, got {max_ngram!r}")
    sizes = [table_size] * (max_ngram - 1) if isinstance(table_size, int) else list(table_size)
    if len(sizes) != max_ngram - 1 or not all(isinstance(s, int) and s >= 2 for s in sizes):
        raise ValueError(
            f"table_size: expected an int >= 2 or {max_ngram - 1} of them (orders 2..{max_ngram}), got {table_size!r}"
        )

    taken: set[int] = set()
    primes: dict[int, tuple[tuple[int, ...], ...]] = {}
    for lid in sorted(ids):
        layer_primes = []
        for start in sizes:
            heads = []
            p = start
            for _ in range(num_heads):
                while p in taken or not _is_prime(p):
                    p += 1
                taken.add(p)
                heads.append(p)
            layer_primes.append(tuple(heads))
        primes[lid] = tuple(layer_primes)

    half = max(1, (_INT64_MAX // vocab_size) // 2)
    _, state = _splitmix64(seed & _MASK64)
    state ^= layer_id & _MASK64
    multipliers = []
    for _ in range(max_ngram):
        state, r = _splitmix64(state)
        multipliers.append(2 * (r % half) + 1)
    return HashConfig(
        layer_id=layer_id, vocab_size=vocab_size, multipliers=tuple(multipliers), table_sizes=primes[layer_id]
    )


# ---------------------------------------------------------------------------------------------
# Hash.


def ngram_hash(
    ids_BS: torch.Tensor,
    config: HashConfig,
    *,
    compress_V: torch.Tensor | None = None,
    pad_id: int = 0,
) -> torch.Tensor:
    """Rows of the concatenated Engram table for every n-gram order and head at every position.

    ``idx[b, s, (n - 2) * K + head] = (XOR_{k<n} tok[b, s-k] * mult[k]) mod prime[n][head]
    + offset[n][head]``, with ``tok = compress_V[ids]`` (or ``ids``) and ``tok[b, s-k] = pad`` for
    ``s - k < 0``, where ``pad = compress_V[pad_id]`` (or ``pad_id``). Products and XOR are exact in
    int64 (non-negative, see :class:`HashConfig`).

    Args:
        ids_BS: ``[B, S]`` int32/int64 token ids; in ``[0, V)`` with ``compress_V``, else in
            ``[0, config.vocab_size)``.
        config: the layer's :class:`HashConfig`.
        compress_V: optional ``[V]`` int32/int64 map from token id to compressed id in
            ``[0, config.vocab_size)``.
        pad_id: the token id (before compression) of the left padding.

    Returns:
        ``idx_BSC`` ``[B, S, (N - 1) * K]`` int64, ``offset_c <= idx[..., c] < offset_c + size_c``.
    """
    check_hash_args(ids_BS, config, compress_V, pad_id)
    if compress_V is not None:
        tok_BS = compress_V.long()[ids_BS.long()]
        pad = int(compress_V[pad_id])
    else:
        tok_BS = ids_BS.long()
        pad = pad_id

    b, s = tok_BS.shape
    k_heads = config.num_heads
    sizes_C = torch.tensor(config.column_sizes, dtype=torch.int64, device=tok_BS.device)
    offsets_C = torch.tensor(config.offsets, dtype=torch.int64, device=tok_BS.device)
    padded_BS = F.pad(tok_BS, (config.max_ngram - 1, 0), value=pad)
    h_BS = torch.zeros_like(tok_BS)
    columns = []
    for k, mult in enumerate(config.multipliers):
        shifted_BS = padded_BS[:, config.max_ngram - 1 - k : config.max_ngram - 1 - k + s]  # tok[s - k]
        h_BS = h_BS ^ (shifted_BS * mult)
        if k >= 1:  # order n = k + 1 is complete
            cols = slice((k - 1) * k_heads, k * k_heads)
            columns.append(h_BS[:, :, None] % sizes_C[cols] + offsets_C[cols])
    return torch.cat(columns, dim=-1)


def check_hash_args(ids_BS, config, compress_V, pad_id, *, values: bool = True) -> None:
    """Validates :func:`ngram_hash`'s arguments (shared with its kernel, which skips the ``values``
    check: ids and map entries in range, a read of both and a host sync)."""
    if not isinstance(config, HashConfig):
        raise TypeError(f"config: expected a HashConfig, got {type(config).__name__}")
    check_tensor("ids_BS", ids_BS, dtype=ID_DTYPES, ndim=2)
    id_range = config.vocab_size
    if compress_V is not None:
        check_tensor("compress_V", compress_V, dtype=ID_DTYPES, ndim=1, device=ids_BS.device)
        id_range = compress_V.shape[0]
        if values:
            check_index_range("compress_V", compress_V, config.vocab_size, allow_masked=False)
    if values:
        check_index_range("ids_BS", ids_BS, id_range, allow_masked=False)
    if isinstance(pad_id, bool) or not isinstance(pad_id, int) or not 0 <= pad_id < id_range:
        raise ValueError(f"pad_id: expected an int in [0, {id_range}), got {pad_id!r}")


# ---------------------------------------------------------------------------------------------
# Gate.


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _gate_fwd(x_TND, k_TND, v_TD, wh_ND, we_ND, clamp, eps, add_residual):
    """Forward math; returns the output and the per-(token, stream) stats the backward needs."""
    cdt = _compute_dtype(x_TND, k_TND, v_TD, wh_ND, we_ND)
    x, k, v = x_TND.to(cdt), k_TND.to(cdt), v_TD.to(cdt)
    w_ND = wh_ND.to(cdt) * we_ND.to(cdt)
    d = x.shape[-1]
    rstd_x_TN = torch.rsqrt(x.square().mean(-1) + eps)
    rstd_k_TN = torch.rsqrt(k.square().mean(-1) + eps)
    raw_TN = (x * w_ND * k).sum(-1)  # the dot before normalization
    dot_TN = raw_TN * rstd_x_TN * rstd_k_TN / math.sqrt(d)
    gate_TN = torch.sigmoid(torch.sign(dot_TN) * torch.sqrt(dot_TN.abs().clamp_min(clamp)))
    out_TND = gate_TN[:, :, None] * v[:, None, :]
    if add_residual:
        out_TND = x + out_TND
    return out_TND.to(x_TND.dtype), (raw_TN, gate_TN, rstd_x_TN, rstd_k_TN)


def _gate_bwd(g_TND, x_TND, k_TND, v_TD, wh_ND, we_ND, raw_TN, gate_TN, rstd_x_TN, rstd_k_TN, clamp, add_residual):
    """Explicit backward of the gate. With ``c = rstd_x * rstd_k / sqrt(D)``, ``dot = raw * c``:

    ``dL/dgate = sum_d g * v``; ``dL/draw = dL/dgate * gate (1 - gate) / 2 * sqrt(c / |raw|)`` where
    ``|dot| >= clamp``, else 0;
    ``d x = g [residual] + dL/draw * (w k - x * raw * rstd_x^2 / D)``;
    ``d k = dL/draw * (w x - k * raw * rstd_k^2 / D)``;  ``d v = sum_h g_h * gate_h``;
    ``d w = sum_T dL/draw * x * k`` (reduced over tokens), ``d wh = d w * we``, ``d we = d w * wh``.
    """
    cdt = raw_TN.dtype
    g, x, k, v = g_TND.to(cdt), x_TND.to(cdt), k_TND.to(cdt), v_TD.to(cdt)
    wh, we = wh_ND.to(cdt), we_ND.to(cdt)
    w_ND = wh * we
    d = x.shape[-1]
    c_TN = rstd_x_TN * rstd_k_TN / math.sqrt(d)
    dgate_TN = (g * v[:, None, :]).sum(-1)
    live_TN = (raw_TN * c_TN).abs() >= clamp  # clamp > 0, so raw != 0 where live
    safe_raw_TN = torch.where(live_TN, raw_TN.abs(), torch.ones_like(raw_TN))
    draw_TN = torch.where(
        live_TN, dgate_TN * gate_TN * (1 - gate_TN) * 0.5 * torch.sqrt(c_TN / safe_raw_TN), torch.zeros_like(raw_TN)
    )
    dr = draw_TN[:, :, None]
    grad_x = dr * (w_ND * k - x * (raw_TN * rstd_x_TN.square() / d)[:, :, None])
    if add_residual:
        grad_x = grad_x + g
    grad_k = dr * (w_ND * x - k * (raw_TN * rstd_k_TN.square() / d)[:, :, None])
    grad_v = (g * gate_TN[:, :, None]).sum(1)
    grad_w_ND = (dr * x * k).sum(0)
    return (
        grad_x.to(x_TND.dtype),
        grad_k.to(k_TND.dtype),
        grad_v.to(v_TD.dtype),
        (grad_w_ND * we).to(wh_ND.dtype),
        (grad_w_ND * wh).to(we_ND.dtype),
    )


class _Gate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TND, k_TND, v_TD, wh_ND, we_ND, clamp, eps, add_residual):
        out_TND, stats = _gate_fwd(x_TND, k_TND, v_TD, wh_ND, we_ND, clamp, eps, add_residual)
        ctx.save_for_backward(x_TND, k_TND, v_TD, wh_ND, we_ND, *stats)
        ctx.clamp, ctx.add_residual = clamp, add_residual
        return out_TND

    @staticmethod
    def backward(ctx, g_TND):
        grads = _gate_bwd(g_TND, *ctx.saved_tensors, ctx.clamp, ctx.add_residual)
        return (*grads, None, None, None)


def gate(
    x_TND: torch.Tensor,
    k_TND: torch.Tensor,
    v_TD: torch.Tensor,
    wh_ND: torch.Tensor,
    we_ND: torch.Tensor,
    *,
    clamp: float = 1e-6,
    eps: float = 1e-6,
    add_residual: bool = True,
) -> torch.Tensor:
    """Engram's gated value: ``out_h = x_h + gate_h * v`` per mHC stream ``h``.

    ``rstd(a) = rsqrt(mean_d(a**2) + eps)``;
    ``dot_h = sum_d x_hd * wh_hd * k_hd * we_hd * rstd(x_h) * rstd(k_h) / sqrt(D)``;
    ``gate_h = sigmoid(sign(dot_h) * sqrt(max(|dot_h|, clamp)))`` (0.5 where ``dot_h == 0``; no
    gradient through ``dot`` where ``|dot_h| < clamp``). Backward is explicit; ``wh``/``we`` grads
    are sums over all tokens.

    Args:
        x_TND: ``[T, N, D]`` hidden states (the query), bfloat16/float16/float32/float64.
        k_TND: ``[T, N, D]`` keys (one projection per stream).
        v_TD: ``[T, D]`` value, shared by the streams.
        wh_ND, we_ND: ``[N, D]`` RMS-norm weights of ``x`` and ``k``.
        clamp: > 0. eps: >= 0.
        add_residual: False returns ``gate_h * v`` alone (for the short conv path).

    Returns:
        ``out_TND`` ``[T, N, D]`` in ``x_TND``'s dtype.
    """
    check_gate_args(x_TND, k_TND, v_TD, wh_ND, we_ND, clamp, eps)
    return _Gate.apply(x_TND, k_TND, v_TD, wh_ND, we_ND, float(clamp), float(eps), bool(add_residual))


# ---------------------------------------------------------------------------------------------
# Short convolution.


def short_conv(
    x_BSND: torch.Tensor,
    weight_NDW: torch.Tensor,
    *,
    dilation: int,
    norm_weight_ND: torch.Tensor | None = None,
    norm_eps: float = 1e-5,
) -> torch.Tensor:
    """Depthwise causal convolution along the sequence, then SiLU (autograd through torch ops).

    ``out[b, s, h, d] = silu(sum_{w<W} weight[h, d, w] * xn[b, s - (W - 1 - w) * dilation, h, d])``
    with zeros before the sequence start, where ``xn`` is ``x`` or, with ``norm_weight_ND``, its RMS
    norm per stream (``x * rsqrt(mean_d(x**2) + norm_eps) * norm_weight``). Every channel ``(h, d)``
    has its own ``W`` taps; tap ``W - 1`` sees the current position.

    Args:
        x_BSND: ``[B, S, N, D]`` float (the gated values, sequences unflattened).
        weight_NDW: ``[N, D, W]`` taps (W = 4 in Engram).
        dilation: >= 1 (Engram: the largest n-gram order).
        norm_weight_ND: optional ``[N, D]`` RMS-norm weight applied first.

    Returns:
        ``[B, S, N, D]`` in ``x_BSND``'s dtype (computed in the compute dtype).
    """
    check_tensor("x_BSND", x_BSND, dtype=FLOAT_DTYPES, ndim=4)
    b, s, n, d = x_BSND.shape
    check_tensor("weight_NDW", weight_NDW, dtype=FLOAT_DTYPES, shape=(n, d, None), device=x_BSND.device)
    if not weight_NDW.shape[-1]:
        raise ValueError("weight_NDW: expected at least one tap, got shape (N, D, 0)")
    check_positive("dilation", dilation)
    check_finite("x_BSND", x_BSND)
    check_finite("weight_NDW", weight_NDW)
    cdt = _compute_dtype(x_BSND, weight_NDW)
    x = x_BSND.to(cdt)
    if norm_weight_ND is not None:
        check_tensor("norm_weight_ND", norm_weight_ND, dtype=FLOAT_DTYPES, shape=(n, d), device=x_BSND.device)
        check_finite("norm_weight_ND", norm_weight_ND)
        x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + norm_eps) * norm_weight_ND.to(cdt)
    w = weight_NDW.shape[-1]
    if not x.numel():  # no positions or no channels: an empty result, in both inputs' autograd graph
        return (x * weight_NDW.to(cdt).sum()).to(x_BSND.dtype)
    x_BCS = x.reshape(b, s, n * d).transpose(1, 2)
    x_BCS = F.pad(x_BCS, ((w - 1) * dilation, 0))
    y_BCS = F.conv1d(x_BCS, weight_NDW.to(cdt).reshape(n * d, 1, w), dilation=dilation, groups=n * d)
    return F.silu(y_BCS).transpose(1, 2).reshape(b, s, n, d).to(x_BSND.dtype)


def check_gate_args(x_TND, k_TND, v_TD, wh_ND, we_ND, clamp, eps, *, values: bool = True) -> None:
    """Validates :func:`gate`'s arguments (shared with its kernel, which skips the ``values``
    check: NaN/Inf in the tensors, a read of all of them and a host sync)."""
    check_tensor("x_TND", x_TND, dtype=FLOAT_DTYPES, ndim=3)
    t, n, d = x_TND.shape
    dev = x_TND.device
    check_tensor("k_TND", k_TND, dtype=FLOAT_DTYPES, shape=(t, n, d), device=dev)
    check_tensor("v_TD", v_TD, dtype=FLOAT_DTYPES, shape=(t, d), device=dev)
    check_tensor("wh_ND", wh_ND, dtype=FLOAT_DTYPES, shape=(n, d), device=dev)
    check_tensor("we_ND", we_ND, dtype=FLOAT_DTYPES, shape=(n, d), device=dev)
    for name, tensor in (("x_TND", x_TND), ("k_TND", k_TND), ("v_TD", v_TD), ("wh_ND", wh_ND), ("we_ND", we_ND)):
        if values:
            check_finite(name, tensor)
    if isinstance(clamp, bool) or not isinstance(clamp, (int, float)) or not 0 < clamp < math.inf:
        raise ValueError(f"clamp: expected a finite float > 0, got {clamp!r}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < math.inf:
        raise ValueError(f"eps: expected a finite float >= 0, got {eps!r}")
