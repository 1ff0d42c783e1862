"""The replica rule and the traffic model, against brute-force counts."""

import pytest
import torch

from topology import Link, Topology, TrafficModel, plan, plan_from_phy2log
from topology.synthetic import draw_routes, route_load, zipf_popularity

SMALL = [
    Topology.uniform(2, 2),
    Topology.uniform(3, 2),
    Topology(num_nodes=2, gpus_per_node=2, intra_node=Link(kind="pcie", bandwidth_GBps=32),
             inter_node=Link(kind="ethernet", bandwidth_GBps=12.5), node_of_gpu=(1, 0, 0, 1)),
]


def _brute_force(p, routes_LTK):
    """Per-token loops: transfers per token as DeepEP's internode dispatch sends them."""
    t = p.topology
    G = t.num_gpus
    L, T, _ = routes_LTK.shape
    remote = torch.zeros(L, dtype=torch.float64)
    nvlink = torch.zeros(L, dtype=torch.float64)
    for layer in range(L):
        for token in range(T):
            src = token % G
            phys = p.physical_route(routes_LTK[layer, token:token + 1], layer, source_gpu=src,
                                    token_index_T=torch.tensor([token // G]))[0].tolist()
            gpus = {q // p.experts_per_gpu for q in phys if q >= 0}
            nodes = {t.node_of_gpu[g] for g in gpus}
            remote[layer] += len(nodes - {t.node_of_gpu[src]})
            for g in gpus:
                if g == src:
                    continue
                if t.node_of_gpu[g] == t.node_of_gpu[src]:
                    nvlink[layer] += 1  # straight over NVLink
                elif t.local_rank_of_gpu[g] != t.local_rank_of_gpu[src]:
                    nvlink[layer] += 1  # RDMA lands on the same local rank, which forwards
    return remote / T, nvlink / T


@pytest.mark.parametrize("topology", SMALL, ids=["2x2", "3x2", "2x2-interleaved-pcie"])
@pytest.mark.parametrize("policy", ["locality", "eplb_global"])
def test_traffic_model_matches_brute_force(topology, policy, seed):
    E, K = 12, 3
    P = E + 2 * topology.num_gpus
    routes = draw_routes(zipf_popularity(2, E, 1.2, seed=seed), 60, K, expert_groups=4, topk_groups=2, seed=seed)
    routes[0, ::7, 1] = -1  # dropped routes
    load = route_load(routes, E)
    model = TrafficModel(routes_LTK=routes, tokens_per_gpu=10, token_bytes=3)
    p = plan(load, topology, P, 4, policy, traffic=model)
    remote, nvlink = _brute_force(p, routes)
    assert torch.allclose(p.traffic.remote_nodes_per_token_L, remote)
    assert torch.allclose(p.traffic.intra_node_copies_per_token_L, nvlink)
    steps = 10 * topology.num_gpus * 3
    assert p.traffic.inter_node_bytes == pytest.approx(float(remote.sum()) * steps)
    assert p.traffic.intra_node_bytes == pytest.approx(float(nvlink.sum()) * steps)


def test_replica_fractions_keep_replicas_equally_loaded(seed):
    topology = Topology.uniform(3, 2)
    E = 6
    # Expert 0: 4 replicas over nodes 0, 0, 1, 2; expert 1: 2 on node 2; the others once.
    phy2log = torch.tensor([[0, 0, 2, 3, 0, 4, 5, 1, 1, 0, 2, 3]])
    p = plan_from_phy2log(phy2log, torch.ones(1, E), topology, traffic=None)
    f = p.replica_fractions(0)  # [N, E, R]
    assert torch.allclose(f.sum(-1), torch.ones(3, E, dtype=torch.float64))
    # Every replica takes 1/count of the routes when each node sends a third of them.
    per_replica = f.mean(0)
    counts = p.replica_counts_LE[0].double()
    valid = p.log2phy_LER[0] >= 0
    assert torch.allclose(per_replica[valid], (1 / counts).unsqueeze(-1).expand_as(valid)[valid])
    assert (f[:, ~valid] == 0).all()
    # Local first: node 1 holds one of expert 0's four replicas (capacity 1/4 < its share 1/3): all local.
    # Node 0 holds two (capacity 1/2 >= 1/3): its tokens never leave the node.
    node_of_phys = torch.tensor(topology.node_of_gpu).repeat_interleave(p.experts_per_gpu)
    replicas0 = p.log2phy_LER[0, 0]
    on_node0 = node_of_phys[replicas0.clamp(min=0)] == 0
    assert f[0, 0][on_node0 & valid[0]].sum() == pytest.approx(1.0)
    # Expert 1 lives only on node 2: everyone goes there.
    assert torch.allclose(f[:, 1, :2].sum(-1), torch.ones(3, dtype=torch.float64))


def test_physical_route_spreads_deterministically(seed):
    topology = Topology.uniform(2, 2)
    load = torch.tensor([[100.0, 1, 1, 1, 1, 1, 1, 1]])
    p = plan(load, topology, 16, None, traffic=None)
    assert int(p.replica_counts_LE[0, 0]) >= 4
    topk = torch.zeros(4000, 1, dtype=torch.long)
    picks = [p.physical_route(topk, 0, source_gpu=g) for g in range(4)]
    again = p.physical_route(topk, 0, source_gpu=0)
    assert torch.equal(picks[0], again)
    hits = torch.bincount(torch.cat(picks).flatten(), minlength=16).double()
    replicas = p.log2phy_LER[0, 0][p.log2phy_LER[0, 0] >= 0]
    share = hits[replicas] / hits.sum()
    assert torch.allclose(share, torch.full_like(share, 1 / len(replicas)), atol=0.01)
    assert (hits[torch.isin(torch.arange(16), replicas, invert=True)] == 0).all()
    masked = p.physical_route(torch.tensor([[-1, 0], [3, -1]]), 0, source_gpu=1)
    assert masked[0, 0] == -1 and masked[1, 1] == -1 and p.phy2log_LP[0, masked[1, 0]] == 3


def test_route_sample_errors():
    load = torch.ones(2, 8)
    with pytest.raises(ValueError, match="routes_LTK"):
        plan(load, Topology.uniform(2, 2), 8, traffic=TrafficModel(routes_LTK=torch.full((2, 4, 2), 8)))
    with pytest.raises(ValueError, match="routes_LTK"):
        plan(load, Topology.uniform(2, 2), 8, traffic=TrafficModel(routes_LTK=torch.zeros(3, 4, 2, dtype=torch.long)))
    with pytest.raises(ValueError, match="topk"):
        TrafficModel(topk=0)


def test_physical_route_errors():
    p = plan(torch.ones(1, 8), Topology.uniform(2, 2), 8, traffic=None)
    with pytest.raises(ValueError, match="topk_idx_TK"):
        p.physical_route(torch.tensor([[8]]), 0, source_gpu=0)
    with pytest.raises(TypeError, match="topk_idx_TK"):
        p.physical_route(torch.tensor([[0.0]]), 0, source_gpu=0)
    with pytest.raises(ValueError, match="layer"):
        p.physical_route(torch.tensor([[0]]), 1, source_gpu=0)
    with pytest.raises(ValueError, match="source_gpu"):
        p.physical_route(torch.tensor([[0]]), 0, source_gpu=4)


def test_locality_beats_hierarchical_traffic_and_global_balance(seed):
    """The bar's shape on a small sample (the full measurement is python -m topology.bench)."""
    topology = Topology.uniform(4, 8)
    routes = draw_routes(zipf_popularity(2, 256, 1.0, seed=seed), 1024, 8, expert_groups=8, topk_groups=4,
                         seed=seed + 1)
    load = route_load(routes, 256)
    model = TrafficModel(routes_LTK=routes)
    ours = plan(load, topology, 288, 8, traffic=model)
    glob = plan(load, topology, 288, 8, "eplb_global", traffic=model)
    hier = plan(load, topology, 288, 8, "eplb_hierarchical", traffic=model)
    assert ours.balance <= glob.balance * 1.01
    assert ours.traffic.remote_nodes_per_token <= hier.traffic.remote_nodes_per_token
    assert ours.traffic.remote_nodes_per_token < glob.traffic.remote_nodes_per_token
