"""Expert placement at run time (``ep_runtime.placement``): replicas change where routes run, not
what the layer computes; a plan switch moves weights and optimizer state so that training goes on
as if it had started on the new plan; bad placements are named."""

import pytest
import torch
from ep_workers import HIDDEN, build_layer, forward_backward, moe_config
from placement_workers import PLAN_A, PLAN_B, placement_suite

from ep_runtime.config import ModelConfig
from ep_runtime.dispatch import AllToAllDispatcher
from ep_runtime.model import TinyDeepSeek
from ep_runtime.moe import MoELayer
from ep_runtime.parallel import single_process
from ep_runtime.placement import ExpertPlacement, placements_from_plan
from ep_runtime.replicas import _transfers, switch_placement, sync_replica_gradients
from launch.local import launch_local
from topology import Topology, migration, plan_from_phy2log

# CPU, fp32: the replicated layer sums the same terms as one process in another order.
RTOL = 1e-5


def _placement(phy2log, ep_size=1, num_experts=8, nodes=None):
    return ExpertPlacement(phy2log_P=torch.tensor(phy2log), num_experts=num_experts, ep_size=ep_size,
                           node_of_rank=nodes)


def _layer(phy2log, ctx=None):
    cfg = moe_config("balanced", False)
    ctx = ctx or single_process(torch.device("cpu"))
    torch.manual_seed(1234)
    dispatcher = AllToAllDispatcher(num_experts=len(phy2log), alignment=cfg.alignment)
    return MoELayer(cfg, HIDDEN, dispatcher, ep_rank=0, seed=7, placement=_placement(phy2log))


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(40, HIDDEN, generator=g), torch.randn(40, HIDDEN, generator=g)


def test_identity_placement_is_no_placement(seed):
    x, g = _inputs(seed)
    ctx = single_process(torch.device("cpu"))
    plain = build_layer(moe_config("balanced", False), ctx, "balanced")
    placed = _layer(list(range(8)))
    for a, b in zip(forward_backward(plain, x, g), forward_backward(placed, x, g)):
        assert torch.equal(a, b)
    for (name, a), b in zip(plain.named_parameters(), placed.parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_replicas_in_one_process_and_switch(seed):
    """12 slots in one process (no transfers): outputs equal the plain layer's, replicas' summed
    gradients equal the logical expert's, and a switch keeps the outputs exactly."""
    x, g = _inputs(seed)
    plain = build_layer(moe_config("balanced", False), single_process(torch.device("cpu")), "balanced")
    placed = _layer(PLAN_A)
    want_out, want_gx = forward_backward(plain, x, g)
    out, gx = forward_backward(placed, x, g)
    torch.testing.assert_close(out, want_out, rtol=0, atol=RTOL)
    torch.testing.assert_close(gx, want_gx, rtol=0, atol=RTOL)
    sync_replica_gradients(placed, single_process(torch.device("cpu")))
    for slot, e in enumerate(PLAN_A):
        torch.testing.assert_close(placed.experts.w13_EDI2.grad[slot], plain.experts.w13_EDI2.grad[e],
                                   rtol=0, atol=RTOL)
    placed.zero_grad(set_to_none=True)
    assert switch_placement(placed, None, [_placement(PLAN_B)], single_process(torch.device("cpu"))) == [0]
    assert placed.experts.logical_ids == tuple(PLAN_B)
    out_b, gx_b = forward_backward(placed, x, g)
    assert torch.equal(out_b, out) and torch.equal(gx_b, gx)


def test_routes_pick_replicas_as_the_plan_does(seed):
    topo = Topology.uniform(2, 2)  # 4 ranks on 2 nodes: replicas on the token's node first
    phy2log = torch.tensor([[0, 1, 5, 5, 2, 3, 4, 5, 6, 7, 5, 2, 0, 1, 6, 7]])
    plan = plan_from_phy2log(phy2log, torch.ones(1, 8), topo, traffic=None)
    (placement,) = placements_from_plan(plan)
    idx_TK = torch.randint(-1, 8, (300, 3))
    for rank in range(4):
        got = placement.physical_route(idx_TK, ep_rank=rank)
        assert torch.equal(got, plan.physical_route(idx_TK, 0, source_gpu=rank))
        assert torch.equal(torch.where(got >= 0, phy2log[0][got.clamp(min=0)], -1), idx_TK)
    # Every replica of expert 5 serves some of its routes.
    routes = torch.cat([placement.physical_route(torch.full((64, 1), 5), ep_rank=r) for r in range(4)])
    assert set(routes.flatten().tolist()) == {2, 3, 7, 10}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_gate_routes_to_the_plans_replicas(seed, device):
    """The router's gate with a rank's map (the kernel on a GPU) picks the replicas the plan picks
    for that rank's tokens."""
    from kernels.routing import gate

    topo = Topology.uniform(2, 2)
    phy2log = torch.tensor([[0, 1, 5, 5, 2, 3, 4, 5, 6, 7, 5, 2, 0, 1, 6, 7]])
    (placement,) = placements_from_plan(plan_from_phy2log(phy2log, torch.ones(1, 8), topo, traffic=None))
    logits_TE = torch.randn(1000, 8)
    for rank in range(4):
        routes = gate(logits_TE.to(device), topk=3, scoring="sigmoid",
                      physical_map=placement.physical_map(rank).to(device))
        want = placement.physical_route(routes.logical_idx_TK.cpu(), ep_rank=rank)
        assert torch.equal(routes.physical_idx_TK.cpu(), want)


def test_ranks_of_a_node_with_one_token_each_spread_over_the_replicas():
    """Expert 0 on every rank of one node, one route each: the source term sends the four ranks'
    first tokens to different replicas, not all to one."""
    phy2log = torch.tensor([[0, 1, 0, 2, 0, 3, 0, 4]])
    plan = plan_from_phy2log(phy2log, torch.ones(1, 5), Topology.uniform(1, 4), traffic=None)
    (placement,) = placements_from_plan(plan)
    picks = [int(placement.physical_route(torch.zeros(1, 1, dtype=torch.long), ep_rank=r)) for r in range(4)]
    assert len(set(picks)) >= 3 and all(phy2log[0, p] == 0 for p in picks), picks


def test_switch_transfers_are_the_planned_migration():
    topo = Topology.uniform(2, 2)
    old = plan_from_phy2log(torch.tensor([[0, 1, 5, 5, 2, 3, 4, 5, 6, 7, 5, 2, 0, 1, 6, 7]]), torch.ones(1, 8), topo,
                            traffic=None)
    new = plan_from_phy2log(torch.tensor([[7, 1, 5, 0, 2, 3, 4, 4, 6, 5, 5, 2, 3, 1, 6, 0]]), torch.ones(1, 8), topo,
                            traffic=None)
    (p_old,), (p_new,) = placements_from_plan(old), placements_from_plan(new)
    sources, transfers = _transfers(p_old, p_new)
    m = migration(old, new)
    assert sources == m.source_LP[0].tolist()
    assert len(transfers) == int(m.experts_moved_L[0]) > 0


def test_bad_placements_are_named():
    with pytest.raises(ValueError, match=r"placement.phy2log_P: expected a multiple of the EP size 4 .* got 10"):
        _placement([0, 1, 2, 3, 4, 5, 6, 7, 0, 1], ep_size=4)
    with pytest.raises(ValueError, match=r"placement.phy2log_P: expected every logical expert to have a replica, "
                                         r"experts \[3, 6\] have none"):
        _placement([0, 1, 2, 0, 4, 5, 2, 7], ep_size=2)
    with pytest.raises(ValueError, match=r"placement.phy2log_P: expected logical experts in \[0, 8\)"):
        _placement([0, 1, 2, 3, 4, 5, 6, 8], ep_size=2)
    with pytest.raises(TypeError, match="placement.phy2log_P: expected an integer dtype"):
        ExpertPlacement(phy2log_P=torch.zeros(8), num_experts=8, ep_size=1)
    with pytest.raises(ValueError, match=r"placement.node_of_rank: expected 2 ints"):
        _placement(list(range(8)), ep_size=2, nodes=(0,))
    cfg = moe_config("balanced", False)
    with pytest.raises(ValueError, match="placement.phy2log_P: expected the dispatcher's 8 physical experts, got 12"):
        MoELayer(cfg, HIDDEN, AllToAllDispatcher(num_experts=8), ep_rank=0, seed=0, placement=_placement(PLAN_A))
    with pytest.raises(ValueError, match="placement.num_experts: expected model.moe.num_experts=8, got 9"):
        MoELayer(cfg, HIDDEN, AllToAllDispatcher(num_experts=9), ep_rank=0, seed=0,
                 placement=_placement(list(range(9)), num_experts=9))
    with pytest.raises(ValueError, match=r"^topk_idx_TK: expected entries in -1 or \[0, 8\), got values in \[-2, 1\]"):
        _placement(PLAN_A).physical_route(torch.tensor([[-2, 1]]), ep_rank=0)
    with pytest.raises(TypeError, match="^topk_idx_TK: expected dtype"):
        _placement(PLAN_A).physical_route(torch.tensor([[0.0, 1.0]]), ep_rank=0)
    with pytest.raises(TypeError, match=r"^placement: expected an ExpertPlacement, got list$"):
        MoELayer(cfg, HIDDEN, AllToAllDispatcher(num_experts=8), ep_rank=0, seed=0, placement=list(range(8)))
    with pytest.raises(ValueError, match=r"^placement\.ep_size: expected the dispatcher's EP size 1, got 2$"):
        MoELayer(cfg, HIDDEN, AllToAllDispatcher(num_experts=8), ep_rank=0, seed=0,
                 placement=_placement(list(range(8)), ep_size=2))
    layer = _layer(PLAN_A)
    with pytest.raises(ValueError, match=r"^placement\.phy2log_P: expected the dispatcher's 12 physical experts, "
                                         r"got 8$"):
        layer.set_placement(_placement(list(range(8))))
    with pytest.raises(ValueError, match="new_placements: expected one placement per MoE layer"):
        switch_placement(layer, None, [], single_process(torch.device("cpu")))
    with pytest.raises(ValueError, match=r"new_placements\[0\].phy2log_P: expected the dispatcher's 12"):
        switch_placement(layer, None, [_placement(list(range(8)))], single_process(torch.device("cpu")))
    with pytest.raises(ValueError, match=r"placement: expected one per MoE layer \(2\), got 1"):
        TinyDeepSeek(ModelConfig(), AllToAllDispatcher(num_experts=8), placement=[_placement(list(range(8)))])


def test_two_ranks_replicas_switch_and_training():
    """One 2-process gloo job: (a) replicated layer == one process without replicas, (b) a plan
    switch keeps the layer's outputs, gradients, weights and optimizer state, (c) training on plan
    A then B == starting on B from A's state (losses bit-exact)."""
    if torch.cuda.is_available():  # float32's orders of summation: GPUs run the experts in bf16
        pytest.skip("the tolerances are float32's (CPU); GPUs run bf16 experts")
    results = launch_local(placement_suite, nproc=2)
    assert sorted(results) == [0, 1]
    for rank, r in results.items():
        a = r["replicas"]
        assert a["weights_equal"] and a["replicas_equal"], rank
        assert a["min_routes_per_slot"] > 0, rank  # every replica served routes
        for name, err in a["errors"].items():
            assert err <= RTOL, f"rank {rank} replicas {name}: max relative error {err:.3g} > {RTOL}"

        b = r["switch"]
        assert b["replicas_equal"] and b["moved"] == [3], rank
        assert b["one_sided"].startswith("optimizer: expected optimizer state for the experts on every rank"), rank
        assert b["logical_after"] == PLAN_B[rank * 6:(rank + 1) * 6]
        diff = b["max_abs_diff"]
        # Bit-exact: outputs, input and router gradients (each token's routes are the same logical
        # experts with the same weights), weights and AdamW moments (moved as raw bytes).
        for name in ("out", "grad_x", "router", "w13.weight", "w2.weight", "w13.exp_avg", "w13.exp_avg_sq",
                     "w2.exp_avg", "w2.exp_avg_sq"):
            assert diff[name] == 0.0, f"rank {rank} switch {name}: {diff[name]}"
        # An expert's gradient sums its tokens split over other replicas: equal up to rounding.
        for name in ("w13.grad", "w2.grad"):
            assert diff[name] <= 1e-5, f"rank {rank} switch {name}: {diff[name]}"

        c = r["train"]
        assert c["switched"] == c["fresh"], rank
        assert c["dense_equal"] and c["experts_equal"] and c["replicas_equal"], rank
        assert c["moved"] == [1, 3] and len(c["first"]) == 2
    assert results[0]["train"] == results[1]["train"]


def test_the_route_tables_follow_the_layer_and_are_not_in_the_state_dict():
    """The placement, not a checkpoint's state dict, says where experts are; a switch after the
    layer moved (to a GPU in training; "meta" stands in for it here) puts its tables there too."""
    layer = _layer(PLAN_A)
    tables = {"route_log2phy_ER", "route_cdf_ER", "route_draw_E"}
    assert tables <= {name for name, _ in layer.named_buffers()}
    assert not tables & set(layer.state_dict())
    layer.to("meta").set_placement(_placement(PLAN_B))
    assert {layer.get_buffer(name).device.type for name in tables} == {"meta"}
    assert not tables & set(layer.state_dict())
