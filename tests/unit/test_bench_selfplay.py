"""benchmarks/bench_selfplay.py's pure parts: the exact reference win rates (worked by hand), the SFT games (every
reply legal, each seat's conversation as the env speaks to it) and reading a run's eval passes."""

import json
import re
from fractions import Fraction

import pytest
from script_module import load_script

bench = load_script("benchmarks/bench_selfplay.py")


def test_uniform_player_win_rates_match_the_hand_worked_ones():
    # Against random, pile 3: take 3 wins (1/3); take 2 leaves 1, lost (1/3); take 1 leaves 2, and the opponent
    # wins by taking 2 (1/2), else leaves 1 for us: (1/3)(1/2) = 1/6. Total 1/2.
    assert bench.policy_wins(3, "uniform", "random") == pytest.approx(0.5, abs=1e-12)
    # Against optimal, pile 5: only take 1 survives (leaves 4, optimal takes 1-3 at random, leaving 3, 2, 1 for us,
    # which we win with 1/3, 1/2, 1): (1/3) * (1/3)(1/3 + 1/2 + 1) = 11/54.
    assert bench.policy_wins(5, "uniform", "optimal") == pytest.approx(float(Fraction(11, 54)), abs=1e-12)
    # The second seat at pile 2: optimal takes 2 and wins; random takes 2 (1/2) or leaves 1 for us (1/2).
    assert 1 - bench.scripted_wins(2, "uniform", "optimal") == 0.0
    assert 1 - bench.scripted_wins(2, "uniform", "random") == pytest.approx(0.5, abs=1e-12)


def test_best_player_win_rates_match_the_hand_worked_ones():
    # Against optimal only winning positions (not a multiple of 4) can be won, and then always.
    assert [bench.policy_wins(n, "best", "optimal") for n in range(1, 13)] == [1.0, 1.0, 1.0, 0.0] * 3
    # Against random from 4: leave 3, 2 or 1; random then wins only by taking all 3 (1/3) of a 3: best is 2/3.
    assert bench.policy_wins(4, "best", "random") == pytest.approx(2 / 3, abs=1e-12)
    # From 8: leave 5; random leaves us 4 (2/3), 3 or 2 (1 each): (2/3 + 1 + 1) / 3 = 8/9.
    assert bench.policy_wins(8, "best", "random") == pytest.approx(8 / 9, abs=1e-12)
    rates = bench.reference_rates([4, 5])
    assert rates["best possible (exact)"][("optimal", "first")] == 0.5  # 5 won, 4 lost
    assert rates["best possible (exact)"][("optimal", "second")] == 0.5  # 4 won (optimal must give it away)


def test_sft_games_are_legal_and_spoken_as_the_env_speaks():
    rows = bench.random_game_rows(300, seed=3)
    seconds = 0
    for row in rows:
        system, first_user = row["prompt"]
        assert system == {"role": "system", "content": bench.rules(3)} and first_user["role"] == "user"
        turns = [first_user] + row["completion"]
        assert [m["role"] for m in turns] == ["user", "assistant"] * (len(turns) // 2)
        seconds += first_user["content"].startswith("Your opponent took")
        for user, reply in zip(turns[::2], turns[1::2], strict=True):
            left = int(re.search(r"The pile has (\d+) stick", user["content"]).group(1))
            upper = int(re.search(r"Take 1(?: to (\d+))?\.", user["content"]).group(1) or 1)
            assert upper == min(3, left) and 1 <= int(reply["content"]) <= upper
    # A second seat moves in every game except those the first seat ends with its first move (piles of 1-3 taken
    # whole): 300 games, so between 300 and 600 conversations, both seats well represented.
    assert 300 < len(rows) < 600 and 100 < seconds < len(rows) - 100
    assert bench.random_game_rows(300, seed=3) == rows  # seeded


def test_read_run_gives_each_eval_env_its_win_rate_games_and_forfeits(tmp_path):
    def rollout(env: str, reward: float, forfeited: float) -> str:
        return json.dumps({"env": env, "reward": reward, "metrics": {"forfeited": forfeited}}) + "\n"

    step = tmp_path / "evals" / "step_20"
    step.mkdir(parents=True)
    lines = [rollout(f"{o}-{s}", 0.0, 0.0) for o, s in bench.EVALS]
    lines += [rollout("random-first", 1.0, 0.0), rollout("random-first", 1.0, 0.0), rollout("optimal-second", 0.0, 1.0)]
    (step / "results.jsonl").write_text("".join(lines))
    metrics = [
        {"process": "orchestrator", "step": 1, "time/step": 2.0, "reward/nim/first/mean": 0.25},
        {"process": "trainer", "step": 1},
        {"process": "orchestrator", "step": 2, "time/step": 4.0, "reward/nim/first/mean": 0.75},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    run = bench.read_run(tmp_path)
    cells = run["curve"][20]
    assert cells[("random", "first")] == (2 / 3, 3, 0.0)
    assert cells[("optimal", "second")] == (0.0, 2, 0.5)
    assert cells[("random", "second")] == (0.0, 1, 0.0)
    assert run["step_s"] == 3.0 and run["train_first"] == [0.25, 0.75]
    assert bench.cell(0.5, 100) == "0.50 ± 0.05"
