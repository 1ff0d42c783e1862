"""Checkpoints: a run resumed from its checkpoint continues with exactly the losses of an
uninterrupted run, and at another world size, EP size or pipeline depth with them within
``RESHARD_RTOL``; partial, truncated or corrupt checkpoints are skipped for the previous valid one,
with a line naming them; a fresh run refuses a folder with checkpoints unless ``--overwrite``; a
restarted local job (torchrun's agent, ``--max-restarts``) resumes by itself; the fault injection
parses strictly; a file's sha256s cover its pieces one each."""

import dataclasses
import json
import logging
import shutil

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
    assert sorted(p.name for p in (ckpt / "step_4").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp",
                                                                   "complete.json"]

    resumed = launch_local(worker, job(tmp_path, "--steps", str(STEPS), "--checkpoint-every", "2", "--resume"),
                           nproc=2)
    assert sorted(resumed) == [0, 1] and all(r["first_step"] == 5 for r in resumed.values())
    assert resumed[0]["losses"] == resumed[1]["losses"] == reference_losses[4:]
    assert read_losses(tmp_path / "job") == reference_losses
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_6", "step_8"]  # the newest two are kept

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
    model.loss(torch.randint(256, (2, 17))).backward()
    optimizer.step()
    saver = checkpoint.Checkpointer(tmp_path / "ckpt", ctx)
    saver.save(1, model=model, optimizer=optimizer)

    fresh, fresh_optimizer = build()
    saver.load(*saver.latest(), model=fresh, optimizer=fresh_optimizer)
    assert fresh.moe_layers[0].placement is None
    assert fresh.moe_layers[1].experts.logical_ids == (3, 1, 0, 2, 7, 6, 5, 4)
    assert torch.equal(fresh.moe_layers[1].placement.phy2log_P, moved.phy2log_P)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert optimizer.state[p].keys() == fresh_optimizer.state[q].keys() == {"step", "exp_avg", "exp_avg_sq"}
        for key, value in optimizer.state[p].items():
            assert torch.equal(value, fresh_optimizer.state[q][key]), key


# The next step's loss after resuming at another layout, against the uninterrupted run's: the same
# model and data, summed in another order (measured: at most 1 float32 ulp, 9.3e-8 relative, over
# four steps; a step without the optimizer's state or on another batch is off by more than 1e-3).
RESHARD_RTOL = 1e-5


def _damage(path, how: str) -> None:
    data = path.read_bytes()
    if how == "flipped":
        middle = len(data) // 2
        path.write_bytes(data[:middle] + bytes(b ^ 0xFF for b in data[middle:middle + 8]) + data[middle + 8:])
    elif how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    else:
        path.write_bytes(b"")


def _close(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) and all(abs(a - b) <= RESHARD_RTOL * abs(b) for a, b in zip(got, want))


def test_resume_at_another_world_size_ep_size_or_pipeline_depth(tmp_path, capfd):
    """Saved at world 2 / EP 2, resumed at world 1 / EP 1 and at PP 2 x EP 1; saved at EP 1,
    resumed at EP 2. The global batch stays 16 sequences (8 a rank at two data ranks, 16 at one).
    The world-1 resume also finds its newest checkpoint corrupt and takes the one before."""
    saved = launch_local(worker, job(tmp_path, "--steps", str(STEPS), "--checkpoint-every", "4"), nproc=2)
    uninterrupted = saved[0]["losses"]
    run = tmp_path / "job"
    for name, args, nproc in [("w1", ["--batch-size", "16"], 1),
                              ("pp2", ["--batch-size", "16", "--pp", "2", "--ep", "1"], 2)]:
        shutil.copytree(run, tmp_path / name)
        if name == "w1":  # the newest is damaged: resume from step 4, with a line naming the file
            _damage(next((tmp_path / name / "ckpt" / f"step_{STEPS}").glob("__1_*.distcp")), "flipped")
        else:
            shutil.rmtree(tmp_path / name / "ckpt" / f"step_{STEPS}")
        cfg = job(tmp_path, "--steps", str(STEPS), "--resume", *args)
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, name=name))
        resumed = launch_local(worker, cfg, nproc=nproc)[0]
        assert resumed["first_step"] == 5, name
        assert _close(resumed["losses"], uninterrupted[4:]), (name, resumed["losses"], uninterrupted[4:])
        if name == "w1":
            assert f"checkpoint {tmp_path / name / 'ckpt' / f'step_{STEPS}'}: __1_0.distcp is corrupt" in \
                capfd.readouterr().err

    one = launch_local(worker, job(tmp_path, "--steps", str(STEPS), "--checkpoint-every", "4", "--batch-size", "16",
                                   "--name", "ep1"), nproc=1)[0]["losses"]
    assert _close(one, uninterrupted)  # the same model at EP 1
    shutil.rmtree(tmp_path / "ep1" / "ckpt" / f"step_{STEPS}")
    resumed = launch_local(worker, job(tmp_path, "--steps", str(STEPS), "--resume", "--name", "ep1", "--ep", "2"),
                           nproc=2)[0]
    assert resumed["first_step"] == 5 and _close(resumed["losses"], one[4:]), (resumed["losses"], one[4:])


@pytest.mark.parametrize("damage", ["flipped", "truncated", "empty", "no marker", "empty marker"])
def test_a_damaged_checkpoint_is_skipped_for_the_previous_valid_one(tmp_path, caplog, damage):
    import torch

    from ep_runtime import checkpoint
    from ep_runtime.dispatch import make_dispatcher
    from ep_runtime.model import TinyDeepSeek
    from ep_runtime.parallel import single_process

    cfg, ctx = job(tmp_path, "--steps", "1"), single_process(torch.device("cpu"))
    model = TinyDeepSeek(cfg.model, make_dispatcher(cfg.model.moe, ctx), seed=0)
    optimizer = torch.optim.AdamW(model.parameters())
    saver = checkpoint.Checkpointer(tmp_path / "ckpt", ctx)
    weights = {}
    for step in (1, 2):
        model.loss(torch.randint(256, (2, 17))).backward()
        optimizer.step()
        saver.save(step, model=model, optimizer=optimizer)
        weights[step] = {k: v.clone() for k, v in model.state_dict().items()}
    saver.wait()
    newest = tmp_path / "ckpt" / "step_2"
    assert json.loads((newest / "complete.json").read_text())["files"].keys() == {".metadata", "__0_0.distcp"}
    assert saver.latest()[0] == 2
    if damage == "no marker":
        (newest / "complete.json").unlink()
        named = "no complete.json (a partial save)"
    elif damage == "empty marker":
        (newest / "complete.json").write_text("")
        named = "complete.json is unreadable"
    else:
        _damage(newest / "__0_0.distcp", damage)
        named = {"flipped": "__0_0.distcp is corrupt", "truncated": "__0_0.distcp is truncated",
                 "empty": "__0_0.distcp is empty"}[damage]
    with caplog.at_level(logging.WARNING, logger="ep_runtime.checkpoint"):
        step, marker = saver.latest()
    assert step == 1
    assert f"checkpoint {newest}: {named}" in caplog.text and "skipped for the previous valid one" in caplog.text
    fresh = TinyDeepSeek(cfg.model, make_dispatcher(cfg.model.moe, ctx), seed=1)
    saver.load(step, marker, model=fresh, optimizer=torch.optim.AdamW(fresh.parameters()))
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, weights[1][name]), name


def test_a_fresh_run_refuses_earlier_checkpoints_unless_overwrite(tmp_path, monkeypatch):
    from ep_runtime.failures import RankFailed
    from launch.cli import main as cli_main

    monkeypatch.delenv("WORLD_SIZE", raising=False)  # one process, in this one
    worker(job(tmp_path, "--steps", "2", "--checkpoint-every", "1"))
    ckpt = tmp_path / "job" / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_1", "step_2"]
    refusal = (f"{ckpt} holds checkpoints (steps 1, 2): pass --resume to continue from the newest valid one, or "
               "--overwrite to delete them")
    with pytest.raises(SystemExit) as refused:  # the command says so before starting anything, in one line
        cli_main(["train", "--out", str(tmp_path), "--name", "job", "--steps", "3"])
    assert str(refused.value) == f"ep-runtime train: {refusal}"
    with pytest.raises(RankFailed, match="holds checkpoints"):  # and so does the worker (torchrun)
        worker(job(tmp_path, "--steps", "3"))
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_1", "step_2"]
    worker(job(tmp_path, "--steps", "1", "--overwrite"))
    assert not list(ckpt.iterdir())


def test_engram_table_shards_reshard(tmp_path):
    """The v4 preset's Engram tables, split over 2 EP ranks when saved, are whole at 1 (with their
    AdamW moments): the resumed steps' losses are the uninterrupted run's."""
    args = ["--model", "v4", "--steps", "4"]
    uninterrupted = launch_local(worker, job(tmp_path, *args, "--checkpoint-every", "2"), nproc=2)[0]["losses"]
    shutil.rmtree(tmp_path / "job" / "ckpt" / "step_4")
    resumed = launch_local(worker, job(tmp_path, *args, "--resume", "--batch-size", "16"), nproc=1)[0]
    assert resumed["first_step"] == 3 and _close(resumed["losses"], uninterrupted[2:]), resumed["losses"]


def test_a_files_pieces_are_hashed_each(tmp_path, monkeypatch):
    """``digests``: a sha256 for each ``PIECE`` bytes, so a large file's pieces hash in parallel;
    a changed byte changes its piece's hash only."""
    import hashlib

    from ep_runtime import checkpoint_verify

    monkeypatch.setattr(checkpoint_verify, "PIECE", 4)
    data = bytes(range(10))
    (tmp_path / "f").write_bytes(data)
    (tmp_path / "empty").write_bytes(b"")
    got = checkpoint_verify.digests([tmp_path / "f", tmp_path / "empty"])
    assert got["f"] == {"bytes": 10, "sha256": [hashlib.sha256(data[i:i + 4]).hexdigest() for i in (0, 4, 8)]}
    assert got["empty"] == {"bytes": 0, "sha256": [hashlib.sha256(b"").hexdigest()]}
    (tmp_path / "f").write_bytes(data[:5] + b"\xff" + data[6:])
    changed = checkpoint_verify.digests([tmp_path / "f"])["f"]["sha256"]
    assert [a == b for a, b in zip(changed, got["f"]["sha256"])] == [True, False, True]
