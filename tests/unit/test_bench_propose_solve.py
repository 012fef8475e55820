"""benchmarks/bench_propose_solve.py's pure parts: the SFT rows (valid proposals, right sums) and the
hierarchical_grpo rule written out by hand on samples-table groups (numbers worked by hand)."""

import json

import pytest
from propose_solve import judge_proposal
from script_module import load_script

bench = load_script("benchmarks/bench_propose_solve.py")


def test_sft_rows_are_valid_proposals_and_right_sums():
    rows = bench.sft_rows(200, seed=1)
    proposals, answers = rows[::2], rows[1::2]
    for row in proposals:
        assert row["prompt"] == [{"role": "user", "content": bench.source_prompt("+", 1, 9)}]
        assert judge_proposal(row["completion"][0]["content"], "+", 1, 9)["valid"]
    for row in answers:
        a, b = map(int, bench.SOLVE.search(row["prompt"][0]["content"]).group(1).split(" + "))
        assert 1 <= a <= 9 and 1 <= b <= 9 and row["completion"][0]["content"] == str(a + b)
    assert bench.sft_rows(200, seed=1) == rows


def group(proposals, solvers):
    """Samples-table rows of one group: each episode's proposer, then its 3 solvers (no prompt when not run)."""
    rows = []
    for (completion, reward), attempts in zip(proposals, solvers, strict=True):
        rows.append({"prompt": bench.source_prompt("+", 1, 9), "completion": completion, "reward": reward})
        for problem, answer, correct in attempts:
            prompt = bench.solve_prompt(problem) if problem else ""
            rows.append({"prompt": prompt, "completion": answer, "reward": correct})
    return rows


def test_hand_advantages_of_a_group_with_one_invalid_proposal():
    # Proposals: invalid (0) and valid with 2 of 3 right (learnability 2/3): proposer mean 1/3 -> -1/3, +1/3.
    # Solvers of the valid one [1, 1, 0]: mean 2/3 -> 1/3, 1/3, -2/3; the invalid one's never ran: 0 each.
    rows = group(
        [("Problem: 6 + 1\nAnswer: 8", 0.0), ("Problem: 3 + 2\nAnswer: 5", 2 / 3)],
        [[(None, "", 0.0)] * 3, [("3 + 2", "5", 1.0), ("3 + 2", "5", 1.0), ("3 + 2", "6", 0.0)]],
    )
    expected = [-1 / 3, 0.0, 0.0, 0.0, 1 / 3, 1 / 3, 1 / 3, -2 / 3]
    assert bench.hand_advantages(rows) == pytest.approx(expected, abs=1e-12)


def test_hand_advantages_refuse_rows_that_are_not_one_group():
    rows = group(
        [("Problem: 4 + 5\nAnswer: 9", 2 / 3), ("Problem: 8 + 4\nAnswer: 12", 0.0)],
        [[("4 + 5", "8", 0.0), ("4 + 5", "9", 1.0), ("4 + 5", "8", 0.0)], [("8 + 4", "12", 1.0)] * 3],
    )
    # Proposers [2/3, 0] (1 of 3 right; all 3 right): mean 1/3. Solvers [0, 1, 0]: mean 1/3; [1, 1, 1]: 0 each.
    expected = [1 / 3, -1 / 3, 2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0]
    assert bench.hand_advantages(rows) == pytest.approx(expected, abs=1e-12)
    assert bench.hand_advantages(rows[:7]) is None  # a row short
    swapped = rows[:1] + rows[5:8] + rows[4:5] + rows[1:4]  # solvers under the other episode's proposer
    assert bench.hand_advantages(swapped) is None


def test_read_run_checks_every_whole_group_against_the_logged_advantages(tmp_path):
    good = group(
        [("Problem: 6 + 1\nAnswer: 8", 0.0), ("Problem: 3 + 2\nAnswer: 5", 2 / 3)],
        [[(None, "", 0.0)] * 3, [("3 + 2", "5", 1.0), ("3 + 2", "5", 1.0), ("3 + 2", "6", 0.0)]],
    )
    logged = [-1 / 3, 0.0, 0.0, 0.0, 1 / 3, 1 / 3, 1 / 3, -0.5]  # the last one off by 1/6
    columns = ["env", "prompt", "completion", "reward", "advantage"]
    table = [["propose-solve", r["prompt"], r["completion"], r["reward"], a] for r, a in zip(good, logged, strict=True)]
    (tmp_path / "tables.jsonl").write_text(json.dumps({"step": 3, "columns": columns, "rows": table}) + "\n")
    metrics = [
        {"process": "orchestrator", "step": 3, "reward/propose-solve/solver/mean": 2 / 9},
        {"process": "orchestrator", "step": 4, "reward/propose-solve/solver/mean": 0.0, "metrics/valid_proposal": 0.0},
    ]
    metrics[0] |= {"metrics/valid_proposal": 0.5, "metrics/solve_rate": 2 / 3}
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    run = bench.read_run(tmp_path)
    assert run["groups"] == 1 and run["worst"] == pytest.approx(1 / 6, abs=1e-12)
    # Shown: the proposers' rewards differ and a solver's advantage is not 0, so both levels of the rule act.
    assert run["checked"]["step"] == 3 and run["checked"]["hand"][7] == pytest.approx(-2 / 3, abs=1e-12)
    assert run["valid"] == [0.5, 0.0] and run["rate"] == [2 / 3, None] and run["solve"] == [2 / 9, 0.0]
