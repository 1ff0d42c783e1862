"""Checkpoints: a run resumed from its checkpoint continues with exactly the losses of an
uninterrupted run; a job of another world size is refused with the reason; a restarted local job
(torchrun's agent, ``--max-restarts``) resumes by itself; the fault injection parses strictly."""

import pytest
from conftest import STEPS, read_losses
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from ep_runtime.options import job_config_from_args, train_parser
from ep_runtime.train import FAULT_ENV, InjectedFault, worker
from launch.local import launch_local

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # as in the reference run
    monkeypatch.delenv(FAULT_ENV, raising=False)


def job(tmp_path, *args: str):
    return job_config_from_args(train_parser().parse_args(["--out", str(tmp_path), "--name", "job", *args]))


def test_resume_continues_with_identical_losses(tmp_path, reference_losses, monkeypatch):
    # The first run stops at step 5 (the learning rate's schedule spans the run's --steps, so a
    # shorter run is not the longer one's prefix): its checkpoints are steps 2 and 4.
    monkeypatch.setenv(FAULT_ENV, "0:5:raise")
    with pytest.raises(ChildFailedError):
        launch_local(worker, job(tmp_path, "--steps", str(STEPS), "--checkpoint-every", "2"), nproc=2)
    monkeypatch.delenv(FAULT_ENV)
    assert read_losses(tmp_path / "job") == reference_losses[:4]
    ckpt = tmp_path / "job" / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_2", "step_4"]
    assert sorted(p.name for p in (ckpt / "step_4").iterdir()) == ["rank_0.pt", "rank_1.pt"]

    resumed = launch_local(worker, job(tmp_path, "--steps", str(STEPS), "--checkpoint-every", "2", "--resume"),
                           nproc=2)
    assert sorted(resumed) == [0, 1] and all(r["first_step"] == 5 for r in resumed.values())
    assert resumed[0]["losses"] == resumed[1]["losses"] == reference_losses[4:]
    assert read_losses(tmp_path / "job") == reference_losses
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_6", "step_8"]  # the newest two are kept

    with pytest.raises(ChildFailedError) as refused:  # one rank cannot hold the experts of two
        launch_local(worker, job(tmp_path, "--steps", str(STEPS), "--resume"), nproc=1)
    message = refused.value.format_msg()
    assert "saved with world size 2, EP 2 (EP rank 0 holds experts 0..3 of 8" in message
    assert "this job has world size 1, EP 1" in message

    with pytest.raises(ChildFailedError) as refused:  # nothing left to train: not a silent success
        launch_local(worker, job(tmp_path, "--steps", str(STEPS), "--resume"), nproc=2)
    assert f"train.steps: expected more than the checkpoint's step {STEPS} to resume" in refused.value.format_msg()

    with pytest.raises(ChildFailedError) as refused:  # another model: the option that differs, not 100 tensors
        launch_local(worker, job(tmp_path, "--steps", str(STEPS + 2), "--resume", "--hidden", "128"), nproc=2)
    assert "model.hidden saved 64, this job 128: resume with the model options" in refused.value.format_msg()


def test_restarted_local_job_resumes_by_itself(tmp_path, monkeypatch, reference_losses):
    monkeypatch.setenv(FAULT_ENV, "0:4:raise")
    results = launch_local(worker, job(tmp_path, "--steps", str(STEPS), "--checkpoint-every", "3"), nproc=2,
                           max_restarts=1)
    assert sorted(results) == [0, 1]
    assert all(r["restart"] == 1 and r["first_step"] == 4 for r in results.values()), results
    assert read_losses(tmp_path / "job") == reference_losses


def test_fault_injection_spec(monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "1:3")
    assert InjectedFault.from_env() == InjectedFault(1, 3, "raise")
    monkeypatch.setenv(FAULT_ENV, "0:12:hang")
    assert InjectedFault.from_env() == InjectedFault(0, 12, "hang")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert InjectedFault.from_env() is None  # a restarted job runs clean
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    for bad in ("1", "a:3", "1:3:explode", "1:-3"):
        monkeypatch.setenv(FAULT_ENV, bad)
        with pytest.raises(ValueError, match=FAULT_ENV):
            InjectedFault.from_env()


def test_a_moved_placement_is_restored_before_the_weights(tmp_path):
    """One process, experts in permuted slots (as ``placement.switch_placement`` leaves them): a
    fresh model loading the checkpoint takes the saved placement, then the saved tensors."""
    import torch

    from ep_runtime import checkpoint
    from ep_runtime.dispatch import make_dispatcher
    from ep_runtime.model import TinyDeepSeek
    from ep_runtime.parallel import single_process
    from ep_runtime.placement import ExpertPlacement

    cfg, ctx = job(tmp_path, "--steps", "1"), single_process(torch.device("cpu"))

    def build():
        model = TinyDeepSeek(cfg.model, make_dispatcher(cfg.model.moe, ctx), seed=0)
        return model, torch.optim.AdamW(model.parameters())

    model, optimizer = build()
    moved = ExpertPlacement(phy2log_P=torch.tensor([3, 1, 0, 2, 7, 6, 5, 4]), num_experts=8, ep_size=1)
    model.moe_layers[1].set_placement(moved)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    checkpoint.save(tmp_path / "ckpt", 1, model=model, optimizer=optimizer, ctx=ctx)

    fresh, fresh_optimizer = build()
    checkpoint.load(tmp_path / "ckpt", 1, model=fresh, optimizer=fresh_optimizer, ctx=ctx)
    assert fresh.moe_layers[0].placement is None
    assert fresh.moe_layers[1].experts.logical_ids == (3, 1, 0, 2, 7, 6, 5, 4)
    assert torch.equal(fresh.moe_layers[1].placement.phy2log_P, moved.phy2log_P)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
