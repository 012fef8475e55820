"""The questions: generated locally from a seed, or read from a local JSONL file of `{"question", "answer"}` rows.

Every generated question has one short reference answer a judge can check against the policy's free-form reply.
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path
from typing import Literal

Kind = Literal["add", "reverse", "count", "weekday", "binary"]
KINDS: tuple[Kind, ...] = ("add", "reverse", "count", "weekday", "binary")
WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")


def question(kind: Kind, rng: random.Random) -> tuple[str, str]:
    """One (question, reference answer) pair of `kind`."""
    if kind == "add":
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        return f"What is {a} plus {b}?", str(a + b)
    word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(4, 8)))
    if kind == "reverse":
        return f"Write the string '{word}' backwards.", word[::-1]
    if kind == "count":
        return f"How many letters does the string '{word}' have?", str(len(word))
    if kind == "weekday":
        start, days = rng.randrange(7), rng.randint(1, 20)
        return f"Which day of the week is {days} days after a {WEEKDAYS[start]}?", WEEKDAYS[(start + days) % 7]
    if kind == "binary":
        n = rng.randint(2, 63)
        return f"What is the number {n} written in binary?", format(n, "b")
    raise ValueError(f"unknown question kind {kind!r}; expected one of {KINDS}")


def generate(num_tasks: int, seed: int, kinds: list[Kind]) -> list[tuple[str, str]]:
    """`num_tasks` (question, answer) pairs, kinds drawn uniformly from `kinds`; deterministic in `seed`."""
    rng = random.Random(seed)
    return [question(rng.choice(kinds), rng) for _ in range(num_tasks)]


def read_jsonl(path: Path) -> list[tuple[str, str]]:
    """(question, answer) pairs from a JSONL file, one `{"question": str, "answer": str}` object per line (blank
    lines skipped; other keys ignored). Bad input raises naming the file, the line and the key."""
    if not path.is_file():
        raise FileNotFoundError(f"llm-judge data_file {path} does not exist")
    pairs = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: not a JSON object ({e})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
        for key in ("question", "answer"):
            if not isinstance(row.get(key), str) or not row[key].strip():
                raise ValueError(f"{path}:{number}: key {key!r} must be a non-empty string")
        pairs.append((row["question"], row["answer"]))
    if not pairs:
        raise ValueError(f"llm-judge data_file {path} has no rows")
    return pairs
