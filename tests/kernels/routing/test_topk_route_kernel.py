"""The one-kernel router against the reference on the same CUDA device, and its sm_90a compile.

GPU tests run the reference on the GPU too, so both sides use CUDA's math. Indices and counts are
bit-exact; weights are bit-exact without ``normalize`` and within 2e-6 relative with it (the K
weights are summed in another order than torch's). ``EP_KERNEL_TESTS=full`` widens the parameters.
"""

import os

import pytest
import torch

from kernels.lowering import compile_only
from kernels.routing import reference
from kernels.routing.topk_route_kernel import (
    MAX_SLOTS,
    WARP,
    get_topk_route_kernel,
    lane_layout,
    supports,
    topk_route,
)
from kernels.testing import poison_allocator, router_inputs, spy

FULL = os.environ.get("EP_KERNEL_TESTS") == "full"
SCORINGS = ("softmax", "sigmoid", "sqrtsoftplus")
# (experts, num_groups, topk_groups, topk): DeepSeek-V3, tiny, ragged slots and groups (240: 15
# experts a lane, 2 lanes a group, 16 lanes used). The kept groups are compacted into fewer slots
# a lane for DeepSeek-V3 (8 -> 4), 64 / 8 / 4 (2 -> 1), 512 / 16 / 4 (16 -> 4) and, in the full run,
# 128 / 8 / 2 (4 -> 1), 256 / 16 / 8 (8 -> 4, 4 lanes a kept group) and 1024 / 32 / 4 (32 -> 4).
GROUPINGS = [(256, 8, 4, 8), (8, 1, None, 2), (16, 4, 2, 5), (12, 12, 5, 4), (72, 3, 1, 4), (160, 8, 3, 6), (240, 8, 3, 6),
             (64, 8, 4, 6), (512, 16, 4, 8)]
if FULL:
    GROUPINGS += [(256, 1, None, 8), (64, 8, 8, 6), (1024, 32, 4, 8), (2, 2, 1, 1), (96, 32, 3, 3), (128, 8, 2, 8),
                  (256, 16, 8, 8)]
TOKENS = [0, 1, 37, 4099] + ([16384] if FULL else [])
# (bias, normalize, routed_scaling_factor)
OPTIONS = [(False, False, 1.0), (True, True, 2.5), (True, False, 1.5)]


def check_route(logits_TE, bias_E, *, with_counts=False, **options):
    poison_allocator(logits_TE.device)
    got = topk_route(logits_TE, bias_E=bias_E, with_counts=with_counts, **options)
    idx_TK, weights_TK = reference.topk_route(logits_TE, bias_E=bias_E, **options)
    assert got[0].dtype == torch.int64 and got[1].dtype == torch.float32
    assert torch.equal(got[0], idx_TK)
    if options.get("normalize"):
        torch.testing.assert_close(got[1], weights_TK, rtol=2e-6, atol=1e-7)
    else:
        assert torch.equal(got[1], weights_TK)
    if with_counts:
        assert got[2].dtype == torch.int32
        assert torch.equal(got[2], reference.expert_counts(idx_TK, logits_TE.shape[1]))


@pytest.mark.gpu
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("bias, normalize, factor", OPTIONS)
@pytest.mark.parametrize("num_experts, num_groups, topk_groups, topk", GROUPINGS)
@pytest.mark.parametrize("scoring", SCORINGS)
@pytest.mark.parametrize("num_tokens", TOKENS)
def test_topk_route_matches_reference(
    seed, num_tokens, scoring, num_experts, num_groups, topk_groups, topk, bias, normalize, factor, ties
):
    logits_TE, bias_E = router_inputs(num_tokens, num_experts, ties=ties, device="cuda", seed=seed)
    check_route(
        logits_TE,
        bias_E if bias else None,
        with_counts=bias,
        topk=topk,
        scoring=scoring,
        num_groups=num_groups,
        topk_groups=topk_groups,
        normalize=normalize,
        routed_scaling_factor=factor,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scoring", SCORINGS)
def test_topk_route_half_logits(seed, scoring, dtype):
    logits_TE, bias_E = router_inputs(1029, 256, dtype=dtype, device="cuda", seed=seed)
    check_route(logits_TE, bias_E, with_counts=True, topk=8, scoring=scoring, num_groups=8, topk_groups=4, normalize=True)


@pytest.mark.gpu
def test_topk_route_public_op_uses_the_kernel_result(monkeypatch, seed):
    from kernels.routing import topk_route_kernel, topk_route_with_counts

    calls = spy(monkeypatch, topk_route_kernel, "topk_route")
    logits_TE, bias_E = router_inputs(300, 64, device="cuda", seed=seed)
    idx_TK, _weights_TK, counts_E = topk_route_with_counts(logits_TE, topk=6, scoring="sigmoid", bias_E=bias_E)
    assert torch.equal(idx_TK, reference.topk_route(logits_TE, topk=6, scoring="sigmoid", bias_E=bias_E)[0])
    assert int(counts_E.sum()) == 300 * 6 and len(calls) == 1


def test_options_beyond_the_kernel_send_the_public_op_to_the_reference(monkeypatch):
    """Valid options the kernel cannot take (more than 1024 experts, top-k above a warp, more than
    a warp of groups to choose from) are not the kernel's: the public op runs the reference. On the
    CPU, with the kernels switched on and the kernel replaced by a marker: which one each call ran."""
    assert not supports(2048, 8, 1, None) and not supports(256, 40, 1, None) and not supports(512, 8, 64, 8)
    assert supports(256, 8, 8, 4) and supports(512, 8, 64, 64) and supports(1024, 32, 1, None)
    import kernels.routing as public
    from kernels.routing import topk_route_kernel

    monkeypatch.setattr(public, "use_tilelang", lambda device: True)
    monkeypatch.setattr(topk_route_kernel, "topk_route", lambda logits, **options: "kernel")
    logits = torch.randn(4, 2048)
    assert public.topk_route(logits[:, :256], topk=8, num_groups=8, topk_groups=4) == "kernel"
    assert public.topk_route(logits, topk=8)[0].shape == (4, 8)  # 2048 experts: the reference
    assert public.topk_route(logits[:, :256], topk=40)[0].shape == (4, 40)
    assert public.topk_route(logits[:, :512], topk=8, num_groups=64, topk_groups=8)[0].shape == (4, 8)


@pytest.mark.gpu
def test_public_op_takes_non_contiguous_logits_and_options_beyond_the_kernel(seed):
    from kernels.routing import topk_route as public

    logits_TE, bias_E = router_inputs(65, 256, device="cuda", seed=seed)
    columns_first = logits_TE.t().contiguous().t()  # same values, strides (1, 65)
    options = {"topk": 8, "scoring": "sigmoid", "num_groups": 8, "topk_groups": 4, "normalize": True}
    got, want = public(columns_first, bias_E=bias_E, **options), reference.topk_route(logits_TE, bias_E=bias_E, **options)
    assert torch.equal(got[0], want[0]) and torch.allclose(got[1], want[1], rtol=2e-6, atol=0)
    got = public(logits_TE, topk=40)  # top-40: more than a warp, the reference's
    assert torch.equal(got[0], reference.topk_route(logits_TE, topk=40)[0])


@pytest.mark.gpu
def test_groups_off_the_lanes_run_the_reference(seed):
    """500-expert groups fit no lane layout: the public op falls back to the reference."""
    from kernels.routing import topk_route as public

    assert not supports(1000, 4, 2, 1)
    logits_TE, bias_E = router_inputs(65, 1000, device="cuda", seed=seed)
    options = {"topk": 4, "scoring": "sigmoid", "num_groups": 2, "topk_groups": 1, "normalize": True}
    got = public(logits_TE, bias_E=bias_E, **options)
    want = reference.topk_route(logits_TE, bias_E=bias_E, **options)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="^num_groups: "):
        topk_route(logits_TE, bias_E=bias_E, **options)


ALL_GROUPINGS = GROUPINGS + [(256, 1, None, 8), (64, 8, 8, 6), (1024, 32, 4, 8), (2, 2, 1, 1), (96, 32, 3, 3)]


@pytest.mark.parametrize("num_experts, num_groups, topk_groups, topk", ALL_GROUPINGS)
def test_lane_layout_lines_groups_up_with_lanes(num_experts, num_groups, topk_groups, topk):
    topk_groups = num_groups if topk_groups is None else topk_groups
    slots, group_lanes, lane_groups = lane_layout(num_experts, num_groups, topk_groups)
    assert WARP * slots >= num_experts and slots <= MAX_SLOTS  # every expert has a lane
    if topk_groups < num_groups:
        group_size = num_experts // num_groups
        assert group_lanes * slots == group_size * lane_groups  # whole groups per lane block
        assert group_lanes & (group_lanes - 1) == 0  # the butterfly stays inside the group


BAD_INPUTS = [
    (lambda: topk_route(torch.zeros(4, 8, dtype=torch.float64), topk=2), TypeError, "logits_TE"),
    (lambda: topk_route(torch.zeros(4, 8), topk=2), ValueError, "logits_TE"),  # not on CUDA
    (lambda: topk_route(torch.zeros(8), topk=2), ValueError, "logits_TE"),
    (lambda: topk_route(torch.zeros(4, 2048), topk=2), ValueError, "logits_TE"),
]


@pytest.mark.parametrize("call, error, argname", BAD_INPUTS)
def test_bad_input_names_the_argument(call, error, argname):
    with pytest.raises(error, match=f"^{argname}: expected"):
        call()


# Each specialization the runtime uses: DeepSeek-V3 (sigmoid, normalized, with counts, fp32 and
# bf16 logits), a tiny softmax router (8 experts, top-2), a ragged one (72 experts, groups across
# lane slots, fp16 logits), DeepSeek-V3 and 512 experts with their kept groups compacted.
SPECIALIZATIONS = [
    (256, 8, 8, 4, "sigmoid", "float32", True, True),
    (256, 8, 8, 4, "sigmoid", "bfloat16", True, False),
    (8, 2, 1, 1, "softmax", "float32", False, False),
    (72, 4, 3, 1, "sqrtsoftplus", "float16", False, True),
    (240, 6, 8, 3, "softmax", "bfloat16", True, True),
    (512, 8, 16, 4, "sigmoid", "float32", True, False),
]


@pytest.mark.parametrize("spec", SPECIALIZATIONS, ids=lambda s: "-".join(map(str, s)))
def test_compiles_for_sm90a(spec):
    with compile_only():
        kernel = get_topk_route_kernel(*spec)
    assert "topk_route_kernel" in kernel.get_kernel_source()
