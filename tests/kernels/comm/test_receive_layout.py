"""receive_layout: a dispatch's receiving side (plan_receive, then the local experts' layout). The
one-CTA kernel against the reference on fresh random metadata (ids of every rank, masked and out
of range; rows past their sender's count hold garbage), bit for bit, every output poisoned first;
the public op's two paths; sm_90a compile."""

import pytest

from kernels import lowering
from kernels.comm import receive_layout
from kernels.comm import reference
from kernels.comm.receive_layout_kernel import MAX_EXPERTS, MAX_ROUTES, fits, get_receive_layout_kernel
from kernels.permute import max_rows
from kernels.testing import arrived_routes, assert_same_receive, poison_allocator


def sizes(world, t_max, k, e_local, alignment):
    return dict(num_local_experts=e_local, rank=world - 1, max_tokens=t_max, alignment=alignment,
                num_rows=max_rows(world * t_max, k, e_local, alignment))


def test_public_op_runs_the_kernel_only_where_selected(seed, stub_kernel, monkeypatch):
    import kernels.comm
    from kernels.comm import receive_layout_kernel

    meta, count = arrived_routes(2, 40, 8, 16, seed)
    args = sizes(2, 40, 8, 16, 8)
    calls = stub_kernel(receive_layout_kernel, "receive_layout", "from the kernel")
    assert_same_receive(receive_layout(meta, count, **args), reference.receive_layout(meta, count, **args))
    assert not calls
    monkeypatch.setattr(kernels.comm, "use_tilelang", lambda device: True)
    assert receive_layout(meta, count, **args) == "from the kernel" and len(calls) == 1 and calls[0][1] == args


@pytest.mark.gpu
@pytest.mark.parametrize("world,t_max,k,e_local,alignment", [
    (2, 128, 8, 128, 8),  # the small batch on two ranks (DeepSeek-V3 experts)
    (1, 256, 8, 256, 8),  # the same rows on one rank
    (8, 64, 8, 32, 128),
    (3, 50, 6, 5, 1),
    (2, 256, 8, MAX_EXPERTS, 16),  # MAX_ROUTES routes, MAX_EXPERTS experts
    (1, 1, 1, 1, 1),
    (4, 3, 2, 64, 8),
])
def test_kernel_matches_reference(world, t_max, k, e_local, alignment, seed):
    assert fits(world * t_max * k, e_local)
    meta, count = arrived_routes(world, t_max, k, e_local, seed)
    args = sizes(world, t_max, k, e_local, alignment)
    poison_allocator("cuda")
    got = receive_layout(meta.cuda(), count.cuda(), **args)
    assert_same_receive(got, reference.receive_layout(meta, count, **args))


@pytest.mark.gpu
@pytest.mark.parametrize("e_local", [64, 4])
def test_a_larger_batch_takes_the_two_ops(e_local, seed):
    """One row past what one CTA takes; with 4 local experts for top-8, at the dispatcher's capacity
    (``receive_rows``: min(K, E_local) routes a row, fewer than max_rows over K)."""
    world, t_max, k = 2, MAX_ROUTES // 8 + 1, 8
    assert not fits(world * t_max * k, e_local)
    meta, count = arrived_routes(world, t_max, k, e_local, seed)
    args = sizes(world, t_max, k, e_local, 8) | {"num_rows": reference.receive_rows(world, t_max, k, e_local, 8)}
    got = receive_layout(meta.cuda(), count.cuda(), **args)
    assert_same_receive(got, reference.receive_layout(meta, count, **args))


def test_a_receivers_capacity_counts_min_k_e_local_routes_a_row(seed):
    """Top-8 onto 4 local experts: the reference lays the rows out in ``receive_rows`` (which is
    less than max_rows over K) and refuses a row with more routes to this rank than experts here."""
    world, t_max, k, e_local = 2, 40, 8, 4
    assert reference.receive_rows(world, t_max, k, e_local, 8) < max_rows(world * t_max, k, e_local, 8)
    meta, count = arrived_routes(world, t_max, k, e_local, seed)
    args = sizes(world, t_max, k, e_local, 8) | {"num_rows": reference.receive_rows(world, t_max, k, e_local, 8)}
    plan, layout = receive_layout(meta, count, **args)
    assert int(layout.offsets_E[-1]) <= layout.num_rows == args["num_rows"]
    meta[0, :k] = 2 * e_local - 1  # rank 1's last expert, eight times: not a router's routes
    count[0] = max(int(count[0]), 1)
    with pytest.raises(ValueError, match="^topk_idx_TK: expected at most 4 routes a token"):
        receive_layout(meta, count, **args)


def test_compiles_for_sm90a():
    """Two ranks of 128 DeepSeek-V3 experts (the small batch), one of 256, eight of 32 at
    alignment 128; the tiny model's two ranks, top-2."""
    with lowering.compile_only():
        for world, k, e_local, alignment in ((2, 8, 128, 8), (1, 8, 256, 8), (8, 8, 32, 128), (2, 2, 4, 8)):
            kernel = get_receive_layout_kernel(world, k, e_local, alignment)
            source = lowering.kernel_source(kernel)
            assert "__match_any_sync" in source and lowering.waits_first(source)
