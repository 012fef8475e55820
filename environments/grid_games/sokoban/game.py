"""Sokoban in pure Python (no verifiers): levels as text, the move rules, an optimal solver, level generation and
the game a chat episode plays (one reply per move).

Text format (`Level.rows`, what task data stores; `render` spaces the cells out for the model):
`#` wall, `_` floor, `.` goal, `$` box, `*` box on a goal, `@` player, `+` player on a goal. Row 0 is the top:
`up` decreases the row.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from grid_games.game import MOVES, Pos, TurnGame, add, cells, render_rows

OPPOSITE = {"up": "down", "down": "up", "left": "right", "right": "left"}


@dataclass(frozen=True)
class Level:
    """A position: the static room (`walls`, `goals`, size) and the movable part (`player`, `boxes`)."""

    height: int
    width: int
    walls: frozenset[Pos]
    goals: frozenset[Pos]
    boxes: frozenset[Pos]
    player: Pos

    @classmethod
    def parse(cls, rows: list[str]) -> Level:
        """The inverse of `rows`; refuses a level that is not rectangular, not walled in, or whose counts are off."""
        if not rows or any(len(row) != len(rows[0]) for row in rows):
            raise ValueError(f"a level is a non-empty rectangle of equal-length rows, got {rows!r}")
        walls, goals, boxes, players = set(), set(), set(), []
        for pos, cell in cells(rows, "#_.$*@+"):
            if cell == "#":
                walls.add(pos)
            if cell in ".*+":
                goals.add(pos)
            if cell in "$*":
                boxes.add(pos)
            if cell in "@+":
                players.append(pos)
        height, width = len(rows), len(rows[0])
        border = {(r, c) for r in range(height) for c in range(width) if r in (0, height - 1) or c in (0, width - 1)}
        if not border <= walls:
            raise ValueError("a level's outer ring must be all walls")
        if len(players) != 1 or not boxes or len(boxes) != len(goals):
            raise ValueError(f"a level needs one player and as many boxes as goals (>= 1), got {rows!r}")
        return cls(height, width, frozenset(walls), frozenset(goals), frozenset(boxes), players[0])

    @property
    def rows(self) -> list[str]:
        out = []
        for r in range(self.height):
            row = ""
            for c in range(self.width):
                pos = (r, c)
                if pos in self.walls:
                    row += "#"
                elif pos == self.player:
                    row += "+" if pos in self.goals else "@"
                elif pos in self.boxes:
                    row += "*" if pos in self.goals else "$"
                else:
                    row += "." if pos in self.goals else "_"
            out.append(row)
        return out

    @property
    def boxes_on_goals(self) -> int:
        return len(self.boxes & self.goals)

    @property
    def solved(self) -> bool:
        return self.boxes == self.goals

    def step(self, move: str) -> tuple[Level, str]:
        """The position after `move`, and what happened: `moved`, `pushed`, `wall` (walked into a wall) or
        `blocked` (the box ahead has a wall or a box behind it); the last two leave the position unchanged."""
        delta = MOVES[move]
        ahead = add(self.player, delta)
        if ahead in self.walls:
            return self, "wall"
        if ahead not in self.boxes:
            return replace(self, player=ahead), "moved"
        behind = add(ahead, delta)
        if behind in self.walls or behind in self.boxes:
            return self, "blocked"
        return replace(self, player=ahead, boxes=(self.boxes - {ahead}) | {behind}), "pushed"


def render(level: Level) -> str:
    """The board as the model sees it: one line per row, cells separated by spaces."""
    return render_rows(level.rows)


def solve(level: Level, max_moves: int | None = None) -> list[str] | None:
    """A shortest move sequence that solves the level (breadth-first over player and box positions), or None
    when there is none (of at most `max_moves` moves, if given). The rules of `Level.step`, inlined for speed."""
    walls, goals = level.walls, level.goals
    start = (level.player, level.boxes)
    parents: dict[tuple, tuple | None] = {start: None}
    layer, depth = [start], 0
    while layer:
        following = []
        for state in layer:
            player, boxes = state
            if boxes == goals:
                moves = []
                while parents[state] is not None:
                    state, move = parents[state]
                    moves.append(move)
                return moves[::-1]
            if max_moves is not None and depth >= max_moves:
                continue
            for move, (dr, dc) in MOVES.items():
                ahead = (player[0] + dr, player[1] + dc)
                if ahead in walls:
                    continue
                if ahead in boxes:
                    behind = (ahead[0] + dr, ahead[1] + dc)
                    if behind in walls or behind in boxes:
                        continue
                    nxt = (ahead, (boxes - {ahead}) | {behind})
                else:
                    nxt = (ahead, boxes)
                if nxt not in parents:
                    parents[nxt] = (state, move)
                    following.append(nxt)
        layer, depth = following, depth + 1
    return None


# --- generation -------------------------------------------------------------------------------------------------

FLOOR_FRACTION = 0.7
"""Share of the room's interior carved into floor (the rest stays inner walls)."""
PULL_PROBABILITY = 0.8
"""In reverse play, the chance that a step away from an adjacent box pulls it along."""
ATTEMPTS = 200
"""Levels drawn per task before generation gives up (each is rejected only when a box ends on a goal or the
optimal solution is longer than `max_moves`)."""


@dataclass(frozen=True)
class Generated:
    level: Level
    witness: list[str]
    """The construction's own solution: the reverse play undone (a valid, usually not optimal, solution)."""
    solution: list[str]
    """An optimal solution (`solve`)."""


def _carve(rng: random.Random, size: int) -> set[Pos]:
    """Floor cells of a `size` x `size` room: a random walk inside the outer ring (so the floor is connected)."""
    interior = [(r, c) for r in range(1, size - 1) for c in range(1, size - 1)]
    target = max(2, round(FLOOR_FRACTION * len(interior)))
    pos = rng.choice(interior)
    floor = {pos}
    for _ in range(100 * len(interior)):  # bounded: in practice the target is reached in a few dozen steps
        if len(floor) >= target:
            break
        nxt = add(pos, rng.choice(list(MOVES.values())))
        if 1 <= nxt[0] <= size - 2 and 1 <= nxt[1] <= size - 2:
            pos = nxt
            floor.add(pos)
    return floor


def _draw(rng: random.Random, size: int, boxes: int) -> tuple[Level, list[str]] | None:
    """One candidate: carve a room, put the boxes on their goals, then play backwards (the player walks and pulls
    boxes), so undoing the reverse moves solves the level. None when the room is too small for the boxes."""
    floor = _carve(rng, size)
    if len(floor) < boxes + 1:
        return None
    cells = sorted(floor)
    goals = set(rng.sample(cells, boxes))
    box_set = set(goals)
    player = rng.choice([p for p in cells if p not in box_set])
    reverse: list[str] = []
    for _ in range(10 * len(cells)):
        move = rng.choice(list(MOVES))
        delta = MOVES[move]
        ahead = add(player, delta)
        if ahead not in floor or ahead in box_set:
            continue
        pulled = add(player, (-delta[0], -delta[1]))
        if pulled in box_set and rng.random() < PULL_PROBABILITY:
            box_set = (box_set - {pulled}) | {player}
        player = ahead
        reverse.append(move)
    walls = {(r, c) for r in range(size) for c in range(size)} - floor
    level = Level(size, size, frozenset(walls), frozenset(goals), frozenset(box_set), player)
    return level, [OPPOSITE[move] for move in reversed(reverse)]


def generate(rng: random.Random, size: int, boxes: int, max_moves: int) -> Generated:
    """A level of a `size` x `size` room (outer ring included) with `boxes` boxes, none of them on a goal,
    solvable in at most `max_moves` moves. Solvable by construction (reverse play from the solved position); the
    solver only measures it."""
    for _ in range(ATTEMPTS):
        drawn = _draw(rng, size, boxes)
        if drawn is None:
            continue
        level, witness = drawn
        if level.boxes & level.goals:
            continue
        solution = solve(level, max_moves)
        if solution is not None:
            return Generated(level, witness, solution)
    raise ValueError(
        f"no sokoban level with size={size}, boxes={boxes} solvable within max_turns={max_moves} was found in "
        f"{ATTEMPTS} attempts: raise `max_turns` or `size`, or lower `boxes`"
    )


# --- the game a chat episode plays ------------------------------------------------------------------------------


def status(level: Level, turns_left: int) -> str:
    return f"Boxes on goals: {level.boxes_on_goals} of {len(level.boxes)}. Turns left: {turns_left}."


class Game(TurnGame[Level]):
    """One episode: every reply is a turn. It ends when the level is solved, after `max_turns` replies, or at the
    `max_invalid`-th reply without a move. Blocked moves: into a wall, or a box that cannot move."""

    NOTES = {
        "moved": "You moved {move}.",
        "pushed": "You pushed a box {move}.",
        "wall": "You walked into a wall; nothing moved.",
        "blocked": "The box cannot move {move}: a wall or another box is behind it; nothing moved.",
    }
    BLOCKED = frozenset({"wall", "blocked"})

    @property
    def level(self) -> Level:
        return self.board

    def finished(self) -> bool:
        return self.level.solved

    def status_line(self, turns_left: int) -> str:
        return status(self.level, turns_left)
