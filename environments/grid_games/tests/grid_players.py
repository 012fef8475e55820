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


def assert_solved_optimally(
    episodes: list[vf.Episode], requests: list[dict], system_prompt: str, partial: str, **metrics
):
    """The solver player's episodes: each solved (reward 1; `partial`, the game's partial-credit reward, 0) in the
    optimal number of turns, with no invalid or blocked move (and the game's own `metrics`), ended by the env."""
    for episode in episodes:
        trace = only_trace(episode)
        optimal = episode.task.data.optimal_moves
        assert trace.reward == 1.0
        assert (trace.rewards["solved"].score, trace.rewards[partial].score) == (1.0, 0.0)
        assert len(trace.assistant_messages) == optimal
        assert trace.metrics == {
            "moves": optimal,
            "invalid_moves": 0.0,
            "blocked_moves": 0.0,
            **metrics,
            "optimal_moves": optimal,
        }
        assert trace.stop_condition == "user_closed"  # the env ended the game
    assert len(requests) == sum(e.task.data.optimal_moves for e in episodes)
    assert requests[0]["messages"][:2] == [
        {"role": "system", "content": system_prompt},
        {"role": "user", "content": episodes[0].task.data.prompt},
    ]
