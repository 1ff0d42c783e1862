"""Every dispatcher backend against one definition: combine(expert(dispatch(x))) with expert e
multiplying by e + 1 is ``sum_k w_k (e_k + 1) x`` (and its gradients), for balanced and skewed
routing (experts without tokens), -1 routes and tokens without any, a rank with no tokens (idle), FP8
payloads (and FP8 rows home too, where a backend has that), FP4 (e2m1) payloads where a backend
carries them (``all_to_all``; the others refuse e2m1 in the config); ``nvlink`` and ``deepep`` (the adapter to DeepEP's Buffer, over ep-runtime's facade of
it) give ``all_to_all``'s bits and hand each expert the same rows in the same order, ``hierarchical`` (nvlink inside nodes, all_to_all between them) the same rows; a rank that
dispatches more tokens than the receive buffers hold gets an error naming the limit; routes naming
an expert out of range, or one expert twice for a token, get an error naming ``topk_idx_TK``
(``nvlink`` on GPUs checks them on the device instead, where a failed check ends the process:
``tests/kernels/comm/test_plan.py``).

CPU: gloo processes (``nvlink`` over shared-memory files); GPU: one process per GPU (``nvlink``
over NVLink symmetric memory with the TileLang kernels)."""

import importlib

import pytest
import torch
from dispatch_workers import (carries, case_name, conformance, deepep_combine_of_float32_rows, file_heap_across_hosts,
                              groups_of_two_sizes, nvlink_without_routes, one_rank_with_bad_routes,
                              pool_over_a_group_too_small)
from gpus import needs_gpus

from ep_runtime.dispatch.symmetric import ALIGN, aligned, plan_offsets
from launch.local import launch_local

CASES = [("balanced", 37, False), ("skewed", 37, False), ("masked", 37, False), ("idle", 37, False),
         ("balanced", 64, True), ("masked", 37, True), ("masked", 37, "combine"), ("masked", 37, "e2m1")]
TOL = {"out": 1e-6, "grad_x": 1e-5, "grad_w": 1e-6}  # float32 sums of a few float32 products
# FP8 rows home: each rank's part of an element is off by at most 2^-4 of itself (e4m3's 3 mantissa
# bits), and the parts share the element's sign here (positive weights and factors); the gradients
# pass straight through the cast.
TOL_FP8_COMBINE = TOL | {"out": 2.0**-4 * 1.01}
# hierarchical: a row from another node was rounded at both stages, the second time as part of its
# node's sum: 2^-4 of the parts its node's ranks forwarded, plus 2^-4 (1 + 2^-4) of the node's sum.
TOL_FP8_COMBINE_TWO_STAGES = TOL | {"out": 2.0**-4 * (2 + 2.0**-4) * 1.01}


# One launch per symmetric-memory group: on GPUs a process's heaps go over one group only
# (``CudaHeap``), and ``hierarchical``'s heap is over a node, ``nvlink``'s over the whole group.
LAUNCHES = [("all_to_all", "nvlink", "deepep"), ("all_to_all", "hierarchical")]


# Each launch at 4 ranks (more peers than 2: every backend's multi-peer paths), and ``hierarchical``
# also over 2 nodes of one rank each (its inside-node stage without peers). ``nvlink``, ``deepep``
# and ``all_to_all`` at 2 ranks run in test_ep_equivalence.py and test_deep_ep_compat.py.
@pytest.mark.parametrize("world,ranks_per_node,backends", [(4, 2, LAUNCHES[0]), (4, 2, LAUNCHES[1]),
                                                           (2, 1, LAUNCHES[1])],
                         ids=["4-2-nvlink", "4-2-hierarchical", "2-1-hierarchical"])
def test_backends_conform(world, ranks_per_node, backends):
    """``hierarchical`` over 2 nodes of 1 rank (every process its own node) and of 2 ranks."""
    if torch.cuda.is_available() and torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    results = launch_local(conformance, CASES, ranks_per_node, backends, nproc=world)
    assert sorted(results) == list(range(world))
    for rank, per_case in results.items():
        for backend in {"nvlink", "hierarchical"} & set(backends):
            overflow = per_case.pop(f"overflow-{backend}")
            assert overflow is not None and f"rank {rank} " in overflow and "max_tokens_per_rank" in overflow, backend
        for backend in backends:
            if backend == "nvlink" and torch.cuda.is_available():
                continue
            out_of_range, repeated = per_case.pop(f"bad-routes-{backend}")
            assert out_of_range.startswith(f"topk_idx_TK: expected entries in -1 or [0, {4 * world})"), backend
            assert repeated.startswith("topk_idx_TK: expected distinct experts per token, token 2 has"), backend
        assert sorted(per_case) == sorted(case_name(*c) for c in CASES)
        for case, r in per_case.items():
            assert r.pop("same_out") and r.pop("same_rows") and r.pop("same_row_sets"), (rank, case)
            routes = r.pop("routes_received")
            assert routes > 0 or "skewed" in case, (rank, case)
            fp8_combine = case.endswith("-fp8-combine")
            payload = {case_name(*c): c[2] for c in CASES}[case]
            assert sorted(r) == sorted(b for b in backends if carries(b, payload)), (rank, case)
            for backend, errs in r.items():
                two_stages = TOL_FP8_COMBINE_TWO_STAGES if backend == "hierarchical" else TOL_FP8_COMBINE
                tol = two_stages if fp8_combine else TOL
                assert errs.pop("padding_zero"), (rank, case, backend)
                for name, err in errs.items():
                    assert err <= tol[name], f"rank {rank} {case} {backend} {name}: error {err:.3g} > {tol[name]}"


@pytest.mark.parametrize("world", [2, 4])
def test_nvlink_over_ep_groups_of_two_sizes_in_one_process(world):
    """Heaps of EP groups of half the ranks and of all of them reserved in one pool, two
    dispatchers a group: each gives all_to_all's bits over its group, whichever ran before it
    (over 2 ranks: the two dispatchers over the whole group)."""
    if torch.cuda.is_available() and torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    results = launch_local(groups_of_two_sizes, 24, nproc=world)
    assert sorted(results) == list(range(world))
    for rank, per_group in results.items():
        sizes = (world // 2, world) if world > 2 else (world,)
        assert sorted(per_group) == [(size, fp8) for size in sizes for fp8 in (False, True)], rank
        for key, r in per_group.items():
            assert r["out"] <= TOL["out"] and r["same_out"] and r["same_rows"] and r["same_grad_x"], (rank, key, r)
            assert r["pooled"] == "PooledHeap", (rank, key, r)


def test_a_pool_over_too_few_ranks_is_refused_on_every_rank():
    if torch.cuda.is_available() and torch.cuda.device_count() < 4:
        pytest.skip("needs 4 GPUs")
    messages = launch_local(pool_over_a_group_too_small, nproc=4)
    assert sorted(messages) == [0, 1, 2, 3]
    for message in messages.values():
        assert message.startswith("over: expected a group holding every rank of the heaps' groups;"), message
        assert "[0, 1, 2, 3] are not all in" in message, message


def test_pool_offsets_keep_heaps_that_share_a_rank_apart():
    needs = {"a": ((0, 1), 1000), "b": ((2, 3), 3000), "c": ((0, 1, 2, 3), 500), "d": ((0, 1), 100)}
    offsets = plan_offsets(needs)
    spans = {n: (offsets[n], offsets[n] + aligned(b)) for n, (_, b) in needs.items()}
    for x in needs:
        assert offsets[x] % ALIGN == 0
        for y in needs:
            if x < y and set(needs[x][0]) & set(needs[y][0]):
                assert spans[x][1] <= spans[y][0] or spans[y][1] <= spans[x][0], (x, y, spans)
    # largest first; heaps of disjoint ranks share offsets; each past the placed heaps it meets
    assert offsets == {"b": 0, "a": 0, "c": aligned(3000), "d": aligned(3000) + aligned(500)}


def test_nvlink_on_cpu_refuses_ranks_on_other_hosts():
    """The CPU heap maps peers' /dev/shm files; a peer it cannot see (another host) would get
    rows into a file nobody reads. Every rank raises, naming what it misses."""
    messages = launch_local(file_heap_across_hosts, nproc=2)
    assert all("every rank of its group must run on one host" in m for m in messages.values()), messages
    assert "rank 1 does not see the files of ranks [0]" in messages[1]
    assert "another rank does not" in messages[0]


def test_nvlink_needs_a_route_column():
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    for message in launch_local(nvlink_without_routes, nproc=2).values():
        assert message.startswith("topk_idx_TK: expected at least one route a token"), message


@needs_gpus(2)
def test_one_rank_with_bad_routes_stops_every_rank():
    """``all_to_all`` reads the routes' check in its one host sync, beside the counts every peer
    gets: a rank whose routes are bad stops the others too (each raises, naming it), none waits."""
    messages = launch_local(one_rank_with_bad_routes, nproc=2)
    assert messages[0].startswith("topk_idx_TK: expected entries in -1 or [0, 8), got values in"), messages[0]
    assert messages[1].startswith("topk_idx_TK: EP ranks [0] of this group dispatched invalid routes"), messages[1]


def test_deepep_across_nodes_is_refused():
    """The adapter makes DeepEP's intranode Buffer: an EP group over several nodes is named at
    construction, not left to DeepEP (the groups are never used: the check comes first)."""
    import dataclasses

    from ep_runtime.config import MoEConfig
    from ep_runtime.dispatch import make_dispatcher
    from ep_runtime.parallel import single_process

    ctx = dataclasses.replace(single_process(torch.device("cpu")), ep_size=2, ep_group=object(),
                              ep_rail_group=object())
    with pytest.raises(ValueError, match="^model.moe.dispatcher: 'deepep' runs DeepEP's intranode mode"):
        make_dispatcher(MoEConfig(dispatcher="deepep"), ctx)


def test_deepep_refuses_rows_deep_ep_cannot_combine():
    """Over DeepEP's own Buffer, float32 expert rows are named at combine, not left to its kernels."""
    (message,) = launch_local(deepep_combine_of_float32_rows, nproc=1).values()
    assert message == ("y_PD: expected torch.bfloat16 with dispatcher 'deepep' (DeepEP combines bf16 rows only), "
                       "got torch.float32"), message


def test_deepep_without_deep_ep_says_what_is_missing():
    from ep_runtime.dispatch.deepep import import_deep_ep

    try:
        importlib.import_module("deep_ep")
    except ImportError:
        with pytest.raises(ValueError, match="'deepep' needs the deep_ep package"):
            import_deep_ep()
    else:
        pytest.skip("deep_ep is installed here")


def test_home_sum_adds_in_float32_in_the_dtype_asked():
    """``sum_home``, every backend's home sum: a token's returned rows (``home_TW``: the row from
    each rank, -1 none) added in float32, then rounded to the rows' dtype, or kept in the
    ``out_dtype`` asked (the DeepEP facade's float32 combine): 1 + 2^-8 is 1 in bfloat16."""
    from ep_runtime.dispatch.all_to_all import sum_home

    rows_SX = torch.tensor([[1.0], [2.0**-8], [2.0**-8], [3.0]]).bfloat16()
    home_TW = torch.tensor([[0, 1], [-1, 3], [2, -1]], dtype=torch.int32)
    want = torch.tensor([[1.0 + 2.0**-8], [3.0], [2.0**-8]])
    exact = sum_home(rows_SX, home_TW, out_dtype=torch.float32)
    assert exact.dtype == torch.float32
    torch.testing.assert_close(exact, want, rtol=0, atol=0)
    rounded = sum_home(rows_SX, home_TW)
    assert rounded.dtype == torch.bfloat16
    torch.testing.assert_close(rounded, want.bfloat16(), rtol=0, atol=0)


def test_all_to_all_defaults_on_one_process(seed):
    """``AllToAllDispatcher`` by default pads segments to 128 rows (DeepGEMM's FP8 layout); its
    handle records the tokens dispatched; on one process combine is the weighted sum."""
    from ep_runtime.dispatch import AllToAllDispatcher

    dispatcher = AllToAllDispatcher(num_experts=4)
    x_TD = torch.randn(5, 128)
    idx_TK = torch.tensor([[0, 2], [1, 3], [2, -1], [0, 1], [3, 2]])
    weights_TK = torch.rand(5, 2)
    x_PD, layout, handle = dispatcher.dispatch(x_TD, idx_TK, weights_TK)
    assert layout.offsets_E.tolist() == [128, 256, 384, 512]
    assert handle.route.num_tokens == 5
    out_TD = dispatcher.combine(x_PD, handle)
    torch.testing.assert_close(out_TD, x_TD * (weights_TK * (idx_TK >= 0)).sum(1, keepdim=True))
