"""``ep-runtime bench ep-scaling`` end to end on 2 CPU workers (local launcher): EP 1 and 2, weak
and strong scaling, JSON and plot written."""

import json
import subprocess
import sys

import pytest
from cluster import REPO, job_env

pytestmark = pytest.mark.timeout(180)


def test_ep_scaling_runs_at_ep_1_and_2(tmp_path):
    done = subprocess.run([sys.executable, "-m", "ep_runtime.cli", "bench", "ep-scaling", "--launcher", "local",
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
        assert row["rank_imbalance"] >= 1 and row["expert_imbalance"] >= 1
        if ep == 1:
            assert row["layer_efficiency"] == 1 and row["dispatch_bytes_per_rank"] == 0
            assert row["a2a_same_bytes_gbps_per_rank"] is None
        else:  # about half of the rows go to the other rank: hidden 128 FP8 bytes + one float32 scale each
            assert 0.3 * 256 * 132 < row["dispatch_bytes_per_rank"] <= 256 * 132
            assert row["dispatch_gbps_per_rank"] > 0 and row["a2a_same_bytes_gbps_per_rank"] > 0
    assert (tmp_path / "ep_scaling_small.png").stat().st_size > 10_000
    assert "weak EP   2" in done.stdout
