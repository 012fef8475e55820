"""`eval`'s summary math, on hand-worked numbers."""

import math

import pytest

from prime_rl.eval.eval import pass_at_k, pass_ks, summarize


def test_pass_at_k_hand_values():
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(4, 2, 1) == pytest.approx(0.5)  # pass@1 is the fraction correct
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # C(3,2)=3, C(5,2)=10
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(5, 2, 4) == 1.0  # only 3 wrong samples: any 4 contain a correct one
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def test_pass_ks():
    assert pass_ks(1) == [1]
    assert pass_ks(6) == [1, 2, 4, 6]
    assert pass_ks(8) == [1, 2, 4, 8]


def record(example_id, reward, error=None, **metrics):
    return {
        "example_id": example_id,
        "reward": reward,
        "error": error,
        "metrics": metrics,
        "prompt_tokens": 10,
        "completion_tokens": 4 + example_id,
        "seconds": 0.5,
    }


def test_summarize_two_rollouts_per_example():
    records = [
        record(0, 1.0, exact=1.0),
        record(0, 0.5, exact=0.0),
        record(1, 0.0, exact=0.0),
        record(1, 0.0, error="ProviderError: boom"),  # recorded, excluded from the numbers
        record(2, 1.0, exact=1.0),
        record(2, 1.0, exact=1.0),
    ]
    s = summarize(records, rollouts_per_example=2, pass_threshold=1.0)
    rewards = [1.0, 0.5, 0.0, 1.0, 1.0]
    assert s["rollouts"] == 6 and s["errors"] == 1
    assert s["reward_mean"] == pytest.approx(3.5 / 5)
    assert s["reward_std"] == pytest.approx(math.sqrt(sum((r - 0.7) ** 2 for r in rewards) / 5))
    # Example 1 lost a rollout to an error: pass@k uses the complete examples 0 and 2 only.
    assert s["pass@1"] == pytest.approx((0.5 + 1.0) / 2)
    assert s["pass@2"] == pytest.approx((1.0 + 1.0) / 2)
    assert s["avg@2"] == pytest.approx((0.75 + 1.0) / 2)
    assert s["metrics"] == {"exact": pytest.approx(3 / 5)}
    assert s["completion_tokens_total"] == 4 + 4 + 5 + 6 + 6
    assert s["prompt_tokens_mean"] == 10


def test_summarize_all_failed():
    s = summarize([record(0, 0.0, error="x")], rollouts_per_example=1, pass_threshold=1.0)
    assert s["errors"] == 1 and s["reward_mean"] is None and "pass@1" not in s


def test_named_policies_are_categories_and_steps_a_series(tmp_path):
    from prime_rl.eval.eval import plot_rewards, step_axis

    assert step_axis(["base", "sft", "rl"]) is None  # bars: no order or distance between named policies
    assert step_axis(["base", "step_2", "step_10"]) == [0, 2, 10]  # a line over training steps, spaced by step
    assert step_axis(["step_5", "step_6"]) == [5, 6]
    summary = {"envs": {"e": {}}, "policies": [{"label": x, "envs": {"e": {"reward_mean": 0.5}}} for x in "ab"]}
    assert plot_rewards(summary, tmp_path / "p.png").stat().st_size > 0
