import asyncio

import env_testkit as kit
import pytest
from reverse_text import (
    SYSTEM_PROMPT,
    ReverseTextConfig,
    ReverseTextData,
    ReverseTextTask,
    ReverseTextTaskset,
    lcs_length,
    lcs_ratio,
)

# verifiers keeps some asyncio state bound to the loop that first used it: one loop for this module.
LOOP = asyncio.new_event_loop()
API_KEY_VAR = "REVERSE_TEXT_TEST_API_KEY"


@pytest.mark.parametrize(
    ("a", "b", "lcs"),
    [
        ("abc", "abc", 3),
        ("abc", "acb", 2),
        ("abcde", "ace", 3),
        ("abc", "xyz", 0),
        ("", "abc", 0),
        ("AGGTAB", "GXTXAYB", 4),  # GTAB
        ("cab", "cba", 2),
    ],
)
def test_lcs_length(a, b, lcs):
    assert lcs_length(a, b) == lcs
    assert lcs_length(b, a) == lcs


def test_lcs_ratio_hand_computed():
    assert lcs_ratio("abc", "abc") == 1.0
    assert lcs_ratio("abc", "acb") == pytest.approx(2 * 2 / 6)  # 0.6667
    assert lcs_ratio("abcde", "ace") == pytest.approx(2 * 3 / 8)  # 0.75
    assert lcs_ratio("abc", "xyz") == 0.0
    assert lcs_ratio("", "abc") == 0.0
    assert lcs_ratio("", "") == 1.0


def tasks(**args):
    return list(ReverseTextTaskset(ReverseTextConfig(**args)))


def test_generation_is_deterministic_and_configurable():
    first = tasks(num_tasks=20, seed=3, min_len=5, max_len=10)
    again = tasks(num_tasks=20, seed=3, min_len=5, max_len=10)
    other = tasks(num_tasks=20, seed=4, min_len=5, max_len=10)
    assert [t.data for t in first] == [t.data for t in again]
    assert [t.data.text for t in first] != [t.data.text for t in other]
    for i, task in enumerate(first):
        assert task.data.idx == i
        assert 5 <= len(task.data.text) <= 10
        assert set(task.data.text) <= set("abcdefghijklmnopqrstuvwxyz")
        assert task.data.answer == task.data.text[::-1]
        assert task.data.prompt == f"Reverse this text: {task.data.text}"
        assert task.data.system_prompt == SYSTEM_PROMPT
    assert len({t.data.text for t in first}) > 15
    short = tasks(num_tasks=5, min_len=3, max_len=3, alphabet="xy")
    assert all(len(t.data.text) == 3 and set(t.data.text) <= {"x", "y"} for t in short)


def test_config_rejects_bad_lengths():
    with pytest.raises(ValueError):
        ReverseTextConfig(min_len=6, max_len=5)
    with pytest.raises(ValueError):
        ReverseTextConfig(min_len=0)


def reverse_script(body: dict) -> dict:
    """The correct reversal of whatever the user asked for."""
    text = body["messages"][-1]["content"].removeprefix("Reverse this text: ")
    return {"content": f"  {text[::-1]}\n"}


async def run_episodes(script, task_list, **taskset_args):
    config = {
        "taskset": {"id": "reverse-text", **taskset_args},
        "agent": {"harness": {"id": "env_testkit"}, "runtime": {"type": "subprocess"}},
    }
    return await kit.run_episodes(config, script, task_list, api_key_var=API_KEY_VAR)


def test_episode_correct_reversal(monkeypatch):
    monkeypatch.setenv(API_KEY_VAR, "sk-test")
    episodes, requests = LOOP.run_until_complete(
        run_episodes(reverse_script, lambda env: list(env.taskset.take(3)), num_tasks=3, min_len=5, max_len=10)
    )
    assert len(episodes) == 3 and len(requests) == 3
    for episode, request in zip(episodes, requests, strict=True):
        assert episode.ok, episode.errors
        (trace,) = episode.traces
        assert not trace.has_error, trace.errors
        assert trace.rewards["lcs"].score == 1.0
        assert trace.reward == 1.0
        assert trace.metrics["exact"] == 1.0
        assert request["model"] == "m" and request["max_tokens"] == 16
        assert request["messages"][0] == {"role": "system", "content": SYSTEM_PROMPT}
        assert 5 <= len(trace.last_reply) <= 10


def test_episode_wrong_reversal(monkeypatch):
    monkeypatch.setenv(API_KEY_VAR, "sk-test")
    task = ReverseTextTask(
        ReverseTextData(prompt="Reverse this text: abc", system_prompt=SYSTEM_PROMPT, text="abc", answer="cba")
    )
    episodes, _ = LOOP.run_until_complete(run_episodes(lambda body: {"content": "cab"}, [task], num_tasks=1))
    (trace,) = episodes[0].traces
    assert not trace.has_error, trace.errors
    # LCS("cab", "cba") = 2 ("ca" or "cb") -> 2 * 2 / 6
    assert trace.rewards["lcs"].score == pytest.approx(0.6667, abs=1e-4)
    assert trace.reward == pytest.approx(2 / 3)
    assert trace.metrics["exact"] == 0.0
    assert trace.last_reply == "cab"
