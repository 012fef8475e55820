"""tower-of-hanoi: solve a Tower of Hanoi of procedural size in one chat turn.

`n` disks (1 = smallest) lie on the start peg; the reply must move them all to the target peg, one top disk at a
time, never a larger disk onto a smaller one. Three pegs named by one character each (default `A`, `B`, `C`).

Answer format: the moves separated by spaces (commas and newlines work too); a move is the peg it takes the top
disk from followed by the peg it puts it on, `AC` (or `A->C`). `AB AC BC` solves 2 disks from A to C.

Reward `solution` (see the README for worked examples), with `optimal = 2^n - 1` moves:
- unparsable (empty, or any token that is not a move between two of the puzzle's pegs): 0;
- the moves are all legal and end with every disk on the target peg: `optimal / len(moves)` (1.0 when optimal);
- otherwise (an illegal move, or legal moves that stop short of the goal): `0.5 * progress`, where progress is
  `(optimal - d) / optimal` and `d` the fewest moves still needed from the state the legal moves reached (the
  state just before the first illegal move). Any unsolved answer thus scores below 0.5.
Metrics: `parsed`, `solved` (legal and reaches the goal), `optimal` (solved in `2^n - 1` moves).

The simulator (`apply_moves`), the optimal solver (`solve`) and the distance to the goal (`distance`) are pure
functions of this module. No harness is exported: any single-call chat harness plays it.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

import verifiers.v1 as vf
from pydantic import Field, field_validator, model_validator


def system_prompt(pegs: str) -> str:
    """Short on purpose: the demo's tiny model reads every character of it."""
    return f"Solve the Tower of Hanoi. Reply with the moves only, like {pegs[0]}{pegs[2]} for peg {pegs[0]} to peg {pegs[2]}."


State = tuple[str, ...]
"""The peg each disk is on, smallest disk first: `("A", "A", "C")` has disks 1 and 2 on A and disk 3 on C."""

Move = tuple[str, str]
"""(from-peg, to-peg)."""


def solve(n: int, source: str, target: str, spare: str) -> list[Move]:
    """The unique optimal solution (2^n - 1 moves) moving `n` disks from `source` to `target`."""
    if n == 0:
        return []
    return solve(n - 1, source, spare, target) + [(source, target)] + solve(n - 1, spare, target, source)


def distance(state: State, target: str, pegs: str) -> int:
    """Fewest moves that gather every disk of `state` on `target`. The largest disk not yet on `target` must move
    once, straight there, after the smaller ones are stacked on the third peg; those then follow in 2^k - 1."""
    for k in range(len(state), 0, -1):  # disk k (1-based), the largest first
        if state[k - 1] != target:
            (third,) = set(pegs) - {state[k - 1], target}
            return distance(state[: k - 1], third, pegs) + 1 + (2 ** (k - 1) - 1)
    return 0


@dataclass(frozen=True)
class Outcome:
    """What `apply_moves` found: the state the legal moves reached and how many were legal."""

    state: State
    legal: int
    """Moves applied before the first illegal one (all of them when `illegal` is False)."""
    illegal: bool


def apply_moves(state: State, moves: list[Move], pegs: str) -> Outcome:
    """Play `moves` from `state`, stopping at the first illegal one: an unknown peg, a move to the same peg, from
    an empty peg, or onto a smaller disk."""
    current = list(state)
    for i, (src, dst) in enumerate(moves):
        if src not in pegs or dst not in pegs or src == dst:
            return Outcome(tuple(current), i, True)
        on_src = [d for d, peg in enumerate(current) if peg == src]
        on_dst = [d for d, peg in enumerate(current) if peg == dst]
        if not on_src or (on_dst and on_dst[0] < on_src[0]):
            return Outcome(tuple(current), i, True)
        current[on_src[0]] = dst
    return Outcome(tuple(current), len(moves), False)


def parse_moves(reply: str, pegs: str) -> list[Move] | None:
    """The moves of `reply` (tokens split on whitespace and commas, each `XY` or `X->Y` over `pegs`), or None when
    there is no move or a token is not one."""
    peg = f"[{re.escape(pegs)}]"
    move = re.compile(f"({peg})(?:->)?({peg})")
    tokens = [t for t in re.split(r"[\s,]+", reply) if t]
    matches = [move.fullmatch(t) for t in tokens]
    if not matches or not all(matches):
        return None
    return [(m.group(1), m.group(2)) for m in matches]


def score(reply: str, n: int, start: str, target: str, pegs: str) -> float:
    """The `solution` reward of the module docstring."""
    moves = parse_moves(reply, pegs)
    if moves is None:
        return 0.0
    optimal = 2**n - 1
    outcome = apply_moves((start,) * n, moves, pegs)
    if not outcome.illegal and all(peg == target for peg in outcome.state):
        return optimal / len(moves)
    return 0.5 * (optimal - distance(outcome.state, target, pegs)) / optimal


def format_moves(moves: list[Move]) -> str:
    """`[("A", "B"), ("A", "C")]` -> `"AB AC"`: the answer format."""
    return " ".join(src + dst for src, dst in moves)


def question(n: int, start: str, target: str) -> str:
    disks = "1 disk" if n == 1 else f"{n} disks"
    return f"Move {disks} from peg {start} to peg {target}."


class HanoiData(vf.TaskData):
    n: int
    """Number of disks."""
    pegs: str
    """The three peg names."""
    start: str
    """The peg every disk starts on."""
    target: str
    """The peg every disk must end on."""
    answer: str
    """The optimal solution in the answer format."""


class HanoiTask(vf.Task[HanoiData]):
    def _outcome(self, reply: str) -> tuple[list[Move] | None, Outcome | None]:
        moves = parse_moves(reply, self.data.pegs)
        if moves is None:
            return None, None
        return moves, apply_moves((self.data.start,) * self.data.n, moves, self.data.pegs)

    def _solved(self, reply: str) -> bool:
        _, outcome = self._outcome(reply)
        return outcome is not None and not outcome.illegal and set(outcome.state) == {self.data.target}

    @vf.reward
    async def solution(self, trace: vf.Trace) -> float:
        d = self.data
        return score(trace.last_reply, d.n, d.start, d.target, d.pegs)

    @vf.metric
    async def parsed(self, trace: vf.Trace) -> float:
        return float(parse_moves(trace.last_reply, self.data.pegs) is not None)

    @vf.metric
    async def solved(self, trace: vf.Trace) -> float:
        return float(self._solved(trace.last_reply))

    @vf.metric
    async def optimal(self, trace: vf.Trace) -> float:
        moves, _ = self._outcome(trace.last_reply)
        return float(self._solved(trace.last_reply) and len(moves) == 2**self.data.n - 1)


class HanoiConfig(vf.TasksetConfig):
    num_tasks: int = Field(1000, ge=1)
    """Number of tasks generated."""
    seed: int = 0
    """Generator seed: the same seed always yields the same tasks."""
    min_disks: int = Field(1, ge=1)
    """Fewest disks in a puzzle."""
    max_disks: int = Field(4, ge=1, le=12)
    """Most disks in a puzzle (the optimal answer has 2^n - 1 moves: 4095 at 12)."""
    pegs: str = "ABC"
    """The three peg names, one letter or digit each."""
    random_pegs: bool = True
    """Draw the start and target pegs per task (6 combinations); False: always from the first peg to the last."""

    @field_validator("pegs")
    @classmethod
    def _check_pegs(cls, pegs: str) -> str:
        if len(pegs) != 3 or len(set(pegs)) != 3 or not pegs.isalnum():
            raise ValueError(f"pegs must be 3 distinct letters or digits, got {pegs!r}")
        return pegs

    @model_validator(mode="after")
    def _check_disks(self) -> HanoiConfig:
        if self.max_disks < self.min_disks:
            raise ValueError(f"max_disks ({self.max_disks}) must be >= min_disks ({self.min_disks})")
        return self


def generate(config: HanoiConfig) -> list[tuple[int, str, str]]:
    """(disks, start peg, target peg) puzzles, deterministic in `config.seed`."""
    rng = random.Random(config.seed)
    puzzles = []
    for _ in range(config.num_tasks):
        n = rng.randint(config.min_disks, config.max_disks)
        start, target = rng.sample(config.pegs, 2) if config.random_pegs else (config.pegs[0], config.pegs[-1])
        puzzles.append((n, start, target))
    return puzzles


class HanoiTaskset(vf.Taskset[HanoiTask, HanoiConfig]):
    def load(self):
        pegs = self.config.pegs
        for n, start, target in generate(self.config):
            (spare,) = set(pegs) - {start, target}
            data = HanoiData(
                prompt=question(n, start, target),
                system_prompt=system_prompt(pegs),
                n=n,
                pegs=pegs,
                start=start,
                target=target,
                answer=format_moves(solve(n, start, target, spare)),
            )
            yield HanoiTask(data, self.config.task)


__all__ = ["HanoiTaskset"]
