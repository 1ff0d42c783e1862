"""Online re-planning inside training (``--replan-every``) on 2 gloo processes: experts and their AdamW
state move mid-run without changing the losses, the EP ranks' load evens out, and a checkpoint saved
after a move resumes."""

import json
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from gpus import needs_gpus

from ep_runtime.config import TrainConfig
from ep_runtime.options import job_config_from_args, train_parser
from ep_runtime.placement import ExpertPlacement
from ep_runtime.rebalance import Rebalancer, rank_load_imbalance
from ep_runtime.train import FAULT_ENV, worker
from launch.local import launch_local

pytestmark = pytest.mark.timeout(300)

STEPS, EVERY = 20, 4
# A move changes which rank sums a token's expert outputs, so the losses may differ by rounding: on
# gloo in float32 they come out identical; on GPUs the model runs under bf16 autocast. Relative
# tolerance on every step's loss:
LOSS_RTOL = 1e-2 if torch.cuda.is_available() else 1e-5
REPLAN = ("--replan-every", str(EVERY), "--replan-max-moved", "0.5")  # 8 slots a layer: 4 may move


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv(FAULT_ENV, raising=False)


def job(tmp_path, name, *args):
    return job_config_from_args(train_parser().parse_args(
        ["--steps", str(STEPS), "--out", str(tmp_path), "--name", name, *args]))


def records(tmp_path, name) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The tiny model for STEPS steps, never moved and re-planned every EVERY steps (checkpoints
    every 10 steps: they do not change the losses)."""
    out = tmp_path_factory.mktemp("rebalance")
    still = launch_local(worker, job(out, "still"), nproc=2)
    moved = launch_local(worker, job(out, "moved", *REPLAN, "--checkpoint-every", "10"), nproc=2)
    return out, still, moved


@needs_gpus(2)
def test_replan_mid_run_keeps_the_losses_and_evens_the_ranks(runs):
    out, still, moved = runs
    assert still[0]["losses"] == still[1]["losses"] and moved[0]["losses"] == moved[1]["losses"]
    assert moved[0]["losses"] == pytest.approx(still[0]["losses"], rel=LOSS_RTOL)
    base, ours = records(out, "still"), records(out, "moved")
    assert all(r["experts_moved"] is None for r in base)
    # A plan starts after steps 4, 8, ... and moves experts after the next step, every rank alike.
    moves = {r["step"]: r["experts_moved"] for r in ours if r["experts_moved"] is not None}
    assert sorted(moves) == [5, 9, 13, 17], moves
    assert sum(map(sum, moves.values())) > 0, moves
    # The ranks' load (max/mean routes a rank receives, worst layer) after the first move, against
    # the same steps of the run that never moved.
    after = slice(5, STEPS)
    mean_still = sum(r["rank_load_imbalance"] for r in base[after]) / len(base[after])
    mean_moved = sum(r["rank_load_imbalance"] for r in ours[after]) / len(ours[after])
    assert mean_moved < mean_still - 0.03, (mean_moved, mean_still)
    assert [r["rank_load_imbalance"] for r in ours[:5]] == [r["rank_load_imbalance"] for r in base[:5]]


@needs_gpus(2)
def test_a_checkpoint_saved_after_a_move_resumes(runs, tmp_path, monkeypatch):
    """Stopped at step 11, resumed from step 10's checkpoint (its placement is the one the moves after
    steps 5 and 9 made): steps 11-13 repeat the uninterrupted run exactly (the next move comes after
    step 13, planned from a window the resumed run saw only from step 11), the rest within
    LOSS_RTOL."""
    out, _, moved = runs
    monkeypatch.setenv(FAULT_ENV, "0:11:raise")
    with pytest.raises(ChildFailedError):
        launch_local(worker, job(tmp_path, "job", *REPLAN, "--checkpoint-every", "10"), nproc=2)
    monkeypatch.delenv(FAULT_ENV)
    marker = json.loads((tmp_path / "job" / "ckpt" / "step_10" / "complete.json").read_text())
    saved = [p["phy2log"] for p in marker["placements"].values()]
    assert saved and any(phy2log != list(range(8)) for phy2log in saved), saved  # experts had moved
    resumed = launch_local(worker, job(tmp_path, "job", *REPLAN, "--checkpoint-every", "10", "--resume"), nproc=2)
    assert all(r["first_step"] == 11 for r in resumed.values())
    losses = resumed[0]["losses"]
    assert losses[:3] == moved[0]["losses"][10:13]
    assert losses == pytest.approx(moved[0]["losses"][10:], rel=LOSS_RTOL)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="2 GPUs")
def test_replan_with_the_nvlink_dispatcher(tmp_path):
    """The same on 2 GPUs through the nvlink dispatcher (peer stores into symmetric memory)."""
    still = launch_local(worker, job(tmp_path, "still", "--dispatcher", "nvlink"), nproc=2)
    moved = launch_local(worker, job(tmp_path, "moved", "--dispatcher", "nvlink", *REPLAN), nproc=2)
    assert moved[0]["losses"] == pytest.approx(still[0]["losses"], rel=LOSS_RTOL)
    base, ours = records(tmp_path, "still"), records(tmp_path, "moved")
    assert any(r["experts_moved"] and sum(r["experts_moved"]) for r in ours)
    after = slice(5, STEPS)
    assert (sum(r["rank_load_imbalance"] for r in ours[after])
            < sum(r["rank_load_imbalance"] for r in base[after])), "re-planning did not lower the ranks' load"


def _layer(phy2log, num_experts=4, ep_size=2):
    return SimpleNamespace(cfg=SimpleNamespace(num_experts=num_experts),
                           placement=None if phy2log is None else ExpertPlacement(
                               phy2log_P=torch.tensor(phy2log), num_experts=num_experts, ep_size=ep_size))


def test_rank_load_imbalance_follows_the_placement():
    load = torch.tensor([[3, 1, 1, 1]])
    assert rank_load_imbalance([_layer(None)], load, 2) == pytest.approx(4 / 3)  # ranks hold {0, 1}, {2, 3}
    assert rank_load_imbalance([_layer([0, 2, 1, 3])], load, 2) == pytest.approx(4 / 3)
    # Expert 0 in three slots: each replica serves a third of its routes.
    assert rank_load_imbalance([_layer([0, 1, 2, 0, 3, 0])], load, 2) == pytest.approx(1.0)
    assert rank_load_imbalance([_layer(None), _layer([1, 0, 2, 3])], torch.tensor([[1, 1, 1, 1], [0, 4, 0, 0]]),
                               2) == pytest.approx(2.0)  # the worst layer
    assert rank_load_imbalance([_layer(None)], torch.zeros(1, 4), 2) == 1.0


def test_bad_replan_settings_are_named():
    with pytest.raises(ValueError, match=r"train.replan_every: expected an int >= 0, got -1"):
        TrainConfig(replan_every=-1)
    with pytest.raises(ValueError, match=r"train.replan_max_moved: expected in \[0, 1\], got 1.5"):
        TrainConfig(replan_max_moved=1.5)
    with pytest.raises(ValueError, match=r"train.replan_every: expected an int >= 1 to re-plan, got 0"):
        Rebalancer(SimpleNamespace(moe_layers=[]), None, SimpleNamespace(pp_size=1), every=0, max_moved=0.1)
    with pytest.raises(ValueError, match=r"expected a job without pipeline stages \(parallel.pp 1\) to re-plan "
                                         r"online, got parallel.pp 2"):
        Rebalancer(SimpleNamespace(moe_layers=[]), None, SimpleNamespace(pp_size=2), every=3, max_moved=0.1)
    with pytest.raises(ValueError, match=r"train.replan_every: expected a model with MoE layers to re-plan, got none"):
        Rebalancer(SimpleNamespace(moe_layers=[]), None, SimpleNamespace(pp_size=1), every=3, max_moved=0.1)
