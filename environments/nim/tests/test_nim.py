import asyncio
import random
import re

import env_testkit as kit
import pytest
import verifiers.v1 as vf
from nim import (
    NimConfig,
    NimData,
    NimEnv,
    NimEnvConfig,
    NimGame,
    NimHarness,
    NimTask,
    NimTaskset,
    legal_move,
    optimal_move,
    parse_move,
    policy_seat_of,
    random_move,
    rules,
    seat_reward,
    turn_message,
)

# verifiers keeps some asyncio state bound to the loop that first used it: one loop for this module.
LOOP = asyncio.new_event_loop()
API_KEY_VAR = "NIM_TEST_API_KEY"

RULES_3 = (
    "You are playing Nim. Two players take turns removing sticks from one pile. On your turn you take 1 to 3 "
    "sticks, never more than are left. Whoever takes the last stick wins. An invalid move loses."
)


# --- game logic -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reply", "move"),
    [("2", 2), (" 3\n", 3), ("I take 1.", 1), ("12 is a lot, I take 2", 2), ("-1", -1), ("two", None), (None, None)],
)
def test_parse_move(reply, move):
    assert parse_move(reply) == move


@pytest.mark.parametrize(
    ("reply", "left", "take"),
    [
        ("1", 7, 1),
        ("3", 7, 3),
        ("3", 3, 3),  # the whole pile
        ("4", 7, None),  # above max_take
        ("0", 7, None),
        ("-2", 7, None),
        ("3", 2, None),  # more than is left
        ("two", 7, None),
        ("", 7, None),
        (None, 7, None),
    ],
)
def test_legal_move(reply, left, take):
    assert legal_move(reply, left, max_take=3) == take


def test_prompts():
    assert rules(3) == RULES_3
    assert turn_message(7, 3) == "The pile has 7 sticks. Take 1 to 3. Reply with a single number."
    assert (
        turn_message(5, 3, 2)
        == "Your opponent took 2 sticks. The pile has 5 sticks. Take 1 to 3. Reply with a single number."
    )
    assert (
        turn_message(2, 3, 1)
        == "Your opponent took 1 stick. The pile has 2 sticks. Take 1 to 2. Reply with a single number."
    )
    assert (
        turn_message(1, 3, 3)
        == "Your opponent took 3 sticks. The pile has 1 stick. Take 1. Reply with a single number."
    )


def test_game_to_the_last_stick():
    game = NimGame(7, 3)
    assert (game.left, game.to_move, game.over, game.last_take) == (7, "first", False, None)
    assert game.play("2") == 2  # 7 -> 5
    assert (game.left, game.to_move, game.last_take) == (5, "second", 2)
    assert game.play("I take 3") == 3  # 5 -> 2
    assert (game.left, game.to_move) == (2, "first")
    assert game.play("2") == 2  # 2 -> 0: first took the last stick
    assert (game.left, game.over, game.winner, game.forfeited, game.valid_moves) == (0, True, "first", None, 3)
    assert game.record() == {
        "sticks": 7,
        "max_take": 3,
        "moves": [
            {"seat": "first", "reply": "2", "take": 2, "left": 5},
            {"seat": "second", "reply": "I take 3", "take": 3, "left": 2},
            {"seat": "first", "reply": "2", "take": 2, "left": 0},
        ],
        "winner": "first",
        "forfeited": None,
    }
    with pytest.raises(ValueError):
        game.play("1")


def test_game_second_seat_wins_and_forfeits():
    game = NimGame(4, 3)
    game.play("1")  # 4 -> 3
    game.play("3")  # 3 -> 0
    assert (game.winner, game.forfeited, game.valid_moves) == ("second", None, 2)

    game = NimGame(5, 3)
    game.play("3")  # 5 -> 2
    assert game.play("3") is None  # 3 > 2 left: second forfeits
    assert (game.left, game.winner, game.forfeited, game.valid_moves) == (2, "first", "second", 1)

    game = NimGame(9, 2)
    assert game.play("3") is None  # above max_take 2
    assert (game.winner, game.forfeited) == ("second", "first")

    game = NimGame(9, 2)
    assert game.play(None) is None  # no reply at all
    assert (game.winner, game.forfeited, game.moves[0]["reply"]) == ("second", "first", None)

    with pytest.raises(ValueError):
        NimGame(0, 3)
    with pytest.raises(ValueError):
        NimGame(5, 0)


def test_seat_reward():
    won = {"winner": "first"}
    assert (seat_reward(won, "first"), seat_reward(won, "second")) == (1.0, 0.0)
    lost = {"winner": "second"}
    assert (seat_reward(lost, "first"), seat_reward(lost, "second")) == (0.0, 1.0)
    drawn = {"winner": None}
    assert (seat_reward(drawn, "first"), seat_reward(drawn, "second")) == (0.5, 0.5)


def play_scripted(sticks: int, max_take: int, first, second, rng: random.Random) -> NimGame:
    game = NimGame(sticks, max_take)
    players = {"first": first, "second": second}
    while not game.over:
        assert game.play(str(players[game.to_move](game.left, game.max_take, rng))) is not None  # always legal
    return game


def test_scripted_moves_are_legal_and_optimal_takes_the_winning_move():
    rng = random.Random(0)
    for max_take in (1, 2, 3, 5):
        for left in range(1, 25):
            takes = {random_move(left, max_take, rng) for _ in range(60)}
            assert takes == set(range(1, min(max_take, left) + 1))  # uniform over every legal move
            best = {optimal_move(left, max_take, rng) for _ in range(60)}
            if left % (max_take + 1):
                assert best == {left % (max_take + 1)}  # leaves the opponent a multiple of max_take + 1
            else:
                assert best == takes  # a lost position: any legal move, at random


@pytest.mark.parametrize("max_take", [1, 2, 3, 4])
def test_optimal_never_loses_a_winning_position(max_take):
    rng = random.Random(max_take)
    for sticks in range(1, 30):
        first_wins = sticks % (max_take + 1) != 0
        for _ in range(20):
            as_first = play_scripted(sticks, max_take, optimal_move, random_move, rng)
            as_second = play_scripted(sticks, max_take, random_move, optimal_move, rng)
            both = play_scripted(sticks, max_take, optimal_move, optimal_move, rng)
            if first_wins:
                assert as_first.winner == both.winner == "first"
            else:
                assert as_second.winner == both.winner == "second"


def test_policy_seat_of():
    assert [policy_seat_of("alternate", idx) for idx in (0, 1, 2, 7, None)] == [
        "first",
        "second",
        "first",
        "second",
        "first",
    ]
    assert policy_seat_of("first", 1) == "first" and policy_seat_of("second", 0) == "second"


# --- taskset and config -----------------------------------------------------------------------------------------


def piles(**args):
    return [t.data.sticks for t in NimTaskset(NimConfig(**args))]


def test_generation_is_deterministic_and_configurable():
    assert piles(num_tasks=40, seed=5) == piles(num_tasks=40, seed=5)
    assert piles(num_tasks=40, seed=5) != piles(num_tasks=40, seed=6)
    assert all(1 <= p <= 12 for p in piles(num_tasks=300))
    assert set(piles(num_tasks=300)) == set(range(1, 13))
    assert set(piles(num_tasks=100, max_sticks=3)) == {1, 2, 3}
    (task,) = NimTaskset(NimConfig(num_tasks=1, max_sticks=1, max_take=2))
    assert (task.data.sticks, task.data.max_take) == (1, 2)
    assert task.data.prompt == "The pile has 1 stick. Take 1. Reply with a single number."
    assert task.data.system_prompt == rules(2)
    for bad in ({"max_take": 0}, {"max_sticks": 0}, {"num_tasks": 0}):
        with pytest.raises(ValueError):
            NimConfig(**bad)


def test_env_config_with_only_the_taskset():
    config = vf.resolve_env_config({"taskset": {"id": "nim"}})
    assert type(config) is NimEnvConfig
    assert isinstance(config.taskset, NimConfig)
    assert (config.taskset.num_tasks, config.taskset.seed, config.taskset.max_sticks, config.taskset.max_take) == (
        1000,
        0,
        12,
        3,
    )
    assert config.max_moves is None
    assert (config.opponent, config.policy_seat) == (None, "alternate")
    for seat in (config.first, config.second):
        assert seat.harness is None  # unpinned: the taskset's harness plays
        assert seat.runtime.type == "subprocess"
        assert seat.max_turns is None
    assert {name: h.id for name, h in config.agent_harnesses().items()} == {"first": "nim", "second": "nim"}
    assert vf.default_agent_harness("nim").id == "nim"  # the module exports NimHarness
    assert NimHarness.SUPPORTS_RESUME and not NimHarness.EXECUTES_CODE
    env = vf.load_environment(config)
    assert type(env) is NimEnv
    assert len(list(env.taskset)) == 1000


def test_env_config_with_role_overrides():
    config = vf.resolve_env_config(
        {
            "taskset": {"id": "nim", "num_tasks": 5, "max_sticks": 6, "max_take": 2},
            "first": {"harness": {"id": "env_testkit"}, "max_turns": 4},
            "second": {"sampling": {"temperature": 0.5}, "max_total_tokens": 300},
            "max_moves": 6,
        }
    )
    assert type(config) is NimEnvConfig
    assert (config.taskset.num_tasks, config.taskset.max_sticks, config.taskset.max_take) == (5, 6, 2)
    assert config.max_moves == 6
    # Overrides merge onto each role's declared default: the local runtime stays.
    assert (config.first.harness.id, config.first.max_turns, config.first.runtime.type) == (
        "env_testkit",
        4,
        "subprocess",
    )
    assert (config.second.harness, config.second.sampling.temperature, config.second.max_total_tokens) == (
        None,
        0.5,
        300,
    )
    assert config.second.runtime.type == "subprocess"
    assert {name: h.id for name, h in config.agent_harnesses().items()} == {"first": "env_testkit", "second": "nim"}
    env = vf.load_environment(config)
    assert [t.data.sticks for t in env.taskset] == piles(num_tasks=5, max_sticks=6, max_take=2)
    assert all(t.data.max_take == 2 for t in env.taskset)


def test_env_config_refuses_the_single_agent_seat():
    with pytest.raises(ValueError, match="agent"):
        vf.resolve_env_config({"taskset": {"id": "nim"}, "agent": {"max_turns": 3}})
    with pytest.raises(ValueError):
        vf.resolve_env_config({"taskset": {"id": "nim"}, "max_moves": 0})
    for bad in ({"opponent": "perfect"}, {"opponent": "random", "policy_seat": "third"}):
        with pytest.raises(ValueError):
            vf.resolve_env_config({"taskset": {"id": "nim"}, **bad})


def test_env_config_with_an_opponent():
    config = vf.resolve_env_config({"taskset": {"id": "nim"}, "opponent": "optimal", "policy_seat": "second"})
    assert type(config) is NimEnvConfig and (config.opponent, config.policy_seat) == ("optimal", "second")
    # as prime-rl's orchestrator and eval load it, from `env_args`
    from prime_rl.orchestrator.config import EnvConfig
    from prime_rl.orchestrator.envs import load_env

    env = load_env(EnvConfig(id="nim", env_args={"opponent": "random", "policy_seat": "alternate"}), 256)
    assert type(env) is NimEnv and (env.config.opponent, env.config.policy_seat) == ("random", "alternate")
    assert env.config.first.harness.id == env.config.second.harness.id == "nim"


# --- episodes ---------------------------------------------------------------------------------------------------


def make_task(sticks: int, max_take: int = 3) -> NimTask:
    return NimTask(
        NimData(prompt=turn_message(sticks, max_take), system_prompt=rules(max_take), sticks=sticks, max_take=max_take)
    )


def replies(*texts: str):
    """The n-th model call of the episode (either seat) gets texts[n-1]: the game alternates, so the call order is
    the move order."""
    it = iter(texts)
    return lambda body: {"content": next(it)}


def optimal(body: dict) -> dict:
    """Leave the opponent a multiple of max_take + 1 when possible, else take 1."""
    system, last = body["messages"][0]["content"], body["messages"][-1]["content"]
    max_take = int(re.search(r"you take 1 to (\d+) sticks", system).group(1))
    left = int(re.search(r"The pile has (\d+) stick", last).group(1))
    return {"content": str(left % (max_take + 1) or 1)}


def run(script, tasks, **config):
    return LOOP.run_until_complete(
        kit.run_episodes({"taskset": {"id": "nim"}, **config}, script, tasks, api_key_var=API_KEY_VAR)
    )


def seats(episode) -> tuple[vf.Trace, vf.Trace]:
    by_seat = episode.by_agent
    assert sorted(by_seat) == ["first", "second"]
    (first,), (second,) = by_seat["first"], by_seat["second"]
    return first, second


def assert_never_acted(trace: vf.Trace) -> None:
    assert trace.calls == [] and trace.nodes == [] and trace.branches == []
    assert trace.num_turns == 0 and trace.usage is None
    assert trace.ok and not trace.has_error and trace.is_completed
    assert trace.stop_condition == "user_closed"


def test_episode_played_to_the_end(monkeypatch):
    monkeypatch.setenv(API_KEY_VAR, "sk-test")
    # 7 sticks: first takes 2 (5 left), second 3 (2 left), first 2 and takes the last stick.
    (episode,), requests = run(replies("2", "I take 3", "2"), [make_task(7)])
    assert episode.ok, episode.errors
    first, second = seats(episode)
    for trace in (first, second):
        assert trace.ok and not trace.has_error, trace.errors
        assert trace.agent.trainable is True
        assert trace.agent.config.harness.id == "nim"
        assert trace.metrics == {"moves": 3.0, "forfeited": 0.0}
        assert trace.info["nim"]["winner"] == "first"
        assert trace.stop_condition == "user_closed"
        assert trace.num_branches == 1
    assert (first.agent.name, second.agent.name) == ("first", "second")
    assert first.rewards["win"].score == 1.0 and first.reward == 1.0
    assert second.rewards["win"].score == 0.0 and second.reward == 0.0
    assert [m["take"] for m in first.info["nim"]["moves"]] == [2, 3, 2]
    assert [(m.role, m.content) for m in first.messages] == [
        ("system", RULES_3),
        ("user", "The pile has 7 sticks. Take 1 to 3. Reply with a single number."),
        ("assistant", "2"),
        ("user", "Your opponent took 3 sticks. The pile has 2 sticks. Take 1 to 2. Reply with a single number."),
        ("assistant", "2"),
    ]
    assert [(m.role, m.content) for m in second.messages] == [
        ("system", RULES_3),
        ("user", "Your opponent took 2 sticks. The pile has 5 sticks. Take 1 to 3. Reply with a single number."),
        ("assistant", "I take 3"),
    ]
    assert (len(first.calls), len(second.calls)) == (2, 1)
    assert len(requests) == 3
    assert requests[1]["messages"] == [
        {"role": "system", "content": RULES_3},
        {
            "role": "user",
            "content": "Your opponent took 2 sticks. The pile has 5 sticks. Take 1 to 3. Reply with a single number.",
        },
    ]
    assert requests[2]["messages"][-2:] == [
        {"role": "assistant", "content": "2"},
        {
            "role": "user",
            "content": "Your opponent took 3 sticks. The pile has 2 sticks. Take 1 to 2. Reply with a single number.",
        },
    ]


def test_episode_second_seat_wins(monkeypatch):
    monkeypatch.setenv(API_KEY_VAR, "sk-test")
    # 5 sticks: 1 (4 left), 1 (3 left), 1 (2 left), 2: the second seat takes the last stick.
    (episode,), requests = run(replies("1", "1", "1", "2"), [make_task(5)])
    first, second = seats(episode)
    assert episode.ok, episode.errors
    assert (first.reward, second.reward) == (0.0, 1.0)
    assert first.metrics == second.metrics == {"moves": 4.0, "forfeited": 0.0}
    assert (first.num_turns, second.num_turns, len(requests)) == (2, 2, 4)


def test_episode_first_seat_wins_on_its_first_move(monkeypatch):
    monkeypatch.setenv(API_KEY_VAR, "sk-test")
    (episode,), requests = run(replies("3"), [make_task(3)])
    assert episode.ok, episode.errors
    first, second = seats(episode)
    assert len(requests) == 1
    assert (first.reward, first.metrics) == (1.0, {"moves": 1.0, "forfeited": 0.0})
    assert len(first.calls) == 1 and first.num_turns == 1
    # The second seat never acted: its trace exists, holds no model call and no tokens, and has its reward.
    assert_never_acted(second)
    assert second.agent.name == "second" and second.agent.trainable is True
    assert second.rewards["win"].score == 0.0 and second.reward == 0.0
    assert second.metrics == {"moves": 1.0, "forfeited": 0.0}


@pytest.mark.parametrize("reply", ["5", "0", "no idea"])
def test_episode_forfeit_on_the_first_move(monkeypatch, reply):
    monkeypatch.setenv(API_KEY_VAR, "sk-test")
    (episode,), requests = run(replies(reply), [make_task(7)])
    assert episode.ok, episode.errors
    first, second = seats(episode)
    assert len(requests) == 1
    assert (first.reward, first.metrics) == (0.0, {"moves": 0.0, "forfeited": 1.0})
    assert first.info["nim"]["moves"] == [{"seat": "first", "reply": reply, "take": None, "left": 7}]
    assert_never_acted(second)
    assert (second.reward, second.metrics) == (1.0, {"moves": 0.0, "forfeited": 0.0})


def test_episode_taking_more_than_is_left_forfeits(monkeypatch):
    monkeypatch.setenv(API_KEY_VAR, "sk-test")
    # 5 sticks: first takes 3 (2 left); second asks for 3 of the 2 left and forfeits.
    (episode,), _ = run(replies("3", "3"), [make_task(5)])
    first, second = seats(episode)
    assert (first.reward, second.reward) == (1.0, 0.0)
    assert (first.metrics["forfeited"], second.metrics["forfeited"], second.metrics["moves"]) == (0.0, 1.0, 1.0)


def test_episode_stopped_by_the_move_cap_is_a_draw(monkeypatch):
    monkeypatch.setenv(API_KEY_VAR, "sk-test")
    (episode,), requests = run(replies("1", "1"), [make_task(12)], max_moves=2)
    first, second = seats(episode)
    assert len(requests) == 2
    assert (first.reward, second.reward) == (0.5, 0.5)
    assert first.metrics == second.metrics == {"moves": 2.0, "forfeited": 0.0}
    assert first.info["nim"]["winner"] is None and first.info["nim"]["moves"][-1]["left"] == 10


def test_episode_seat_out_of_turns_forfeits(monkeypatch):
    monkeypatch.setenv(API_KEY_VAR, "sk-test")
    # The first seat may make one model call: its second move is refused, so it never replies and forfeits.
    (episode,), requests = run(replies("1", "1"), [make_task(7)], first={"max_turns": 1})
    first, second = seats(episode)
    assert len(requests) == 2
    assert first.stop_condition == "max_turns" and first.ok
    assert first.info["nim"]["moves"][-1] == {"seat": "first", "reply": None, "take": None, "left": 5}
    assert (first.reward, second.reward) == (0.0, 1.0)
    assert (first.metrics, second.metrics) == ({"moves": 2.0, "forfeited": 1.0}, {"moves": 2.0, "forfeited": 0.0})


def test_episode_with_a_role_pinned_to_another_harness(monkeypatch):
    monkeypatch.setenv(API_KEY_VAR, "sk-test")
    (episode,), _ = run(replies("1", "2", "1"), [make_task(4)], first={"harness": {"id": "env_testkit"}})
    first, second = seats(episode)
    assert episode.ok, episode.errors
    assert (first.agent.config.harness.id, second.agent.config.harness.id) == ("env_testkit", "nim")
    assert (first.reward, second.reward) == (1.0, 0.0)  # 4 -> 3 -> 1 -> 0
    assert first.metrics["moves"] == 3.0


def test_episodes_from_the_taskset_follow_the_theory(monkeypatch):
    """Two optimal seats: the first wins exactly when the pile is not a multiple of max_take + 1."""
    monkeypatch.setenv(API_KEY_VAR, "sk-test")
    episodes, _ = run(
        optimal, lambda env: list(env.taskset), taskset={"id": "nim", "num_tasks": 10, "max_sticks": 9, "seed": 2}
    )
    assert len(episodes) == 10
    sticks = [episode.task.data.sticks for episode in episodes]
    assert any(s % 4 == 0 for s in sticks) and any(s % 4 != 0 for s in sticks)
    for episode in episodes:
        assert episode.ok, episode.errors
        first, second = seats(episode)
        first_wins = episode.task.data.sticks % 4 != 0
        assert (first.reward, second.reward) == ((1.0, 0.0) if first_wins else (0.0, 1.0))
        assert first.metrics["forfeited"] == second.metrics["forfeited"] == 0.0


# --- against a scripted opponent --------------------------------------------------------------------------------


def policy_moves(trace: vf.Trace) -> list[int]:
    return [m["take"] for m in trace.info["nim"]["moves"] if m["seat"] == trace.agent.name]


@pytest.mark.parametrize("opponent", ["random", "optimal"])
@pytest.mark.parametrize(("seat", "sticks"), [("first", 7), ("second", 8)])
def test_episode_against_an_opponent_in_a_winning_position(monkeypatch, opponent, seat, sticks):
    """An optimal policy in a winning position (first on 7, second on 8) beats either scripted player; only the
    policy's seat has a trace, and every model call is the policy's."""
    monkeypatch.setenv(API_KEY_VAR, "sk-test")
    (episode,), requests = run(optimal, [make_task(sticks)], opponent=opponent, policy_seat=seat)
    assert episode.ok, episode.errors
    (trace,) = episode.traces
    assert (trace.agent.name, trace.agent.trainable, trace.ok) == (seat, True, True)
    record = trace.info["nim"]
    assert (record["opponent"], record["policy_seat"], record["winner"], record["forfeited"]) == (
        opponent,
        seat,
        seat,
        None,
    )
    assert [m["seat"] for m in record["moves"]] == [("first", "second")[i % 2] for i in range(len(record["moves"]))]
    assert all(m["take"] is not None for m in record["moves"])  # the scripted seat always moves legally
    assert len(requests) == len(policy_moves(trace)) == trace.num_turns
    assert trace.reward == trace.rewards["win"].score == 1.0
    assert trace.metrics == {"moves": float(len(record["moves"])), "forfeited": 0.0, f"win_as_{seat}": 1.0}
    if seat == "second":
        assert trace.messages[1].content.startswith("Your opponent took ")
        assert requests[0]["messages"][-1]["content"] == trace.messages[1].content


@pytest.mark.parametrize(("seat", "sticks"), [("first", 8), ("second", 7)])
def test_the_optimal_opponent_wins_from_a_winning_position(monkeypatch, seat, sticks):
    monkeypatch.setenv(API_KEY_VAR, "sk-test")
    (episode,), _ = run(optimal, [make_task(sticks)], opponent="optimal", policy_seat=seat)
    (trace,) = episode.traces
    assert episode.ok and trace.info["nim"]["winner"] != seat
    assert (trace.reward, trace.metrics[f"win_as_{seat}"], trace.metrics["forfeited"]) == (0.0, 0.0, 0.0)


def test_the_opponent_takes_the_whole_pile_before_the_policy_moves(monkeypatch):
    monkeypatch.setenv(API_KEY_VAR, "sk-test")
    (episode,), requests = run(optimal, [make_task(3)], opponent="optimal", policy_seat="second")
    assert episode.ok, episode.errors
    assert requests == []
    (trace,) = episode.traces
    assert_never_acted(trace)
    assert trace.info["nim"]["moves"] == [{"seat": "first", "reply": "3", "take": 3, "left": 0}]
    assert (trace.reward, trace.metrics) == (0.0, {"moves": 1.0, "forfeited": 0.0, "win_as_second": 0.0})


def test_the_policy_forfeits_against_an_opponent(monkeypatch):
    monkeypatch.setenv(API_KEY_VAR, "sk-test")
    (episode,), _ = run(replies("4"), [make_task(7)], opponent="random", policy_seat="first")
    (trace,) = episode.traces
    assert (trace.reward, trace.metrics) == (0.0, {"moves": 0.0, "forfeited": 1.0, "win_as_first": 0.0})


def test_alternating_seats_give_per_seat_win_rates_with_nothing_of_the_opponent_trained(monkeypatch):
    """Over a taskset the policy alternates seats by task index; the scripted seat yields no rollout for the
    orchestrator, and eval's per-metric means are the win rates per seat."""
    from prime_rl.eval.eval import summarize
    from prime_rl.orchestrator.results import episode_results

    monkeypatch.setenv(API_KEY_VAR, "sk-test")
    taskset = {"id": "nim", "num_tasks": 8, "max_sticks": 12, "seed": 3}
    episodes, _ = run(optimal, lambda env: list(env.taskset), taskset=taskset, opponent="optimal")
    records = []
    for episode in episodes:
        assert episode.ok, episode.errors
        (result,) = episode_results(episode, 0.0)  # one rollout: the policy's seat only
        seat = ("first", "second")[episode.task.data.idx % 2]
        assert result.seat == seat and result.samples == [] and result.error is None
        sticks = episode.task.data.sticks
        assert result.reward == float((sticks % 4 != 0) == (seat == "first"))  # optimal vs optimal: the theory
        records.append(
            {"seat": seat, "example_id": episode.task.data.idx, "error": None, "reward": result.reward}
            | {"metrics": result.metrics, "prompt_tokens": 0, "completion_tokens": 0, "seconds": 0.0}
        )
    summary = summarize(records, 1, 1.0)
    firsts = [r["reward"] for r in records if r["seat"] == "first"]
    seconds = [r["reward"] for r in records if r["seat"] == "second"]
    assert summary["metrics"]["win_as_first"] == pytest.approx(sum(firsts) / len(firsts))
    assert summary["metrics"]["win_as_second"] == pytest.approx(sum(seconds) / len(seconds))
    assert summary["seats"]["first"]["reward_mean"] == summary["metrics"]["win_as_first"]
