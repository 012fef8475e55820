"""grid_games: what the grid-game environments (`sokoban`, `frozen_lake`) share on the verifiers side: the task
data and taskset config fields every game has, the game metrics, the env config (a local runtime for the player)
and the env's turn loop. The pure shared game code is `grid_games.game`.

Not a taskset: each game's own module is (taskset ids `sokoban` and `frozen-lake`). It adds its board field to
`GridData`, its board's knobs to `GridConfig`, and exports its `GridEnv` subclass, which only says how a task's game
starts (`new_game`).
"""

from __future__ import annotations

import random
from typing import Self

import verifiers.v1 as vf
from pydantic import Field

from grid_games.game import TurnGame


class GridData(vf.TaskData):
    """A grid game's task, besides its starting board (a field of each game's own: one string per row)."""

    optimal_moves: int
    """The length of a shortest solution."""
    max_turns: int
    """Replies allowed."""
    max_invalid: int
    """The game ends at this many replies without a move."""

    @classmethod
    def opening(cls, game: TurnGame, optimal_moves: int, system_prompt: str, **board: list[str]) -> Self:
        """The data of a task that starts `game`: its opening board is the prompt; `board` names the game's own
        board field (`level=...`, `lake=...`)."""
        return cls(
            prompt=game.opening_prompt(),
            system_prompt=system_prompt,
            optimal_moves=optimal_moves,
            max_turns=game.max_turns,
            max_invalid=game.max_invalid,
            **board,
        )


class GridConfig(vf.TasksetConfig):
    """The taskset fields every grid game has; each game adds its board's size and difficulty, and `max_turns`
    (its default depends on the board)."""

    num_tasks: int = Field(1000, ge=1)
    """Number of boards (levels, lakes) generated."""
    seed: int = 0
    """Generator seed: the same seed always yields the same boards."""
    max_invalid: int = Field(3, ge=1)
    """The game ends at this many replies that name no move."""


def board_rng(game: str, seed: int, index: int) -> random.Random:
    """Board `index`'s own generator (string seeds are hashed stably), so a board does not depend on the others."""
    return random.Random(f"{game}/{seed}/{index}")


def trace_replies(trace: vf.Trace) -> list[str | None]:
    """The player's replies in a trace, in order: what a game replays to score it."""
    return [message.content for message in trace.assistant_messages]


def game_metrics(game: TurnGame, optimal_moves: int) -> dict[str, float]:
    """The metrics every grid game reports of a replayed game."""
    return {
        "moves": float(game.moves),
        "invalid_moves": float(game.invalid),
        "blocked_moves": float(game.blocked),
        "optimal_moves": float(optimal_moves),
    }


class GridEnvConfig(vf.EnvConfig):
    # A tool-less chat loop runs locally by default (verifiers' default is a remote sandbox).
    agent: vf.AgentConfig = vf.AgentConfig(runtime=vf.SubprocessConfig())
    """The player (the policy). Its harness must be resumable: the env resumes it on each new board."""


class GridEnv(vf.Env[GridEnvConfig]):
    """The game engine: the task's prompt shows the opening board, and after each reply the env answers as the
    player's user with the new board, until the game is over or the seat stops (its own `max_turns`)."""

    def new_game(self, task: vf.Task) -> TurnGame:
        """The game the task starts (its board, `max_turns` and `max_invalid`)."""
        raise NotImplementedError

    async def run(self, task: vf.Task, agents: vf.Agents) -> None:
        game = self.new_game(task)
        async with agents.agent.interaction(task) as player:
            segment = await player.turn()  # the task's prompt (the opening board) speaks first
            while not segment.terminated:
                answer = game.play(segment.last_reply)
                if game.over:
                    break
                segment = await player.turn(answer)


__all__ = ["GridConfig", "GridData", "GridEnv", "GridEnvConfig", "board_rng", "game_metrics", "trace_replies"]
