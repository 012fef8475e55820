"""The orchestrator's batch of advantages (`batch_samples`: per group and seat, then over the batch) and the
checkpoint of the state that estimators and the temperature scaling keep across steps."""

import json

import pytest

from prime_rl.config import CheckpointConfig
from prime_rl.orchestrator import ckpt
from prime_rl.orchestrator.advantage import RunningMean
from prime_rl.orchestrator.config import OrchestratorConfig
from prime_rl.orchestrator.messages import RolloutResult
from prime_rl.orchestrator.orchestrator import batch_mean_rewards, batch_samples
from prime_rl.orchestrator.samples import SampleTokens
from prime_rl.orchestrator.scheduler import Group
from prime_rl.orchestrator.temperature import TemperatureController


def rollout(reward: float, sampled: int = 1, seat: str = "agent", temperature: float | None = None) -> RolloutResult:
    """A rollout with one sample of one prompt token and `sampled` sampled tokens (0: a seat that never acted)."""
    n = 1 + sampled
    samples = [SampleTokens([1] * n, [False] + [True] * sampled, [0.0] * n, [0] * n)] if sampled else []
    return RolloutResult(reward=reward, samples=samples, seat=seat, temperature=temperature)


def group(env: str, *rollouts: RolloutResult, temperature: float | None = None) -> Group:
    return Group(0, env, 0, {}, 0, "u", rollouts=list(rollouts), temperature=temperature)


def config(estimator: str, **advantage) -> OrchestratorConfig:
    return OrchestratorConfig(advantage={"estimator": estimator, **advantage}, rollouts_per_example=2, batch_size=4)


def test_reinforce_mean_subtracts_each_environments_running_mean():
    groups = [group("a", rollout(1.0), rollout(0.0)), group("b", rollout(2.0), rollout(2.0))]
    samples, advantages, _ = batch_samples(groups, config("reinforce_mean"), {"a": 0.25, "b": 1.5})
    assert advantages == [0.75, -0.25, 0.5, 0.5]  # r - b_env; the constant group keeps a signal
    assert [s.advantages for s in samples] == [[0.75] * 2, [-0.25] * 2, [0.5] * 2, [0.5] * 2]
    assert batch_samples(groups, config("reinforce_mean"))[1] == [1.0, 0.0, 2.0, 2.0]  # no baseline yet
    assert batch_mean_rewards(groups) == {"a": 0.5, "b": 2.0}


def test_running_mean_over_steps_as_the_orchestrator_drives_it():
    """decay 0.5. Step 1: rewards a [1, 0] -> baseline 0, then mean 0.5 folded in. Step 2: a [1, 1] -> A = r - 0.5,
    then the mean becomes (0.5 · 0.5 + 1) / (0.5 + 1) = 5/6. Step 3: a [0, 1] -> A = r - 5/6."""
    cfg = config("reinforce_mean", baseline_decay=0.5)
    baseline = RunningMean(cfg.advantage.baseline_decay)
    seen = []
    for rewards in ([1.0, 0.0], [1.0, 1.0], [0.0, 1.0]):
        groups = [group("a", *(rollout(r) for r in rewards))]
        seen.append(batch_samples(groups, cfg, {"a": baseline.value("a")})[1])
        baseline.update(batch_mean_rewards(groups))
    assert seen[:2] == [[1.0, 0.0], [0.5, 0.5]]
    assert seen[2] == pytest.approx([-5 / 6, 1 / 6])


def test_batch_stage_spans_groups_and_seats():
    """reinforce_pp_baseline over two groups: [1, 0] -> [0.5, -0.5]; a two-seat group, seat `first` [1, 1] -> [0, 0],
    seat `second` [1, 0] -> [0.5, -0.5]. Batch: 6 rollouts, mean 0, population var 4 · 0.25 / 6 = 1/6, std 1/√6."""
    groups = [
        group("a", rollout(1.0), rollout(0.0)),
        group("nim", rollout(1.0, seat="first"), rollout(1.0, seat="first"), rollout(1.0, 1, "second"),
              rollout(0.0, 0, "second")),
    ]  # fmt: skip
    samples, advantages, _ = batch_samples(groups, config("reinforce_pp_baseline", eps=0.0))
    k = 0.5 * 6**0.5
    assert advantages == pytest.approx([k, -k, 0.0, 0.0, k, -k], abs=1e-12)
    assert len(samples) == 5  # the idle seat counts in the statistics, but has no sample


def test_gpg_alpha_counts_loss_tokens():
    """gpg: [1, 0] with 3 and 1 sampled tokens -> [0.5, -0.5]; [1, 1] with 2 and 2 -> [0, 0]. Loss tokens 8, 4 of
    them with signal: alpha 2 -> [1, -1, 0, 0]."""
    groups = [group("a", rollout(1.0, 3), rollout(0.0, 1)), group("a", rollout(1.0, 2), rollout(1.0, 2))]
    assert batch_samples(groups, config("gpg"))[1] == [1.0, -1.0, 0.0, 0.0]


def test_samples_record_the_groups_temperature_unless_the_seat_set_its_own():
    groups = [group("a", rollout(1.0), rollout(0.0, temperature=0.7), temperature=1.21)]
    samples, _, _ = batch_samples(groups, OrchestratorConfig())
    assert [s.temperature for s in samples] == [1.21, 0.7]
    assert batch_samples([group("a", rollout(1.0))], OrchestratorConfig())[0][0].temperature == 1.0  # no scaling


def test_checkpoint_round_trips_every_state(tmp_path):
    """What the orchestrator saves at step n and restores on resume: the buffer, reinforce_mean's running mean and the
    temperatures; a resumed run continues with the same baseline and temperatures."""
    cfg = OrchestratorConfig(
        advantage={"estimator": "reinforce_mean", "baseline_decay": 0.5}, sampling={"temperature_scaling": {}}
    )
    baseline = RunningMean(0.5)
    baseline.update({"a": 1.0})
    baseline.update({"a": 0.0})
    temperatures = TemperatureController(cfg.sampling, ["a"])
    temperatures.observe("a", {"agent": [1.0, 1.0]})
    states = {"buffer": {"x": 1}, "advantage_baseline": baseline.state_dict(), "temperature": temperatures.state_dict()}
    ckpt.save(tmp_path, ckpt.Progress(step=3, samples=12), states, CheckpointConfig())
    files = sorted(p.name for p in ckpt.ckpt_dir(tmp_path, 3).iterdir())
    assert files == ["advantage_baseline.json", "buffer.json", "progress.json", "temperature.json"]
    progress, loaded = ckpt.load(tmp_path, 3)
    assert progress == ckpt.Progress(step=3, samples=12) and loaded == json.loads(json.dumps(states))
    resumed_baseline, resumed_temperatures = RunningMean(0.5), TemperatureController(cfg.sampling, ["a"])
    resumed_baseline.load_state_dict(loaded["advantage_baseline"])
    resumed_temperatures.load_state_dict(loaded["temperature"])
    assert resumed_baseline.value("a") == baseline.value("a") == pytest.approx(1 / 3)
    assert resumed_temperatures.temperature("a") == temperatures.temperature("a") == pytest.approx(1.1)
    # A checkpoint written without the optional states (e.g. by a run with grpo) loads with just the buffer.
    ckpt.save(tmp_path, ckpt.Progress(step=4), {"buffer": {}}, CheckpointConfig())
    assert ckpt.load(tmp_path, 4)[1] == {"buffer": {}}


def test_a_truncated_rollout_is_masked_out_but_keeps_its_place_in_the_baseline():
    """grpo on [1, 0, 0, 1] with the second rollout cut off: advantages [0.5, -0.5, -0.5, 0.5] either way (the
    truncated reward still counts in the mean); with `mask_truncated_completions` its tokens are not trained."""
    cut = rollout(0.0, sampled=2)
    cut.truncated = True
    groups = [group("a", rollout(1.0, sampled=2), cut, rollout(0.0, sampled=2), rollout(1.0, sampled=2))]
    cfg = OrchestratorConfig(rollouts_per_example=4, batch_size=4)
    samples, advantages, _ = batch_samples(groups, cfg)
    assert advantages == [0.5, -0.5, -0.5, 0.5] and [sum(s.loss_mask) for s in samples] == [2, 2, 2, 2]
    cfg = OrchestratorConfig(rollouts_per_example=4, batch_size=4, mask_truncated_completions=True)
    samples, advantages, _ = batch_samples(groups, cfg)
    assert advantages == [0.5, -0.5, -0.5, 0.5] and [sum(s.loss_mask) for s in samples] == [2, 0, 2, 2]
    assert samples[1].token_ids == [1, 1, 1]  # the sequence is still there, with nothing to train
