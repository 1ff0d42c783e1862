"""ep-scaling's baseline without communication and the layer's FLOP count (the measurements:
tests/launch/test_bench.py)."""

from dataclasses import replace

import pytest

from ep_runtime.bench.ep_local import comm_figures, layer_flops, local_spec
from ep_runtime.bench.ep_scaling import SHAPES, BenchSpec, _moe_config

SMALL = BenchSpec(shape="small", **SHAPES["small"])
V3 = BenchSpec(shape="deepseek-v3", **SHAPES["deepseek-v3"])


def test_small_layer_flops_by_hand():
    # hidden 128, 8 experts, top-2, one shared expert of 128
    router = 128 * 8
    experts = (2 + 1) * 3 * 128 * 128  # 2 routed + 1 shared, SwiGLU: w13 2 D I + w2 I D
    per_token = 2 * (router + experts) + 4 * (router + experts)  # forward 2 per weight, backward 4
    assert layer_flops(_moe_config(SMALL), SMALL.hidden, 256) == 256 * per_token == 228_065_280


def test_the_baselines_router_misses_under_one_percent_of_deepseek_v3():
    """What the baseline's smaller router leaves out of the exposed communication at EP 8."""
    full = layer_flops(_moe_config(V3), V3.hidden, 1)
    local = layer_flops(_moe_config(local_spec(V3, 8)), V3.hidden, 1)
    assert full - local == 6 * V3.hidden * (256 - 32)
    assert 0 < (full - local) / full < 0.01


def test_local_spec_keeps_a_ranks_experts_under_plain_top_k():
    local = local_spec(V3, 8)
    assert (local.num_experts, local.num_groups, local.topk_groups) == (32, 1, None)
    assert replace(local, num_experts=256, num_groups=8, topk_groups=4) == V3
    assert _moe_config(local_spec(V3, 32)).router.topk == 8  # 8 experts, top-8: still a valid router
    assert local_spec(V3, 64) is None  # 4 experts cannot take 8 distinct routes
    assert local_spec(SMALL, 1) == SMALL  # already one group


@pytest.mark.parametrize("ep", [0, 3, 2.0])
def test_local_spec_refuses_sizes_that_do_not_divide_the_experts(ep):
    with pytest.raises(ValueError, match=rf"ep: expected a positive divisor of num_experts=8, got {ep!r}"):
        local_spec(SMALL, ep)


def test_exposed_communication_is_the_layer_time_past_the_baseline():
    row = comm_figures(4.0, 3.0, 6_000_000_000)
    assert row == {"local_ms": 3.0, "exposed_comm_ms": 1.0, "exposed_comm_pct": 25.0,
                   "layer_flops_per_rank": 6_000_000_000, "model_tflops_per_gpu": 1.5}
    no_baseline = comm_figures(4.0, None, 6_000_000_000)
    assert no_baseline["exposed_comm_ms"] is None and no_baseline["exposed_comm_pct"] is None
    assert no_baseline["model_tflops_per_gpu"] == 1.5


def test_fp8_experts_in_the_layer_and_its_baseline():
    """``--fp8-experts`` aligns segments to 128 rows unless told otherwise, reaches the layer's
    config, and the baseline without communication runs the same experts."""
    from ep_runtime.bench.ep_scaling import parser, spec_from_args

    spec = spec_from_args(parser().parse_args(["--shape", "deepseek-v3", "--fp8-experts"]), on_gpu=False)
    assert spec.fp8_experts and spec.alignment == 128 and _moe_config(spec).fp8_experts
    assert local_spec(spec, 4).fp8_experts and _moe_config(local_spec(spec, 4)).alignment == 128
    assert not spec_from_args(parser().parse_args(["--shape", "deepseek-v3"]), on_gpu=False).fp8_experts
    with pytest.raises(ValueError, match=r"^bench\.alignment: expected a multiple of 128 with --fp8-experts .*got 8$"):
        spec_from_args(parser().parse_args(["--shape", "deepseek-v3", "--fp8-experts", "--alignment", "8"]),
                       on_gpu=False)
