"""A CTA-wide prefix sum of int32 values for TileLang kernels: warp shuffles within each warp, then
one warp scans the warps' totals. Two barriers, where a Hillis-Steele scan over shared memory takes
two a step (16 for 256 threads): barriers are what a one-CTA bookkeeping kernel's time is made of.

Used by the expert layout's scan pass and ``receive_layout``, which place every barrier themselves
(``HAND_SYNC_CONFIGS``, also the configuration of ``kernels.comm``'s ``put_routes`` and
``plan_receive``).
"""

import tilelang
from tilelang import language as T

WARP = 32
SHUFFLE_DELTAS = [1, 2, 4, 8, 16]
# TileLang's barrier planner puts two CTA barriers around each round of a warp's ranks in shared
# memory (it cannot tell that a warp's counts are its own), which keeps 32 warps in lockstep; and
# buffers it lays over each other need its barriers. Kernels built with these configs place every
# barrier themselves and keep their shared buffers apart.
HAND_SYNC_CONFIGS = {
    tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
    tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True,
    tilelang.PassConfigKey.TL_DISABLE_SHARED_MEMORY_REUSE: True,
}


def block_scan(count: int, warps: int):
    """A macro ``(values, totals, thread)`` for a CTA of ``warps`` warps (at most 32): each thread's
    ``values[s]`` (local int32, ``s < count``) becomes the inclusive sum of ``values[s]`` over threads
    ``0..thread``; ``totals`` (``[count, warps]`` shared int32) is its scratch. Every thread of the
    CTA calls it."""
    if not 1 <= warps <= WARP:
        raise ValueError(f"warps: expected 1 to {WARP}, got {warps}")

    @T.macro
    def scan(values, totals, thread):
        lane = thread % WARP
        warp = thread // WARP
        up = T.alloc_var(T.int32)
        total = T.alloc_var(T.int32)
        for s in T.unroll(count):
            for delta in SHUFFLE_DELTAS:
                up = T.shfl_up(values[s], delta)
                if lane >= delta:
                    values[s] = values[s] + up
            if lane == WARP - 1:
                totals[s, warp] = values[s]
        T.sync_threads()
        if warp == 0:  # the warps' totals, scanned by one warp into exclusive prefixes
            for s in T.unroll(count):
                total = 0
                if lane < warps:
                    total = totals[s, lane]
                for delta in SHUFFLE_DELTAS:
                    up = T.shfl_up(total, delta)
                    if lane >= delta:
                        total = total + up
                if lane < warps:
                    totals[s, lane] = total - totals[s, lane]
        T.sync_threads()
        for s in T.unroll(count):
            values[s] = values[s] + totals[s, warp]

    return scan
