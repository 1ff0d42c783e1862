"""The gate's kernel (the router kernel with its gate stages) against the reference on the same
CUDA device, and its sm_90a compile. Routes, logical ids and counts are bit-exact; weights as the
router's (bit-exact without ``normalize``, 2e-6 relative with it)."""

import os

import pytest
import torch

from kernels.lowering import compile_only
from kernels.routing import PhysicalMap, reference
from kernels.routing.gate_kernel import gate
from kernels.routing.topk_route_kernel import get_topk_route_kernel
from kernels.testing import physical_map_inputs, poison_allocator, router_inputs

FULL = os.environ.get("EP_KERNEL_TESTS") == "full"
# (experts, num_groups, topk_groups, topk): DeepSeek-V3, tiny, ragged lanes, compacted groups.
GROUPINGS = [(256, 8, 4, 8), (8, 1, None, 2), (72, 3, 1, 4), (240, 8, 3, 6)]
TOKENS = [0, 1, 37, 4099] + ([16384] if FULL else [])
# (shared routes, with a map, with a token mask, with fixed routes, normalize)
STAGES = [(0, True, False, False, False), (1, True, True, True, True), (2, False, True, False, False),
          (0, False, False, True, True), (3, True, False, False, True)]


def gate_inputs(num_tokens, num_experts, topk, stages, *, device, seed):
    num_shared, with_map, with_mask, with_fixed, _normalize = stages
    gen = torch.Generator().manual_seed(seed)
    inputs = {"num_shared": num_shared}
    if with_map:
        log2phy_ER, fraction_ER, num_physical = physical_map_inputs(num_experts + num_shared, 3, seed=seed)
        terms_E = torch.rand(num_experts + num_shared, generator=gen, dtype=torch.float64) * 7
        inputs["physical_map"] = PhysicalMap.from_replicas(
            log2phy_ER, fraction_ER, num_physical=num_physical, token_step=0.6180339887498949,
            source_term=3 * 0.4142135623730951, expert_term_E=terms_E).to(device)
    if with_mask:
        inputs["token_mask_T"] = (torch.rand(num_tokens, generator=gen) < 0.8).to(device)
    if with_fixed:
        fixed_idx_TK = torch.rand(num_tokens, num_experts, generator=gen).argsort(1)[:, :topk]
        fixed_idx_TK[torch.rand(num_tokens, topk, generator=gen) < 0.2] = -1
        inputs["fixed_T"] = (torch.rand(num_tokens, generator=gen) < 0.3).to(device)
        inputs["fixed_idx_TK"] = fixed_idx_TK.to(device)
    return inputs


@pytest.mark.gpu
@pytest.mark.parametrize("stages", STAGES, ids=lambda s: "-".join(map(str, s)))
@pytest.mark.parametrize("num_experts, num_groups, topk_groups, topk", GROUPINGS)
@pytest.mark.parametrize("num_tokens", TOKENS)
def test_gate_matches_reference(seed, num_tokens, num_experts, num_groups, topk_groups, topk, stages):
    normalize = stages[-1]
    logits_TE, bias_E = router_inputs(num_tokens, num_experts, device="cuda", seed=seed)
    options = {"topk": topk, "scoring": "sigmoid", "num_groups": num_groups, "topk_groups": topk_groups,
               "normalize": normalize, "routed_scaling_factor": 1.5, "bias_E": bias_E, "with_counts": True,
               **gate_inputs(num_tokens, num_experts, topk, stages, device="cuda", seed=seed)}
    poison_allocator(logits_TE.device)
    got = gate(logits_TE, **options)
    want = reference.gate(logits_TE, **options)
    assert got.physical_idx_TK.dtype == torch.int64 and got.weights_TK.dtype == torch.float32
    assert torch.equal(got.physical_idx_TK, want.physical_idx_TK)
    assert torch.equal(got.logical_idx_TK, want.logical_idx_TK)
    assert torch.equal(got.counts_E, want.counts_E)
    if normalize:
        torch.testing.assert_close(got.weights_TK, want.weights_TK, rtol=2e-6, atol=1e-7)
    else:
        assert torch.equal(got.weights_TK, want.weights_TK)


@pytest.mark.gpu
def test_public_gate_runs_the_kernel_and_the_layer_map(seed):
    """A placement's map (the planner's draw) through the public op on the GPU."""
    from kernels.routing import gate as public
    from topology.routing import draw_terms

    logits_TE, bias_E = router_inputs(1000, 64, device="cuda", seed=seed)
    log2phy_ER, fraction_ER, num_physical = physical_map_inputs(64, 2, seed=seed)
    token_step, source_term, expert_term_E = draw_terms(3, 64)
    physical_map = PhysicalMap.from_replicas(log2phy_ER, fraction_ER, num_physical=num_physical, token_step=token_step,
                                             source_term=source_term, expert_term_E=expert_term_E).to("cuda")
    options = {"topk": 6, "scoring": "sigmoid", "bias_E": bias_E, "physical_map": physical_map}
    got, want = public(logits_TE, **options), reference.gate(logits_TE, **options)
    assert torch.equal(got.physical_idx_TK, want.physical_idx_TK)


def test_public_gate_picks_the_kernel_where_the_router_would(stub_kernel, monkeypatch):
    import kernels.routing as public
    from kernels.routing import gate_kernel

    monkeypatch.setattr(public, "use_tilelang", lambda device: True)
    calls = stub_kernel(gate_kernel, "gate", "kernel")
    logits_TE = torch.randn(4, 64)
    assert public.gate(logits_TE, topk=8, num_shared=2) == "kernel" and len(calls) == 1
    assert public.gate(logits_TE, topk=8, num_shared=25).physical_idx_TK.shape == (4, 33)  # past a warp
    assert public.gate(logits_TE.double(), topk=8).physical_idx_TK.shape == (4, 8)  # float64: the reference
    assert len(calls) == 1


BAD_INPUTS = [
    (lambda: gate(torch.zeros(4, 8), topk=2), ValueError, "logits_TE"),  # not on CUDA
    (lambda: gate(torch.zeros(4, 8), topk=2, num_shared=31), ValueError, "num_shared"),
    (lambda: gate(torch.zeros(4, 8), topk=2, fixed_T=torch.ones(4, dtype=torch.bool)), ValueError, "fixed_idx_TK"),
    (lambda: gate(torch.zeros(4, 8), topk=2, token_mask_T=torch.ones(3, dtype=torch.bool)), ValueError,
     "token_mask_T"),
    (lambda: gate(torch.zeros(4, 8), topk=2, physical_map="map"), TypeError, "physical_map"),
]


@pytest.mark.parametrize("call, error, argname", BAD_INPUTS)
def test_bad_input_names_the_argument(call, error, argname):
    with pytest.raises(error, match=f"^{argname}: expected"):
        call()


# The gate as the MoE layer runs it (DeepSeek-V3 with a map) and with every stage (a ragged router).
SPECIALIZATIONS = [
    ((256, 8, 8, 4, "sigmoid", "float32", True, True), {"with_map": True}),
    ((72, 4, 3, 1, "softmax", "bfloat16", False, False),
     {"num_shared": 2, "with_map": True, "with_mask": True, "with_fixed": True}),
]


@pytest.mark.parametrize("spec, stages", SPECIALIZATIONS, ids=["v3-map", "ragged-every-stage"])
def test_compiles_for_sm90a(spec, stages):
    with compile_only():
        kernel = get_topk_route_kernel(*spec, **stages)
    source = kernel.get_kernel_source()
    assert "__dmul_rn" in source and "__dadd_rn" in source  # no fused multiply-add in the draw
