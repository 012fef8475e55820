"""The difficulty-pool sampler: pool assignment, sampling frequencies by weight, exact resumption; its config."""

import hashlib
import json
import random

import pytest
from loguru import logger
from pydantic import ValidationError

from prime_rl.config.curriculum import DifficultyPoolSampler, StandardSampler
from prime_rl.config.orchestrator import BufferConfig
from prime_rl.orchestrator.buffer import Buffer
from prime_rl.orchestrator.config import OrchestratorConfig
from prime_rl.orchestrator.curriculum import DifficultyPools, pick, pool_for

# Weights that are exact in binary floating point, so the hand-worked sums below hold exactly.
POOLS = {
    "hard": {"threshold": 0.25, "weight": 0.25},
    "medium": {"threshold": 0.75, "weight": 1.0},
    "easy": {"threshold": 1.0, "weight": 0.25},
}


def sampler(**values) -> DifficultyPoolSampler:
    return DifficultyPoolSampler(**{"pools": POOLS, **values})


def test_a_reward_goes_to_the_first_pool_whose_threshold_it_does_not_exceed():
    ordered = sampler().ordered()
    assert ordered == [("hard", 0.25), ("medium", 0.75), ("easy", 1.0)]  # sorted by threshold, not by key order
    cases = {-1.0: "hard", 0.0: "hard", 0.25: "hard", 0.26: "medium", 0.75: "medium", 0.76: "easy", 1.0: "easy"}
    assert {r: pool_for(r, ordered) for r in cases} == cases  # thresholds are inclusive
    assert pool_for(3.0, ordered) == "easy"  # the highest pool takes everything above it


def test_pick_walks_the_running_sum():
    # weights 0.25, 1, 0.25, 0.5 (total 2): u * 2 falls in [0, .25) -> 0, [.25, 1.25) -> 1, [1.25, 1.5) -> 2, else 3
    weights = [0.25, 1.0, 0.25, 0.5]
    assert [pick(weights, u) for u in (0.0, 0.1, 0.2, 0.6, 0.65, 0.9, 0.999)] == [0, 0, 1, 1, 2, 3, 3]
    assert pick([0.0, 1.0, 0.0], 0.999) == 1  # a zero weight is never picked


def test_tasks_move_between_pools_on_their_latest_group():
    pools = DifficultyPools(sampler(), 4)
    assert pools.sizes() == {"unseen": 4, "hard": 0, "medium": 0, "easy": 0}
    assert pools.total_weight() == 4.0  # unseen weight 1 each
    for task, mean in ((0, 0.0), (1, 0.5), (2, 1.0)):
        pools.observe(task, mean)
    assert [pools.pool(t) for t in range(4)] == ["hard", "medium", "easy", "unseen"]
    assert pools.total_weight() == 2.5  # 0.25 + 1 + 0.25 + 1
    pools.observe(0, 0.5)  # the latest result counts, not an average: 0.0 then 0.5 -> medium
    assert pools.pool(0) == "medium" and pools.rewards[0] == 0.5
    assert pools.sizes() == {"unseen": 1, "hard": 0, "medium": 2, "easy": 1}
    pools.retire(2)
    assert pools.pool(2) is None and pools.sizes()["easy"] == 0
    pools.observe(2, 0.0)  # a late group of a retired task records its reward but does not bring it back
    assert pools.pool(2) is None and pools.rewards[2] == 0.0


def test_sampling_frequencies_follow_the_pool_weights():
    """Tasks 0..3 in pools hard (0.25), medium (1), easy (0.25), unseen (1): total 2.5, so task 1 and task 3 are
    drawn with probability 1 / 2.5 = 0.4 each, tasks 0 and 2 with 0.25 / 2.5 = 0.1 each."""
    pools = DifficultyPools(sampler(), 4)
    for task, mean in ((0, 0.0), (1, 0.5), (2, 1.0)):
        pools.observe(task, mean)
    rng, n = random.Random(7), 20000
    counts = [0] * 4
    for _ in range(n):
        counts[pools.draw(rng)] += 1
    # Binomial standard deviations: sqrt(20000 * 0.4 * 0.6) = 69, sqrt(20000 * 0.1 * 0.9) = 42; allow 4 of them.
    for task, p, sd in ((0, 0.1, 42), (1, 0.4, 69), (2, 0.1, 42), (3, 0.4, 69)):
        assert abs(counts[task] - n * p) < 4 * sd, counts


def test_buffer_draws_by_pool_weight_and_a_zero_weight_pool_is_never_drawn():
    config = BufferConfig(
        sampler={"type": "difficulty_pool", "pools": {**POOLS, "easy": {"threshold": 1, "weight": 0}}}
    )
    buffer = Buffer(config, {"e": 3})
    for task, rewards in ((0, [1.0, 1.0]), (1, [0.0, 1.0])):
        buffer.add_group("e", task, rewards)
    drawn = {buffer.sample_task()[1] for _ in range(300)}
    assert drawn == {1, 2}  # task 0 is easy (weight 0)
    for task in (1, 2):
        buffer.add_group("e", task, [1.0, 1.0])
    with pytest.raises(RuntimeError, match=r"difficulty pools of weight 0 \(\['e'\]\)"):
        buffer.sample_task()


def test_an_environment_whose_tasks_all_weigh_zero_leaves_the_draw_to_the_others():
    pools = {"hard": {"threshold": 0.5, "weight": 0.0}, "rest": {"threshold": 1.0, "weight": 1.0}}
    buffer = Buffer(BufferConfig(), {"a": 1, "b": 2}, samplers={"a": DifficultyPoolSampler(pools=pools)})
    buffer.add_group("a", 0, [0.0, 1.0])  # mean 0.5: hard, weight 0, and env a has no other task
    assert {buffer.sample_task()[0] for _ in range(100)} == {"b"}
    assert buffer.curriculum_metrics() == {
        "curriculum/a/pool/unseen": 0.0,
        "curriculum/a/pool/hard": 1.0,
        "curriculum/a/pool/rest": 0.0,
    }


def test_retirement_takes_a_task_out_of_its_pool():
    buffer = Buffer(BufferConfig(sampler=sampler(), easy_threshold=1.0), {"e": 3})
    buffer.add_group("e", 0, [1.0, 1.0])  # mean 1: pool easy, then retired as easy
    buffer.add_group("e", 1, [0.0, 1.0])
    assert buffer.curriculum_metrics() == {
        "curriculum/e/pool/unseen": 1.0,
        "curriculum/e/pool/hard": 0.0,
        "curriculum/e/pool/medium": 1.0,
        "curriculum/e/pool/easy": 0.0,
    }
    assert {buffer.sample_task()[1] for _ in range(200)} == {1, 2}


def test_a_restored_buffer_draws_the_same_next_tasks():
    """Swap-and-pop moves reorder the pools; the state keeps that order, the RNG and the rewards, so the restored
    buffer continues exactly, also as new groups move tasks on."""
    config = BufferConfig(seed=3, sampler=sampler(), hard_threshold=0.0)
    original = Buffer(config, {"e": 10})
    rng = random.Random(0)
    for _ in range(30):  # a history of draws and groups: tasks move between pools and some retire as hard
        _, task = original.sample_task()
        original.add_group("e", task, [rng.choice([0.0, 0.5, 1.0]) for _ in range(2)])
    restored = Buffer(config, {"e": 10})
    restored.load_state_dict(json.loads(json.dumps(original.state_dict())))
    assert restored.curriculum_metrics() == original.curriculum_metrics()

    def continue_run(buffer: Buffer) -> list[int]:
        draws, feedback = [], random.Random(1)
        for _ in range(50):
            env, task = buffer.sample_task()
            draws.append(task)
            buffer.add_group(env, task, [feedback.choice([0.25, 0.5, 1.0])])
        return draws

    assert continue_run(restored) == continue_run(original)
    assert restored.state_dict() == original.state_dict()


def test_a_restored_buffer_logs_its_pool_sizes_and_the_digest_of_the_saved_state():
    """The line `test_rl_resume_after_a_crash` compares with buffer.json: sizes, then the first 12 hex digits of the
    SHA-256 of the pools' state as JSON with sorted keys (written out by hand here). A checkpoint without pools logs
    no such line (a warning says its tasks start unseen)."""
    original = Buffer(BufferConfig(sampler=sampler()), {"e": 4})
    original.add_group("e", 0, [0.0])  # hard; swap-and-pop leaves unseen [3, 1, 2]
    original.add_group("e", 1, [0.25, 0.75])  # mean 0.5: medium; unseen [3, 2]
    canonical = (
        '{"pools": {"easy": [], "hard": [0], "medium": [1], "unseen": [3, 2]}, "rewards": [0.0, 0.5, null, null]}'
    )
    digest = hashlib.sha256(canonical.encode()).hexdigest()[:12]
    lines: list[str] = []
    sink = logger.add(lines.append, format="{message}")
    try:
        Buffer(BufferConfig(sampler=sampler()), {"e": 4}).load_state_dict(json.loads(json.dumps(original.state_dict())))
        Buffer(BufferConfig(sampler=sampler()), {"e": 4}).load_state_dict(Buffer(BufferConfig(), {"e": 4}).state_dict())
    finally:
        logger.remove(sink)
    assert lines[0] == f"difficulty pools of e restored: unseen 2, hard 1, medium 1, easy 0 (state {digest})\n"
    assert lines[1:] == ["checkpoint has no difficulty pools of 'e': its active tasks start unseen\n"]


def test_resuming_with_other_thresholds_re_places_tasks_by_their_latest_reward():
    original = Buffer(BufferConfig(sampler=sampler()), {"e": 3})
    original.add_group("e", 0, [0.5])  # medium under the old thresholds
    other = {**POOLS, "hard": {"threshold": 0.5, "weight": 0.25}}
    restored = Buffer(BufferConfig(sampler=sampler(pools=other)), {"e": 3})
    restored.load_state_dict(original.state_dict())
    assert restored._pools["e"].pool(0) == "hard"
    # A checkpoint saved with the standard sampler: every active task starts unseen.
    standard = Buffer(BufferConfig(easy_threshold=1.0), {"e": 3})
    standard.add_group("e", 1, [1.0])  # retired
    switched = Buffer(BufferConfig(sampler=sampler(), easy_threshold=1.0), {"e": 3})
    switched.load_state_dict(standard.state_dict())
    assert switched._pools["e"].sizes() == {"unseen": 2, "hard": 0, "medium": 0, "easy": 0}


def test_the_standard_sampler_is_todays_uniform_draw():
    default = Buffer(BufferConfig(seed=5), {"a": 3, "b": 4})
    explicit = Buffer(BufferConfig(seed=5), {"a": 3, "b": 4}, samplers={"a": StandardSampler(), "b": StandardSampler()})
    assert [default.sample_task() for _ in range(40)] == [explicit.sample_task() for _ in range(40)]
    assert default.curriculum_metrics() == {}


def test_an_infinite_taskset_cannot_have_difficulty_pools():
    with pytest.raises(ValueError, match="'gen' has an infinite taskset"):
        Buffer(BufferConfig(sampler=sampler()), {"gen": None})


# -- config ----------------------------------------------------------------------------------------------------


def test_per_environment_sampler_and_gate_fall_back_to_the_buffer_defaults(tmp_path):
    from prime_rl.config.loader import load_config

    toml = tmp_path / "o.toml"
    toml.write_text(
        "[buffer]\ngate = { type = 'advantage_range', low = -0.05, high = 0.05 }\n"
        "[[env]]\nid = 'reverse-text'\nsampler = { type = 'difficulty_pool', unseen_weight = 2.0, pools = { "
        "hard = { threshold = 0.2, weight = 0.5 }, rest = { threshold = 1.0, weight = 1.0 } } }\n"
        "[[env]]\nid = 'arithmetic'\ngate = { type = 'advantage_range' }\n"
    )
    config, _ = load_config(OrchestratorConfig, "orchestrator", ["@", str(toml)])
    pools = config.env_sampler("reverse-text")
    assert pools.type == "difficulty_pool" and pools.unseen_weight == 2.0
    assert pools.ordered() == [("hard", 0.2), ("rest", 1.0)]
    assert config.env_sampler("arithmetic").type == "standard"
    assert (config.env_gate("reverse-text").low, config.env_gate("reverse-text").high) == (-0.05, 0.05)
    assert (config.env_gate("arithmetic").low, config.env_gate("arithmetic").high) == (0.0, 0.0)
    assert OrchestratorConfig().env_gate("reverse-text") is None


def test_default_pools():
    pools = DifficultyPoolSampler().pools
    assert {n: (p.threshold, p.weight) for n, p in pools.items()} == {
        "hard": (0.25, 0.2),
        "normal": (0.75, 1.0),
        "easy": (1.0, 0.2),
    }


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        ({"env": [{"sampler": {"type": "difficulty_pool", "pool": {}}}]}, r"env\.0\.sampler\.difficulty_pool\.pool"),
        ({"env": [{"sampler": {"type": "difficulty_pool", "pools": {"a": {"threshold": 1, "wieght": 1}}}}]}, "wieght"),
        ({"env": [{"sampler": {"type": "curriculum"}}]}, "'standard', 'difficulty_pool'"),
        ({"buffer": {"gate": {"type": "advantage_range", "min": 0}}}, r"gate\.advantage_range\.min"),
        ({"buffer": {"gate": {"type": "advantage_range", "low": 0.1, "high": -0.1}}}, r"low \(0.1\) must be <= high"),
        ({"buffer": {"sampler": {"type": "difficulty_pool", "pools": {}}}}, "at least one pool"),
        (
            {"buffer": {"sampler": {"type": "difficulty_pool", "pools": {"unseen": {"threshold": 1, "weight": 1}}}}},
            "reserved",
        ),
        (
            {"buffer": {"sampler": {"type": "difficulty_pool", "pools": {"a": {"threshold": 1, "weight": 0}}}}},
            "positive",
        ),
        (
            {"buffer": {"sampler": {"type": "difficulty_pool", "pools": {"a": {"threshold": 1, "weight": -1}}}}},
            r"pools\.a\.weight",
        ),
        (
            {"env": [{"gate": {"type": "advantage_range"}}], "advantage": {"estimator": "reinforce_pp"}},
            "gate with advantage.estimator reinforce_pp",
        ),
    ],
)
def test_wrong_settings_name_the_key(values, needle):
    with pytest.raises((ValidationError, ValueError), match=needle):
        OrchestratorConfig(**values)
