"""Can two processes on one GPU share torch symmetric memory (the CUDA backend) over a gloo group?
If so, the nvlink backend's cross-rank path (stores into a peer's heap, the barrier) can be
checked on a one-GPU machine. Run: torchrun --standalone --nproc-per-node 2 bench/scripts/symm_one_gpu.py
Prints one line per rank: what worked, or the first error."""

import os

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    try:
        from torch.distributed import _symmetric_memory as symm_mem

        local = symm_mem.empty(1 << 20, dtype=torch.uint8, device=device)
        local.fill_(rank)
        handle = symm_mem.rendezvous(local, dist.group.WORLD)
        handle.barrier(channel=0)
        peer = (rank + 1) % world
        view = handle.get_buffer(peer, (1 << 20,), torch.uint8)
        view[:16].fill_(100 + rank)  # a store into the peer's copy
        handle.barrier(channel=0)
        got = local[:16].tolist()
        torch.cuda.synchronize()
        ok = got == [100 + (rank - 1) % world] * 16 and int(local[16]) == rank
        print(f"rank {rank}: backend {symm_mem.get_backend(device)}, peer store seen: {ok} ({got[:2]}...)", flush=True)
    except Exception as e:  # the experiment's answer, printed
        print(f"rank {rank}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TORCH_SYMMMEM", "CUDA")
    main()
