"""The benchmarks end to end on CPU: ``ep-scaling`` on 2 workers (local launcher, EP 1 and 2, weak
and strong scaling, both backends), ``dispatch``, ``pipeline``, ``mhc-overhead`` and ``grouped-gemm``;
JSON (and plots) written."""

import json
import pkgutil
import re
import subprocess
import sys

import pytest
from cluster import REPO, job_env

from ep_runtime import bench
from launch.cli import BENCHMARKS, main

pytestmark = pytest.mark.timeout(180)


def test_ep_scaling_runs_at_ep_1_and_2(tmp_path):
    done = subprocess.run([sys.executable, "-m", "launch.cli", "bench", "ep-scaling", "--launcher", "local",
                           "--num-workers", "2", "--fp8-dispatch", "--warmup", "1", "--iters", "2",
                           "--out", str(tmp_path)], env=job_env(), cwd=REPO, capture_output=True, text=True,
                          timeout=150, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "ep_scaling_small.json").read_text())
    assert report["spec"]["fp8_dispatch"] and report["world_size"] == 2
    rows = {(r["mode"], r["ep"]): r for r in report["rows"]}
    assert sorted(rows) == [("strong", 1), ("strong", 2), ("weak", 1), ("weak", 2)]
    for (mode, ep), row in rows.items():
        assert row["tokens_per_rank"] == (256 if mode == "weak" else 512 // ep)
        assert row["layer_ms"] > 0 and row["dispatch_ms"] > 0 and row["combine_ms"] > 0
        assert row["dispatch_graph_ms"] is None and row["combine_graph_ms"] is None  # CUDA graphs: GPUs only
        assert row["rank_imbalance"] >= 1 and row["expert_imbalance"] >= 1
        # hidden 128, 8 experts, top-2, one shared expert of 128: 6 FLOPs a weight a token (fwd+bwd)
        assert row["layer_flops_per_rank"] == 6 * row["tokens_per_rank"] * (8 * 128 + 3 * 3 * 128 * 128)
        assert row["model_tflops_per_gpu"] == row["layer_flops_per_rank"] / row["layer_ms"] / 1e9
        assert row["local_ms"] > 0 and row["exposed_comm_ms"] == row["layer_ms"] - row["local_ms"]
        assert row["exposed_comm_pct"] == 100 * row["exposed_comm_ms"] / row["layer_ms"]
        if ep == 1:
            assert row["layer_efficiency"] == 1 and row["dispatch_bytes_per_rank"] == 0
            assert row["a2a_same_bytes_gbps_per_rank"] is None
            assert row["local_ms"] == row["layer_ms"]  # its own baseline
        else:  # about half of the rows go to the other rank: hidden 128 FP8 bytes + one float32 scale each
            assert 0.3 * 256 * 132 < row["dispatch_bytes_per_rank"] <= 256 * 132
            assert row["dispatch_gbps_per_rank"] > 0 and row["a2a_same_bytes_gbps_per_rank"] > 0
            assert row["local_ms"] != row["layer_ms"]  # a layer of its own, timed apart
    assert (tmp_path / "ep_scaling_small.png").stat().st_size > 10_000
    assert re.search(r"^\s*weak EP\s+2 .* \| local +[\d.]+ ms exposed comm +-?[\d.]+ ms +-?[\d.]+ % \| +[\d.]+ "
                     r"TFLOP/s/GPU \| efficiency layer [\d.]+$", done.stdout, re.M)


def test_bench_lists_every_benchmark_module_and_refuses_other_names(capsys):
    """``BENCHMARKS`` names exactly the modules of ``ep_runtime.bench`` that define ``main``."""
    with_main = {m.name.replace("_", "-") for m in pkgutil.iter_modules(bench.__path__)
                 if "\ndef main(" in (REPO / "ep_runtime" / "bench" / f"{m.name}.py").read_text()}
    assert set(BENCHMARKS) == with_main
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    listing = capsys.readouterr().out
    assert all(f"  {name} " in listing for name in BENCHMARKS)
    with pytest.raises(SystemExit):
        main(["bench", "peer-tuning"])
    assert "invalid choice: 'peer-tuning'" in capsys.readouterr().err


def run_bench(tmp_path, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "launch.cli", "bench", *args, "--out", str(tmp_path)],
                          env=job_env(), cwd=REPO, capture_output=True, text=True, timeout=150, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_ep_scaling_with_the_nvlink_backend(tmp_path):
    done = run_bench(tmp_path, "ep-scaling", "--num-workers", "2", "--dispatcher", "nvlink", "--modes", "weak",
                     "--warmup", "1", "--iters", "1")
    report = json.loads((tmp_path / "ep_scaling_small_nvlink.json").read_text())
    lines = done.stdout.splitlines()
    progress = [line for line in lines if line.startswith("ep-scaling: ")]  # a line a point as it ends
    assert len(progress) == 2 and all(re.match(r"ep-scaling: \d/\d weak EP [12] \(\d+ s\)$", p) for p in progress)
    assert sum(bool(re.match(r"\s*weak EP\s+2 ", line)) for line in lines) == 1  # each row once
    assert report["spec"]["dispatcher"] == "nvlink"
    assert [r["ep"] for r in report["rows"]] == [1, 2] and all(r["layer_ms"] > 0 for r in report["rows"])


def test_ep_scaling_sweeps_nvlink_ep_sizes_in_one_process_set(tmp_path):
    """EP 2 and 4 over nvlink in the same processes (their heaps from one pool), with ranks 4 and
    5 in no EP-4 group: every rank still takes part in the pool's collective."""
    run_bench(tmp_path, "ep-scaling", "--num-workers", "6", "--max-ep", "4", "--dispatcher", "nvlink",
              "--modes", "weak", "--warmup", "1", "--iters", "1")
    report = json.loads((tmp_path / "ep_scaling_small_nvlink.json").read_text())
    assert [r["ep"] for r in report["rows"]] == [1, 2, 4] and all(r["layer_ms"] > 0 for r in report["rows"])


def test_dispatch_bench_times_every_backend_and_peer(tmp_path):
    """CPU: all_to_all and nvlink (shared-memory heap), its transport, DeepEP's Buffer API (here the
    facade's: the adapter and the Buffer's own calls), and the collective all-to-all of the same
    bytes, labelled with the backend that ran it (gloo here, nccl on GPUs)."""
    done = run_bench(tmp_path, "dispatch", "--tokens", "64", "--hidden", "256", "--warmup", "1", "--iters", "2",
                     "--peer", "deepep", "--deepep-module", "ep_runtime.compat.deep_ep")
    report = json.loads((tmp_path / "dispatch.json").read_text())
    (row,) = report["rows"]
    for key in ("all_to_all_dispatch", "all_to_all_combine", "nvlink_dispatch", "nvlink_combine", "nvlink_transport",
                "deepep_dispatch", "deepep_combine", "deepep_buffer_dispatch", "deepep_buffer_combine",
                "gloo_a2a_dispatch", "gloo_a2a_combine"):
        assert row[f"{key}_ms"] > 0 and row[f"{key}_gbps"] > 0, key
    assert not any(key.startswith("nccl") for key in row)
    # about half of 64 tokens go to the other rank: 256 FP8 bytes + 2 float32 scales each
    assert 0.3 * 64 * 264 < row["dispatch_bytes_per_rank"] <= 64 * 264
    assert "nvlink_transport" in done.stdout


@pytest.mark.parametrize("args, message", [
    (["--deepep-module", "no_such_module"], "--deepep-module: expected an importable module with DeepEP's Buffer API, "
                                            "got 'no_such_module'"),
    (["--fp8-combine"], "--fp8-combine: expected a bf16 combine with --peer deepep"),
])
def test_dispatch_bench_refuses_a_deepep_peer_it_cannot_time_before_any_worker(args, message):
    from ep_runtime.bench.dispatch import main as dispatch_main

    def no_workers(*_args, **_kwargs):
        raise AssertionError("a worker started")

    with pytest.raises(SystemExit, match=re.escape(message)):
        dispatch_main(["--peer", "deepep", "--deepep-module", "ep_runtime.compat.deep_ep", *args], start=no_workers)


def test_pipeline_bench_reports_bubbles_against_the_formula(tmp_path):
    done = run_bench(tmp_path, "pipeline", "--microbatches", "2,4", "--batch-size", "4", "--seq-len", "8",
                     "--warmup", "1", "--steps", "2")
    assert re.search(r"^pipeline: 1/8 1f1b M=2 \(\d+ s\)$", done.stdout, re.M)  # progress while it runs
    assert re.search(r"^pipeline: 8/8 overlap M=4 ", done.stdout, re.M)
    report = json.loads((tmp_path / "pipeline.json").read_text())
    rows = {(r["schedule"], r["microbatches"], r["stage"]): r for r in report["rows"]}
    assert sorted(rows) == [(s, m, st) for s in ("1f1b", "gpipe", "interleaved", "overlap") for m in (2, 4)
                            for st in (0, 1)]
    for (schedule, m, _), r in rows.items():
        chunks = 2 if schedule == "interleaved" else 1
        assert r["bubble_formula"] == 1 / (chunks * m + 1) and 0 <= r["bubble"] < 1 and r["step_s"] > 0
        assert r["peak_memory_mb"] > 0 and r["compute_per_microbatch_s"] > 0
        assert (r["bubble_model"] is None) == (schedule == "overlap")
        assert r["bubble_model"] is None or 0 <= r["bubble_model"] < 1
    assert (tmp_path / "pipeline.png").stat().st_size > 10_000


def test_mhc_overhead_bench_reports_the_mhc_share_of_the_moe_layer(tmp_path):
    run_bench(tmp_path, "mhc-overhead", "--hidden", "64,128", "--tokens", "32", "--warmup", "0", "--iters", "2")
    report = json.loads((tmp_path / "mhc_overhead.json").read_text())
    assert [r["hidden"] for r in report["rows"]] == [64, 128]
    for r in report["rows"]:
        assert r["tokens"] == 32 and r["streams"] == 4 and r["stream_dtype"] == "float32"
        assert r["moe_ms"] > 0 and r["mhc_ms"] > 0 and r["mhc_around_moe_ms"] > 0
        assert r["mhc_fraction_of_moe"] == r["mhc_ms"] / r["moe_ms"]
        assert r["added_fraction_of_moe"] == r["mhc_around_moe_ms"] / r["moe_ms"] - 1


def test_dispatch_bars_from_a_row():
    """The bars' arithmetic on a made-up GPU row: eager's bar is 1.15x the graph plus 20 us; NCCL
    1.4x as slow is 1.4x; the copy's time for to_buffers is 100%; DeepEP's dispatch + combine over
    ours, eager against eager and against our one graph."""
    from ep_runtime.bench.dispatch import bars

    row = {"dispatch_bytes_per_rank": 100, "combine_bytes_per_rank": 200, "nvlink_graph_to_buffers_ms": 0.1,
           "p2p_copy_ms": 0.1, "nvlink_dispatch_ms": 0.3, "nvlink_graph_dispatch_ms": 0.2,
           "nccl_a2a_dispatch_ms": 0.28, "nvlink_combine_ms": 0.5, "nvlink_graph_combine_ms": 0.4,
           "nccl_a2a_combine_ms": 0.2, "nvlink_graph_step_ms": 0.5, "deepep_buffer_dispatch_ms": 0.6,
           "deepep_buffer_combine_ms": 0.4}
    got = bars(row)
    assert got == pytest.approx({"eager_dispatch_us": 300, "eager_dispatch_bar_us": 250, "dispatch_x_nccl": 1.4,
                                 "eager_combine_us": 500, "eager_combine_bar_us": 480, "combine_x_nccl": 0.5,
                                 "to_buffers_pct_of_p2p_copy": 100, "step_us": 500, "eager_x_deepep": 1.25,
                                 "graph_x_deepep": 2.0})
    assert bars({"dispatch_bytes_per_rank": 100, "nvlink_dispatch_ms": 1.0}) == {}


def test_grouped_gemm_bench_times_six_gemms_per_split(tmp_path):
    run_bench(tmp_path, "grouped-gemm", "--device", "cpu", "--quick")
    (path,) = tmp_path.glob("grouped_gemm-*.json")
    results = json.loads(path.read_text())["results"]
    assert [r["split"] for r in results] == ["uniform"] * 6 + ["skewed"] * 6
    assert {r["gemm"] for r in results} == {"fwd x@W13", "fwd h@W2", "dgrad dh@W13^T", "dgrad dy@W2^T",
                                            "wgrad x^T@dh", "wgrad h^T@dy"}
    for r in results:  # --quick: 64 tokens x top-4 over 4 experts, hidden 256, W13 256 -> 256, W2 128 -> 256
        assert r["rows"] == 256 and r["fp8_ms"] > 0 and r["ratio"] == r["bf16_ms"] / r["fp8_ms"]
        assert r["fp8_tflops"] == 2 * 256 * r["k_or_m"] * r["n"] / r["fp8_ms"] / 1e9
