"""arithmetic: "What is 37 + 48? Answer with the number only." in one chat turn.

Reward `correct`: 1.0 when the answer parsed from the reply equals the true result. The parsed answer is the
last integer in the reply (optional sign, optional thousands commas), so "85", " 85\n", "85." and
"37 + 48 = 85" all parse as 85. Metrics: `parsed` (an integer was found), `number_only` (the stripped reply is
exactly the result). No harness is exported: any single-call chat harness plays it.
"""

from __future__ import annotations

import random
import re
from typing import Literal

import verifiers.v1 as vf
from pydantic import Field

Op = Literal["+", "-", "*"]

# An optionally signed integer: either with thousands commas ("1,234,567") or a plain digit run.
_INTEGER = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?!\d)|[-+]?\d+")


def parse_answer(reply: str) -> int | None:
    """The last integer in `reply` (commas between digit groups of three are dropped), or None."""
    matches = _INTEGER.findall(reply.strip())
    if not matches:
        return None
    return int(matches[-1].replace(",", ""))


def compute(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    raise ValueError(f"unsupported op {op!r}")


class ArithmeticData(vf.TaskData):
    a: int
    op: str
    b: int
    answer: int


class ArithmeticTask(vf.Task[ArithmeticData]):
    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        return float(parse_answer(trace.last_reply) == self.data.answer)

    @vf.metric
    async def parsed(self, trace: vf.Trace) -> float:
        return float(parse_answer(trace.last_reply) is not None)

    @vf.metric
    async def number_only(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == str(self.data.answer))


class ArithmeticConfig(vf.TasksetConfig):
    num_tasks: int = Field(1000, ge=1)
    """Number of tasks generated."""
    seed: int = 0
    """Generator seed: the same seed always yields the same tasks."""
    ops: list[Op] = Field(default_factory=lambda: ["+", "-", "*"], min_length=1)
    """Operators drawn from (uniformly)."""
    digits: int = Field(2, ge=1, le=9)
    """Digits per operand (1 digit: 0-9; d > 1 digits: 10^(d-1) .. 10^d - 1)."""
    allow_negative: bool = False
    """Whether subtraction may go below zero (False: the larger operand comes first)."""


def generate(config: ArithmeticConfig) -> list[tuple[int, str, int, int]]:
    """(a, op, b, answer) problems, deterministic in `config.seed`."""
    rng = random.Random(config.seed)
    low = 0 if config.digits == 1 else 10 ** (config.digits - 1)
    high = 10**config.digits - 1
    problems = []
    for _ in range(config.num_tasks):
        op = rng.choice(config.ops)
        a, b = rng.randint(low, high), rng.randint(low, high)
        if op == "-" and not config.allow_negative and a < b:
            a, b = b, a
        problems.append((a, op, b, compute(a, op, b)))
    return problems


def question(a: int, op: str, b: int) -> str:
    return f"What is {a} {op} {b}? Answer with the number only."


class ArithmeticTaskset(vf.Taskset[ArithmeticTask, ArithmeticConfig]):
    def load(self):
        for a, op, b, answer in generate(self.config):
            yield ArithmeticTask(
                ArithmeticData(prompt=question(a, op, b), a=a, op=op, b=b, answer=answer), self.config.task
            )


__all__ = ["ArithmeticTaskset"]
