"""What every grid game here shares, in pure Python (no verifiers): the four moves, reading a move out of a reply,
drawing a board for the model, and the turn loop of a game played one reply per move (`TurnGame`).

A board is text (one string per row, one character per cell). Row 0 is the top: `up` decreases the row.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar, Generic, Protocol, Self, TypeVar

Pos = tuple[int, int]
"""(row, column)."""

MOVES: dict[str, Pos] = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}

# A move word stands alone: not inside a word, nor after an apostrophe (the `d` of "I'd" is no move).
_MOVE_WORD = re.compile(r"(?<![\w'’])(up|down|left|right|u|d|l|r)(?![\w'’])", re.IGNORECASE)
_LETTER = {"u": "up", "d": "down", "l": "left", "r": "right"}

UNREADABLE = "No move found in your reply. Reply with one move: up, down, left or right."


def parse_move(reply: str | None) -> str | None:
    """The last move named in the reply, as `up`/`down`/`left`/`right`, or None. Accepted (any case, as whole
    words, not after an apostrophe): `up`, `down`, `left`, `right` and the letters `U`, `D`, `L`, `R`
    (`Move: right`, `I go L.`)."""
    matches = _MOVE_WORD.findall(reply or "")
    if not matches:
        return None
    word = matches[-1].lower()
    return _LETTER.get(word, word)


def add(pos: Pos, delta: Pos) -> Pos:
    return pos[0] + delta[0], pos[1] + delta[1]


def cells(rows: list[str], legend: str) -> Iterator[tuple[Pos, str]]:
    """Each cell of a board's text with its position, row by row; refuses a character that is not in `legend`."""
    for r, row in enumerate(rows):
        for c, cell in enumerate(row):
            if cell not in legend:
                raise ValueError(f"unknown cell {cell!r} at row {r}, column {c}")
            yield (r, c), cell


def render_rows(rows: list[str]) -> str:
    """A board as the model sees it: one line per row, cells separated by spaces."""
    return "\n".join(" ".join(row) for row in rows)


class Board(Protocol):
    """A position of one game: its text and its move rule."""

    @property
    def rows(self) -> list[str]: ...

    def step(self, move: str) -> tuple[Self, str]:
        """The position after `move`, and the outcome (a key of the game's `NOTES`)."""
        ...


B = TypeVar("B", bound=Board)


@dataclass
class TurnGame(Generic[B]):
    """One episode: every reply is a turn. It ends when the board says so (`finished`), after `max_turns` replies,
    or at the `max_invalid`-th reply without a move. A game names its notes and what counts as a blocked move, and
    says when its board is finished and what status line follows the board."""

    board: B
    max_turns: int
    max_invalid: int
    turns: int = 0
    moves: int = 0
    """Replies that named a move (blocked ones included)."""
    invalid: int = 0
    """Replies that named no move."""
    blocked: int = 0
    """Moves that changed nothing (their outcome is in `BLOCKED`)."""

    NOTES: ClassVar[dict[str, str]]
    """What the player is told after each outcome of `Board.step` (`{move}` is filled in)."""
    BLOCKED: ClassVar[frozenset[str]]
    """The outcomes that leave the board unchanged."""

    def finished(self) -> bool:
        """Whether the board itself ends the game (won, or lost)."""
        raise NotImplementedError

    def status_line(self, turns_left: int) -> str:
        """The line under the board."""
        raise NotImplementedError

    def opening_prompt(self) -> str:
        """The task's prompt: the board before any move, then the status and the question."""
        return f"{render_rows(self.board.rows)}\n\n{self.status_line(self.max_turns)} Your move?"

    @property
    def over(self) -> bool:
        return self.finished() or self.turns >= self.max_turns or self.invalid >= self.max_invalid

    def play(self, reply: str | None) -> str:
        """Apply one reply; returns what the player is told next (a note, the board, the status)."""
        if self.over:
            raise ValueError("the game is over")
        self.turns += 1
        move = parse_move(reply)
        if move is None:
            self.invalid += 1
            note = UNREADABLE
        else:
            self.moves += 1
            self.board, outcome = self.board.step(move)
            self.blocked += outcome in self.BLOCKED
            note = self.NOTES[outcome].format(move=move)
        return f"{note}\n\n{render_rows(self.board.rows)}\n\n{self.status_line(self.max_turns - self.turns)}"

    @classmethod
    def replay(cls, board: B, replies: list[str | None], max_turns: int, max_invalid: int) -> Self:
        """The game those replies played (replies past its end are ignored)."""
        game = cls(board, max_turns, max_invalid)
        for reply in replies:
            if game.over:
                break
            game.play(reply)
        return game
