"""The training algorithms other than grpo (orchestrator/algorithms.py), their configs, and their place in the batch:
numbers worked out by hand in each docstring."""

import numpy as np
import pytest
from pydantic import ValidationError
from test_batch_advantages import group, rollout

from prime_rl.models.tokenizers import tokenizer_mismatch
from prime_rl.orchestrator.algorithms import (
    RaeBaselines,
    agent_of,
    group_has_signal,
    hierarchical_advantages,
    max_rl_advantages,
)
from prime_rl.orchestrator.config import OrchestratorConfig
from prime_rl.orchestrator.messages import RolloutResult
from prime_rl.orchestrator.orchestrator import batch_samples, teacher_sampler_kl
from prime_rl.orchestrator.teacher import TeacherError, parse_prompt_logprobs


def test_max_rl_divides_the_centred_rewards_by_the_group_mean():
    """[1, 0, 0, 1]: mean 1/2, A = (r - 1/2) / (1/2) = [1, -1, -1, 1]. [1, 0, 0, 0]: mean 1/4, A = [3, -1, -1, -1]:
    a rare success weighs 1/p, where grpo would give it 3/4. [0.5, 1, 0, 0.5]: mean 1/2, A = [0, 1, -1, 0]."""
    assert max_rl_advantages(np.array([1.0, 0.0, 0.0, 1.0])).tolist() == [1.0, -1.0, -1.0, 1.0]
    assert max_rl_advantages(np.array([1.0, 0.0, 0.0, 0.0])).tolist() == [3.0, -1.0, -1.0, -1.0]
    assert max_rl_advantages(np.array([0.5, 1.0, 0.0, 0.5])).tolist() == [0.0, 1.0, -1.0, 0.0]


def test_max_rl_gives_exact_zeros_without_success_or_spread():
    assert max_rl_advantages(np.zeros(4)).tolist() == [0.0] * 4  # mean 0: nothing to divide by, nothing learned
    assert max_rl_advantages(np.array([-1.0, 0.0, 0.0, 0.0])).tolist() == [0.0] * 4  # mean < 0: refused to flip signs
    assert max_rl_advantages(np.full(3, 0.1)).tolist() == [0.0] * 3  # three 0.1s: exactly 0, not one ulp off
    assert max_rl_advantages(np.array([1.0])).tolist() == [0.0]  # a group of one is its own mean


def test_rae_compares_each_reward_with_the_baseline_before_it():
    """decay 0.9, seat `first` wins then loses: A1 = 1 - 0 = 1, then b = 0.9 * 0 + 0.1 * 1 = 0.1; A2 = 0 - 0.1 = -0.1,
    then b = 0.9 * 0.1 + 0.1 * 0 = 0.09. Seat `second` keeps its own baseline: it loses first, A = 0 - 0 = 0."""
    rae = RaeBaselines(0.9)
    assert rae.advantage("first", 1.0) == 1.0
    assert rae.values["first"] == pytest.approx(0.1)
    assert rae.advantage("second", 0.0) == 0.0
    assert rae.advantage("first", 0.0) == pytest.approx(-0.1)
    assert rae.values == pytest.approx({"first": 0.09, "second": 0.0})


def test_rae_baselines_survive_a_checkpoint_and_refuse_another_decay():
    rae = RaeBaselines(0.95)
    for reward in (1.0, 0.0, 1.0):
        rae.advantage("first", reward)
    restored = RaeBaselines(0.95)
    restored.load_state_dict(rae.state_dict())
    assert restored.advantage("first", 1.0) == rae.advantage("first", 1.0)  # same baseline, same next advantage
    with pytest.raises(ValueError, match="built with 0.95"):
        RaeBaselines(0.9).load_state_dict(rae.state_dict())


def test_hierarchical_grpo_compares_solvers_per_problem_and_proposers_per_source_task():
    """Two episodes (proposals) of one source task. Episode 0: solvers [1, 1, 0], mean 2/3 -> [1/3, 1/3, -2/3].
    Episode 1: solvers [0, 0, 0] -> 0. Proposers across the group: [0.5, 1.0], mean 0.75 -> [-0.25, 0.25]."""
    seats = ["proposer", "solver_1", "solver_2", "solver_3"] * 2
    episodes = [0] * 4 + [1] * 4
    rewards = [0.5, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    advantages = hierarchical_advantages(seats, episodes, rewards, ["solver"])
    assert advantages[:4] == pytest.approx([-0.25, 1 / 3, 1 / 3, -2 / 3])
    assert advantages[4:] == pytest.approx([0.25, 0.0, 0.0, 0.0])
    assert advantages[5:] == [0.0, 0.0, 0.0]  # exact


def test_hierarchical_grpo_gives_a_comparison_of_one_rollout_zero():
    """One episode: its proposer has no other proposal to compare with; a problem with one solver attempt neither."""
    assert hierarchical_advantages(["proposer", "solver"], [0, 0], [1.0, 1.0], ["solver"]) == [0.0, 0.0]
    assert agent_of("solver_12") == "solver" and agent_of("second") == "second" and agent_of("solver") == "solver"


def test_signal_when_a_group_arrives():
    assert group_has_signal(alg("rae"), ["first", "second"], [0, 0], [1.0, 0.0])
    assert group_has_signal(alg("rae"), ["agent"] * 2, [0, 1], [1.0, 1.0])  # baselines move: a constant group too
    assert not group_has_signal(alg("max_rl"), ["agent"] * 4, [0, 1, 2, 3], [0.0] * 4)
    assert group_has_signal(alg("max_rl"), ["agent"] * 4, [0, 1, 2, 3], [0.0, 1.0, 0.0, 0.0])
    seats, episodes = ["proposer", "solver_1", "solver_2"], [0, 0, 0]
    assert not group_has_signal(alg("hierarchical_grpo"), seats, episodes, [1.0, 1.0, 1.0])
    assert group_has_signal(alg("hierarchical_grpo"), seats, episodes, [1.0, 1.0, 0.0])


def alg(kind: str):
    return OrchestratorConfig(algo={"type": kind}).algo


def seated(reward: float, seat: str, episode: int = 0) -> RolloutResult:
    r = rollout(reward, seat=seat)
    r.episode = episode
    return r


def test_each_environment_gets_its_own_algorithm_in_one_batch():
    """Env `game` runs rae (decay 0.5), env `text` the run's max_rl. Batch: game group 1 (first wins 1, second 0), text
    group [1, 0, 0, 0], game group 2 (first 0, second 1). RAE in batch order: first 1 - 0 = 1 (b 0.5), second 0 - 0 = 0
    (b 0), then first 0 - 0.5 = -0.5 (b 0.25), second 1 - 0 = 1 (b 0.5). max_rl: [3, -1, -1, -1]."""
    cfg = OrchestratorConfig(
        algo={"type": "max_rl"},
        env=[
            {"id": "nim", "name": "game", "algo": {"type": "rae", "decay": 0.5}},
            {"id": "reverse-text", "name": "text"},
        ],
        rollouts_per_example=4,
        batch_size=8,
    )
    groups = [
        group("game", seated(1.0, "first"), seated(0.0, "second")),
        group("text", *(rollout(r) for r in (1.0, 0.0, 0.0, 0.0))),
        group("game", seated(0.0, "first"), seated(1.0, "second")),
    ]
    rae = {"game": RaeBaselines(0.5)}
    samples, advantages, _ = batch_samples(groups, cfg, None, rae)
    assert advantages == [1.0, 0.0, 3.0, -1.0, -1.0, -1.0, -0.5, 1.0]
    assert [s.advantages[0] for s in samples] == advantages
    assert rae["game"].values == {"first": 0.25, "second": 0.5}


def test_algorithm_configs():
    cfg = OrchestratorConfig(env=[{"id": "nim", "algo": {"type": "hierarchical_grpo", "episode_agents": ["solver"]}}])
    assert cfg.env_algo("nim").type == "hierarchical_grpo" and cfg.algo.type == "grpo"
    with pytest.raises(ValidationError, match="decy"):
        OrchestratorConfig(algo={"type": "rae", "decy": 0.9})
    with pytest.raises(ValidationError, match="opd_typo|does not match any of the expected tags"):
        OrchestratorConfig(algo={"type": "opd_typo"})
    with pytest.raises(ValidationError, match="no environment runs one of them"):
        OrchestratorConfig(algo={"type": "rae"}, advantage={"estimator": "rloo"})
    with pytest.raises(ValidationError, match=r"gate on \['nim'\], which run max_rl"):
        OrchestratorConfig(env=[{"id": "nim", "algo": {"type": "max_rl"}, "gate": {"type": "advantage_range"}}])


def test_prompt_logprobs_become_one_logprob_per_token():
    """vLLM's prompt_logprobs for prompt [5, 7, 9]: None for the first token, then maps holding each position's own
    token (and, with prompt_logprobs > 0, the top others). The first token has no context: 0.0."""
    entries = [None, {"7": {"logprob": -0.5, "rank": 1}}, {"3": {"logprob": -0.1}, "9": {"logprob": -2.25}}]
    assert parse_prompt_logprobs([5, 7, 9], entries) == [0.0, -0.5, -2.25]
    with pytest.raises(TeacherError, match="position 2 lack token 9"):
        parse_prompt_logprobs([5, 7, 9], entries[:2] + [{"3": {"logprob": -0.1}}])
    with pytest.raises(TeacherError, match="scored 2 positions of a 3-token sample"):
        parse_prompt_logprobs([5, 7, 9], entries[:2])


def test_an_opd_sample_trains_its_sampled_tokens_towards_the_teacher():
    """Env `text` runs opd: its sample keeps no rl token (loss_mask all False, advantage 0) and ships the teacher's
    log-probs with the sampled tokens as the ref_kl mask; env `game` (grpo) is unchanged. The orchestrator's view of
    the reverse KL is mean(mu - teacher) over those tokens: on the one sampled token, -0.5 - (-0.25) = -0.25."""
    cfg = OrchestratorConfig(
        env=[
            {"id": "reverse-text", "name": "text", "algo": {"type": "opd", "teacher": TEACHER}},
            {"id": "nim", "name": "game"},
        ],
        rollouts_per_example=2,
        batch_size=4,
    )
    opd = rollout(1.0)
    opd.samples[0].logprobs[:] = [0.0, -0.5]
    groups = [group("text", opd, rollout(0.0)), group("game", rollout(1.0), rollout(0.0))]
    refs = {(0, 0, 0): [0.0, -0.25], (0, 1, 0): [0.0, -3.0]}
    samples, advantages, _ = batch_samples(groups, cfg, None, None, refs)
    assert advantages == [0.0, 0.0, 0.5, -0.5]
    first = samples[0]
    assert first.loss_mask == [False, False] and first.ref_kl_mask == [False, True]
    assert first.ref_logprobs == [0.0, -0.25] and first.advantages == [0.0, 0.0]
    assert samples[2].loss_mask == [False, True] and samples[2].ref_kl_mask == [] and samples[2].ref_logprobs == []
    assert teacher_sampler_kl(samples[:1]) == -0.25
    assert teacher_sampler_kl(samples[2:]) is None


def test_opd_needs_a_teacher_and_temperature_one():
    alone = OrchestratorConfig(algo={"type": "opd"})  # `rl` may still fill it from its [teacher]
    with pytest.raises(ValueError, match="reverse-text: algo opd needs a teacher"):
        alone.env_teacher("reverse-text")
    with pytest.raises(ValidationError, match="sample at temperature 1"):
        OrchestratorConfig(algo={"type": "opd", "teacher": TEACHER}, sampling={"temperature": 0.7})
    assert group_has_signal(OrchestratorConfig(algo={"type": "opd", "teacher": TEACHER}).algo, ["a"], [0], [0.0])


TEACHER = {"name": "teacher", "base_url": "http://127.0.0.1:1/v1"}


def model_dir(path, vocab: str):
    path.mkdir()
    (path / "tokenizer.json").write_text(vocab)
    return str(path)


def test_rl_points_opd_at_the_teacher_it_serves(tmp_path):
    from prime_rl.rl.config import RLConfig

    policy, teacher = model_dir(tmp_path / "policy", '{"v": 1}'), model_dir(tmp_path / "teacher", '{"v": 1}')
    orch = {"algo": {"type": "opd"}, "env": [{"id": "reverse-text"}, {"id": "nim", "algo": {"type": "rae"}}]}
    config = RLConfig(model={"name": policy}, inference={}, orchestrator=orch, teacher={"model": teacher, "port": 8123})
    algo = config.orchestrator.algo
    assert (algo.teacher.name, algo.teacher.base_url) == (teacher, "http://127.0.0.1:8123/v1")
    assert algo.teacher.api_key_var == config.orchestrator.client.api_key_var  # unset: the run's token
    assert config.orchestrator.env_algo("nim").type == "rae"
    other = model_dir(tmp_path / "other", '{"v": 2}')
    with pytest.raises(ValidationError, match=r"the tokenizer of .*other.* differs from the policy's"):
        RLConfig(model={"name": policy}, inference={}, orchestrator=orch, teacher={"model": other})
    with pytest.raises(ValidationError, match="no environment runs opd or sft without a teacher"):
        RLConfig(model={"name": policy}, inference={}, teacher={"model": teacher})
    assert tokenizer_mismatch("Qwen/Qwen3-0.6B", policy) is None  # a hub id: checked on the teacher's server
