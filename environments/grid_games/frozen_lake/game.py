"""Frozen Lake in pure Python (no verifiers): lakes as text, the move rules, a shortest-path solver, lake
generation and the game a chat episode plays (one reply per move). Not slippery: a move goes where it says.

Text format (`Lake.rows`, what task data stores; `render` spaces the cells out for the model): `P` the player,
`F` frozen ice, `H` hole, `G` goal. Row 0 is the top: `up` decreases the row. Moving off the grid is a bump
(nothing moves).
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, replace

from grid_games.game import MOVES, Pos, TurnGame, add, cells, render_rows


@dataclass(frozen=True)
class Lake:
    """A position: the static lake (`holes`, `goal`, size) and where the player stands."""

    size: int
    holes: frozenset[Pos]
    goal: Pos
    player: Pos

    @classmethod
    def parse(cls, rows: list[str]) -> Lake:
        """The inverse of `rows`; refuses a lake that is not square or lacks exactly one player and one goal."""
        if not rows or any(len(row) != len(rows) for row in rows):
            raise ValueError(f"a lake is a square of rows, got {rows!r}")
        holes, goals, players = set(), [], []
        for pos, cell in cells(rows, "PFHG"):
            if cell == "H":
                holes.add(pos)
            elif cell == "G":
                goals.append(pos)
            elif cell == "P":
                players.append(pos)
        if len(players) != 1 or len(goals) != 1:
            raise ValueError(f"a lake needs one player and one goal, got {rows!r}")
        return cls(len(rows), frozenset(holes), goals[0], players[0])

    @property
    def rows(self) -> list[str]:
        def cell(pos: Pos) -> str:
            if pos == self.player:
                return "P"
            if pos == self.goal:
                return "G"
            return "H" if pos in self.holes else "F"

        return ["".join(cell((r, c)) for c in range(self.size)) for r in range(self.size)]

    @property
    def won(self) -> bool:
        return self.player == self.goal

    @property
    def fell(self) -> bool:
        return self.player in self.holes

    def inside(self, pos: Pos) -> bool:
        return 0 <= pos[0] < self.size and 0 <= pos[1] < self.size

    def step(self, move: str) -> tuple[Lake, str]:
        """The position after `move`, and what happened: `moved`, `fell` (into a hole), `won` (reached the goal)
        or `edge` (off the grid: nothing moves)."""
        ahead = add(self.player, MOVES[move])
        if not self.inside(ahead):
            return self, "edge"
        lake = replace(self, player=ahead)
        return lake, "won" if lake.won else "fell" if lake.fell else "moved"


def render(lake: Lake) -> str:
    """The lake as the model sees it: one line per row, cells separated by spaces. A player in a hole shows as
    `P` (the game is over then)."""
    return render_rows(lake.rows)


def distances(lake: Lake) -> dict[Pos, int]:
    """Moves from each safe cell to the goal over safe cells (breadth-first from the goal); unreachable cells
    and holes are absent."""
    dist = {lake.goal: 0}
    frontier = deque([lake.goal])
    while frontier:
        pos = frontier.popleft()
        for delta in MOVES.values():
            nxt = add(pos, delta)
            if lake.inside(nxt) and nxt not in lake.holes and nxt not in dist:
                dist[nxt] = dist[pos] + 1
                frontier.append(nxt)
    return dist


def solve(lake: Lake) -> list[str] | None:
    """A shortest safe move sequence from the player to the goal, or None when the holes cut it off."""
    dist = distances(lake)
    if lake.player not in dist:
        return None
    moves, pos = [], lake.player
    while pos != lake.goal:
        move = next(m for m, d in MOVES.items() if dist.get(add(pos, d)) == dist[pos] - 1)
        moves.append(move)
        pos = add(pos, MOVES[move])
    return moves


# --- generation -------------------------------------------------------------------------------------------------

TOWARD_GOAL = 0.6
"""In the carving walk, the chance that a step goes toward the goal (else any direction): paths wander a little."""


@dataclass(frozen=True)
class Generated:
    lake: Lake
    witness: list[str]
    """The carved safe path from the start to the goal (a valid, not always shortest, solution)."""
    solution: list[str]
    """A shortest solution (`solve`)."""


def _manhattan(a: Pos, b: Pos) -> int:
    return abs(a[0] - b[0]) + abs(a[1] - b[1])


def _carve(rng: random.Random, size: int, start: Pos, goal: Pos, max_len: int) -> list[Pos]:
    """A simple path of cells from start to goal of at most `max_len` moves: a loop-erased random walk drifting
    toward the goal, or, if that wanders too far, a straight staircase (Manhattan length)."""
    path, index = [start], {start: 0}
    for _ in range(20 * size * size):  # bounded; the drift reaches the goal in a few dozen steps in practice
        here = path[-1]
        if here == goal:
            break
        steps = [add(here, d) for d in MOVES.values()]
        steps = [p for p in steps if 0 <= p[0] < size and 0 <= p[1] < size]
        closer = [p for p in steps if _manhattan(p, goal) < _manhattan(here, goal)]
        nxt = rng.choice(closer if rng.random() < TOWARD_GOAL else steps)
        if nxt in index:  # erase the loop
            for pos in path[index[nxt] + 1 :]:
                del index[pos]
            path = path[: index[nxt] + 1]
        else:
            index[nxt] = len(path)
            path.append(nxt)
    if path[-1] == goal and len(path) - 1 <= max_len:
        return path
    path = [start]
    while path[-1] != goal:
        here = path[-1]
        closer = [add(here, d) for d in MOVES.values() if _manhattan(add(here, d), goal) < _manhattan(here, goal)]
        path.append(rng.choice(closer))
    return path


def _moves_along(path: list[Pos]) -> list[str]:
    by_delta = {d: m for m, d in MOVES.items()}
    return [by_delta[(b[0] - a[0], b[1] - a[1])] for a, b in zip(path, path[1:], strict=False)]


def generate(rng: random.Random, size: int, hole_fraction: float, max_moves: int) -> Generated:
    """A `size` x `size` lake: start and goal at least `size - 1` moves apart, a safe path carved between them
    first (at most `max_moves` long, at least the Manhattan distance), then each other cell a hole with
    probability `hole_fraction`. Solvable by construction; `max_moves >= 2 * (size - 1)` keeps the straight
    fallback path within it."""
    cells = [(r, c) for r in range(size) for c in range(size)]
    start = rng.choice(cells)
    goal = rng.choice([p for p in cells if _manhattan(p, start) >= size - 1])
    path = _carve(rng, size, start, goal, max_moves)
    safe = set(path)
    holes = frozenset(p for p in cells if p not in safe and rng.random() < hole_fraction)
    lake = Lake(size, holes, goal, start)
    solution = solve(lake)
    assert solution is not None and len(solution) <= len(path) - 1, "the carved path is safe"
    return Generated(lake, _moves_along(path), solution)


# --- the game a chat episode plays ------------------------------------------------------------------------------


def status(turns_left: int) -> str:
    return f"Turns left: {turns_left}."


class Game(TurnGame[Lake]):
    """One episode: every reply is a turn. It ends at the goal, in a hole, after `max_turns` replies, or at the
    `max_invalid`-th reply without a move. Blocked moves: off the grid (nothing moves)."""

    NOTES = {
        "moved": "You moved {move}.",
        "edge": "You bumped into the edge of the lake; nothing moved.",
        "won": "You reached the goal.",
        "fell": "You fell into a hole.",
    }
    BLOCKED = frozenset({"edge"})

    @property
    def lake(self) -> Lake:
        return self.board

    def finished(self) -> bool:
        return self.lake.won or self.lake.fell

    def status_line(self, turns_left: int) -> str:
        return status(turns_left)
