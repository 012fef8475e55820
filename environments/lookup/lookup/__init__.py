"""lookup: answer the code stored under a key; only the `lookup(key)` tool knows it.

The smallest task whose reward needs a tool, sized for a tiny model to learn through SFT then RL on a CPU (the
tool-use demo, configs/lookup/). A key is `#` and four distinct capitals (`#PZBH`), a code four distinct digits:
using the tool is two copies (the key into the call, the code into the answer) of tokens that do not repeat.
The `#` gives the first copy a foothold: a 2-layer model copies a run by matching the token it just wrote to
the one before the run's next token, and only the key's own first token has nothing to match. (Without the `#`
the tiny model learned to copy the code within 750 SFT steps but not the key within 1000.) The codes come from a
hash of the key, so without the tool the chance of a right answer is 1 in 5040.

The tool is an MCP server written the verifiers-v1 way (`lookup.tools.LookupTools`, a `vf.Toolset`): one server
per environment worker (`Taskset.toolsets`), shared by its rollouts, stateless. The taskset brings no harness: any
MCP-capable harness plays it (prime-rl's in-process `prime-chat`, verifiers' `null` or `bash`); a `@vf.stop` ends
the episode after `max_turns` model calls.

Reward `matched`: the share of the code's digits the final answer (the last assistant message, if it made no tool
call, stripped) has in their places, over the longer of the two: 1.0 for the code itself, 0.75 with one digit
wrong, ~0.1 for a guess. Partial credit, like reverse-text's, gives RL a gradient on a copy that is nearly right.
Metrics: `correct` (the answer is the code), `tool_calls`, `tool_errors`.
"""

from __future__ import annotations

import hashlib
import random

import verifiers.v1 as vf
from pydantic import Field
from verifiers.v1.types import content_text

# All lowercase but the key: the key's letters are the only capitals in the context (Qwen3's tool preamble has
# capitals of its own, none from KEY_LETTERS), which a tiny model finds far faster than letters among words.
SYSTEM_PROMPT = "find the code with the lookup tool, then reply with the code only."
KEY_LETTERS = "BCDGHJPQRVWZ"
"""Capitals absent from the prompts and from Qwen3's tools block (whose capitals are T, Y, X, M, L, F, A, K)."""
KEY_LENGTH = 4
"""Letters after the `#`."""
CODE_DIGITS = 4


def is_key(key: object) -> bool:
    if not isinstance(key, str) or not key.startswith("#"):
        return False
    letters = key[1:]
    return len(letters) == len(set(letters)) == KEY_LENGTH and set(letters) <= set(KEY_LETTERS)


def code_of(key: str) -> str:
    """The code stored under `key`: four distinct digits drawn from a hash of the key (fixed: the same key always
    has the same code, in every process)."""
    rng = random.Random(hashlib.sha256(f"lookup:{key}".encode()).digest())
    return "".join(rng.sample("0123456789", CODE_DIGITS))


def lookup(key: str) -> str:
    """The tool: the code, or `Error: ...` for anything that is not a key."""
    if not is_key(key):
        return f"Error: no key {str(key)[:40]!r}; a key is # and {KEY_LENGTH} distinct letters of {KEY_LETTERS}"
    return code_of(key)


def random_key(rng: random.Random) -> str:
    return "#" + "".join(rng.sample(KEY_LETTERS, KEY_LENGTH))


def matched(reply: str | None, code: str) -> float:
    """Digits of `code` that `reply` has in the same place, over the longer length (0.0 without a reply)."""
    if not reply:
        return 0.0
    return sum(a == b for a, b in zip(reply, code, strict=False)) / max(len(reply), len(code))  # the shorter one


def final_reply(trace: vf.Trace) -> str | None:
    """The model's last message, stripped, if it is a final answer (made no tool call)."""
    replies = trace.assistant_messages
    if not replies or replies[-1].tool_calls:
        return None
    return content_text(replies[-1].content).strip()


class LookupData(vf.TaskData):
    key: str
    code: str
    max_turns: int
    """Model calls allowed (tool rounds included)."""


class LookupTask(vf.Task[LookupData]):
    @vf.stop
    async def out_of_turns(self, trace: vf.Trace) -> bool:
        """`max_turns` model calls were made (checked before each call)."""
        return trace.num_turns >= self.data.max_turns

    @vf.reward
    async def matched(self, trace: vf.Trace) -> float:
        return matched(final_reply(trace), self.data.code)

    @vf.metric
    async def correct(self, trace: vf.Trace) -> float:
        return float(final_reply(trace) == self.data.code)

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(sum(len(m.tool_calls or []) for m in trace.assistant_messages))

    @vf.metric
    async def tool_errors(self, trace: vf.Trace) -> float:
        return float(sum(content_text(m.content).startswith("Error") for m in trace.tool_messages))


class LookupConfig(vf.TasksetConfig):
    num_tasks: int = Field(1000, ge=1)
    """Number of tasks generated."""
    seed: int = 0
    """Generator seed: the same seed always yields the same keys."""
    max_turns: int = Field(3, ge=1)
    """Model calls per episode, tool rounds included."""
    tools: vf.SharedToolsetConfig = vf.SharedToolsetConfig()
    """Where the tool server runs (default: a local subprocess, one per environment worker)."""


def generate(config: LookupConfig) -> list[str]:
    """The task keys, deterministic in `config.seed`."""
    rng = random.Random(config.seed)
    return [random_key(rng) for _ in range(config.num_tasks)]


def lookup_task(key: str, max_turns: int, config: vf.TaskConfig | None = None) -> LookupTask:
    """The task that asks for `key`'s code."""
    data = LookupData(
        prompt=f"what is the code of {key}?",
        system_prompt=SYSTEM_PROMPT,
        key=key,
        code=code_of(key),
        max_turns=max_turns,
    )
    return LookupTask(data, config)


class LookupTaskset(vf.Taskset[LookupTask, LookupConfig]):
    def load(self):
        for key in generate(self.config):
            yield lookup_task(key, self.config.max_turns, self.config.task)

    @classmethod
    def toolsets(cls, config: LookupConfig) -> list[vf.Toolset]:
        from lookup.tools import LookupTools

        return [LookupTools(config.tools)]


__all__ = ["LookupTaskset"]
