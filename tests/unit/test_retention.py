"""Which checkpoints and published weight directories are kept."""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from prime_rl.config.optim import ConstantSchedulerConfig, SGDConfig
from prime_rl.trainer.ckpt import COMPLETE, CheckpointManager, Progress, complete_steps, resolve_resume_step, step_dir
from prime_rl.trainer.config import CheckpointConfig
from prime_rl.trainer.optim import build_optimizer, build_scheduler
from prime_rl.trainer.weights import broadcast_dir, prune_broadcasts


def fake_checkpoint(out: Path, step: int, complete: bool = True) -> None:
    path = step_dir(out, step)
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"x")
    if complete:
        (path / COMPLETE).touch()


def test_keep_last_and_keep_interval(tmp_path):
    for step in range(1, 11):
        fake_checkpoint(tmp_path, step)
    manager = CheckpointManager(tmp_path, CheckpointConfig(interval=1, keep_last=2, keep_interval=4), is_main=True)
    manager._prune(10)
    # last two (9, 10) plus multiples of 4 (4, 8)
    assert complete_steps(tmp_path) == [4, 8, 9, 10]
    assert not (tmp_path / "checkpoints" / "step_3").exists()  # emptied step dirs are removed too


def test_resume_step_resolution_skips_unfinished(tmp_path, caplog):
    fake_checkpoint(tmp_path, 2)
    fake_checkpoint(tmp_path, 4)
    fake_checkpoint(tmp_path, 6, complete=False)
    assert resolve_resume_step(tmp_path, -1) == 4
    assert resolve_resume_step(tmp_path, 2) == 2
    with pytest.raises(FileNotFoundError, match="step 6"):
        resolve_resume_step(tmp_path, 6)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        resolve_resume_step(tmp_path / "empty", -1)


def test_prune_broadcasts_keeps_what_the_async_bound_needs(tmp_path):
    for step in range(1, 9):
        broadcast_dir(tmp_path, step).mkdir(parents=True)
    # After publishing step 8 with max_async_level 2, batch 9 may start on pi_6 at the oldest (>= 9-1-2):
    # steps 6, 7, 8 stay, and step 4 stays because a checkpoint needs it on resume.
    removed = prune_broadcasts(tmp_path, 8, 2, keep={4})
    assert removed == [1, 2, 3, 5]
    assert sorted(int(p.name.split("_")[1]) for p in (tmp_path / "broadcasts").iterdir()) == [4, 6, 7, 8]


def published_steps(out: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in (out / "broadcasts").iterdir())


def test_broadcasts_of_checkpoints_stay_while_a_resume_may_need_them(tmp_path):
    # Checkpoints every 3 steps with keep_last 2, max_async_level 0, at the end of step 10:
    # complete checkpoints 3 and 6; step 9's save crashed half-way (no COMPLETE): no resume can start there.
    for step in range(1, 11):
        broadcast_dir(tmp_path, step).mkdir(parents=True)
    fake_checkpoint(tmp_path, 3)
    fake_checkpoint(tmp_path, 6)
    fake_checkpoint(tmp_path, 9, complete=False)
    manager = CheckpointManager(tmp_path, CheckpointConfig(interval=3, keep_last=2), is_main=True)
    assert manager.live_steps() == {3, 6}
    # Async bound: nothing older than 10 - 0 = 10; live checkpoints 3 and 6 stay, 9 goes with the others.
    assert prune_broadcasts(tmp_path, 10, 0, keep=manager.live_steps()) == [1, 2, 4, 5, 7, 8, 9]
    assert published_steps(tmp_path) == [3, 6, 10]

    # Step 12 is saved (keep_last 2 drops checkpoint 3, and the crashed 9 is no checkpoint): 3's weights go too.
    broadcast_dir(tmp_path, 11).mkdir()
    broadcast_dir(tmp_path, 12).mkdir()
    fake_checkpoint(tmp_path, 12)
    manager._prune(12)
    assert complete_steps(tmp_path) == [6, 12]
    assert prune_broadcasts(tmp_path, 12, 0, keep=manager.live_steps()) == [3, 10, 11]
    assert published_steps(tmp_path) == [6, 12]


def test_a_checkpoint_still_being_written_keeps_its_broadcast(tmp_path):
    """An async save has no COMPLETE marker until its background write ends; should the run die meanwhile, a
    resume starts from the checkpoint before it. Both that one and the one in flight must keep their weights."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Linear(4, 2)
        optimizer = build_optimizer(model.parameters(), SGDConfig(lr=0.1))
        scheduler = build_scheduler(optimizer, ConstantSchedulerConfig(), None)
        config = CheckpointConfig(interval=2, keep_last=1, save_async=True)
        manager = CheckpointManager(tmp_path, config, is_main=True)
        for step in (2, 3, 4):
            broadcast_dir(tmp_path, step).mkdir(parents=True)
        manager.save(2, model, optimizer, scheduler, Progress(2))
        manager.wait()  # returns once the checkpoint is marked complete, not merely written
        assert complete_steps(tmp_path) == [2] and manager.pending_step is None
        manager.save(4, model, optimizer, scheduler, Progress(4))
        # Save 4 is in flight (whether its marker is written yet or not, it is live); checkpoint 2 is complete
        # and stays live until save 4 has finished and keep_last dropped it.
        live = manager.live_steps()
        assert manager.pending_step == 4 and 4 in live
        assert 2 in live or complete_steps(tmp_path) == [4]
        prune_broadcasts(tmp_path, 4, 0, keep=live)
        assert published_steps(tmp_path) == sorted(live)  # 3 is past the async bound and no checkpoint
        manager.wait()
        # Save 4 is complete and keep_last 1 dropped checkpoint 2: now its weights may go.
        assert complete_steps(tmp_path) == [4] and manager.live_steps() == {4}
        prune_broadcasts(tmp_path, 4, 0, keep=manager.live_steps())
        assert published_steps(tmp_path) == [4]
    finally:
        dist.destroy_process_group()


def test_orchestrator_checkpoints_follow_the_same_retention(tmp_path):
    """keep_last 2 + keep_interval 4 over steps 2, 4, 6, 8, 10: 4 and 8 (interval) and 8, 10 (last two) stay; a
    step directory goes once both halves are gone, and stays while the trainer's half is still there."""
    from prime_rl.config import CheckpointConfig as Shared
    from prime_rl.orchestrator import ckpt as orchestrator_ckpt

    config = Shared(interval=2, keep_last=2, keep_interval=4)
    step_dir(tmp_path, 6).mkdir(parents=True)  # the trainer's half of step 6
    for step in (2, 4, 6, 8, 10):
        orchestrator_ckpt.save(tmp_path, orchestrator_ckpt.Progress(step=step), {}, config)
    assert orchestrator_ckpt.saved_steps(tmp_path) == [4, 8, 10]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_10", "step_4", "step_6", "step_8"]
    assert Shared().kept([1, 2, 3]) == {1, 2, 3}  # keep_last None keeps all


def test_rl_shares_one_checkpoint_config_with_both_halves():
    from prime_rl.rl import RLConfig

    config = RLConfig(model={"name": "m"}, ckpt={"interval": 3, "keep_last": 2, "save_async": True})
    for half in (config.trainer.ckpt, config.orchestrator.ckpt):
        assert (half.interval, half.keep_last, half.keep_interval, half.save_async) == (3, 2, None, True)
    assert config.orchestrator.model.name == config.trainer.model.name == "m"
    with pytest.raises(ValueError, match="disagree on interval, resume_step, keep_last, keep_interval"):
        RLConfig(trainer={"ckpt": {"keep_last": 1}}, orchestrator={"ckpt": {}})


def test_trainer_and_orchestrator_save_the_same_steps():
    """One rule for both halves: every `interval` steps and after the last one (with keep_last, the kept step
    must have an orchestrator checkpoint beside the trainer's)."""
    ckpt = CheckpointConfig(interval=3)
    assert [s for s in range(1, 8) if ckpt.due(s, max_steps=7)] == [3, 6, 7]
    assert [s for s in range(1, 8) if ckpt.due(s, max_steps=None)] == [3, 6]
