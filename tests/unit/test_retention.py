"""Which checkpoints and published weight directories are kept."""

from pathlib import Path

import pytest

from prime_rl.trainer.ckpt import COMPLETE, CheckpointManager, complete_steps, resolve_resume_step, step_dir
from prime_rl.trainer.config import CheckpointConfig
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
