"""grid_games: what the grid-game environments (`sokoban`, `frozen_lake`) share on the verifiers side: the env
config (a local runtime for the player) and the env's turn loop. The pure shared game code is `grid_games.game`.

Not a taskset: each game's own module is (taskset ids `sokoban` and `frozen-lake`), and exports its `GridEnv`
subclass, which only says how a task's game starts (`new_game`).
"""

from __future__ import annotations

import verifiers.v1 as vf

from grid_games.game import TurnGame


class GridEnvConfig(vf.EnvConfig):
    # A tool-less chat loop runs locally by default (verifiers' default is a remote sandbox).
    agent: vf.AgentConfig = vf.AgentConfig(runtime=vf.SubprocessConfig())
    """The player (the policy). Its harness must be resumable: the env resumes it on each new board."""


def trace_replies(trace: vf.Trace) -> list[str | None]:
    """The player's replies in a trace, in order: what a game replays to score it."""
    return [message.content for message in trace.assistant_messages]


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


__all__ = ["GridEnvConfig", "GridEnv", "trace_replies"]
