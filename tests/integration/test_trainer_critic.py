"""The trainer with `[critic]` under torchrun (gloo, 2 CPU ranks) on the tiny model: it trains the value model
beside the policy, checkpoints both, and a run resumed at step 1 ends bit-identical to the uninterrupted one."""

import json
import random
from pathlib import Path

import msgspec
import pytest
import torch
from test_trainer import make_batch, model_dir, published, trainer, trainer_params  # noqa: F401 (a fixture)

from prime_rl.batch import TrainingBatch, batch_path, write_batch

pytestmark = pytest.mark.slow

CRITIC = ("--critic", "--critic.epochs", "2", "--critic.optim.lr", "1e-2", "--critic.value-clip", "1e-3")
"""Two value epochs with a tight clip: the second epoch's clip must bind somewhere."""


def batch_with_rewards(step: int) -> TrainingBatch:
    batch = make_batch(step)
    rng = random.Random(step)
    return TrainingBatch(step, [msgspec.structs.replace(s, reward=rng.choice([0.0, 1.0])) for s in batch.samples])


def metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def test_critic_trains_checkpoints_and_resumes_exactly(model_dir, tmp_path):  # noqa: F811
    straight, split = tmp_path / "straight", tmp_path / "split"
    for out in (straight, split):
        for step in (1, 2):
            write_batch(batch_with_rewards(step), batch_path(out, step))
    ckpt = ("--ckpt", "--ckpt.interval", "1")
    trainer(model_dir, straight, "--max-steps", "2", *ckpt, *CRITIC)
    trainer(model_dir, split, "--max-steps", "1", *ckpt, *CRITIC)
    resumed = trainer(model_dir, split, "--max-steps", "2", *ckpt, *CRITIC, "--ckpt.resume-step", "1")
    assert "critic resumed from step 1" in resumed.stdout + resumed.stderr

    first, second = metrics(straight)
    # Step 1: the head starts at zero, so the values are 0 and the returns (gamma = lam = 1) are the rewards:
    # returns/mean is the loss-token-weighted mean reward.
    samples = batch_with_rewards(1).samples
    weighted = sum(s.reward * sum(s.loss_mask) for s in samples) / sum(sum(s.loss_mask) for s in samples)
    assert first["values/mean"] == 0.0
    assert first["returns/mean"] == pytest.approx(weighted, rel=1e-12)  # float64 sums of float32 0/1 rewards
    assert first["value_clipped_fraction"] > 0  # the second epoch moved values by more than 1e-3
    assert first["critic_grad_norm"] > 0
    assert second["values/mean"] != 0.0  # the critic learned in step 1

    # The resumed run: the same step-2 metrics, policy and value model, bit for bit.
    resumed_second = metrics(split)[-1]
    for key in ("loss", "value_loss", "values/mean", "returns/mean", "value_clipped_fraction", "critic_grad_norm"):
        assert resumed_second[key] == second[key], key
    a, b = published(straight, 2), published(split, 2)
    assert all(torch.equal(a[name], b[name]) for name in a)
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    critic_a = trainer_params(straight / "checkpoints" / "step_2" / "critic", tmp_path / "a")
    critic_b = trainer_params(split / "checkpoints" / "step_2" / "critic", tmp_path / "b")
    assert "value_head.weight" in critic_a and set(critic_a) == set(critic_b)
    assert all(torch.equal(critic_a[name], critic_b[name]) for name in critic_a)
    assert not torch.equal(critic_a["value_head.weight"], torch.zeros_like(critic_a["value_head.weight"]))
