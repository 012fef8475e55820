"""connections: sort shuffled words into the categories they were drawn from, in one chat turn.

A puzzle draws `num_groups` categories from the word-category list shipped with this package
(`categories.json`: 36 categories of 6-11 lowercase words), `group_size` words from each, and shows the words
shuffled. Categories whose word lists share a word (`orange` is a fruit and a colour) are never drawn together,
so no word of a puzzle fits two of its categories.

Answer format: one group per line (a `;` also separates groups), its words separated by commas; an optional
label before a colon is ignored (`fruits: apple, pear, plum`). Words are compared lowercased and stripped.

Reward `groups`: the fraction of the puzzle's groups that appear in the answer exactly (as a set of words), so
2 of 3 groups right scores 2/3. 0 for an invalid answer: no group, a word that is not in the puzzle, or a word
named twice (so listing every combination cannot score). Metrics: `valid`, `solved` (every group found).
No harness is exported: any single-call chat harness plays it.
"""

from __future__ import annotations

import json
import random
import re
from functools import cache
from importlib.resources import files

import verifiers.v1 as vf
from pydantic import Field, model_validator

SYSTEM_PROMPT = "Reply with one group per line, its words separated by commas."


@cache
def categories() -> dict[str, tuple[str, ...]]:
    """The shipped word-category list: category name -> its words (lowercase, no duplicates within a category)."""
    raw = json.loads(files(__package__).joinpath("categories.json").read_text())
    return {name: tuple(words) for name, words in raw.items()}


def draw(rng: random.Random, num_groups: int, group_size: int) -> list[tuple[str, list[str]]]:
    """`num_groups` (category, words) groups of `group_size` words, from categories whose word lists are pairwise
    disjoint (no word of the puzzle fits two of its categories)."""
    table = categories()
    eligible = [name for name, words in table.items() if len(words) >= group_size]
    chosen: list[str] = []
    used: set[str] = set()
    for name in rng.sample(eligible, len(eligible)):
        if used.isdisjoint(table[name]):
            chosen.append(name)
            used.update(table[name])
            if len(chosen) == num_groups:
                return [(name, rng.sample(table[name], group_size)) for name in chosen]
    raise ValueError(
        f"num_groups={num_groups}: only {len(chosen)} categories with disjoint word lists were found "
        f"among the {len(eligible)} with at least group_size={group_size} words"
    )


def parse_groups(reply: str, words: list[str]) -> list[frozenset[str]] | None:
    """The groups of `reply` (see the module docstring), or None when the answer is invalid."""
    puzzle = set(words)
    groups, seen = [], set()
    for line in re.split(r"[\n;]", reply):
        named = [w.strip().lower() for w in line.rsplit(":", 1)[-1].split(",")]
        named = [w for w in named if w]
        if not named:
            continue
        for word in named:
            if word not in puzzle or word in seen:
                return None
            seen.add(word)
        groups.append(frozenset(named))
    return groups or None


def score(reply: str, groups: list[list[str]]) -> float:
    """The `groups` reward: the fraction of `groups` the reply names exactly; 0 for an invalid reply."""
    answered = parse_groups(reply, [w for group in groups for w in group])
    if answered is None:
        return 0.0
    return sum(frozenset(group) in answered for group in groups) / len(groups)


def question(words: list[str], num_groups: int, group_size: int) -> str:
    return f"Sort these words into {num_groups} groups of {group_size} by category: {', '.join(words)}."


class ConnectionsData(vf.TaskData):
    words: list[str]
    """The puzzle's words, shuffled, as shown."""
    groups: list[list[str]]
    """The solution: each category's words."""
    categories: list[str]
    """The categories' names, in the order of `groups`."""


class ConnectionsTask(vf.Task[ConnectionsData]):
    @vf.reward
    async def groups(self, trace: vf.Trace) -> float:
        return score(trace.last_reply, self.data.groups)

    @vf.metric
    async def valid(self, trace: vf.Trace) -> float:
        return float(parse_groups(trace.last_reply, self.data.words) is not None)

    @vf.metric
    async def solved(self, trace: vf.Trace) -> float:
        return float(score(trace.last_reply, self.data.groups) == 1.0)


class ConnectionsConfig(vf.TasksetConfig):
    num_tasks: int = Field(1000, ge=1)
    """Number of tasks generated."""
    seed: int = 0
    """Generator seed: the same seed always yields the same tasks."""
    num_groups: int = Field(3, ge=2)
    """Categories per puzzle."""
    group_size: int = Field(3, ge=2)
    """Words drawn from each category."""

    @model_validator(mode="after")
    def _check_size(self) -> ConnectionsConfig:
        eligible = sum(len(words) >= self.group_size for words in categories().values())
        if eligible < self.num_groups:
            raise ValueError(
                f"num_groups={self.num_groups} with group_size={self.group_size}: only {eligible} shipped "
                f"categories have {self.group_size} or more words"
            )
        return self


def generate(config: ConnectionsConfig) -> list[list[tuple[str, list[str]]]]:
    """Puzzles as lists of (category, words) groups, deterministic in `config.seed`."""
    rng = random.Random(config.seed)
    return [draw(rng, config.num_groups, config.group_size) for _ in range(config.num_tasks)]


class ConnectionsTaskset(vf.Taskset[ConnectionsTask, ConnectionsConfig]):
    def load(self):
        rng = random.Random(f"shuffle-{self.config.seed}")
        for puzzle in generate(self.config):
            words = [w for _, group in puzzle for w in group]
            rng.shuffle(words)
            data = ConnectionsData(
                prompt=question(words, self.config.num_groups, self.config.group_size),
                system_prompt=SYSTEM_PROMPT,
                words=words,
                groups=[group for _, group in puzzle],
                categories=[name for name, _ in puzzle],
            )
            yield ConnectionsTask(data, self.config.task)


__all__ = ["ConnectionsTaskset"]
