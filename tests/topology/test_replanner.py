"""Re-planning: balance within tolerance of a fresh plan, few weight copies, a usable migration."""

import pytest
import torch

from topology import Topology, migration, plan, replan
from topology.synthetic import draw_routes, route_load, zipf_popularity


def _drifted(seed, layers=3, experts=64, groups=8):
    pop = zipf_popularity(layers, experts, 1.0, seed=seed)
    before = route_load(draw_routes(pop, 1024, 4, expert_groups=groups, topk_groups=4, seed=seed), experts)
    factor = 0.5 + 1.5 * torch.rand(layers, experts, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    after = route_load(draw_routes(pop * factor, 1024, 4, expert_groups=groups, topk_groups=4, seed=seed + 1), experts)
    return before, after


@pytest.mark.parametrize("topology", [Topology.uniform(2, 4), Topology.uniform(4, 2)], ids=["2x4", "4x2"])
def test_replan_within_tolerance_moving_less(topology, seed):
    before, after = _drifted(seed)
    current = plan(before, topology, 80, 8, traffic=None)
    new = replan(current, after, traffic=None, expert_bytes=10)
    fresh = plan(after, topology, 80, 8, traffic=None)
    assert (new.balance_L <= fresh.balance_L * 1.02 + 1e-9).all()
    # invariants
    assert (new.replica_counts_LE >= 1).all() and (new.replica_counts_LE.sum(-1) == 80).all()
    assert torch.equal(new.load_LE, after)
    fresh_moves = migration(current, fresh).experts_moved
    assert 0 < new.migration.experts_moved < fresh_moves / 2
    assert new.migration.bytes_moved == 10 * new.migration.experts_moved


def test_replan_of_experts_turned_hot_still_meets_the_tolerance(seed):
    """Experts 0-3 twenty times hotter: the moves on the busiest GPU stall (their spare replicas sit
    on cold GPUs), and the stalled layer takes the fresh plan's."""
    before, after = _drifted(seed)
    after[:, :4] *= 20
    current = plan(before, Topology.uniform(2, 4), 80, 8, traffic=None)
    new = replan(current, after, traffic=None)
    fresh = plan(after, Topology.uniform(2, 4), 80, 8, traffic=None)
    assert (new.balance_L <= fresh.balance_L * 1.02 + 1e-9).all()


def test_replan_without_drift_moves_nothing(seed):
    before, _ = _drifted(seed)
    current = plan(before, Topology.uniform(2, 4), 80, 8, traffic=None)
    same = replan(current, before, traffic=None)
    assert same.migration.experts_moved == 0
    assert torch.equal(same.phy2log_LP, current.phy2log_LP)


def test_migration_sources_hold_the_right_experts(seed):
    topology = Topology.uniform(2, 4)
    before, after = _drifted(seed)
    current = plan(before, topology, 80, 8, traffic=None)
    new = replan(current, after, traffic=None)
    m = new.migration
    gpu_old = current.gpu_of_physical()
    gpu_new = new.gpu_of_physical()
    node = torch.tensor(topology.node_of_gpu)
    for layer in range(new.num_layers):
        src = m.source_LP[layer]
        assert torch.equal(current.phy2log_LP[layer, src], new.phy2log_LP[layer])  # copies the right weights
        assert torch.equal(m.moved_LP[layer], gpu_old[src] != gpu_new)
        same_slot = src == torch.arange(new.num_physical_experts)
        assert torch.equal(same_slot, current.phy2log_LP[layer] == new.phy2log_LP[layer])
        arrivals = {(int(gpu_new[p]), int(new.phy2log_LP[layer, p])) for p in m.moved_LP[layer].nonzero().flatten()}
        assert int(m.experts_moved_L[layer]) == len(arrivals)
        # a copy comes from the same node when the old plan had the expert there
        for p in m.moved_LP[layer].nonzero().flatten().tolist():
            e = int(new.phy2log_LP[layer, p])
            old_nodes = {int(node[gpu_old[q]]) for q in current.log2phy_LER[layer, e].tolist() if q >= 0}
            if int(node[gpu_new[p]]) in old_nodes:
                assert int(node[gpu_old[src[p]]]) == int(node[gpu_new[p]])


def test_replan_errors():
    topology = Topology.uniform(2, 4)
    current = plan(torch.ones(2, 16), topology, 24, 4, traffic=None)
    with pytest.raises(ValueError, match=r"^new_load: expected shape \(2, 16\) like the current plan, got \(2, 8\)$"):
        replan(current, torch.ones(2, 8), traffic=None)
    with pytest.raises(ValueError, match=r"^new_load: expected finite values, got 32 NaN/Inf entries$"):
        replan(current, torch.full((2, 16), float("nan")), traffic=None)
    with pytest.raises(ValueError, match=r"^topology: expected the current plan's 2 nodes x 4 GPUs, got 4 x 2$"):
        replan(current, torch.ones(2, 16), Topology.uniform(4, 2), traffic=None)
    with pytest.raises(ValueError, match=r"^tolerance: expected a number in \[0, 1\), got -0\.1$"):
        replan(current, torch.ones(2, 16), tolerance=-0.1, traffic=None)
    with pytest.raises(TypeError, match=r"^current: expected a topology\.Plan, got str$"):
        replan("plan", torch.ones(2, 16))
