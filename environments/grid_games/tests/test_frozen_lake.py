import grid_players as players
import pytest
import verifiers.v1 as vf
from frozen_lake import (
    SYSTEM_PROMPT,
    FrozenLakeConfig,
    FrozenLakeEnv,
    FrozenLakeTask,
    generate_lake,
    new_task,
    progress_credit,
)
from frozen_lake.game import Game, Lake, distances, render, solve
from pydantic import ValidationError

API_KEY_VAR = "FROZEN_LAKE_TEST_API_KEY"

# The player top-left, one hole in the middle, the goal bottom-right: 4 moves around the hole.
SMALL = ["PFF", "FHF", "FFG"]


def walk(lake: Lake, moves: list[str]) -> Lake:
    """Play moves that must all land on the ice or the goal (no hole, no bump)."""
    for move in moves:
        lake, outcome = lake.step(move)
        assert outcome in ("moved", "won"), (move, outcome)
    return lake


# --- rules ------------------------------------------------------------------------------------------------------


def test_lake_text_round_trips_and_renders():
    lake = Lake.parse(SMALL)
    assert (lake.size, lake.player, lake.goal, lake.holes) == (3, (0, 0), (2, 2), {(1, 1)})
    assert lake.rows == SMALL
    assert render(lake) == "P F F\nF H F\nF F G"
    for rows in (["PF", "FG", "FF"], ["PFF", "FHF", "FFF"], ["PFF", "PHF", "FFG"], ["PFF", "FXF", "FFG"]):
        with pytest.raises(ValueError):
            Lake.parse(rows)


def test_step_outcomes():
    lake = Lake.parse(SMALL)
    assert lake.step("up") == (lake, "edge")
    assert lake.step("left") == (lake, "edge")
    down, outcome = lake.step("down")
    assert (outcome, down.player) == ("moved", (1, 0))
    fell, outcome = down.step("right")
    assert (outcome, fell.player, fell.fell, fell.won) == ("fell", (1, 1), True, False)
    assert walk(lake, ["right", "right", "down", "down"]).won


def test_solver_and_distances():
    assert len(solve(Lake.parse(SMALL))) == 4
    # The only safe way from P to G goes up and around: 5 moves, though G is 3 moves away as the crow flies.
    detour = Lake.parse(["FFF", "PHF", "HHG"])
    assert solve(detour) == ["up", "right", "right", "down", "down"]
    assert distances(detour)[(1, 0)] == 5 and (1, 1) not in distances(detour)
    assert solve(Lake.parse(["PHF", "HFF", "FFG"])) is None  # walled in by holes


def test_progress_credit():
    detour = Lake.parse(["FFF", "PHF", "HHG"])
    up, _ = detour.step("up")
    assert progress_credit(detour, up) == pytest.approx(0.2)  # safe distance 5 -> 4: (5 - 4) / 5
    assert progress_credit(detour, walk(up, ["right", "right"])) == pytest.approx(0.6)  # 5 -> 2
    assert progress_credit(detour, detour) == 0.0
    start = Lake.parse(["FFF", "PHF", "FFG"])  # 3 moves along the bottom
    assert progress_credit(start, start.step("up")[0]) == 0.0  # 3 -> 4: further away, clipped at 0
    assert progress_credit(start, start.step("right")[0]) == 0.0  # in a hole
    assert progress_credit(start, walk(start, ["down", "right", "right"])) == 0.0  # won: scored by `solved`


def test_game_records_moves_and_ends():
    game = Game(Lake.parse(SMALL), max_turns=3, max_invalid=2)
    assert (
        game.play("up")
        == "You bumped into the edge of the lake; nothing moved.\n\nP F F\nF H F\nF F G\n\nTurns left: 2."
    )
    assert game.play("??") == (
        "No move found in your reply. Reply with one move: up, down, left or right.\n\nP F F\nF H F\nF F G\n\n"
        "Turns left: 1."
    )
    assert game.play("right") == "You moved right.\n\nF P F\nF H F\nF F G\n\nTurns left: 0."
    assert game.over and (game.turns, game.moves, game.invalid, game.blocked) == (3, 2, 1, 1)
    with pytest.raises(ValueError):
        game.play("right")
    assert Game.replay(Lake.parse(SMALL), ["?", "?", "down"], 20, 2).turns == 2  # ends at the 2nd unreadable
    fell = Game.replay(Lake.parse(SMALL), ["down", "right", "right"], 20, 3)
    assert fell.lake.fell and fell.turns == 2
    won = Game.replay(Lake.parse(SMALL), ["D", "D", "R", "R", "up"], 20, 3)
    assert won.lake.won and won.turns == 4


# --- generation -------------------------------------------------------------------------------------------------


def lakes(**args) -> list[list[str]]:
    config = FrozenLakeConfig(**args)
    return [generate_lake(config, i).lake.rows for i in range(config.num_tasks)]


def test_generation_is_deterministic_by_seed():
    assert lakes(num_tasks=30, seed=5) == lakes(num_tasks=30, seed=5)
    assert lakes(num_tasks=30, seed=5) != lakes(num_tasks=30, seed=6)
    assert lakes(num_tasks=10, seed=5) == lakes(num_tasks=30, seed=5)[:10]  # a lake does not depend on the others
    assert all("H" not in "".join(rows) for rows in lakes(num_tasks=30, hole_fraction=0.0))


@pytest.mark.parametrize(
    ("size", "hole_fraction", "max_turns"), [(5, 0.3, 20), (3, 0.5, 4), (8, 0.6, 14), (12, 0.9, 22), (6, 0.9, 10)]
)
def test_every_generated_lake_is_solvable(size, hole_fraction, max_turns):
    config = FrozenLakeConfig(num_tasks=150, seed=7, size=size, hole_fraction=hole_fraction, max_turns=max_turns)
    holes = 0
    for i in range(config.num_tasks):
        generated = generate_lake(config, i)
        lake = generated.lake
        assert Lake.parse(lake.rows) == lake and lake.size == size
        start, goal = lake.player, lake.goal
        assert abs(start[0] - goal[0]) + abs(start[1] - goal[1]) >= size - 1
        assert walk(lake, generated.witness).won  # the carved path
        assert walk(lake, generated.solution).won
        assert len(generated.solution) <= len(generated.witness) <= max_turns
        assert len(generated.solution) == distances(lake)[start]
        holes += len(lake.holes)
    assert holes > 0


def test_config_errors_name_the_field():
    for args, field in [
        ({"size": 2}, "size"),
        ({"hole_fraction": 1.0}, "hole_fraction"),
        ({"max_invalid": 0}, "max_invalid"),
        ({"num_tasks": 0}, "num_tasks"),
    ]:
        with pytest.raises(ValidationError, match=field):
            FrozenLakeConfig(**args)
    with pytest.raises(ValidationError, match=r"max_turns=7 is below 2 \* \(size - 1\) = 8"):
        vf.resolve_env_config({"taskset": {"id": "frozen-lake", "size": 5, "max_turns": 7}})


def test_taskset_prompts_and_env():
    config = {"taskset": {"id": "frozen-lake", "num_tasks": 3, "seed": 2}, "agent": {"harness": {"id": "env_testkit"}}}
    env = vf.load_environment(vf.resolve_env_config(config))
    assert isinstance(env, FrozenLakeEnv)
    tasks = list(env.taskset)
    assert len(tasks) == 3
    for task in tasks:
        lake = Lake.parse(task.data.lake)
        assert task.data.system_prompt == SYSTEM_PROMPT
        assert task.data.prompt == f"{render(lake)}\n\nTurns left: 20. Your move?"
        assert task.data.optimal_moves == len(solve(lake))
        assert (task.data.max_turns, task.data.max_invalid) == (20, 3)


# --- episodes through verifiers ---------------------------------------------------------------------------------


def first_optimal_move(rows: list[str]) -> str:
    return solve(Lake.parse(rows))[0]


# Reads the lake in the last user message and plays the first move of a shortest safe path.
solver_player = players.solver_player(lambda block: set(block) <= set("PFHG \n"), first_optimal_move)
replies = players.replies
only_trace = players.only_trace


def run(script, tasks, **taskset_args):
    return players.run("frozen-lake", API_KEY_VAR, script, tasks, **taskset_args)


def make_task(rows: list[str], max_turns: int = 20, max_invalid: int = 3) -> FrozenLakeTask:
    lake = Lake.parse(rows)
    return new_task(lake, len(solve(lake)), max_turns, max_invalid)


def test_solver_player_solves_every_lake_in_the_optimal_number_of_turns(monkeypatch):
    monkeypatch.setenv(API_KEY_VAR, "sk-test")
    episodes, requests = run(solver_player, lambda env: list(env.taskset), num_tasks=6, seed=3, hole_fraction=0.5)
    assert len(episodes) == 6
    players.assert_solved_optimally(episodes, requests, SYSTEM_PROMPT, "progress", fell=0.0)


def test_edge_unreadable_reply_and_a_hole(monkeypatch):
    monkeypatch.setenv(API_KEY_VAR, "sk-test")
    (episode,), requests = run(replies("left", "what?", "I go down", "right", "down"), [make_task(SMALL, 8)])
    trace = only_trace(episode)
    assert len(requests) == 4  # the 4th reply steps into the hole: the game ends without another board
    assert [m.content for m in trace.messages if m.role == "user"] == [
        "P F F\nF H F\nF F G\n\nTurns left: 8. Your move?",
        "You bumped into the edge of the lake; nothing moved.\n\nP F F\nF H F\nF F G\n\nTurns left: 7.",
        "No move found in your reply. Reply with one move: up, down, left or right.\n\nP F F\nF H F\nF F G\n\n"
        "Turns left: 6.",
        "You moved down.\n\nF F F\nP H F\nF F G\n\nTurns left: 5.",
    ]
    assert trace.reward == 0.0
    assert (trace.rewards["solved"].score, trace.rewards["progress"].score) == (0.0, 0.0)
    assert trace.metrics == {
        "moves": 3.0,
        "invalid_moves": 1.0,
        "blocked_moves": 1.0,
        "fell": 1.0,
        "optimal_moves": 4.0,
    }


def test_move_limit_gives_progress_credit(monkeypatch):
    monkeypatch.setenv(API_KEY_VAR, "sk-test")
    (episode,), requests = run(replies("right", "R", "down"), [make_task(SMALL, max_turns=2)])
    trace = only_trace(episode)
    assert len(requests) == 2
    # Safe distance to the goal 4 -> 2: progress (4 - 2) / 4 = 0.5 at weight 0.5.
    assert (trace.rewards["solved"].score, trace.rewards["progress"].score) == (0.0, 0.5)
    assert trace.rewards["progress"].weight == 0.5
    assert trace.reward == 0.25
    assert trace.metrics["moves"] == 2.0 and trace.metrics["fell"] == 0.0


def test_unreadable_replies_end_the_game(monkeypatch):
    monkeypatch.setenv(API_KEY_VAR, "sk-test")
    (episode,), requests = run(replies("?", "pass", "down"), [make_task(SMALL, max_invalid=2)])
    trace = only_trace(episode)
    assert len(requests) == 2
    assert trace.reward == 0.0
    assert trace.metrics == {
        "moves": 0.0,
        "invalid_moves": 2.0,
        "blocked_moves": 0.0,
        "fell": 0.0,
        "optimal_moves": 4.0,
    }


def test_reaching_the_goal_scores_one(monkeypatch):
    monkeypatch.setenv(API_KEY_VAR, "sk-test")
    (episode,), requests = run(replies("down", "down", "right", "right"), [make_task(SMALL)])
    trace = only_trace(episode)
    assert len(requests) == 4
    assert trace.reward == 1.0 and trace.rewards["solved"].score == 1.0
