import asyncio

import env_testkit as kit
import pytest
from tower_of_hanoi import (
    HanoiConfig,
    HanoiData,
    HanoiTask,
    HanoiTaskset,
    apply_moves,
    distance,
    format_moves,
    parse_moves,
    question,
    score,
    solve,
    system_prompt,
)

# verifiers keeps some asyncio state bound to the loop that first used it: one loop for this module.
LOOP = asyncio.new_event_loop()
API_KEY_VAR = "TOWER_OF_HANOI_TEST_API_KEY"

OPTIMAL_3 = "AC AB CB AC BA BC AC"  # 3 disks from A to C, worked by hand


def test_solver_hand_cases():
    assert solve(0, "A", "C", "B") == []
    assert format_moves(solve(1, "A", "C", "B")) == "AC"
    assert format_moves(solve(2, "A", "C", "B")) == "AB AC BC"
    assert format_moves(solve(3, "A", "C", "B")) == OPTIMAL_3
    assert format_moves(solve(2, "C", "A", "B")) == "CB CA BA"
    for n in range(1, 9):
        moves = solve(n, "B", "A", "C")
        assert len(moves) == 2**n - 1
        outcome = apply_moves(("B",) * n, moves, "ABC")
        assert not outcome.illegal and outcome.state == ("A",) * n


def test_simulator_stops_at_the_first_illegal_move():
    start = ("A", "A", "A")
    # disk 1 to C, disk 2 to B, then disk 2 (B) onto disk 1 (C): larger onto smaller
    outcome = apply_moves(start, [("A", "C"), ("A", "B"), ("B", "C"), ("A", "B")], "ABC")
    assert (outcome.state, outcome.legal, outcome.illegal) == (("C", "B", "A"), 2, True)
    assert apply_moves(start, [("B", "C")], "ABC").illegal  # from an empty peg
    assert apply_moves(start, [("A", "A")], "ABC").illegal  # to the same peg
    assert apply_moves(start, [("A", "D")], "ABC").illegal  # unknown peg
    outcome = apply_moves(start, [("A", "C"), ("A", "B")], "ABC")
    assert (outcome.state, outcome.legal, outcome.illegal) == (("C", "B", "A"), 2, False)


def test_distance_hand_cases():
    assert distance(("C", "C", "C"), "C", "ABC") == 0
    assert distance(("A", "A", "A"), "C", "ABC") == 7
    assert distance(("A",) * 5, "B", "ABC") == 31
    # disk 3 on C already; disks 1-2 on B need 3 more moves
    assert distance(("B", "B", "C"), "C", "ABC") == 3
    # disk 3 on C; disk 2 on B: disk 1 (A) is on the spare, so disk 2 moves once, then disk 1: 2 moves
    assert distance(("A", "B", "C"), "C", "ABC") == 2
    # disks 1-2 on C, disk 3 on A: stack 1-2 on B (3 moves), disk 3 to C (1), 1-2 onto it (3)
    assert distance(("C", "C", "A"), "C", "ABC") == 7
    # every state of the optimal path is one move closer than the one before
    state, moves = ("A",) * 4, solve(4, "A", "C", "B")
    for i in range(len(moves) + 1):
        reached = apply_moves(state, moves[:i], "ABC").state
        assert distance(reached, "C", "ABC") == 15 - i


@pytest.mark.parametrize(
    ("reply", "moves"),
    [
        ("AB AC BC", [("A", "B"), ("A", "C"), ("B", "C")]),
        ("  AB,AC, BC\n", [("A", "B"), ("A", "C"), ("B", "C")]),
        ("A->B\nA->C", [("A", "B"), ("A", "C")]),
        ("AA", [("A", "A")]),  # parsable; illegal when played
        ("", None),
        ("AB then AC", None),
        ("AD", None),  # D is not a peg of the puzzle
        ("ab", None),  # case matters
        ("ABC", None),
    ],
)
def test_parse_moves(reply, moves):
    assert parse_moves(reply, "ABC") == moves


def test_score_hand_worked():
    assert score(OPTIMAL_3, 3, "A", "C", "ABC") == 1.0
    assert score("AC", 1, "A", "C", "ABC") == 1.0
    # legal detour via B: 3 + 3 moves for 2 disks -> 3 / 6
    assert score("AC AB CB BA BC AC", 2, "A", "C", "ABC") == 0.5
    # legal, 9 moves: an extra BC CB pair (disk 1 there and back) after the third move -> 7 / 9
    assert score("AC AB CB BC CB AC BA BC AC", 3, "A", "C", "ABC") == pytest.approx(7 / 9)
    # 5 optimal moves then an illegal CA (disk 3 onto disk 1): from (A, B, C) 2 moves remain -> 0.5 * (7 - 2) / 7
    assert score("AC AB CB AC BA CA", 3, "A", "C", "ABC") == pytest.approx(0.5 * 5 / 7)
    # legal but stops short: the first 4 optimal moves leave 3 -> 0.5 * 4 / 7
    assert score("AC AB CB AC", 3, "A", "C", "ABC") == pytest.approx(0.5 * 4 / 7)
    # the illegal move comes first: no progress
    assert score("CA AC", 3, "A", "C", "ABC") == 0.0
    # the whole tower moved to the wrong peg (C, not B): still 3 moves from the goal
    assert score("AB AC BC", 2, "A", "B", "ABC") == 0.0
    assert score("", 3, "A", "C", "ABC") == 0.0
    assert score("AC AB and so on", 3, "A", "C", "ABC") == 0.0


def tasks(**args):
    return list(HanoiTaskset(HanoiConfig(**args)))


def test_generation_is_deterministic_and_configurable():
    first = tasks(num_tasks=40, seed=3, min_disks=1, max_disks=4)
    again = tasks(num_tasks=40, seed=3, min_disks=1, max_disks=4)
    other = tasks(num_tasks=40, seed=4, min_disks=1, max_disks=4)
    assert [t.data for t in first] == [t.data for t in again]
    assert [t.data for t in first] != [t.data for t in other]
    for i, task in enumerate(first):
        d = task.data
        assert d.idx == i and 1 <= d.n <= 4 and d.pegs == "ABC"
        assert d.start != d.target and {d.start, d.target} <= set("ABC")
        assert d.prompt == question(d.n, d.start, d.target) and d.system_prompt == system_prompt("ABC")
        assert score(d.answer, d.n, d.start, d.target, d.pegs) == 1.0
        assert len(d.answer.split()) == 2**d.n - 1
    assert {t.data.n for t in first} == {1, 2, 3, 4}
    assert len({(t.data.start, t.data.target) for t in first}) == 6
    fixed = tasks(num_tasks=10, min_disks=5, max_disks=5, pegs="LMR", random_pegs=False)
    assert all((t.data.n, t.data.start, t.data.target) == (5, "L", "R") for t in fixed)
    assert fixed[0].data.prompt == "Move 5 disks from peg L to peg R."
    assert fixed[0].data.answer.split()[0] == "LR"  # odd n: the smallest disk goes straight to the target
    assert question(1, "B", "A") == "Move 1 disk from peg B to peg A."


def test_config_errors():
    with pytest.raises(ValueError, match="max_disks"):
        HanoiConfig(min_disks=4, max_disks=3)
    with pytest.raises(ValueError):
        HanoiConfig(min_disks=0)
    with pytest.raises(ValueError):
        HanoiConfig(max_disks=13)
    for pegs in ["AB", "ABCD", "AAB", "A-B"]:
        with pytest.raises(ValueError, match="pegs"):
            HanoiConfig(pegs=pegs)


async def run_episodes(script, task_list, **taskset_args):
    config = {
        "taskset": {"id": "tower-of-hanoi", **taskset_args},
        "agent": {"harness": {"id": "env_testkit"}, "runtime": {"type": "subprocess"}},
    }
    return await kit.run_episodes(config, script, task_list, api_key_var=API_KEY_VAR, max_tokens=64)


def solver_script(body: dict) -> dict:
    """Reads the disks and pegs from the question and answers with the optimal solution."""
    words = body["messages"][-1]["content"].rstrip(".").split()
    n, start, target = int(words[1]), words[-4], words[-1]
    (spare,) = set("ABC") - {start, target}
    return {"content": format_moves(solve(n, start, target, spare)) + "\n"}


def test_episode_optimal_solutions(monkeypatch):
    monkeypatch.setenv(API_KEY_VAR, "sk-test")
    episodes, requests = LOOP.run_until_complete(
        run_episodes(solver_script, lambda env: list(env.taskset.take(4)), num_tasks=4, max_disks=3)
    )
    assert len(episodes) == 4 and len(requests) == 4
    for episode, request in zip(episodes, requests, strict=True):
        assert episode.ok, episode.errors
        (trace,) = episode.traces
        assert not trace.has_error, trace.errors
        assert trace.rewards["solution"].score == 1.0 and trace.reward == 1.0
        assert trace.metrics == {"parsed": 1.0, "solved": 1.0, "optimal": 1.0}
        assert request["messages"][0] == {"role": "system", "content": system_prompt("ABC")}


def test_episode_partial_credit(monkeypatch):
    monkeypatch.setenv(API_KEY_VAR, "sk-test")
    data = HanoiData(
        prompt=question(2, "A", "C"),
        system_prompt=system_prompt("ABC"),
        n=2,
        pegs="ABC",
        start="A",
        target="C",
        answer="AB AC BC",
    )
    task = HanoiTask(data)
    replies = iter(["AC AB CB BA BC AC", "AB BA", "AB CA", "move the disks"])
    episodes, _ = LOOP.run_until_complete(
        run_episodes(lambda body: {"content": next(replies)}, [task] * 4, num_tasks=1)
    )
    detour, back_and_forth, illegal, unparsable = (episode.traces[0] for episode in episodes)
    assert (detour.reward, detour.metrics) == (0.5, {"parsed": 1.0, "solved": 1.0, "optimal": 0.0})
    # legal, back at the start: 3 moves still needed of 3
    assert (back_and_forth.reward, back_and_forth.metrics) == (0.0, {"parsed": 1.0, "solved": 0.0, "optimal": 0.0})
    # AB is the optimal first move (2 left), then CA moves from an empty peg: 0.5 * (3 - 2) / 3
    assert illegal.reward == pytest.approx(1 / 6)
    assert illegal.metrics == {"parsed": 1.0, "solved": 0.0, "optimal": 0.0}
    assert (unparsable.reward, unparsable.metrics) == (0.0, {"parsed": 0.0, "solved": 0.0, "optimal": 0.0})
