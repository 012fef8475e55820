"""sokoban: push every box onto a goal, one move per chat turn (a verifiers v1 taskset and its `Env`).

Levels are generated from `seed`, by reverse play from the solved position, so every level is solvable; the
breadth-first solver (`game.solve`) measures each level's optimal move count. `SokobanEnv` (a `grid_games.GridEnv`)
runs the game: the task's prompt shows the board, and after each reply the env answers as the player's user with
the new board, until the level is solved, `max_turns` replies were made, or `max_invalid` replies named no move.
The move parsing, the turn loop and the env's run are shared with `frozen_lake` (module `grid_games`).

Rewards are scored by replaying the trace's replies on the level (`Game.replay`, the same engine):
`solved` (weight 1.0) and `boxes_on_goals` (weight 0.5: the fraction of boxes on goals at the end, counted only
when the level is not solved). Metrics: `moves`, `invalid_moves`, `blocked_moves`, `optimal_moves`.

Exports (`__all__`): `SokobanTaskset` (taskset id `sokoban`) and `SokobanEnv`. No harness: the seat needs a
resumable chat harness (prime-rl gives it `prime-chat`; with `vf-eval`, pass `--env.agent.harness.id ...`).
"""

from __future__ import annotations

import verifiers.v1 as vf
from grid_games import GridConfig, GridData, GridEnv, board_rng, game_metrics, trace_replies
from pydantic import Field, model_validator

from sokoban.game import Game, Generated, Level, generate

SYSTEM_PROMPT = (
    "You are playing Sokoban on a grid. Push every box onto a goal square. Each turn, move the player one square "
    "up, down, left or right. Walking into a box pushes it one square in the same direction, if the square behind "
    "it is floor or a goal; you cannot pull a box, push two boxes at once, or walk through a wall.\n"
    "Legend: # wall, _ floor, . goal, $ box, * box on a goal, @ player, + player on a goal. Up is toward the top "
    "row.\n"
    "Reply with exactly one move: up, down, left or right (or U, D, L, R)."
)


# --- the taskset ------------------------------------------------------------------------------------------------


class SokobanData(GridData):
    level: list[str]
    """The starting position, one string per row (`game.Level.rows`)."""


def replayed(data: SokobanData, trace: vf.Trace) -> Game:
    """The game the trace's replies played on the task's level."""
    return Game.replay(Level.parse(data.level), trace_replies(trace), data.max_turns, data.max_invalid)


class SokobanTask(vf.Task[SokobanData]):
    @vf.reward
    async def solved(self, trace: vf.Trace) -> float:
        return float(replayed(self.data, trace).level.solved)

    @vf.reward(weight=0.5)
    async def boxes_on_goals(self, trace: vf.Trace) -> float:
        """Partial credit: the fraction of boxes on goals at the end of an unsolved game (0 once solved, so a
        solved level scores exactly 1)."""
        level = replayed(self.data, trace).level
        return 0.0 if level.solved else level.boxes_on_goals / len(level.boxes)

    @vf.metric
    async def game(self, trace: vf.Trace) -> dict[str, float]:
        return game_metrics(replayed(self.data, trace), self.data.optimal_moves)


class SokobanConfig(GridConfig):
    size: int = Field(7, ge=4, le=10)
    """Side of the square room, outer wall included (7: a 5 x 5 interior)."""
    boxes: int = Field(1, ge=1, le=3)
    """Boxes (and goals) per level (generation slows fast with more: 3 boxes in a size-9 room take ~1 s a level)."""
    max_turns: int = Field(30, ge=1)
    """Replies allowed per game; every level is solvable within this many moves."""

    @model_validator(mode="after")
    def _room_fits_boxes(self) -> SokobanConfig:
        interior = (self.size - 2) ** 2
        if 3 * self.boxes > interior:
            raise ValueError(f"boxes={self.boxes} do not fit a size={self.size} room (at most {interior // 3})")
        return self


def generate_level(config: SokobanConfig, index: int) -> Generated:
    return generate(board_rng("sokoban", config.seed, index), config.size, config.boxes, config.max_turns)


def new_task(
    level: Level, optimal_moves: int, max_turns: int, max_invalid: int, config: vf.TaskConfig | None = None
) -> SokobanTask:
    """A task that starts a game on `level` (`config`: the taskset's task config, if any)."""
    data = SokobanData.opening(Game(level, max_turns, max_invalid), optimal_moves, SYSTEM_PROMPT, level=level.rows)
    return SokobanTask(data, config)


class SokobanTaskset(vf.Taskset[SokobanTask, SokobanConfig]):
    def load(self):
        c = self.config
        for index in range(c.num_tasks):
            generated = generate_level(c, index)
            yield new_task(generated.level, len(generated.solution), c.max_turns, c.max_invalid, c.task)


# --- the env ----------------------------------------------------------------------------------------------------


class SokobanEnv(GridEnv):
    def new_game(self, task: SokobanTask) -> Game:
        return Game(Level.parse(task.data.level), task.data.max_turns, task.data.max_invalid)


__all__ = ["SokobanTaskset", "SokobanEnv"]
