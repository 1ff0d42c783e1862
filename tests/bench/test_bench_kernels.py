"""``ep-runtime bench kernels`` smoke test on the CPU: the tiny shape, references only; the JSON has
the documented structure and every time, byte count and rate is positive."""

import json
import types

import pytest
import torch

from ep_runtime.bench import kernels as bench
from ep_runtime.bench.kernels_cases import SHAPES, Case, StreamInputs
from ep_runtime.bench.kernels_check import agreement, check, normwise, within_largest
from ep_runtime.bench.kernels_engram import CASES as ENGRAM_CASES
from ep_runtime.bench.kernels_report import summarize_bars
from ep_runtime.bench.kernels_run import fusion_gain, run_case
from ep_runtime.bench.timer import Timer
from launch.cli import main as cli_main


def test_cpu_quick_run_writes_the_report(tmp_path, capsys):
    out = tmp_path / "kernels.json"
    cli_main(["bench", "kernels", "--device", "cpu", "--quick", "--out", str(out)])
    report = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert "wrote" in printed
    # The bars are GPU targets: on the CPU they are neither met nor missed.
    assert "MISSED" not in printed and "bars: not judged here" in printed

    assert report["device_type"] == "cpu" and report["device"]
    assert {"torch", "tilelang", "tile_kernels", "python"} <= set(report["versions"])
    assert set(report["shapes"]) == {"tiny"}
    assert report["copy"]["gbps"] > 0 and report["copy"]["bytes"] > 0
    ops = {r["op"] for r in report["results"]}
    assert set(bench.CASE_BUILDERS) == ops
    for r in report["results"]:
        assert "error" not in r, r
        # On the CPU the op under test is the reference itself: its check can only be bit-exact
        # (what ``check`` tells apart is tested below, on tensors made to differ).
        assert r["impl"] == "reference" and r["check"]["ok"] and r["check"]["exact"], r
        for key in ("time_us", "bytes", "gbps", "pct_of_copy"):
            assert r[key] > 0, (r["op"], key)
        assert r["first_call_s"] >= 0 and r["bytes_note"]
        assert r["peers"] == {}  # the CPU runs the references only
        if "fusion" in r:
            assert r["fusion"]["unfused_time_us"] > 0 and r["fusion"]["bytes_ratio"] > 1
    assert report["bars"] == {}
    assert report["complete"] and report["wall_s"] > 0


def test_out_takes_a_folder_or_a_file(tmp_path, monkeypatch):
    """--out: a folder (made if missing) gets kernels-<device>-<date>.json; a .json path is the
    file itself; by default the report goes under runs/ of the working folder, not the package."""
    args = ["--device", "cpu", "--quick", "--ops", "expand"]
    bench.main([*args, "--out", str(tmp_path / "reports")])
    (written,) = (tmp_path / "reports").iterdir()
    assert written.name.startswith("kernels-cpu-") and written.suffix == ".json"
    assert json.loads(written.read_text())["complete"]
    bench.main([*args, "--out", str(tmp_path)])  # an existing folder
    assert len(list(tmp_path.glob("kernels-cpu-*.json"))) == 1
    monkeypatch.chdir(tmp_path / "reports")
    bench.main(args)
    assert len(list((tmp_path / "reports" / "runs" / "bench").glob("kernels-cpu-*.json"))) == 1


def test_ops_subset_and_unknown_op(tmp_path):
    out = tmp_path / "k.json"
    report = bench.main(["--device", "cpu", "--quick", "--ops", "expand,per_token_cast", "--out", str(out)])
    assert [r["op"] for r in report["results"]] == ["expand", "per_token_cast"]
    try:
        bench.main(["--device", "cpu", "--quick", "--ops", "nope", "--out", str(out)])
    except SystemExit as exit:
        assert "nope" in str(exit)
    else:
        raise AssertionError("an unknown op must stop the program")


def test_check_tells_exact_close_and_wrong():
    import torch

    a = torch.tensor([1.0, 2.0])
    assert check(a, a.clone(), exact=True) == {"ok": True, "exact": True, "max_abs_err": 0.0}
    near = a * (1 + 1e-7)
    assert check(near, a, exact=False)["ok"] and not check(near, a, exact=True)["ok"]
    assert not check(torch.tensor([1, 2]), torch.tensor([1, 3]), exact=False)["ok"]
    assert not check((a,), (a, a), exact=True)["ok"]


def test_check_takes_the_ops_own_rule():
    import torch

    a, far = torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5])
    assert not check(far, a, exact=False)["ok"]
    assert check(far, a, exact=False, within=lambda got, want: True)["ok"]
    assert not check(a * (1 + 1e-7), a, exact=False, within=lambda got, want: False)["ok"]
    assert not check(far, a, exact=True, within=lambda got, want: True)["ok"]


def test_agreement_compares_indices_of_any_width_by_value():
    import torch

    want = torch.tensor([[1, 2], [3, 2**40]])
    assert agreement(torch.tensor([[1, 2], [3, 4]], dtype=torch.int32), want) == 0.75
    assert agreement(want.float(), want) is None  # floats of another width: not comparable


def test_engram_hash_peer_gets_our_hash_in_its_conventions():
    """tile-kernels' engram_hash as its docstring defines it (an n-gram window [T, W] int32,
    multipliers [L, W] int64, table sizes [L, W - 1, K] and offsets [L, C] int32; int32 [L, T, C]:
    column (n - 2) * K + j = XOR_{k<n} window[t, k] * mult[k] mod size[n - 2][j] + offset), run
    on the tensors the case hands it, gives our reference's indices."""
    import torch

    def engram_hash(ngram_TW, mult_LW, sizes_LOK, offsets_LC):
        assert (ngram_TW.dtype, mult_LW.dtype, sizes_LOK.dtype, offsets_LC.dtype) == (
            torch.int32, torch.int64, torch.int32, torch.int32)
        assert ngram_TW.is_contiguous() and mult_LW.shape == (1, ngram_TW.shape[1])
        h_T, columns = torch.zeros(ngram_TW.shape[0], dtype=torch.int64), []
        for k in range(ngram_TW.shape[1]):
            h_T = h_T ^ (ngram_TW[:, k].long() * mult_LW[0, k])
            if k:
                columns.append(h_T[:, None] % sizes_LOK[0, k - 1].long())
        return (torch.cat(columns, 1) + offsets_LC[0]).int()[None]

    tk = types.SimpleNamespace(engram=types.SimpleNamespace(engram_hash=engram_hash))
    inp = StreamInputs(SHAPES["tiny"], torch.device("cpu"), seed=5)
    case = ENGRAM_CASES["engram_hash"](inp, tk)
    want = case.reference(*case.args)
    got = case.peers["tile_kernels"]()
    assert got.dtype == torch.int32 and torch.equal(got.long(), want)
    assert agreement(got, want) == 1.0


def test_check_rules_reject_what_they_must():
    """``normwise``: within two ulps of the reference's largest magnitude (1e-5 for float32);
    ``within_largest(rel)``: within rel of it, or of 1 where it is smaller. Each passes at its
    bound and fails past it."""
    want = torch.tensor([1000.0, 1.0], dtype=torch.float32)
    assert normwise(want + torch.tensor([0.0, 0.009]), want)  # 1000 * 1e-5 = 0.01
    assert not normwise(want + torch.tensor([0.0, 0.011]), want)
    half = torch.tensor([4.0, 0.5], dtype=torch.bfloat16)  # 2 ulps of bf16 at 4: 4 * 2**-7 = 0.03125
    assert normwise(half + torch.tensor([0.0, 0.03125], dtype=torch.bfloat16), half)
    assert not normwise(half + torch.tensor([0.0, 0.0625], dtype=torch.bfloat16), half)
    rule = within_largest(1e-3)
    small = torch.tensor([0.1, -0.2])  # largest 0.2 < 1: the bound is 1e-3
    assert rule(small + 0.0009, small) and not rule(small + 0.0011, small)
    assert rule(want + 0.99, want) and not rule(want + 1.01, want)  # largest 1000: 1.0
    assert not check(small + 0.0011, small, exact=False, within=rule)["ok"]
    assert check(small + 0.0009, small, exact=False, within=rule)["ok"]


def _row(op: str, shape: str = "large", **fields) -> dict:
    return {"op": op, "shape": shape, "time_us": 10.0, "memory_bound": True, "pct_of_copy": 95.0, **fields}


def test_bars_pass_and_miss_at_their_thresholds():
    """Each bar of ``summarize_bars`` at and past its threshold: copy >= 90% (large shape only),
    ratio vs the fastest peer >= 0.97 (parity), the fusion gain's verdict, the router against tile-kernels'
    topk_gate; an op that failed to run judges nothing."""
    rows = [
        _row("expand", pct_of_copy=90.0, ratio_vs_fastest_peer=0.97),
        _row("unexpand", pct_of_copy=89.9, ratio_vs_fastest_peer=0.9699),
        _row("expand", shape="small", pct_of_copy=10.0),  # small shapes: no copy bar
        _row("swiglu_per_token_cast", memory_bound=False, fusion=fusion_gain_row(1.6, 1.8)),
        _row("expand_per_token_cast", memory_bound=False, fusion=fusion_gain_row(1.5, 1.8)),
        {"op": "cast_back", "shape": "large", "memory_bound": True, "error": "RuntimeError: boom"},
        _row("topk_route", memory_bound=False, time_us=19.5, peers={"tile_kernels.topk_gate": {"time_us": 22.4}}),
    ]
    bars = summarize_bars(rows)
    assert bars["memory_bound_ge_90pct_of_copy"] == {"large/expand": True, "large/unexpand": False}
    assert bars["ratio_vs_fastest_peer_ge_0.97"] == {"large/expand": True, "large/unexpand": False}
    # gains 0.6 / 0.8 = 0.75 (met) and 0.5 / 0.8 = 0.625 (missed)
    assert bars["fusion"] == {"large/swiglu_per_token_cast": True, "large/expand_per_token_cast": False}
    assert bars["router_faster_than_tile_kernels_topk_gate"] is True
    rows[-1]["time_us"] = 22.5
    assert summarize_bars(rows)["router_faster_than_tile_kernels_topk_gate"] is False


def fusion_gain_row(speedup: float, bytes_ratio: float) -> dict:
    return {"bytes_ratio": bytes_ratio, **fusion_gain(10.0, 10.0 * speedup, bytes_ratio)}


class GpuTimeStandIn(Timer):
    """A CPU timer whose ``kernel_us`` reads a set GPU time per thunk, 3 us for any other, and whose
    copies take 1 us + 1 us per 100 bytes (CUPTI needs a GPU)."""

    def __init__(self, gpu_us: dict):
        super().__init__(torch.device("cpu"), iters=3, warmup=0, budget_s=0.01, flush_bytes=0, kernel_calls=1)
        self.gpu_us = gpu_us

    def kernel_us(self, fn, calls=50):
        return self.gpu_us.get(fn, 3.0)

    def copy_kernel_us(self, nbytes):
        return 1.0 + nbytes / 100


def test_kernel_time_judges_the_ratio_and_fusion_bars_beside_the_timer():
    """With ``--kernel-time`` every timed thunk gets ``kernel_us``; the peer ratio and the fusion
    gain are judged by it too, and a thunk CUPTI cannot time leaves the timer's result standing."""
    x = torch.ones(64)
    ours, peer, partial, unfused = (lambda: x + 1), (lambda: x + 1), (lambda: x + 1), (lambda: (x + 0) + 1)
    case = Case("swiglu_per_token_cast", ours, lambda t: t + 1, (x,), bytes=100, bytes_note="-",
                      peers={"peer": peer, "part": partial}, partial_peers=("part",), compile_peer=False,
                      unfused=unfused, unfused_bytes=180, unfused_note="two ops")
    timer = GpuTimeStandIn({ours: 2.0, peer: 2.5, partial: 1.0, unfused: 4.0})  # the eager peer: 3 us
    result = run_case(case, timer, 1.0, with_peers=True, compile_budget=None, impl="reference")
    assert result["kernel_us"] == 2.0
    assert result["fastest_peer_kernel_us"] == 2.5  # the partial peer's 1 us does not count
    assert result["ratio_vs_fastest_peer_by_kernel_time"] == 2.5 / 2.0
    gpu = result["fusion"]["kernel_time"]
    assert gpu["unfused_kernel_us"] == 4.0 and gpu["speedup"] == 2.0
    assert abs(gpu["gain_over_bytes_gain"] - 1.0 / 0.8) < 1e-12 and gpu["bar_ok"]
    # copies of the 100 and 180 bytes: 2.0 and 2.8 us, a gain of 0.4 for the bytes' 0.8 (reported, not a bar)
    assert gpu["copy"]["fused_us"] == 2.0 and gpu["copy"]["unfused_us"] == 2.8
    assert abs(gpu["copy"]["gain_over_bytes_gain"] - 0.5) < 1e-12 and not gpu["copy"]["bar_ok"]
    bars = summarize_bars([{"shape": "small", **result}])
    assert bars["ratio_vs_fastest_peer_ge_0.97_by_kernel_time"] == {"small/swiglu_per_token_cast": True}
    assert bars["fusion_by_kernel_time"] == {"small/swiglu_per_token_cast": True}

    def no_cupti(fn, calls=50):
        raise RuntimeError("3 GPU events in 2 calls")

    timer.kernel_us = no_cupti
    result = run_case(case, timer, 1.0, with_peers=False, compile_budget=None, impl="reference")
    assert "time_us" in result and "kernel_us" not in result and "RuntimeError" in result["kernel_error"]
    assert "kernel_error" in result["fusion"]["kernel_time"] and "speedup" in result["fusion"]
    assert set(summarize_bars([{"shape": "small", **result}])) == {
        "memory_bound_ge_90pct_of_copy", "ratio_vs_fastest_peer_ge_0.97", "fusion"}


@pytest.mark.gpu
def test_kernel_us_sums_the_work_of_a_call_without_the_flush():
    timer = Timer(torch.device("cuda"), iters=10, warmup=2, budget_s=0.1, flush_bytes=256 << 20)
    x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    y, z = torch.empty_like(x), torch.empty_like(x)
    one = timer.kernel_us(lambda: y.copy_(x))
    two = timer.kernel_us(lambda: (y.copy_(x), z.copy_(x)))
    assert 0 < one < 1000 and 1.6 < two / one < 2.4, (one, two)
