import asyncio
import re

import env_testkit as kit
import pytest
from arithmetic import (
    ArithmeticConfig,
    ArithmeticData,
    ArithmeticTask,
    ArithmeticTaskset,
    compute,
    parse_answer,
    question,
)

# verifiers keeps some asyncio state bound to the loop that first used it: one loop for this module.
LOOP = asyncio.new_event_loop()
API_KEY_VAR = "ARITHMETIC_TEST_API_KEY"


@pytest.mark.parametrize(
    ("reply", "parsed"),
    [
        ("85", 85),
        ("  85\n", 85),
        ("85.", 85),
        ("The answer is 85", 85),
        ("37 + 48 = 85", 85),
        ("-11", -11),
        ("37-48=-11", -11),
        ("+7", 7),
        ("1,234", 1234),
        ("It is 1,234,567.", 1234567),
        ("1,2345", 2345),  # not a thousands group: two integers, the last wins
        ("2 or 3", 3),
        ("eighty-five", None),
        ("", None),
    ],
)
def test_parse_answer(reply, parsed):
    assert parse_answer(reply) == parsed


def test_compute():
    assert compute(37, "+", 48) == 85
    assert compute(37, "-", 48) == -11
    assert compute(12, "*", 11) == 132
    with pytest.raises(ValueError):
        compute(1, "/", 2)


def tasks(**args):
    return list(ArithmeticTaskset(ArithmeticConfig(**args)))


def test_generation_is_deterministic_and_configurable():
    first = tasks(num_tasks=30, seed=1)
    again = tasks(num_tasks=30, seed=1)
    other = tasks(num_tasks=30, seed=2)
    assert [t.data for t in first] == [t.data for t in again]
    assert [t.data for t in first] != [t.data for t in other]
    for task in first:
        d = task.data
        assert 10 <= d.a <= 99 and 10 <= d.b <= 99
        assert d.op in "+-*"
        assert d.answer == compute(d.a, d.op, d.b) and d.answer >= 0
        assert d.prompt == f"What is {d.a} {d.op} {d.b}? Answer with the number only."
        assert re.fullmatch(r"What is \d+ [-+*] \d+\? Answer with the number only\.", d.prompt)
    assert {t.data.op for t in first} == {"+", "-", "*"}
    plus_only = tasks(num_tasks=10, ops=["+"], digits=3)
    assert all(t.data.op == "+" and 100 <= t.data.a <= 999 for t in plus_only)
    one_digit = tasks(num_tasks=50, ops=["-"], digits=1, allow_negative=True)
    assert all(0 <= t.data.a <= 9 for t in one_digit)
    assert any(t.data.answer < 0 for t in one_digit)


def test_config_rejects_bad_ops():
    with pytest.raises(ValueError):
        ArithmeticConfig(ops=["/"])
    with pytest.raises(ValueError):
        ArithmeticConfig(ops=[])


def answer_script(body: dict) -> dict:
    """Computes the asked sum/difference/product and answers in a sentence."""
    a, op, b = re.match(r"What is (\d+) ([-+*]) (\d+)\?", body["messages"][-1]["content"]).groups()
    return {"content": f"{a} {op} {b} = {compute(int(a), op, int(b))}"}


async def run_episodes(script, task_list, **taskset_args):
    config = {
        "taskset": {"id": "arithmetic", **taskset_args},
        "agent": {"harness": {"id": "env_testkit"}, "runtime": {"type": "subprocess"}},
    }
    episodes, _ = await kit.run_episodes(config, script, task_list, api_key_var=API_KEY_VAR)
    return episodes


def test_episode_correct_answers(monkeypatch):
    monkeypatch.setenv(API_KEY_VAR, "sk-test")
    episodes = LOOP.run_until_complete(
        run_episodes(answer_script, lambda env: list(env.taskset.take(4)), num_tasks=4, digits=2)
    )
    assert len(episodes) == 4
    for episode in episodes:
        assert episode.ok, episode.errors
        (trace,) = episode.traces
        assert trace.rewards["correct"].score == 1.0 and trace.reward == 1.0
        assert trace.metrics == {"parsed": 1.0, "number_only": 0.0}


def test_episode_number_only_and_wrong(monkeypatch):
    monkeypatch.setenv(API_KEY_VAR, "sk-test")
    task = ArithmeticTask(ArithmeticData(prompt=question(37, "+", 48), a=37, op="+", b=48, answer=85))
    replies = iter(["85", "86", "no idea"])
    episodes = LOOP.run_until_complete(
        run_episodes(lambda body: {"content": next(replies)}, [task, task, task], num_tasks=1)
    )
    right, wrong, unparsed = (episode.traces[0] for episode in episodes)
    assert (right.reward, right.metrics) == (1.0, {"parsed": 1.0, "number_only": 1.0})
    assert (wrong.reward, wrong.metrics) == (0.0, {"parsed": 1.0, "number_only": 0.0})
    assert (unparsed.reward, unparsed.metrics) == (0.0, {"parsed": 0.0, "number_only": 0.0})
