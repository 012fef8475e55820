"""frozen-lake: walk to the goal around the holes, one move per chat turn (a verifiers v1 taskset and its `Env`).

Lakes are generated from `seed`: a safe path from the start to the goal is carved first, then holes are placed
off it, so every lake is solvable; the breadth-first solver (`game.solve`) measures each lake's optimal move
count. Not slippery. `FrozenLakeEnv` (a `grid_games.GridEnv`) runs the game: the task's prompt shows the lake, and
after each reply the env answers as the player's user with the new lake, until the player reaches the goal, falls
into a hole, made `max_turns` replies, or made `max_invalid` replies naming no move. The move parsing, the turn
loop and the env's run are shared with `sokoban` (module `grid_games`).

Rewards are scored by replaying the trace's replies on the lake (`Game.replay`, the same engine): `solved`
(weight 1.0) and `progress` (weight 0.5: the share of the start's distance to the goal closed by the end of a game
that neither reached the goal nor fell in a hole; 0 otherwise). Metrics: `moves`, `invalid_moves`,
`blocked_moves`, `fell`, `optimal_moves`.

Exports (`__all__`): `FrozenLakeTaskset` (taskset id `frozen-lake`) and `FrozenLakeEnv`. No harness: the seat
needs a resumable chat harness (prime-rl gives it `prime-chat`; with `vf-eval`, pass `--env.agent.harness.id`).
"""

from __future__ import annotations

import verifiers.v1 as vf
from grid_games import GridConfig, GridData, GridEnv, board_rng, game_metrics, trace_replies
from pydantic import Field, model_validator

from frozen_lake.game import Game, Generated, Lake, distances, generate

SYSTEM_PROMPT = (
    "You are playing Frozen Lake on a grid. Walk from your square to the goal without falling into a hole. Each "
    "turn, move one square up, down, left or right; a move off the edge of the grid leaves you where you are. "
    "Stepping onto a hole ends the game.\n"
    "Legend: P you, F frozen ice (safe), H hole, G goal. Up is toward the top row.\n"
    "Reply with exactly one move: up, down, left or right (or U, D, L, R)."
)


def progress_credit(start: Lake, end: Lake) -> float:
    """Partial credit for a game that ended on the ice short of the goal: the share of the start's safe distance
    to the goal closed, (d_start - d_end) / d_start, at least 0. 0 for a win (scored by `solved`) or a hole."""
    if end.won or end.fell:
        return 0.0
    dist = distances(start)
    return max(0.0, (dist[start.player] - dist[end.player]) / dist[start.player])


# --- the taskset ------------------------------------------------------------------------------------------------


class FrozenLakeData(GridData):
    lake: list[str]
    """The starting position, one string per row (`game.Lake.rows`)."""


def replayed(data: FrozenLakeData, trace: vf.Trace) -> Game:
    """The game the trace's replies played on the task's lake."""
    return Game.replay(Lake.parse(data.lake), trace_replies(trace), data.max_turns, data.max_invalid)


class FrozenLakeTask(vf.Task[FrozenLakeData]):
    @vf.reward
    async def solved(self, trace: vf.Trace) -> float:
        return float(replayed(self.data, trace).lake.won)

    @vf.reward(weight=0.5)
    async def progress(self, trace: vf.Trace) -> float:
        return progress_credit(Lake.parse(self.data.lake), replayed(self.data, trace).lake)

    @vf.metric
    async def game(self, trace: vf.Trace) -> dict[str, float]:
        game = replayed(self.data, trace)
        return {**game_metrics(game, self.data.optimal_moves), "fell": float(game.lake.fell)}


class FrozenLakeConfig(GridConfig):
    size: int = Field(5, ge=3, le=12)
    """Side of the square lake."""
    hole_fraction: float = Field(0.3, ge=0.0, le=0.9)
    """Chance that a cell off the carved safe path is a hole (the difficulty)."""
    max_turns: int = Field(20, ge=1)
    """Replies allowed per game; at least 2 * (size - 1), so every lake is solvable within it."""

    @model_validator(mode="after")
    def _turns_fit_the_lake(self) -> FrozenLakeConfig:
        if self.max_turns < 2 * (self.size - 1):
            raise ValueError(
                f"max_turns={self.max_turns} is below 2 * (size - 1) = {2 * (self.size - 1)} moves, the longest "
                f"distance between a start and a goal on a size={self.size} lake"
            )
        return self


def generate_lake(config: FrozenLakeConfig, index: int) -> Generated:
    return generate(board_rng("frozen-lake", config.seed, index), config.size, config.hole_fraction, config.max_turns)


def new_task(
    lake: Lake, optimal_moves: int, max_turns: int, max_invalid: int, config: vf.TaskConfig | None = None
) -> FrozenLakeTask:
    """A task that starts a game on `lake` (`config`: the taskset's task config, if any)."""
    data = FrozenLakeData.opening(Game(lake, max_turns, max_invalid), optimal_moves, SYSTEM_PROMPT, lake=lake.rows)
    return FrozenLakeTask(data, config)


class FrozenLakeTaskset(vf.Taskset[FrozenLakeTask, FrozenLakeConfig]):
    def load(self):
        c = self.config
        for index in range(c.num_tasks):
            generated = generate_lake(c, index)
            yield new_task(generated.lake, len(generated.solution), c.max_turns, c.max_invalid, c.task)


# --- the env ----------------------------------------------------------------------------------------------------


class FrozenLakeEnv(GridEnv):
    def new_game(self, task: FrozenLakeTask) -> Game:
        return Game(Lake.parse(task.data.lake), task.data.max_turns, task.data.max_invalid)


__all__ = ["FrozenLakeTaskset", "FrozenLakeEnv"]
