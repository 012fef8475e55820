"""nim: two seats of one policy play Nim against each other (a verifiers v1 multi-agent `Env`).

A pile of `sticks`; the seats `first` and `second` alternate, each taking 1 to `max_take` sticks; whoever takes
the last stick wins. A move is the last integer of the seat's reply; a reply without one, or with one below 1,
above `max_take` or above the sticks left, is an invalid move and forfeits the game (the opponent wins). A seat
whose run ends without replying (a turn or token limit, a failed model call) forfeits the same way.

`NimEnv.run` is the referee: it opens one `interaction` per seat, tells the seat to move the pile size and the
opponent's last move, applies the reply, and writes the game record to both traces' `info["nim"]`.
`NimEnv.finalize` scores it on each seat's trace (found by `trace.agent.name`): reward `win` 1.0 for the winner,
0.0 for the loser (0.5 each for a game stopped by the env's `max_moves` cap, where nobody took the last stick);
metrics `moves` (valid moves made in the game) and `forfeited` (this seat forfeited). Both seats stay trainable:
self-play of one policy. The game can end before the second seat moves (the first takes a whole pile of at most
`max_take` sticks, or forfeits its first move); the second seat's trace then has no model call, and its reward.

With the env arg `opponent` ("random" or "optimal") the policy plays one seat (`policy_seat`: "first", "second",
or "alternate" by task index) and a scripted player the other, in this process with no model call. The scripted
seat has no interaction, so the episode holds only the policy's trace (nothing of the scripted seat to train on);
it adds the metric `win_as_<seat>`, so an eval's per-metric averages are the win rate per seat.

Exports (`__all__`): `NimTaskset` (taskset id `nim`), `NimEnv` (the taskset's env), and `NimHarness`, the
in-process chat harness both seats use unless a role pins another (harness id `nim`).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
from dataclasses import dataclass, field
from typing import Literal

import aiohttp
import verifiers.v1 as vf
from pydantic import Field
from verifiers.v1.dialects.chat import message_to_wire

SEATS = ("first", "second")
"""The roles, in playing order (the `NimEnvConfig` fields, and each trace's `agent.name`)."""

_INTEGER = re.compile(r"[-+]?\d+")


def other(seat: str) -> str:
    return SEATS[1 - SEATS.index(seat)]


def parse_move(reply: str | None) -> int | None:
    """The last integer in the reply (sign included), or None."""
    matches = _INTEGER.findall(reply or "")
    return int(matches[-1]) if matches else None


def legal_move(reply: str | None, left: int, max_take: int) -> int | None:
    """The sticks the reply takes, or None when it is not a legal move (no integer, < 1, > max_take, > left)."""
    take = parse_move(reply)
    if take is None or take < 1 or take > max_take or take > left:
        return None
    return take


def _sticks(n: int) -> str:
    return f"{n} stick" if n == 1 else f"{n} sticks"


def rules(max_take: int) -> str:
    """The system prompt of both seats."""
    return (
        f"You are playing Nim. Two players take turns removing sticks from one pile. On your turn you take 1 to "
        f"{max_take} sticks, never more than are left. Whoever takes the last stick wins. An invalid move loses."
    )


def turn_message(left: int, max_take: int, opponent_took: int | None = None) -> str:
    """What the seat to move is told: the opponent's last move (if any), the pile, the legal range."""
    upper = min(max_take, left)
    parts = [f"Your opponent took {_sticks(opponent_took)}."] if opponent_took is not None else []
    parts.append(f"The pile has {_sticks(left)}.")
    parts.append("Take 1." if upper == 1 else f"Take 1 to {upper}.")
    parts.append("Reply with a single number.")
    return " ".join(parts)


@dataclass
class NimGame:
    """One game's state. `play(reply)` applies the reply of the seat to move (`to_move`)."""

    sticks: int
    max_take: int
    left: int = field(init=False)
    moves: list[dict] = field(default_factory=list)
    """One entry per reply played: `seat`, `reply` (None: no reply), `take` (None: invalid), `left` after it."""
    winner: str | None = None
    forfeited: str | None = None
    """The seat that lost by an invalid move or no reply, if any."""

    def __post_init__(self) -> None:
        if self.sticks < 1 or self.max_take < 1:
            raise ValueError(f"a game needs sticks >= 1 and max_take >= 1 (got {self.sticks}, {self.max_take})")
        self.left = self.sticks

    @property
    def to_move(self) -> str:
        return SEATS[len(self.moves) % 2]

    @property
    def over(self) -> bool:
        return self.winner is not None

    @property
    def valid_moves(self) -> int:
        return sum(move["take"] is not None for move in self.moves)

    @property
    def last_take(self) -> int | None:
        """The sticks taken by the last move, None before the first."""
        return self.moves[-1]["take"] if self.moves else None

    def play(self, reply: str | None) -> int | None:
        """Apply the reply of the seat to move: the sticks it took, or None for a forfeit (which ends the game)."""
        if self.over:
            raise ValueError("the game is over")
        seat = self.to_move
        take = legal_move(reply, self.left, self.max_take)
        if take is None:
            self.forfeited, self.winner = seat, other(seat)
        else:
            self.left -= take
            if self.left == 0:
                self.winner = seat
        self.moves.append({"seat": seat, "reply": reply, "take": take, "left": self.left})
        return take

    def record(self) -> dict:
        return {
            "sticks": self.sticks,
            "max_take": self.max_take,
            "moves": [dict(move) for move in self.moves],
            "winner": self.winner,
            "forfeited": self.forfeited,
        }


def random_move(left: int, max_take: int, rng: random.Random) -> int:
    """A uniformly random legal move."""
    return rng.randint(1, min(max_take, left))


def optimal_move(left: int, max_take: int, rng: random.Random) -> int:
    """Leave the opponent a multiple of max_take + 1 (a lost position) when possible. From a lost position every
    move loses against perfect play; a random legal one (not always 1) makes the policy show it knows the winning
    reply to each of them, instead of learning one fixed line of play."""
    return left % (max_take + 1) or random_move(left, max_take, rng)


OPPONENTS = {"random": random_move, "optimal": optimal_move}
"""The scripted players: (sticks left, max_take, rng) -> a legal move."""


def policy_seat_of(policy_seat: str, idx: int | None) -> str:
    """The seat the policy plays: "first", "second", or by task index for "alternate" (even: first)."""
    if policy_seat == "alternate":
        return SEATS[(idx or 0) % 2]
    return policy_seat


def seat_reward(record: dict, seat: str) -> float:
    """1.0 for the winner, 0.0 for the loser, 0.5 each when nobody won (the game was stopped by the move cap)."""
    if record["winner"] is None:
        return 0.5
    return float(record["winner"] == seat)


# --- the taskset ------------------------------------------------------------------------------------------------


class NimData(vf.TaskData):
    sticks: int
    """The starting pile."""
    max_take: int
    """A move takes 1 to max_take sticks."""


class NimTask(vf.Task[NimData]):
    """No per-trace rewards: who won is a fact about both seats, scored by `NimEnv.finalize`."""


class NimConfig(vf.TasksetConfig):
    num_tasks: int = Field(1000, ge=1)
    """Number of tasks generated."""
    seed: int = 0
    """Generator seed: the same seed always yields the same tasks."""
    max_sticks: int = Field(12, ge=1)
    """The starting pile is drawn uniformly from [1, max_sticks]."""
    max_take: int = Field(3, ge=1)
    """A move takes 1 to max_take sticks."""


def generate(config: NimConfig) -> list[int]:
    """The starting piles, deterministic in `config.seed`."""
    rng = random.Random(config.seed)
    return [rng.randint(1, config.max_sticks) for _ in range(config.num_tasks)]


class NimTaskset(vf.Taskset[NimTask, NimConfig]):
    def load(self):
        c = self.config
        for sticks in generate(c):
            data = NimData(
                prompt=turn_message(sticks, c.max_take),  # what the first seat is told first (the env sends it)
                system_prompt=rules(c.max_take),
                sticks=sticks,
                max_take=c.max_take,
            )
            yield NimTask(data, c.task)


# --- the env ----------------------------------------------------------------------------------------------------


class NimEnvConfig(vf.EnvConfig):
    # Each seat is a tool-less chat loop, so it runs locally by default (verifiers' default is a remote sandbox).
    first: vf.AgentConfig = vf.AgentConfig(runtime=vf.SubprocessConfig())
    """The seat that moves first."""
    second: vf.AgentConfig = vf.AgentConfig(runtime=vf.SubprocessConfig())
    """The seat that moves second."""
    max_moves: int | None = Field(None, ge=1)
    """Stop the game after this many moves (None: play to the end, at most `sticks` moves); a stopped game has
    no winner and scores 0.5 for each seat."""
    opponent: Literal["random", "optimal"] | None = None
    """None: self-play (both seats are the policy). "random": the other seat is a scripted player taking a uniformly
    random legal move; "optimal": one playing perfectly (`optimal_move`). The scripted seat has no trace."""
    policy_seat: Literal["first", "second", "alternate"] = "alternate"
    """With an `opponent`: the policy's seat; "alternate" plays first on even task indices and second on odd ones,
    so an eval over many tasks measures both seats (and all rollouts of one task share a seat)."""


class NimEnv(vf.Env[NimEnvConfig]):
    async def start(self) -> None:
        _acquire_http()

    async def stop(self) -> None:
        await _release_http()

    async def run(self, task: NimTask, agents: vf.Agents) -> None:
        game = NimGame(task.data.sticks, task.data.max_take)
        # The seats are prompt-less: the env, as each seat's user, speaks every turn, the opening one included.
        seat_task = type(task)(task.data.model_copy(update={"prompt": None}), task.config)
        cap, opponent = self.config.max_moves, self.config.opponent
        policy_seats = SEATS if opponent is None else (policy_seat_of(self.config.policy_seat, task.data.idx),)
        scripted, rng = OPPONENTS.get(opponent), random.Random()
        async with contextlib.AsyncExitStack() as stack:
            # The policy's interactions open up front, so each policy seat has a trace even if the game ends before
            # it moves; a scripted seat moves here, with no interaction.
            seats = {
                seat: await stack.enter_async_context(getattr(agents, seat).interaction(seat_task))
                for seat in policy_seats
            }
            while not game.over and (cap is None or len(game.moves) < cap):
                if game.to_move not in seats:
                    game.play(str(scripted(game.left, game.max_take, rng)))
                    continue
                segment = await seats[game.to_move].turn(turn_message(game.left, game.max_take, game.last_take))
                game.play(None if segment.terminated else segment.last_reply)
            against = {} if opponent is None else {"opponent": opponent, "policy_seat": policy_seats[0]}
            for interaction in seats.values():
                interaction.trace.info["nim"] = game.record() | against

    async def finalize(self, task: NimTask, episode: vf.Episode) -> None:
        opponent = self.config.opponent
        seats = SEATS if opponent is None else (policy_seat_of(self.config.policy_seat, task.data.idx),)
        by_seat = episode.by_agent
        if sorted(by_seat) != sorted(seats) or any(len(traces) != 1 for traces in by_seat.values()):
            found = {name: len(traces) for name, traces in by_seat.items()}
            raise ValueError(f"nim needs exactly one trace per policy seat {list(seats)}; got {found}")
        records = [by_seat[seat][0].info.get("nim") for seat in seats]
        if records[0] is None or any(record != records[0] for record in records):
            raise ValueError("the seats' traces do not carry the same game record (info['nim'])")
        record = records[0]
        moves = float(sum(move["take"] is not None for move in record["moves"]))
        for seat in seats:
            trace = by_seat[seat][0]
            win = seat_reward(record, seat)
            trace.record_reward("win", win)
            trace.record_metrics({"moves": moves, "forfeited": float(record["forfeited"] == seat)})
            if opponent is not None:
                # Only on the episodes where the policy held this seat: averaged over the traces carrying it (as eval
                # and the orchestrator average metrics), `win_as_first` is the win rate as the first seat.
                trace.record_metric(f"win_as_{seat}", win)


# --- the harness ------------------------------------------------------------------------------------------------

# One aiohttp pool per event loop, shared by every seat's model calls: building a client per call costs
# milliseconds, and aiohttp's pool stays cheap with hundreds of connections in flight. Envs count their users
# (`start`/`stop`), so the last env leaving a loop closes its pool.
_sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}
_users: dict[asyncio.AbstractEventLoop, int] = {}


def http_session() -> aiohttp.ClientSession:
    loop = asyncio.get_running_loop()
    session = _sessions.get(loop)
    if session is None or session.closed:
        for old in [old for old in _sessions if old.is_closed()]:
            del _sessions[old]
        # The endpoint is verifiers' local interception server: no proxies, no pool cap, no total timeout (the
        # rollout's own deadline bounds a turn).
        session = _sessions[loop] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=30.0),
        )
    return session


def _acquire_http() -> None:
    loop = asyncio.get_running_loop()
    _users[loop] = _users.get(loop, 0) + 1


async def _release_http() -> None:
    loop = asyncio.get_running_loop()
    _users[loop] = _users.get(loop, 1) - 1
    if _users[loop] <= 0:
        del _users[loop]
        session = _sessions.pop(loop, None)
        if session is not None:
            await session.close()


def chat_messages(system: str | None, prompt) -> list[dict]:
    messages = [{"role": "system", "content": system}] if system else []
    if isinstance(prompt, str):
        return messages + [{"role": "user", "content": prompt}]
    return messages + [m if isinstance(m, dict) else message_to_wire(m) for m in prompt or []]


class NimHarness(vf.Harness[vf.HarnessConfig]):
    """One chat completion per segment, made in this process (no subprocess, no `uv`). A seat's later turns
    relaunch it on the conversation so far (verifiers' default resume), so it plays any number of moves."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, *args, **kwargs):
        system, prompt = self.resolve_prompt(data)
        body = {"model": ctx.model, "messages": chat_messages(system, prompt)}
        url = f"{endpoint.rstrip('/')}/chat/completions"
        async with http_session().post(url, json=body, headers={"Authorization": f"Bearer {secret}"}) as response:
            text = await response.text()  # read in full, so the connection goes back to the pool
        if response.status == 200:
            return vf.ProgramResult(0, "", "")
        # The interception server records the real cause (a stop condition or provider error) on the trace.
        return vf.ProgramResult(1, "", f"chat completion failed: HTTP {response.status}: {text[:2000]}")


__all__ = ["NimTaskset", "NimEnv", "NimHarness"]
