"""PPO's critic (`trainer/critic.py`): GAE and the clipped value loss on hand-worked numbers, the token rewards the
rows carry, the value pass on the tiny model (packed rows give each sample's own values), the config's checks."""

import msgspec
import pytest
import torch
from pydantic import ValidationError
from torch import nn
from transformers import AutoModel

from prime_rl.batch import TrainingSample, read_batch
from prime_rl.config.loader import load_config
from prime_rl.models.tiny import TinyModelConfig, build_tiny_model
from prime_rl.rl import RLConfig
from prime_rl.trainer.config import CriticConfig, TrainerConfig
from prime_rl.trainer.packing import pack_samples
from prime_rl.trainer.parallel.distributed import World
from prime_rl.trainer.rl.critic import (
    ValueModel,
    critic_metrics,
    gae,
    prepare,
    value_loss,
    with_token_rewards,
)

F64 = torch.float64


def flat(*columns):
    return [torch.tensor(c, dtype=F64) for c in columns]


def sample(mask: list[bool], reward: float) -> TrainingSample:
    n = len(mask)
    return TrainingSample(
        token_ids=list(range(1, n + 1)), loss_mask=mask, inference_logprobs=[0.0] * n, advantages=[9.0] * n,
        reward=reward,
    )  # fmt: skip


# Two samples in one flat row. Sample 0 is multi-turn: prompt, 2 sampled tokens, an environment token, 1 sampled
# token (reward 1). Sample 1: prompt, 2 sampled tokens (reward -1).
MASK = [False, True, True, False, True, False, True, True]
IDS = [0, 0, 0, 0, 0, 1, 1, 1]
SAMPLES = [sample(MASK[:5], 1.0), sample(MASK[5:], -1.0)]


def rewards_of(samples: list[TrainingSample]) -> torch.Tensor:
    return torch.tensor([r for s in samples for r in with_token_rewards(s).advantages], dtype=F64)


def test_token_rewards_put_the_reward_on_the_last_sampled_token():
    assert rewards_of(SAMPLES).tolist() == [0, 0, 0, 0, 1, 0, 0, -1]
    assert with_token_rewards(sample([False, False], 5.0)).advantages == [0.0, 0.0]  # nothing sampled: no reward
    # The rest of the sample is unchanged.
    assert with_token_rewards(SAMPLES[0]).token_ids == SAMPLES[0].token_ids


def test_gae_with_gamma_lambda_one_and_zero_critic_is_reinforce():
    rewards = rewards_of(SAMPLES)
    advantages = gae(rewards, torch.zeros(8, dtype=F64), torch.tensor(MASK), torch.tensor(IDS), 1.0, 1.0)
    # REINFORCE: the sample's reward on every sampled token (environment tokens included in no sum), 0 elsewhere.
    assert advantages.tolist() == [0, 1, 1, 0, 1, 0, -1, -1]
    # In float32, as the trainer's rows hold them: still exact.
    advantages32 = gae(rewards.float(), torch.zeros(8), torch.tensor(MASK), torch.tensor(IDS), 1.0, 1.0)
    assert advantages32.dtype == torch.float32 and advantages32.tolist() == [0, 1, 1, 0, 1, 0, -1, -1]


def test_gae_by_hand_with_discount_and_values_across_environment_tokens():
    # Values on non-sampled tokens (9.0) must be ignored: the trajectory is the sampled tokens only.
    values = torch.tensor([9.0, 0.5, 0.25, 9.0, 0.5, 9.0, 0.5, -0.5], dtype=F64)
    advantages = gae(rewards_of(SAMPLES), values, torch.tensor(MASK), torch.tensor(IDS), 0.5, 0.5)
    # Sample 0, sampled steps k = 0, 1, 2 with r = (0, 0, 1), V = (0.5, 0.25, 0.5), V_3 = 0; gamma*lam = 0.25:
    #   delta_2 = 1 + 0.5*0 - 0.5 = 0.5          A_2 = 0.5
    #   delta_1 = 0 + 0.5*0.5 - 0.25 = 0        A_1 = 0 + 0.25*0.5 = 0.125
    #   delta_0 = 0 + 0.5*0.25 - 0.5 = -0.375   A_0 = -0.375 + 0.25*0.125 = -0.34375
    # Sample 1, r = (0, -1), V = (0.5, -0.5):
    #   delta_1 = -1 + 0 + 0.5 = -0.5           A_1 = -0.5
    #   delta_0 = 0 + 0.5*(-0.5) - 0.5 = -0.75  A_0 = -0.75 + 0.25*(-0.5) = -0.875
    # (all dyadic: exact in binary)
    assert advantages.tolist() == [0, -0.34375, 0.125, 0, 0.5, 0, -0.875, -0.5]
    # gamma = lam = 1: Monte-Carlo return minus the value, R - V_k.
    mc = gae(rewards_of(SAMPLES), values, torch.tensor(MASK), torch.tensor(IDS), 1.0, 1.0)
    assert mc.tolist() == [0, 0.5, 0.75, 0, 0.5, 0, -1.5, -0.5]


def test_gae_keeps_interleaved_samples_apart_and_checks_shapes():
    # Two samples whose tokens alternate (sample ids need not be contiguous): each is its own trajectory.
    rewards = torch.tensor([0.0, 0.0, 2.0, 4.0], dtype=F64)
    advantages = gae(rewards, torch.zeros(4, dtype=F64), torch.ones(4, dtype=torch.bool), torch.tensor([0, 1, 0, 1]),
                     0.5, 1.0)  # fmt: skip
    assert advantages.tolist() == [1.0, 2.0, 2.0, 4.0]  # gamma 0.5 over one step: half the next reward
    with pytest.raises(ValueError, match="values has shape"):
        gae(rewards, torch.zeros(3), torch.ones(4, dtype=torch.bool), torch.zeros(4, dtype=torch.long), 1.0, 1.0)


# The clipped value loss with clip 0.2 and loss_scale 4 (the step's loss tokens), returns R = 1, V_old = 0:
#   a: V = 0.5 (moved past the clip towards R): unclipped (0.5-1)^2 = 0.25 < clipped (0.2-1)^2 = 0.64 -> binds,
#      0.5*0.64 = 0.32, gradient 0
#   b: V = 0.1 (inside the clip): both (0.1-1)^2 = 0.81 -> 0.405, gradient (V - R)/4 = -0.9/4
#   c: V = -0.5 (past the clip, away from R): unclipped 2.25 > clipped (-0.2-1)^2 = 1.44 -> 1.125, gradient -1.5/4
#   d: not a loss token (V = 100): nothing
# loss = (0.32 + 0.405 + 1.125) / 4 = 0.4625
def test_value_loss_by_hand_where_clipping_binds_and_where_it_does_not():
    values = torch.tensor([0.5, 0.1, -0.5, 100.0], dtype=F64, requires_grad=True)
    old, returns = flat([0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0])
    mask = torch.tensor([True, True, True, False])
    loss, stats = value_loss(values, old, returns, mask, clip=0.2, loss_scale=4)
    (grad,) = torch.autograd.grad(loss, values)
    tol = 1e-15  # 0.1 and 0.2 are not dyadic: a few ulps of rounding
    assert loss.item() == pytest.approx(0.4625, abs=tol)
    assert grad.tolist() == pytest.approx([0.0, -0.9 / 4, -1.5 / 4, 0.0], abs=tol)
    assert stats["value_clipped_tokens"].item() == 1
    assert stats["value_loss"].item() == loss.item()


def test_value_loss_at_the_step_start_values_is_the_plain_squared_error():
    # First epoch: V = V_old, so clipping never binds and the gradient is (V - R) / scale on every loss token.
    values = torch.tensor([0.5, -1.0, 2.0], dtype=F64, requires_grad=True)
    returns = torch.tensor([1.0, 1.0, 0.0], dtype=F64)
    loss, stats = value_loss(values, values.detach().clone(), returns, torch.ones(3, dtype=torch.bool), 0.2, 3)
    (grad,) = torch.autograd.grad(loss, values)
    assert loss.item() == (0.5 * 0.25 + 0.5 * 4 + 0.5 * 4) / 3
    assert grad.tolist() == [-0.5 / 3, -2 / 3, 2 / 3]
    assert stats["value_clipped_tokens"].item() == 0


def test_critic_metrics_from_sums():
    # Loss tokens with returns (1, 3) and values (0, 2): the error R - V is 1 on both, so it has no variance (EV 1).
    sums = {"value_loss": 0.5, "value_clipped_tokens": 1.0, "values_sum": 2.0, "returns_sum": 4.0,
            "returns_sq_sum": 10.0, "error_sum": 2.0, "error_sq_sum": 2.0}  # fmt: skip
    metrics = critic_metrics(sums, 2, 0.25)
    assert metrics == {"value_loss": 0.5, "value_clipped_fraction": 0.5, "values/mean": 1.0, "returns/mean": 2.0,
                       "explained_variance": 1.0, "critic_grad_norm": 0.25}  # fmt: skip
    # Values of 0 (a fresh critic): Var(R - V) = Var(R), so EV = 0.
    fresh = sums | {"values_sum": 0.0, "error_sum": 4.0, "error_sq_sum": 10.0}
    assert critic_metrics(fresh, 2, 0.0)["explained_variance"] == 0.0
    assert critic_metrics(fresh | {"returns_sq_sum": 8.0}, 2, 0.0)["explained_variance"] is None  # Var(R) = 0


def test_an_old_batch_file_without_rewards_reads_as_reward_zero(tmp_path):
    old = {"step": 1, "samples": [{"token_ids": [1, 2], "loss_mask": [False, True], "inference_logprobs": [0.0, -1.0],
                                   "advantages": [0.5, 0.5]}]}  # fmt: skip
    (tmp_path / "batch.bin").write_bytes(msgspec.msgpack.encode(old))
    assert read_batch(tmp_path / "batch.bin").samples[0].reward == 0.0


def test_config_enables_with_defaults_and_refuses_what_it_does_not_support(tmp_path):
    config = TrainerConfig(output_dir=tmp_path, critic={})
    assert config.critic == CriticConfig() and config.critic.epochs == 1 and config.critic.optim.type == "adamw"
    with pytest.raises(ValidationError, match="critic with model.lora"):
        TrainerConfig(output_dir=tmp_path, model={"name": "x", "lora": {}}, critic={})
    with pytest.raises(ValidationError, match="critic with model.cp = 2"):
        TrainerConfig(output_dir=tmp_path, model={"cp": 2}, critic={})
    with pytest.raises(ValidationError, match="gamma"):
        CriticConfig(gamma=1.5)
    with pytest.raises(ValidationError, match="value_clip"):
        CriticConfig(value_clip=0)
    with pytest.raises(ValidationError, match="epochs"):
        CriticConfig(epochs=0)


def test_rl_refuses_a_critic_with_filtered_zero_advantage_groups(tmp_path, capsys):
    """The orchestrator would drop constant-reward groups, which the critic's advantages (r - V) still learn from."""
    path = tmp_path / "rl.toml"
    path.write_text(f'output_dir = "{tmp_path}"\n[trainer.critic]\n[orchestrator]\nfilter_zero_advantage = true\n')
    with pytest.raises(SystemExit) as exit_:
        load_config(RLConfig, "rl", ["@", str(path)])
    assert exit_.value.code == 2
    assert "trainer.critic with orchestrator.filter_zero_advantage" in capsys.readouterr().err
    assert load_config(RLConfig, "rl", ["@", str(path), "--orchestrator.filter-zero-advantage", "false"])[
        0
    ].trainer.critic


# ---------------------------------------------------------------------------------------------------------
# The value pass on the tiny model, unsharded, one CPU rank (no collective is used).


@pytest.fixture(scope="module")
def value_model(tmp_path_factory):
    model_dir = build_tiny_model(TinyModelConfig(output=tmp_path_factory.mktemp("m") / "tiny", dtype="float32"))
    trunk = AutoModel.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model = ValueModel(trunk, trunk.config.hidden_size)
    torch.manual_seed(0)
    nn.init.normal_(model.value_head.weight, std=0.5)  # non-zero values, so the test can tell positions apart
    return model


def test_prepare_scores_each_sampled_token_by_the_state_before_it_and_writes_gae_advantages(value_model):
    world = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), mesh=None)
    samples = [
        TrainingSample(token_ids=[5, 6, 7, 8, 9], loss_mask=[False, True, True, False, True],
                       inference_logprobs=[0.0] * 5, advantages=[0.0] * 5, reward=1.0),
        TrainingSample(token_ids=[11, 12, 13], loss_mask=[False, True, True], inference_logprobs=[0.0] * 3,
                       advantages=[0.0] * 3, reward=-1.0),
    ]  # fmt: skip
    rows = pack_samples([with_token_rewards(s) for s in samples], seq_len=16)
    assert len(rows) == 1  # both in one packed row
    config = CriticConfig(gamma=1.0, lam=1.0)
    prepared, sums = prepare(value_model, rows, config, world)
    (row,), (old,) = rows, prepared
    offsets = {0: 0, 1: 5} if row.sample_indices == [0, 1] else {1: 0, 0: 3}
    with torch.no_grad():
        for i, s in enumerate(samples):
            alone = value_model(torch.tensor([s.token_ids]), torch.arange(len(s.token_ids))[None])[0]
            start, n = offsets[i], len(s.token_ids)
            # Token t's value is the head on the state at t - 1 (0 at the sample's first token); packing changes
            # nothing (tolerance: the same float32 math on a differently shaped attention, a few ulps apart).
            expected = torch.cat([torch.zeros(1), alone[:-1]])
            torch.testing.assert_close(old.old_values[start : start + n], expected, atol=1e-5, rtol=1e-5)
            # gamma = lam = 1: A = R - V on sampled tokens, returns = R there; 0 elsewhere.
            mask = torch.tensor(s.loss_mask)
            values = old.old_values[start : start + n]
            got = row.advantages[start : start + n]
            assert torch.equal(got[~mask], torch.zeros(int((~mask).sum())))
            torch.testing.assert_close(got[mask], (s.reward - values[mask]).float(), atol=1e-6, rtol=0)
            torch.testing.assert_close(old.returns[start : start + n][mask], torch.full((int(mask.sum()),), s.reward))
    assert sums["returns_sum"] == pytest.approx(3 * 1.0 + 2 * -1.0, abs=1e-6)
