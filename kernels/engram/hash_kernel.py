"""TileLang kernel of :func:`kernels.engram.reference.ngram_hash`: every n-gram order and head's
row of the concatenated Engram table at every position, bit for bit.

Memory-bound on its output: a token moves ``8 C`` bytes of indices out and its 4- or 8-byte id in
(136 bytes at C = 16, int64 ids), plus, with a compress map, one gathered entry (from L2 while the
map fits there). A CTA takes a tile of ``M`` consecutive tokens (flattened over the batch), one a
thread:

1. the tile's tokens and the ``N - 1`` before it go to shared memory, compressed, each loaded
   (and looked up) once;
2. each thread mixes its token's n-grams in registers and writes its row of ``C`` indices to a
   shared tile whose rows hold an odd number of int64 (the threads' rows start in distinct banks);
3. the CTA copies the tile out as consecutive 16-byte vectors (8-byte when ``C`` is odd): the tile
   is ``M * C`` contiguous int64 of the output, so every warp store is coalesced (a thread
   storing its own row would touch a line per lane each store).

Why the multipliers, primes and offsets are compile-time constants (one kernel per layer's
:class:`HashConfig`; a model has a few): each ``h mod prime`` is then an unsigned 64-bit modulo by
a constant, which nvcc turns into a multiply-high, shifts and a multiply-subtract (the compile-only
test checks the PTX); a prime read at run time would cost a 64-bit division routine a column, by
our estimate enough to make the kernel compute-bound. The hash is computed in uint64: every
product and XOR is below ``2**63`` (:class:`HashConfig`), so its bits and the modulo are int64's.

Values are not checked (no host sync). Ids out of range give indices other than the reference's
(a compress map read out of bounds gives token 0: TileLang's bounds guard), but every index still
lies in its column's table, so a lookup with them stays in bounds.

Shape suffixes (as in :mod:`kernels.engram.reference`): B sequences, S positions, T tokens
(``B * S``), C hash columns, V token-id vocabulary before compression; and M a CTA's tokens, W
those tokens with the ``N - 1`` before them.
"""

import tilelang
import torch
from tilelang import language as T

from kernels.engram.reference import HashConfig, check_hash_args
from kernels.tiles import PASS_CONFIGS, check_cuda, tl_dtype
from kernels.rows import WARP

TILE_TOKENS = 128  # a CTA's tokens (and threads) where its output tile fits TILE_BYTES
TILE_BYTES = 48 * 1024


def tile_tokens(num_columns: int) -> int:
    """Tokens (threads) of a CTA: :data:`TILE_TOKENS`, halved down to one warp while the shared
    output tile (rows of ``C | 1`` int64) is over :data:`TILE_BYTES`."""
    m = TILE_TOKENS
    while m > WARP and m * (num_columns | 1) * 8 > TILE_BYTES:
        m //= 2
    return m


@tilelang.jit(pass_configs=PASS_CONFIGS)
def get_hash_indices_kernel(
    multipliers: tuple[int, ...], table_sizes: tuple[tuple[int, ...], ...], id_dtype: str, map_dtype: str | None = None
):
    """``(ids_T[, compress_V], idx_TC, seq_len, pad_id)`` kernel for one :class:`HashConfig`'s
    ``multipliers`` and ``table_sizes`` (baked in), ids of ``id_dtype`` and, unless ``map_dtype``
    is None, a compress map of that dtype (token and vocabulary counts are dynamic). ``ids_T`` is
    the ``[B, S]`` ids flattened; ``seq_len`` is S, ``pad_id`` the padding's id."""
    num_tokens = T.dynamic("num_tokens")
    max_ngram, heads = len(multipliers), len(table_sizes[0])
    sizes = [s for order in table_sizes for s in order]
    offsets = [sum(sizes[:c]) for c in range(len(sizes))]
    c = len(sizes)
    m = tile_tokens(c)
    w = m + max_ngram - 1
    vec = 2 if c % 2 == 0 else 1  # 16-byte stores, one row's columns each
    # (k, mult[k], the columns of order k + 1 as (column, prime, offset)) for k = 1 .. N - 1
    orders = [(k, multipliers[k], [(col, sizes[col], offsets[col]) for col in range((k - 1) * heads, k * heads)])
              for k in range(1, max_ngram)]

    def token(i, compress_V):
        """Token id ``i`` as the hash takes it: looked up in the compress map, if one."""
        return T.Cast(T.uint64, i if compress_V is None else compress_V[i])

    @T.macro
    def body(ids_T, compress_V, idx_TC, seq_len, pad_id):
        with T.Kernel(T.ceildiv(num_tokens, m), threads=m) as cta:
            tid = T.get_thread_binding()
            tok_W = T.alloc_shared((w,), T.uint64)  # tok_W[i]: token cta * m - (N - 1) + i
            idx_MC = T.alloc_shared((m, c | 1), T.int64)
            h = T.alloc_local((1,), T.uint64)
            pair = T.alloc_local((vec,), T.int64)
            for r in T.unroll(-(-w // m)):
                i = r * m + tid
                t = cta * m - (max_ngram - 1) + i
                if i < w and t >= 0 and t < num_tokens:
                    tok_W[i] = token(ids_T[t], compress_V)
            T.sync_threads()
            # Positions before the start of the sequence hold the padding.
            s = T.truncmod(cta * m + tid, seq_len)
            pad = token(pad_id, compress_V)
            h[0] = tok_W[tid + max_ngram - 1] * T.uint64(multipliers[0])
            for k, mult, columns in orders:  # a Python list: unrolled, its numbers constants
                prev = T.if_then_else(s >= k, tok_W[tid + max_ngram - 1 - k], pad)
                h[0] = h[0] ^ (prev * T.uint64(mult))
                for col, size, offset in columns:
                    idx_MC[tid, col] = T.Cast(T.int64, h[0] % T.uint64(size)) + offset
            T.sync_threads()
            first = T.Cast(T.int64, cta * m)
            for r in T.unroll(c // vec):
                v = (r * m + tid) * vec  # the tile's element, row-major
                if first + v // c < num_tokens:
                    for j in T.serial(vec):  # 8-byte reads: odd rows are not 16-byte aligned
                        pair[j] = idx_MC[v // c, v % c + j]
                    for j in T.vectorized(vec):
                        idx_TC[first + v // c, v % c + j] = pair[j]

    if map_dtype is None:

        @T.prim_func
        def hash_kernel(
            ids_T: T.Tensor[(num_tokens,), id_dtype],
            idx_TC: T.Tensor[(num_tokens, c), T.int64],
            seq_len: T.int32,
            pad_id: T.int64,
        ):
            body(ids_T, None, idx_TC, seq_len, pad_id)

        return hash_kernel
    vocab = T.dynamic("vocab")

    @T.prim_func
    def compressed_hash_kernel(
        ids_T: T.Tensor[(num_tokens,), id_dtype],
        compress_V: T.Tensor[(vocab,), map_dtype],
        idx_TC: T.Tensor[(num_tokens, c), T.int64],
        seq_len: T.int32,
        pad_id: T.int64,
    ):
        body(ids_T, compress_V, idx_TC, seq_len, pad_id)

    return compressed_hash_kernel


def hash_indices(
    ids_BS: torch.Tensor, config: HashConfig, *, compress_V: torch.Tensor | None = None, pad_id: int = 0
) -> torch.Tensor:
    """TileLang :func:`kernels.engram.reference.ngram_hash`.

    Checks types, shapes, dtypes, devices and ``pad_id``, but no tensor values (that costs a read
    and a host sync; ``kernels.engram.ngram_hash`` checks them): ids out of range give indices
    other than the reference's, though still inside each column's table.

    Args:
        ids_BS: ``[B, S]`` int32/int64 on a CUDA device (copied first if not contiguous).
        config: the layer's :class:`HashConfig`.
        compress_V: optional ``[V]`` int32/int64 map on the same device.
        pad_id: the padding's token id, in ``[0, V)`` (or ``[0, vocab_size)``).

    Returns:
        ``idx_BSC`` ``[B, S, C]`` int64.
    """
    check_hash_args(ids_BS, config, compress_V, pad_id, values=False)
    check_cuda("ids_BS", ids_BS)
    b, s = ids_BS.shape
    idx_BSC = torch.empty((b, s, config.num_columns), dtype=torch.int64, device=ids_BS.device)
    if not idx_BSC.numel():
        return idx_BSC
    inputs = [ids_BS.contiguous().view(-1)] + ([] if compress_V is None else [compress_V.contiguous()])
    kernel = get_hash_indices_kernel(config.multipliers, config.table_sizes, *(tl_dtype(t.dtype) for t in inputs))
    kernel(*inputs, idx_BSC.view(b * s, -1), s, pad_id)
    return idx_BSC
