import asyncio

import env_testkit as kit
import pytest
import verifiers.v1 as vf
from guess_number import (
    SYSTEM_PROMPT,
    GuessNumberConfig,
    GuessNumberData,
    GuessNumberHarness,
    GuessNumberTask,
    GuessNumberTaskset,
    feedback,
    game_prompt,
    parse_guess,
    solved_on,
)

# verifiers keeps some asyncio state bound to the loop that first used it: one loop for this module.
LOOP = asyncio.new_event_loop()
API_KEY_VAR = "GUESS_NUMBER_TEST_API_KEY"


@pytest.mark.parametrize(
    ("reply", "guess"),
    [
        ("16", 16),
        (" 16\n", 16),
        ("My guess is 20.", 20),
        ("10? no, 12", 12),
        ("-3", -3),
        ("sixteen", None),
        (None, None),
    ],
)
def test_parse_guess(reply, guess):
    assert parse_guess(reply) == guess


def test_feedback():
    assert feedback("16", 20, 32) == ("higher", False)
    assert feedback("I say 25", 20, 32) == ("lower", False)
    assert feedback("20", 20, 32) == ("correct", True)
    assert feedback("100", 20, 32) == ("lower", False)
    assert feedback("no idea", 20, 32) == ("Answer with a single whole number from 1 to 32.", False)
    assert feedback(None, 20, 8) == ("Answer with a single whole number from 1 to 8.", False)


def test_solved_on():
    assert solved_on([16, 20], 20) == 2
    assert solved_on([None, 20, 20], 20) == 2
    assert solved_on([1, 2, 3], 20) is None
    assert solved_on([], 20) is None


def test_generation_is_deterministic_and_configurable():
    def targets(**args):
        return [t.data.target for t in GuessNumberTaskset(GuessNumberConfig(**args))]

    assert targets(num_tasks=40, seed=5) == targets(num_tasks=40, seed=5)
    assert targets(num_tasks=40, seed=5) != targets(num_tasks=40, seed=6)
    assert all(1 <= t <= 32 for t in targets(num_tasks=200))
    assert set(targets(num_tasks=200, max_number=3)) == {1, 2, 3}
    (task,) = GuessNumberTaskset(GuessNumberConfig(num_tasks=1, max_number=50, max_turns=6))
    assert task.data.prompt == "Guess my number from 1 to 50. You have 6 guesses."
    assert (task.data.max_number, task.data.max_turns, task.data.system_prompt) == (50, 6, SYSTEM_PROMPT)


def test_taskset_exports_its_harness():
    assert GuessNumberHarness.APPENDS_SYSTEM_PROMPT and not GuessNumberHarness.EXECUTES_CODE
    assert vf.default_agent_harness("guess-number").id == "guess-number"


def make_task(target: int, max_number: int = 32, max_turns: int = 4) -> GuessNumberTask:
    return GuessNumberTask(
        GuessNumberData(
            prompt=game_prompt(max_number, max_turns),
            system_prompt=SYSTEM_PROMPT,
            target=target,
            max_number=max_number,
            max_turns=max_turns,
        )
    )


def scripted(*replies: str):
    """Replies by turn: the n-th request (n-1 assistant messages in it) gets replies[n-1]."""

    def script(body: dict) -> dict:
        turn = sum(m["role"] == "assistant" for m in body["messages"])
        return {"content": replies[turn]}

    return script


def binary_search(body: dict) -> dict:
    """A player that bisects [1, max_number] using the feedback in the conversation."""
    messages = body["messages"]
    low, high = 1, int(messages[1]["content"].split(" to ")[1].split(".")[0])
    for guess_msg, reply in zip(messages[2::2], messages[3::2], strict=True):
        guess = int(guess_msg["content"])
        if reply["content"] == "higher":
            low = guess + 1
        elif reply["content"] == "lower":
            high = guess - 1
    return {"content": str((low + high) // 2)}


async def run_episodes(script, task_list, harness: str | None = "guess-number", **taskset_args):
    agent = {"runtime": {"type": "subprocess"}}
    if harness is not None:
        agent["harness"] = {"id": harness}
    config = {"taskset": {"id": "guess-number", **taskset_args}, "agent": agent}
    return await kit.run_episodes(config, script, task_list, api_key_var=API_KEY_VAR)


def test_episode_solved_on_second_guess(monkeypatch):
    monkeypatch.setenv(API_KEY_VAR, "sk-test")
    episodes, requests = LOOP.run_until_complete(
        run_episodes(scripted("16", "My guess is 20."), [make_task(20)], num_tasks=1)
    )
    (trace,) = episodes[0].traces
    assert episodes[0].ok and not trace.has_error, trace.errors
    assert trace.stop_condition == "agent_completed"
    assert trace.rewards["solved"].score == 1.0
    assert trace.rewards["efficiency"].score == 0.75  # (4 - 2 + 1) / 4
    assert trace.rewards["efficiency"].weight == 0.2
    assert trace.reward == pytest.approx(1.15)
    assert trace.metrics == {"num_guesses": 2.0, "invalid_guesses": 0.0}
    assert [(m.role, m.content) for m in trace.messages] == [
        ("system", SYSTEM_PROMPT),
        ("user", "Guess my number from 1 to 32. You have 4 guesses."),
        ("assistant", "16"),
        ("user", "higher"),
        ("assistant", "My guess is 20."),
    ]
    assert len(requests) == 2 and trace.num_branches == 1
    assert requests[1]["messages"][-2:] == [
        {"role": "assistant", "content": "16"},
        {"role": "user", "content": "higher"},
    ]


def test_episode_not_solved(monkeypatch):
    monkeypatch.setenv(API_KEY_VAR, "sk-test")
    episodes, requests = LOOP.run_until_complete(
        run_episodes(scripted("no idea", "40", "1", "2", "20"), [make_task(20)], num_tasks=1)
    )
    (trace,) = episodes[0].traces
    assert not trace.has_error, trace.errors
    assert len(requests) == 4  # max_turns guesses, then the game ends
    assert [m.content for m in trace.messages if m.role == "user"][1:] == [
        "Answer with a single whole number from 1 to 32.",
        "lower",
        "higher",
    ]
    assert trace.reward == 0.0
    assert trace.rewards["solved"].score == 0.0 and trace.rewards["efficiency"].score == 0.0
    assert trace.metrics == {"num_guesses": 4.0, "invalid_guesses": 1.0}


def test_episodes_from_taskset_with_default_harness(monkeypatch):
    """Ids as a user types them; no harness pinned, so the taskset's own harness plays; a bisecting player
    always wins [1, 8] within 4 guesses."""
    monkeypatch.setenv(API_KEY_VAR, "sk-test")
    episodes, _ = LOOP.run_until_complete(
        run_episodes(binary_search, lambda env: list(env.taskset), harness=None, num_tasks=8, max_number=8, seed=1)
    )
    assert len(episodes) == 8
    for episode in episodes:
        (trace,) = episode.traces
        assert episode.ok, episode.errors
        assert trace.agent.config.harness.id == "guess-number"
        assert trace.rewards["solved"].score == 1.0
        assert 1 <= trace.metrics["num_guesses"] <= 4
        assert trace.rewards["efficiency"].score == (4 - trace.metrics["num_guesses"] + 1) / 4
