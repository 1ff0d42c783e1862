"""Can a few SMs keep NVLink busy? (A probe for the combine's overlap, not a product benchmark.)

The combine's stores to the peer run at the link's rate only when most SMs hold loads in flight
(session 17: a reduce-and-store on 16 / 66 / 132 CTAs ran at 97 / 257 / 315 GB/s), so nothing is
left to overlap the home rows' memory-bound pass. This probe copies ``--tokens`` rows of ``--hidden``
bf16 into the peer's half of a symmetric heap three ways, each as a CUDA graph with the barrier:

- ``put_rows`` on every SM (the shipped transport, the reference bytes);
- ``registers``: N CTAs taking the rows in turn, 16-byte loads into registers then stores to the peer;
- ``bulk``: N CTAs staging each row in shared memory (a ring of S rows) and one thread storing it
  with ``cp.async.bulk`` (fire and forget: a stage is reused once the bulk copy has read it).

Then a memory-bound pass of the same size as the home rows' (``weighted_reduce`` of random expert
rows) alone and beside ``bulk`` on its N CTAs (two streams): overlap means the pair takes about
the longer of the two.

    torchrun --standalone --nproc-per-node 2 bench/scripts/link_probe.py [--tokens 4096]
"""

import argparse

import tilelang
import torch
import torch.distributed as dist
from tilelang import language as T

from ep_runtime.bench.dispatch import _capture, timers
from ep_runtime.dispatch.symmetric import make_heap
from kernels.comm import put_rows
from kernels.quant.tiles import PEER_PASS_CONFIGS
from kernels.reduce import weighted_reduce
from kernels.testing import reduce_routes

BULK = r"""
__device__ __forceinline__ void ep_bulk_put(void* dst, void* src_smem, int bytes) {
  unsigned src = (unsigned)__cvta_generic_to_shared(src_smem);
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
               :: "l"(dst), "r"(src), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
__device__ __forceinline__ void ep_bulk_wait_read(int pending) {  // at most `pending` groups still reading
  switch (pending) {
    case 0: asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); break;
    case 1: asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory"); break;
    case 2: asm volatile("cp.async.bulk.wait_group.read 2;" ::: "memory"); break;
    case 3: asm volatile("cp.async.bulk.wait_group.read 3;" ::: "memory"); break;
    default: asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); break;
  }
}
__device__ __forceinline__ void ep_bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
__device__ __forceinline__ void ep_fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
"""

THREADS = 256


@tilelang.jit(pass_configs=PEER_PASS_CONFIGS)
def get_bulk_put_kernel(words: int, ctas: int, stages: int):
    """``(src_NW, delta, dst_CW)``: row n of ``src_NW`` (``words`` int32) to row n of the copy of
    ``dst_CW`` that lies ``delta`` bytes on, through shared memory and ``cp.async.bulk`` (a ring
    of up to 4 ``stages``: the wait for a stage's last copy is exact up to 3 pending)."""
    if not 1 <= stages <= 4:
        raise ValueError(f"stages: expected 1 to 4, got {stages}")
    num_rows, num_dst = T.dynamic("num_rows"), T.dynamic("num_dst")
    vectors = words // 4

    @T.prim_func
    def bulk_put(src_NW: T.Tensor[(num_rows, words), "int32"], delta: T.int64,
                 dst_CW: T.Tensor[(num_dst * words,), "int32"]):
        with T.Kernel(ctas, threads=THREADS) as pid:
            T.import_source(BULK)
            ring = T.alloc_shared((stages, words), "int32")
            tid = T.get_thread_binding()
            for i in T.serial(T.ceildiv(num_rows, ctas)):
                row = i * ctas + pid
                if row < num_rows:
                    if tid == 0:
                        T.call_extern("handle", "ep_bulk_wait_read", stages - 1)
                    T.sync_threads()  # stage i % stages read by its last bulk copy
                    for v in T.serial(T.ceildiv(vectors, THREADS)):
                        c = v * THREADS + tid
                        if c < vectors:
                            for j in T.vectorized(4):
                                ring[i % stages, c * 4 + j] = src_NW[row, c * 4 + j]
                    T.call_extern("handle", "ep_fence_proxy_async")
                    T.sync_threads()
                    if tid == 0:
                        T.call_extern("handle", "ep_bulk_put", T.address_of(dst_CW[delta // 4 + row * words]),
                                      T.address_of(ring[i % stages, 0]), words * 4)
            if tid == 0:
                T.call_extern("handle", "ep_bulk_wait_all")

    return bulk_put


@tilelang.jit(pass_configs=PEER_PASS_CONFIGS)
def get_register_put_kernel(words: int, ctas: int):
    """As :func:`get_bulk_put_kernel` (the destination as 16-byte vectors), through registers: each
    thread's vectors of a row loaded, then stored to the peer."""
    num_rows, num_dst = T.dynamic("num_rows"), T.dynamic("num_dst")
    vectors = words // 4
    per_thread = -(-vectors // THREADS)

    @T.prim_func
    def register_put(src_NW: T.Tensor[(num_rows, words), "int32"], delta: T.int64,
                     dst_CV: T.Tensor[(num_dst * vectors, 4), "int32"]):
        with T.Kernel(ctas, threads=THREADS) as pid:
            tid = T.get_thread_binding()
            buf = T.alloc_local((per_thread * 4,), "int32")
            for i in T.serial(T.ceildiv(num_rows, ctas)):
                row = i * ctas + pid
                if row < num_rows:
                    for v in T.unroll(per_thread):
                        if v * THREADS + tid < vectors:
                            for j in T.vectorized(4):
                                buf[v * 4 + j] = src_NW[row, (v * THREADS + tid) * 4 + j]
                    for v in T.unroll(per_thread):
                        if v * THREADS + tid < vectors:
                            for j in T.vectorized(4):
                                dst_CV[delta // 16 + row * vectors + v * THREADS + tid, j] = buf[v * 4 + j]

    return register_put


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    peer = (rank + 1) % world
    words = a.hidden // 2

    heap = make_heap(world * a.tokens * a.hidden * 2, dist.group.WORLD, device)
    region = heap.region(0, (world * a.tokens, a.hidden), torch.bfloat16)
    src_TD = torch.randn(a.tokens, a.hidden, device=device, dtype=torch.bfloat16)
    dest_TW = torch.full((a.tokens, world), -1, dtype=torch.int32, device=device)
    dest_TW[:, peer] = rank * a.tokens + torch.arange(a.tokens, dtype=torch.int32, device=device)
    src_NW = src_TD.view(torch.int32)
    first = region.views[0].view(torch.int32).view(-1)
    delta = int(region.delta_W[peer]) + rank * a.tokens * a.hidden * 2  # bytes to block `rank` of the peer's copy

    def bulk(ctas, stages):
        kernel = get_bulk_put_kernel(words, ctas, stages)
        return lambda: (kernel(src_NW, delta, first), heap.barrier())

    def registers(ctas):
        kernel = get_register_put_kernel(words, ctas)
        return lambda: (kernel(src_NW, delta, first.view(-1, 4)), heap.barrier())

    shipped = lambda: (put_rows(src_TD, dest_TW, region), heap.barrier())  # noqa: E731
    parts = {"put_rows, every SM + barrier": shipped}
    parts |= {f"registers on {n} CTAs + barrier": registers(n) for n in (8, 16, 32, 66, 132)}
    parts |= {f"bulk on {n} CTAs, 2 stages + barrier": bulk(n, 2) for n in (16, 32, 66)}

    want = None
    for name, fn in parts.items():  # every variant leaves put_rows' bytes in the peer's copy
        region.views[rank].zero_()
        heap.barrier()
        fn()
        torch.cuda.synchronize()
        got = region.views[rank][peer * a.tokens:(peer + 1) * a.tokens].clone()
        want = got if want is None else want
        same = torch.tensor([torch.equal(got.view(torch.int16), want.view(torch.int16))], device=device)
        dist.all_reduce(same, op=dist.ReduceOp.MIN)
        if not same.item():
            raise AssertionError(f"{name}: not put_rows' bytes")

    # the home rows' pass: ~4 routes of a token's 8 here, rows read once each (~1/2 of the combine's)
    y_PD = torch.randn(a.tokens * 4, a.hidden, device=device, dtype=torch.bfloat16)
    pos_TK, w_TK = reduce_routes(a.tokens, 8, a.tokens * 4, device=device, seed=rank)
    home = lambda: weighted_reduce(y_PD, pos_TK, w_TK)  # noqa: E731
    side = torch.cuda.Stream(device, priority=-1)  # the few CTAs first: resident before the home pass fills the SMs

    def beside(put):
        def both():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                put()
            home()
            torch.cuda.current_stream().wait_stream(side)
        return both

    parts |= {"home pass alone (weighted_reduce)": home}
    parts |= {f"home pass beside bulk on {n} CTAs, 2 stages": beside(bulk(n, 2)) for n in (16, 32, 66)}
    parts |= {f"home pass beside registers on {n} CTAs": beside(registers(n)) for n in (16, 32, 66)}
    median_ms, _ = timers(dist.group.WORLD, device, 5, a.iters)
    graphs = _capture(*parts.values())
    mb = a.tokens * a.hidden * 2 / 1e6
    if rank == 0:
        print(f"{torch.cuda.get_device_name(device)} x {world}, {a.tokens} rows of {a.hidden} bf16 ({mb:.1f} MB) "
              f"to the peer, {a.iters} iterations, median of the slowest rank:")
    for name, graph in zip(parts, graphs):
        ms = median_ms(graph.replay)
        if rank == 0:
            print(f"  {name:45s} {ms * 1e3:8.1f} us  {mb / ms:7.1f} GB/s")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
