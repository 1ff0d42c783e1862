"""receive_expand: a small batch's receiving side (plan_receive, the local experts' layout) and its
FP8 rows dequantized into that layout, in one launch. The kernel against the reference on fresh
random metadata (ids of every rank, masked and out of range; rows past their sender's count hold
garbage, their FP8 bytes NaN) and rows, bit for bit, every output poisoned first; the public op's
two paths; sm_90a compile."""

import pytest
import torch

from kernels import lowering
from kernels.comm import receive_expand, receive_expand_fits, reference
from kernels.comm.receive_expand_kernel import MAX_ROUTES, get_receive_expand_kernel
from kernels.testing import arrived_routes, assert_same_receive, fp8_rows, poison_allocator

NAN_E4M3 = 0x7F


def received(world: int, t_max: int, k: int, e_local: int, hidden: int, seed: int):
    """What a receive region holds: routes, counts, FP8 rows and scales (NaN bytes past each count)."""
    meta, count = arrived_routes(world, t_max, k, e_local, seed)
    q, sf = fp8_rows(world * t_max, hidden, seed=seed)
    for w, c in enumerate(count.tolist()):
        q.view(torch.uint8)[w * t_max + c:(w + 1) * t_max] = NAN_E4M3
    return meta, count, q, sf


def assert_same(got, want):
    (plan, layout, x_PD), (want_plan, want_layout, want_x) = got, want
    assert_same_receive((plan, layout), (want_plan, want_layout))
    assert x_PD.shape == want_x.shape and x_PD.dtype == want_x.dtype
    used = int(want_layout.offsets_E[-1])
    assert torch.equal(x_PD[:used].cpu().view(torch.uint8), want_x[:used].view(torch.uint8))


def sizes(world, t_max, e_local, alignment, dtype=torch.bfloat16, seed=0):
    """The op's keywords, for a receiving rank drawn from the seed."""
    return dict(num_local_experts=e_local, rank=seed % world, max_tokens=t_max, alignment=alignment, out_dtype=dtype)


def test_reference_is_receive_layout_then_expand_cast_back(seed):
    """Rows by hand: each layout row holds its route's row dequantized, each padding row zeros."""
    meta, count = arrived_routes(2, 12, 4, 6, seed)
    count[0] = 12  # rank 0 sent every row (rank 1 nothing), so rank 1 has routes
    q, sf = fp8_rows(24, 256, seed=seed)
    args = dict(sizes(2, 12, 6, 8, torch.float32), rank=1)
    plan, layout, x_PD = reference.receive_expand(meta, count, q, sf, **args)
    used = int(layout.offsets_E[-1])
    assert used > 0 and layout.num_rows == reference.receive_rows(2, 12, 4, 6, 8)
    for p, src in enumerate(layout.src_P[:used].tolist()):
        if src < 0:
            assert not x_PD[p].any()
        else:
            row = src // 4
            assert plan.local_idx_RK.view(-1)[src] >= 0
            assert torch.equal(x_PD[p], q[row].float() * sf[row].repeat_interleave(128))


@pytest.mark.gpu
@pytest.mark.parametrize("world,t_max,k,e_local,alignment,hidden,dtype", [
    (2, 128, 8, 128, 8, 7168, torch.bfloat16),  # the small batch on two ranks (DeepSeek-V3)
    (1, 256, 8, 256, 8, 7168, torch.bfloat16),  # the same rows on one rank
    (8, 64, 8, 32, 128, 7168, torch.bfloat16),  # MAX_ROUTES routes, padding nearly everywhere
    (3, 50, 6, 5, 1, 300, torch.float16),  # a ragged width, no padding
    (2, 37, 2, 4, 8, 64, torch.float32),  # the tiny model's
    (1, 1, 1, 1, 1, 128, torch.bfloat16),
    (4, 3, 2, 64, 16, 7168 + 64, torch.bfloat16),  # experts without routes
])
def test_kernel_matches_reference(world, t_max, k, e_local, alignment, hidden, dtype, seed):
    assert receive_expand_fits(world, t_max, k, e_local)
    meta, count, q, sf = received(world, t_max, k, e_local, hidden, seed)
    args = sizes(world, t_max, e_local, alignment, dtype, seed)
    want = reference.receive_expand(meta, count, q, sf, **args)
    poison_allocator("cuda")
    assert_same(receive_expand(meta.cuda(), count.cuda(), q.cuda(), sf.cuda(), **args), want)


@pytest.mark.gpu
def test_a_larger_batch_takes_the_two_ops(seed):
    world, t_max, k, e_local = 2, MAX_ROUTES // 16 + 1, 8, 64  # one row past what one launch takes
    assert not receive_expand_fits(world, t_max, k, e_local)
    meta, count, q, sf = received(world, t_max, k, e_local, 256, seed)
    args = sizes(world, t_max, e_local, 8, seed=seed)
    assert_same(receive_expand(meta.cuda(), count.cuda(), q.cuda(), sf.cuda(), **args),
                reference.receive_expand(meta, count, q, sf, **args))


def test_compiles_for_sm90a():
    """Two ranks of 128 DeepSeek-V3 experts (the small batch), eight of 32 at alignment 128; the
    tiny model's two ranks, top-2, float32 rows."""
    with lowering.compile_only():
        for spec in [(2, 128, 8, 128, 8, 7168, 128, "bfloat16"), (8, 64, 8, 32, 128, 7168, 128, "bfloat16"),
                     (2, 64, 2, 4, 8, 64, 128, "float32")]:
            source = lowering.kernel_source(get_receive_expand_kernel(*spec))
            assert "AtomicAdd" in source and "fp8" in source and lowering.waits_first(source), spec
