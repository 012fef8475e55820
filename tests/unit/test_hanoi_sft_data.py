"""scripts/tower_of_hanoi_sft_data.py: the demo's demonstrations are the taskset's own conversations, answered
with the solver's optimal solution or, for a seeded fraction, a legal detour of twice the length."""

import importlib.util
from pathlib import Path

from tower_of_hanoi import HanoiConfig, score

ROOT = Path(__file__).parents[2]
spec = importlib.util.spec_from_file_location("hanoi_sft_data", ROOT / "scripts" / "tower_of_hanoi_sft_data.py")
sft_data = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sft_data)


def test_detour_is_legal_and_twice_as_long():
    assert sft_data.detour(1, "A", "C", "B") == "AB BC"
    assert sft_data.detour(2, "A", "C", "B") == "AC AB CB BA BC AC"
    for n in range(1, 5):
        moves = sft_data.detour(n, "C", "A", "B")
        assert len(moves.split()) == 2 * (2**n - 1)
        assert score(moves, n, "C", "A", "ABC") == 0.5


def test_rows_are_the_taskset_conversations_with_a_seeded_share_of_detours():
    config = HanoiConfig(num_tasks=400, seed=0, min_disks=1, max_disks=3)
    rows = sft_data.sft_rows(config, detour_fraction=0.4)
    assert rows == sft_data.sft_rows(config, detour_fraction=0.4)
    rewards = []
    for row in rows:
        system, user = row["prompt"]
        assert system["role"] == "system" and user["role"] == "user"
        (reply,) = row["completion"]
        rewards.append(score(reply["content"], *_task(row)))
    assert set(rewards) == {1.0, 0.5}
    # 400 seeded draws of probability 0.4: 160 expected, std 9.8; +-40 is a 4-sigma band
    assert 120 <= rewards.count(0.5) <= 200
    assert all(score(r["completion"][0]["content"], *_task(r)) == 1.0 for r in sft_data.sft_rows(config))


def _task(row):
    words = row["prompt"][1]["content"].rstrip(".").split()
    return int(words[1]), words[-4], words[-1], "ABC"
