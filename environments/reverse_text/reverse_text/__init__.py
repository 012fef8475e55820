"""reverse-text: reverse a random string of letters in one chat turn.

Reward `lcs`: the longest-common-subsequence ratio between the model's reply (stripped) and the
reversed string, `2 * LCS(a, b) / (len(a) + len(b))` (1.0 for an exact match). Metric `exact`.
No harness is exported: any single-call chat harness plays it.
"""

from __future__ import annotations

import random
import string

import verifiers.v1 as vf
from pydantic import Field, model_validator

SYSTEM_PROMPT = "Reverse the text. Reply with the reversed text only."


def lcs_length(a: str, b: str) -> int:
    """Length of the longest common subsequence of `a` and `b` (O(len(a) * len(b)) time, O(len(b)) memory)."""
    if len(a) < len(b):
        a, b = b, a
    row = [0] * (len(b) + 1)
    for ca in a:
        diag = 0  # row[j - 1] of the previous row
        for j, cb in enumerate(b, start=1):
            up = row[j]
            row[j] = diag + 1 if ca == cb else max(up, row[j - 1])
            diag = up
    return row[-1]


def lcs_ratio(a: str, b: str) -> float:
    """`2 * LCS(a, b) / (len(a) + len(b))`: 1.0 for equal strings (two empty strings included), 0.0 with nothing in common."""
    total = len(a) + len(b)
    if total == 0:
        return 1.0
    return 2 * lcs_length(a, b) / total


class ReverseTextData(vf.TaskData):
    text: str
    """The string shown to the model."""
    answer: str
    """`text` reversed."""


class ReverseTextTask(vf.Task[ReverseTextData]):
    @vf.reward
    async def lcs(self, trace: vf.Trace) -> float:
        return lcs_ratio(trace.last_reply.strip(), self.data.answer)

    @vf.metric
    async def exact(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == self.data.answer)


class ReverseTextConfig(vf.TasksetConfig):
    num_tasks: int = Field(1000, ge=1)
    """Number of tasks generated."""
    seed: int = 0
    """Generator seed: the same seed always yields the same tasks."""
    min_len: int = Field(5, ge=1)
    """Shortest string (characters)."""
    max_len: int = Field(10, ge=1)
    """Longest string (characters)."""
    alphabet: str = Field(string.ascii_lowercase, min_length=1)
    """Characters the strings are drawn from."""

    @model_validator(mode="after")
    def _check_lengths(self) -> ReverseTextConfig:
        if self.max_len < self.min_len:
            raise ValueError(f"max_len ({self.max_len}) must be >= min_len ({self.min_len})")
        return self


def generate(config: ReverseTextConfig) -> list[tuple[str, str]]:
    """(text, reversed text) pairs, deterministic in `config.seed`."""
    rng = random.Random(config.seed)
    pairs = []
    for _ in range(config.num_tasks):
        length = rng.randint(config.min_len, config.max_len)
        text = "".join(rng.choice(config.alphabet) for _ in range(length))
        pairs.append((text, text[::-1]))
    return pairs


class ReverseTextTaskset(vf.Taskset[ReverseTextTask, ReverseTextConfig]):
    def load(self):
        for text, answer in generate(self.config):
            data = ReverseTextData(
                prompt=f"Reverse this text: {text}", system_prompt=SYSTEM_PROMPT, text=text, answer=answer
            )
            yield ReverseTextTask(data, self.config.task)


__all__ = ["ReverseTextTaskset"]
