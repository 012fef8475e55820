import pytest
from grid_games.game import parse_move


@pytest.mark.parametrize(
    ("reply", "move"),
    [
        ("up", "up"),
        ("Go DOWN.", "down"),
        (" Down\n", "down"),
        ("LEFT", "left"),
        ("Move: LEFT.", "left"),
        ("Move: right.", "right"),
        ("U", "up"),
        ("d", "down"),
        ("R", "right"),
        ("I go L", "left"),
        ("I go l", "left"),
        ("R!", "right"),
        ("left, no, up", "up"),  # the last move named
        ("down or maybe right", "right"),
        ("U, then R", "right"),
        ("upward", None),  # whole words only
        ("rightwards", None),
        ("I'd rather not", None),  # the d of "I'd" is no move
        ("I'd stop", None),
        ("I'd go r", "right"),
        ("l'r", None),  # neither before nor after an apostrophe
        ("hmm", None),
        ("no idea", None),
        ("", None),
        (None, None),
    ],
)
def test_parse_move(reply, move):
    assert parse_move(reply) == move
