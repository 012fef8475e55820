import grid_players as players
import pytest
import verifiers.v1 as vf
from pydantic import ValidationError
from sokoban import SYSTEM_PROMPT, SokobanConfig, SokobanEnv, SokobanTask, generate_level, new_task
from sokoban.game import Game, Level, render, solve

API_KEY_VAR = "SOKOBAN_TEST_API_KEY"

# Two boxes ($) left and right of the player (@), goals (.) top-left and far right.
TWO_BOXES = [
    "#######",
    "#.____#",
    "#_$@$.#",
    "#_____#",
    "#######",
]


def apply(level: Level, moves: list[str]) -> Level:
    for move in moves:
        level, outcome = level.step(move)
        assert outcome in ("moved", "pushed"), (move, outcome)
    return level


# --- rules ------------------------------------------------------------------------------------------------------


def test_level_text_round_trips_and_renders():
    level = Level.parse(TWO_BOXES)
    assert (level.player, level.boxes, level.goals) == ((2, 3), {(2, 2), (2, 4)}, {(1, 1), (2, 5)})
    assert level.rows == TWO_BOXES
    assert render(level).splitlines()[2] == "# _ $ @ $ . #"
    on_goals = Level.parse(["#####", "#+*_#", "#_$_#", "#####"])
    assert (on_goals.player, on_goals.boxes_on_goals, on_goals.solved) == ((1, 1), 1, False)
    assert on_goals.rows == ["#####", "#+*_#", "#_$_#", "#####"]


@pytest.mark.parametrize(
    "rows",
    [
        ["#####", "#@$.", "#####"],  # ragged
        ["#####", "_@$.#", "#####"],  # open border
        ["#####", "#@$_#", "#####"],  # a box without a goal
        ["#####", "#_$.#", "#####"],  # no player
        ["#####", "#@$x#", "#####"],  # unknown cell
    ],
)
def test_bad_levels_are_refused(rows):
    with pytest.raises(ValueError):
        Level.parse(rows)


def test_step_outcomes():
    level = Level.parse(TWO_BOXES)
    up, outcome = level.step("up")
    assert (outcome, up.player, up.boxes) == ("moved", (1, 3), level.boxes)
    assert up.step("up") == (up, "wall")
    pushed, outcome = level.step("right")
    assert (outcome, pushed.player, pushed.boxes) == ("pushed", (2, 4), {(2, 2), (2, 5)})
    assert pushed.boxes_on_goals == 1
    assert pushed.step("right") == (pushed, "blocked")  # a wall behind the box
    row = Level.parse(["#######", "#@$$..#", "#######"])
    assert row.step("right") == (row, "blocked")  # a box behind the box


def test_solve_is_optimal():
    # Worked by hand: 3 pushes (right box right; left box left, then up) + 3 walking moves: R, L, L, D, L, U.
    level = Level.parse(TWO_BOXES)
    solution = solve(level)
    assert len(solution) == 6 and apply(level, solution).solved
    assert solve(level, max_moves=5) is None
    assert solve(level, max_moves=6) == solution
    assert solve(Level.parse(["######", "#@_$.#", "######"])) == ["right", "right"]
    stuck = Level.parse(["######", "#$__.#", "#@___#", "######"])  # a box in a corner never moves
    assert solve(stuck) is None


def test_game_records_moves_and_ends():
    game = Game(Level.parse(TWO_BOXES), max_turns=4, max_invalid=3)
    assert game.play("up") == (
        "You moved up.\n\n"
        "# # # # # # #\n# . _ @ _ _ #\n# _ $ _ $ . #\n# _ _ _ _ _ #\n# # # # # # #\n\n"
        "Boxes on goals: 0 of 2. Turns left: 3."
    )
    assert game.play("up").startswith("You walked into a wall; nothing moved.\n\n# # #")
    assert game.play("what?").startswith("No move found in your reply. Reply with one move: up, down, left or right.")
    assert not game.over
    assert game.play("down").endswith("Turns left: 0.")
    assert game.over and (game.turns, game.moves, game.invalid, game.blocked) == (4, 3, 1, 1)
    with pytest.raises(ValueError):
        game.play("down")
    assert Game.replay(Level.parse(TWO_BOXES), ["x", "y", "z", "right"], 30, 3).invalid == 3  # ends at the 3rd
    solved = Game.replay(Level.parse(TWO_BOXES), ["R", "L", "L", "D", "L", "U", "up"], 30, 3)
    assert solved.level.solved and solved.turns == 6  # the reply after the win is not played


# --- generation -------------------------------------------------------------------------------------------------


def levels(**args) -> list[list[str]]:
    config = SokobanConfig(**args)
    return [generate_level(config, i).level.rows for i in range(config.num_tasks)]


def test_generation_is_deterministic_by_seed():
    assert levels(num_tasks=20, seed=5) == levels(num_tasks=20, seed=5)
    assert levels(num_tasks=20, seed=5) != levels(num_tasks=20, seed=6)
    assert levels(num_tasks=10, seed=5) == levels(num_tasks=20, seed=5)[:10]  # a level does not depend on others


@pytest.mark.parametrize(("size", "boxes", "count"), [(7, 1, 200), (5, 1, 100), (7, 2, 60), (8, 2, 30)])
def test_every_generated_level_is_solvable(size, boxes, count):
    config = SokobanConfig(num_tasks=count, seed=11, size=size, boxes=boxes)
    for i in range(count):
        generated = generate_level(config, i)
        level = generated.level
        assert (level.height, level.width, len(level.boxes), level.boxes_on_goals) == (size, size, boxes, 0)
        assert Level.parse(level.rows) == level
        assert apply(level, generated.witness).solved  # the construction's own solution
        assert apply(level, generated.solution).solved
        assert 1 <= len(generated.solution) <= min(len(generated.witness), config.max_turns)
        assert len(solve(level)) == len(generated.solution)  # optimal without the max_turns bound too


def test_config_errors_name_the_field():
    for args, field in [
        ({"size": 3}, "size"),
        ({"boxes": 0}, "boxes"),
        ({"boxes": 4}, "boxes"),
        ({"max_turns": 0}, "max_turns"),
    ]:
        with pytest.raises(ValidationError, match=field):
            SokobanConfig(**args)
    with pytest.raises(ValidationError, match="boxes=2 do not fit a size=4 room"):
        vf.resolve_env_config({"taskset": {"id": "sokoban", "size": 4, "boxes": 2}})
    with pytest.raises(ValueError, match="max_turns=1"):  # two pushes at least: no level fits one move
        generate_level(SokobanConfig(boxes=2, max_turns=1), 0)


def test_taskset_prompts_and_env():
    config = {"taskset": {"id": "sokoban", "num_tasks": 3, "seed": 2}, "agent": {"harness": {"id": "env_testkit"}}}
    env = vf.load_environment(vf.resolve_env_config(config))
    assert isinstance(env, SokobanEnv)
    tasks = list(env.taskset)
    assert len(tasks) == 3
    for task in tasks:
        level = Level.parse(task.data.level)
        assert task.data.system_prompt == SYSTEM_PROMPT
        assert task.data.prompt == f"{render(level)}\n\nBoxes on goals: 0 of 1. Turns left: 30. Your move?"
        assert task.data.optimal_moves == len(solve(level))
        assert (task.data.max_turns, task.data.max_invalid) == (30, 3)


# --- episodes through verifiers ---------------------------------------------------------------------------------


def first_optimal_move(rows: list[str]) -> str:
    return solve(Level.parse(rows))[0]


# Reads the board in the last user message and plays the first move of an optimal solution.
solver_player = players.solver_player(lambda block: block.startswith("#"), first_optimal_move)
replies = players.replies
only_trace = players.only_trace


def run(script, tasks, agent: dict | None = None, **taskset_args):
    return players.run("sokoban", API_KEY_VAR, script, tasks, agent, **taskset_args)


def make_task(rows: list[str], max_turns: int = 30, max_invalid: int = 3) -> SokobanTask:
    level = Level.parse(rows)
    return new_task(level, len(solve(level)), max_turns, max_invalid)


def test_solver_player_solves_every_level_in_the_optimal_number_of_turns(monkeypatch):
    monkeypatch.setenv(API_KEY_VAR, "sk-test")
    episodes, requests = run(solver_player, lambda env: list(env.taskset), num_tasks=6, seed=3, boxes=2)
    assert len(episodes) == 6
    players.assert_solved_optimally(episodes, requests, SYSTEM_PROMPT, "boxes_on_goals")


def test_walls_unreadable_replies_blocked_pushes_and_the_move_limit(monkeypatch):
    monkeypatch.setenv(API_KEY_VAR, "sk-test")
    script = replies("I think I will go up", "U", "hmm", "down", "right", "Right.")
    (episode,), requests = run(script, [make_task(TWO_BOXES, max_turns=6)])
    trace = only_trace(episode)
    assert len(requests) == 6  # the 6th reply hits the move limit: the game ends without another board
    assert [m.content for m in trace.messages if m.role == "user"] == [
        "# # # # # # #\n# . _ _ _ _ #\n# _ $ @ $ . #\n# _ _ _ _ _ #\n# # # # # # #\n\n"
        "Boxes on goals: 0 of 2. Turns left: 6. Your move?",
        "You moved up.\n\n# # # # # # #\n# . _ @ _ _ #\n# _ $ _ $ . #\n# _ _ _ _ _ #\n# # # # # # #\n\n"
        "Boxes on goals: 0 of 2. Turns left: 5.",
        "You walked into a wall; nothing moved.\n\n"
        "# # # # # # #\n# . _ @ _ _ #\n# _ $ _ $ . #\n# _ _ _ _ _ #\n# # # # # # #\n\n"
        "Boxes on goals: 0 of 2. Turns left: 4.",
        "No move found in your reply. Reply with one move: up, down, left or right.\n\n"
        "# # # # # # #\n# . _ @ _ _ #\n# _ $ _ $ . #\n# _ _ _ _ _ #\n# # # # # # #\n\n"
        "Boxes on goals: 0 of 2. Turns left: 3.",
        "You moved down.\n\n# # # # # # #\n# . _ _ _ _ #\n# _ $ @ $ . #\n# _ _ _ _ _ #\n# # # # # # #\n\n"
        "Boxes on goals: 0 of 2. Turns left: 2.",
        "You pushed a box right.\n\n# # # # # # #\n# . _ _ _ _ #\n# _ $ _ @ * #\n# _ _ _ _ _ #\n# # # # # # #\n\n"
        "Boxes on goals: 1 of 2. Turns left: 1.",
    ]
    # One of two boxes on a goal at the end: boxes_on_goals 0.5 at weight 0.5.
    assert (trace.rewards["solved"].score, trace.rewards["boxes_on_goals"].score) == (0.0, 0.5)
    assert trace.rewards["boxes_on_goals"].weight == 0.5
    assert trace.reward == 0.25
    assert trace.metrics == {"moves": 5.0, "invalid_moves": 1.0, "blocked_moves": 2.0, "optimal_moves": 6.0}


def test_unreadable_replies_end_the_game(monkeypatch):
    monkeypatch.setenv(API_KEY_VAR, "sk-test")
    (episode,), requests = run(replies("?", "no idea", "pass", "right"), [make_task(TWO_BOXES, max_invalid=3)])
    trace = only_trace(episode)
    assert len(requests) == 3
    assert trace.reward == 0.0
    assert trace.metrics == {"moves": 0.0, "invalid_moves": 3.0, "blocked_moves": 0.0, "optimal_moves": 6.0}


def test_solving_scores_one(monkeypatch):
    monkeypatch.setenv(API_KEY_VAR, "sk-test")
    (episode,), requests = run(replies("R", "L", "L", "D", "L", "U"), [make_task(TWO_BOXES)])
    trace = only_trace(episode)
    assert len(requests) == 6
    assert trace.reward == 1.0 and trace.rewards["solved"].score == 1.0
    assert trace.metrics["moves"] == 6.0


def test_a_seat_out_of_turns_ends_the_game(monkeypatch):
    """The seat's own `max_turns` (not the game's) stops it: the env ends the game on the terminated segment and
    the rewards score the replies made."""
    monkeypatch.setenv(API_KEY_VAR, "sk-test")
    (episode,), requests = run(replies("R", "L", "L", "D", "L", "U"), [make_task(TWO_BOXES)], agent={"max_turns": 2})
    (trace,) = episode.traces
    assert len(requests) == 2 and len(trace.assistant_messages) == 2
    assert trace.stop_condition == "max_turns"  # the seat's limit, not the env (`user_closed`), ended it
    assert (trace.rewards["solved"].score, trace.rewards["boxes_on_goals"].score) == (0.0, 0.5)
    assert trace.metrics["moves"] == 2.0
