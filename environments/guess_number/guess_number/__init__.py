"""guess-number: find a secret integer in [1, N] with "higher" / "lower" feedback, over several chat turns.

The game loop is the exported in-process harness `GuessNumberHarness` (harness id `guess-number`, the taskset's
default): it asks the model for a guess through the interception endpoint, answers with feedback computed from
the task data, and repeats until the guess is correct or `max_turns` guesses were made.

A guess is the last integer in the reply. Rewards (computed from the trace's assistant messages):
`solved` (weight 1.0) and `efficiency` (weight 0.2, `(max_turns - k + 1) / max_turns` when solved on guess k).
Metrics: `num_guesses`, `invalid_guesses`.
"""

from __future__ import annotations

import asyncio
import random
import re

import httpx
import verifiers.v1 as vf
from pydantic import Field
from verifiers.v1.dialects.chat import message_to_wire

SYSTEM_PROMPT = "Play a number guessing game. Reply with a single whole number."

_INTEGER = re.compile(r"[-+]?\d+")


def parse_guess(reply: str | None) -> int | None:
    """The last integer in the reply, or None."""
    matches = _INTEGER.findall(reply or "")
    return int(matches[-1]) if matches else None


def feedback(reply: str | None, target: int, max_number: int) -> tuple[str, bool]:
    """The environment's answer to one reply, and whether the game is won."""
    guess = parse_guess(reply)
    if guess is None:
        return f"Answer with a single whole number from 1 to {max_number}.", False
    if guess < target:
        return "higher", False
    if guess > target:
        return "lower", False
    return "correct", True


def game_prompt(max_number: int, max_turns: int) -> str:
    return f"Guess my number from 1 to {max_number}. You have {max_turns} guesses."


class GuessNumberData(vf.TaskData):
    target: int
    """The secret number."""
    max_number: int
    """The secret is in [1, max_number]."""
    max_turns: int
    """Guesses allowed."""


def guesses(trace: vf.Trace, max_turns: int) -> list[int | None]:
    """The guesses the model made, in order (None for a reply without a number), at most `max_turns`."""
    return [parse_guess(m.content) for m in trace.assistant_messages[:max_turns]]


def solved_on(made: list[int | None], target: int) -> int | None:
    """1-based number of the first correct guess, or None."""
    return next((i + 1 for i, guess in enumerate(made) if guess == target), None)


class GuessNumberTask(vf.Task[GuessNumberData]):
    @vf.reward
    async def solved(self, trace: vf.Trace) -> float:
        return float(solved_on(guesses(trace, self.data.max_turns), self.data.target) is not None)

    @vf.reward(weight=0.2)
    async def efficiency(self, trace: vf.Trace) -> float:
        k = solved_on(guesses(trace, self.data.max_turns), self.data.target)
        return 0.0 if k is None else (self.data.max_turns - k + 1) / self.data.max_turns

    @vf.metric
    async def num_guesses(self, trace: vf.Trace) -> float:
        made = guesses(trace, self.data.max_turns)
        return float(solved_on(made, self.data.target) or len(made))

    @vf.metric
    async def invalid_guesses(self, trace: vf.Trace) -> float:
        made = guesses(trace, self.data.max_turns)
        k = solved_on(made, self.data.target) or len(made)
        return float(sum(guess is None for guess in made[:k]))


class GuessNumberConfig(vf.TasksetConfig):
    num_tasks: int = Field(1000, ge=1)
    """Number of tasks generated."""
    seed: int = 0
    """Generator seed: the same seed always yields the same tasks."""
    max_number: int = Field(32, ge=1)
    """The secret is drawn uniformly from [1, max_number]."""
    max_turns: int = Field(4, ge=1)
    """Guesses allowed per game."""


def generate(config: GuessNumberConfig) -> list[int]:
    """The secret numbers, deterministic in `config.seed`."""
    rng = random.Random(config.seed)
    return [rng.randint(1, config.max_number) for _ in range(config.num_tasks)]


class GuessNumberTaskset(vf.Taskset[GuessNumberTask, GuessNumberConfig]):
    def load(self):
        c = self.config
        for target in generate(c):
            data = GuessNumberData(
                prompt=game_prompt(c.max_number, c.max_turns),
                system_prompt=SYSTEM_PROMPT,
                target=target,
                max_number=c.max_number,
                max_turns=c.max_turns,
            )
            yield GuessNumberTask(data, c.task)


# --- the harness ------------------------------------------------------------------------------------------------

_HTTP_CLIENTS: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}


def http_client() -> httpx.AsyncClient:
    """One shared client per event loop, created on first use and never closed by a rollout (creating one per
    rollout costs ~20 ms of TLS-context setup, and closing a shared one breaks its siblings)."""
    loop = asyncio.get_running_loop()
    client = _HTTP_CLIENTS.get(loop)
    if client is None:
        for old in [old for old in _HTTP_CLIENTS if old.is_closed()]:
            del _HTTP_CLIENTS[old]
        # The endpoint is verifiers' local interception server: no proxies, no read timeout (the rollout's own
        # deadline bounds a turn), no pool cap (one connection per rollout in flight).
        client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=30.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=1024),
            trust_env=False,
        )
        _HTTP_CLIENTS[loop] = client
    return client


async def chat_completion(endpoint: str, secret: str, body: dict) -> dict:
    """POST `{endpoint}/chat/completions` and return `choices[0]` of the response."""
    response = await http_client().post(
        f"{endpoint.rstrip('/')}/chat/completions", json=body, headers={"Authorization": f"Bearer {secret}"}
    )
    if response.status_code != 200:
        # The interception server records the real cause (a stop condition or provider error) on the trace.
        raise RuntimeError(f"chat completion failed: HTTP {response.status_code}: {response.text[:500]}")
    return response.json()["choices"][0]


def initial_messages(harness: vf.Harness, data: vf.TaskData) -> list[dict]:
    system, prompt = harness.resolve_prompt(data)
    messages = [{"role": "system", "content": system}] if system else []
    if isinstance(prompt, str):
        messages.append({"role": "user", "content": prompt})
    else:
        messages += [message_to_wire(m) for m in prompt or []]
    return messages


def assistant_echo(message: dict) -> dict:
    """The reply as the next request's assistant message: its text and reasoning, as returned (so the trace
    recognizes it as the turn it recorded); no tool calls, since this game offers no tools."""
    echo = {"role": "assistant", "content": message.get("content") or ""}
    for key in ("reasoning_content", "reasoning"):
        if message.get(key):
            echo[key] = message[key]
            break
    return echo


class GuessNumberHarness(vf.Harness[vf.HarnessConfig]):
    """The guessing game, in this process: guess, feedback, guess, ... until correct or `max_turns` guesses."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = False  # the game state (guesses left) lives in this loop, not in a replayable transcript
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data):
        messages = initial_messages(self, data)
        for turn in range(data.max_turns):
            choice = await chat_completion(endpoint, secret, {"model": ctx.model, "messages": messages})
            message = choice["message"]
            messages.append(assistant_echo(message))
            reply, won = feedback(message.get("content"), data.target, data.max_number)
            if won or turn == data.max_turns - 1:
                break
            messages.append({"role": "user", "content": reply})
        return vf.ProgramResult(0, "", "")


__all__ = ["GuessNumberTaskset", "GuessNumberHarness"]
