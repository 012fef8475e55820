import asyncio
import itertools
import random
import re

import env_testkit as kit
import pytest
from connections import (
    SYSTEM_PROMPT,
    ConnectionsConfig,
    ConnectionsData,
    ConnectionsTask,
    ConnectionsTaskset,
    categories,
    draw,
    parse_groups,
    question,
    score,
)

# verifiers keeps some asyncio state bound to the loop that first used it: one loop for this module.
LOOP = asyncio.new_event_loop()
API_KEY_VAR = "CONNECTIONS_TEST_API_KEY"

GROUPS = [["apple", "pear", "plum"], ["red", "blue", "green"], ["oak", "pine", "elm"]]
WORDS = ["pine", "red", "apple", "elm", "plum", "blue", "oak", "green", "pear"]


def test_shipped_categories():
    table = categories()
    assert len(table) >= 30
    for name, words in table.items():
        assert len(words) >= 6, name
        assert len(set(words)) == len(words), name
        assert all(re.fullmatch(r"[a-z]+", w) for w in words), name
    # the list deliberately has words in two categories, which a puzzle must never draw together
    assert "orange" in table["fruits"] and "orange" in table["colors"]
    assert "mercury" in table["planets"] and "mercury" in table["metals"]


@pytest.mark.parametrize(
    ("reply", "groups"),
    [
        ("apple, pear, plum\nred, blue, green", [{"apple", "pear", "plum"}, {"red", "blue", "green"}]),
        ("Apple,Pear , plum; RED,blue,green\n\n", [{"apple", "pear", "plum"}, {"red", "blue", "green"}]),
        ("fruits: apple, pear, plum\ncolors: red", [{"apple", "pear", "plum"}, {"red"}]),
        ("apple, pear, kiwi", None),  # not a word of the puzzle
        ("apple, pear\npear, plum", None),  # a word twice
        ("", None),
        ("\n ; \n", None),
    ],
)
def test_parse_groups(reply, groups):
    parsed = parse_groups(reply, WORDS)
    assert parsed == (None if groups is None else [frozenset(g) for g in groups])


def test_score_hand_worked():
    assert score("apple, pear, plum\nred, blue, green\noak, pine, elm", GROUPS) == 1.0
    assert score("elm, oak, pine\nplum, apple, pear\ngreen, red, blue", GROUPS) == 1.0  # any order
    # fruits right, the other two mixed up: 1 of 3
    assert score("apple, pear, plum\nred, blue, oak\ngreen, pine, elm", GROUPS) == pytest.approx(1 / 3)
    # two groups named, both right; the third left out: 2 of 3
    assert score("apple, pear, plum\nred, blue, green", GROUPS) == pytest.approx(2 / 3)
    # a group of four containing a right three does not count
    assert score("apple, pear, plum, red\nblue, green\noak, pine, elm", GROUPS) == pytest.approx(1 / 3)
    assert score("apple, pear, plum\napple, red", GROUPS) == 0.0  # apple twice: invalid
    assert score("apple, pear, plum\nkiwi", GROUPS) == 0.0  # not in the puzzle: invalid
    assert score("I do not know", GROUPS) == 0.0


def test_draw_never_combines_categories_that_share_a_word():
    table = categories()
    rng = random.Random(0)
    for _ in range(300):
        puzzle = draw(rng, 4, 4)
        names = [name for name, _ in puzzle]
        assert len(set(names)) == 4
        for i, (name, words) in enumerate(puzzle):
            assert len(words) == 4 and set(words) <= set(table[name])
            for other in names[i + 1 :]:
                assert set(table[name]).isdisjoint(table[other]), (name, other)


def tasks(**args):
    return list(ConnectionsTaskset(ConnectionsConfig(**args)))


def test_generation_is_deterministic_and_configurable():
    first = tasks(num_tasks=30, seed=5)
    again = tasks(num_tasks=30, seed=5)
    other = tasks(num_tasks=30, seed=6)
    assert [t.data for t in first] == [t.data for t in again]
    assert [t.data for t in first] != [t.data for t in other]
    table = categories()
    for i, task in enumerate(first):
        d = task.data
        assert d.idx == i and len(d.groups) == 3 and all(len(g) == 3 for g in d.groups)
        assert sorted(d.words) == sorted(w for g in d.groups for w in g)
        assert all(set(g) <= set(table[name]) for name, g in zip(d.categories, d.groups, strict=True))
        assert d.prompt == question(d.words, 3, 3) and d.system_prompt == SYSTEM_PROMPT
        assert score("\n".join(", ".join(g) for g in d.groups), d.groups) == 1.0
    # the words are shown shuffled, not group by group
    assert any(t.data.words != [w for g in t.data.groups for w in g] for t in first)
    big = tasks(num_tasks=5, num_groups=4, group_size=4)
    assert all(len(t.data.words) == 16 and len(t.data.groups) == 4 for t in big)
    assert big[0].data.prompt.startswith("Sort these words into 4 groups of 4 by category: ")


def test_config_errors():
    with pytest.raises(ValueError, match="group_size=12"):
        ConnectionsConfig(group_size=12)  # no shipped category has 12 words
    with pytest.raises(ValueError, match="num_groups=40"):
        ConnectionsConfig(num_groups=40)  # only 36 categories
    with pytest.raises(ValueError):
        ConnectionsConfig(num_groups=1)
    with pytest.raises(ValueError, match="disjoint"):
        draw(random.Random(0), 36, 2)  # 36 categories, but some share words


async def run_episodes(script, task_list, **taskset_args):
    config = {
        "taskset": {"id": "connections", **taskset_args},
        "agent": {"harness": {"id": "env_testkit"}, "runtime": {"type": "subprocess"}},
    }
    return await kit.run_episodes(config, script, task_list, api_key_var=API_KEY_VAR, max_tokens=64)


def solver_script(body: dict) -> dict:
    """Solves the puzzle from the shipped list alone: the 3 categories that split the shown words into groups of 3
    (a word of two categories, like `orange`, leaves only one such split); answers with labelled groups."""
    shown = set(body["messages"][-1]["content"].split(": ", 1)[1].rstrip(".").split(", "))
    holding = {name: shown & set(words) for name, words in categories().items() if len(shown & set(words)) >= 3}
    (split,) = [
        names
        for names in itertools.combinations(holding, 3)
        if all(len(holding[name]) == 3 for name in names) and set().union(*(holding[n] for n in names)) == shown
    ]
    return {"content": "\n".join(f"{name}: {', '.join(sorted(holding[name]))}" for name in split)}


def test_episode_solved(monkeypatch):
    monkeypatch.setenv(API_KEY_VAR, "sk-test")
    episodes, requests = LOOP.run_until_complete(
        run_episodes(solver_script, lambda env: list(env.taskset.take(8)), num_tasks=8, seed=1)
    )
    assert len(episodes) == 8 and len(requests) == 8
    for episode, request in zip(episodes, requests, strict=True):
        assert episode.ok, episode.errors
        (trace,) = episode.traces
        assert not trace.has_error, trace.errors
        assert trace.rewards["groups"].score == 1.0 and trace.reward == 1.0
        assert trace.metrics == {"valid": 1.0, "solved": 1.0}
        assert request["messages"][0] == {"role": "system", "content": SYSTEM_PROMPT}


def test_episode_partial_and_invalid(monkeypatch):
    monkeypatch.setenv(API_KEY_VAR, "sk-test")
    data = ConnectionsData(
        prompt=question(WORDS, 3, 3),
        system_prompt=SYSTEM_PROMPT,
        words=WORDS,
        groups=GROUPS,
        categories=["fruits", "colors", "trees"],
    )
    task = ConnectionsTask(data)
    replies = iter(["apple, pear, plum\nred, blue, oak\ngreen, pine, elm", "apple, apple", "no idea"])
    episodes, _ = LOOP.run_until_complete(
        run_episodes(lambda body: {"content": next(replies)}, [task] * 3, num_tasks=1)
    )
    partial, twice, unparsable = (episode.traces[0] for episode in episodes)
    assert partial.reward == pytest.approx(1 / 3) and partial.metrics == {"valid": 1.0, "solved": 0.0}
    assert (twice.reward, twice.metrics) == (0.0, {"valid": 0.0, "solved": 0.0})
    assert (unparsable.reward, unparsable.metrics) == (0.0, {"valid": 0.0, "solved": 0.0})
