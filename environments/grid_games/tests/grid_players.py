"""What the grid games' tests share: scripted players for the env_testkit chat server and the episode runner."""

import asyncio
from collections.abc import Callable

import env_testkit as kit
import verifiers.v1 as vf

# verifiers keeps some asyncio state bound to the loop that first used it: one loop for the grid games' tests.
LOOP = asyncio.new_event_loop()


def replies(*texts: str):
    """The n-th request (n - 1 assistant messages in it) gets texts[n - 1]."""

    def script(body: dict) -> dict:
        return {"content": texts[sum(m["role"] == "assistant" for m in body["messages"])]}

    return script


def solver_player(is_board: Callable[[str], bool], first_move: Callable[[list[str]], str]):
    """A player that reads the board in the last user message (the block `is_board` picks, spaces dropped) and
    plays `first_move` of its rows (the first move of an optimal solution)."""

    def script(body: dict) -> dict:
        text = body["messages"][-1]["content"]
        board = next(block for block in text.split("\n\n") if is_board(block))
        return {"content": first_move([line.replace(" ", "") for line in board.splitlines()])}

    return script


def run(taskset_id: str, api_key_var: str, script, tasks, agent: dict | None = None, **taskset_args):
    """Episodes of the taskset against `script` (env_testkit's scripted chat server); (episodes, requests)."""
    agent = {"harness": {"id": "env_testkit"}, **(agent or {})}
    config = {"taskset": {"id": taskset_id, **taskset_args}, "agent": agent}
    return LOOP.run_until_complete(kit.run_episodes(config, script, tasks, api_key_var=api_key_var))


def only_trace(episode: vf.Episode) -> vf.Trace:
    (trace,) = episode.traces
    assert episode.ok and not trace.has_error, (episode.errors, trace.errors)
    return trace
