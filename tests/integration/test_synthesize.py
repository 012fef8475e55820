"""`synthesize` against the real vLLM server: single- and multi-turn rollouts become rows `sft` trains on as is,
and reward filtering keeps exactly the rollouts at or above the threshold."""

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import API_KEY

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
KEY_VAR = "PRIME_TEST_API_KEY"
ENVS = json.dumps(
    [
        {"id": "reverse-text", "num_examples": 6, "rollouts_per_example": 2},
        {"id": "guess-number", "num_examples": 2, "rollouts_per_example": 2},
    ]
)


def synthesize(srv, out: Path, *extra: str) -> tuple[list[dict], dict]:
    args = [
        str(BIN / "synthesize"),
        "--output-dir", str(out),
        "--model.name", str(srv.base),
        "--model.renderer", '{"name": "qwen3", "enable_thinking": false}',
        "--client.base-url", f'["{srv.url}/v1"]',
        "--client.api-key-var", KEY_VAR,
        "--seq-len", "512",
        "--sampling.max-tokens", "8",
        "--sampling.temperature", "0",  # greedy: two runs produce the same rollouts
        "--env", ENVS,
        *extra,
    ]  # fmt: skip
    proc = subprocess.run(args, env={**os.environ, KEY_VAR: API_KEY}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "data.jsonl").read_text().splitlines()]
    return rows, json.loads((out / "synthesize_summary.json").read_text())


def test_synthesized_rollouts_train_with_sft(tied_server, tmp_path):
    rows, summary = synthesize(tied_server, tmp_path / "all")
    assert summary["rollouts"] == 6 * 2 + 2 * 2 and summary["kept"] == len(rows) == 16
    for row in rows:
        assert [m["role"] for m in row["prompt"]] == ["system", "user"]
        assert row["completion"][0]["role"] == "assistant"
    guess = [r for r in rows if r["env"] == "guess-number"]
    # Multi-turn: the environment's feedback stays between the model's guesses (the tiny model never wins in 1).
    assert all(sum(m["role"] == "assistant" for m in r["completion"]) >= 2 for r in guess)
    assert all(m["role"] in ("assistant", "user") for r in guess for m in r["completion"])
    reverse = [r for r in rows if r["env"] == "reverse-text"]
    assert all(r["prompt"][1]["content"].startswith("Reverse this text: ") for r in reverse)

    # Reward filtering: same greedy rollouts, keep those at or above the median reward.
    threshold = statistics.median(r["reward"] for r in rows)
    kept, summary = synthesize(tied_server, tmp_path / "filtered", "--min-reward", str(threshold))
    expected = sorted((r["env"], r["example_id"], r["reward"]) for r in rows if r["reward"] >= threshold)
    assert sorted((r["env"], r["example_id"], r["reward"]) for r in kept) == expected
    assert summary["below min_reward"] == 16 - len(expected)

    # sft reads the file as it is.
    sft = [
        str(BIN / "sft"),
        "--output-dir", str(tmp_path / "sft"),
        "--model.name", str(tied_server.base),
        "--model.dtype", "float32",
        "--data.name", str(tmp_path / "all" / "data.jsonl"),
        "--batch-size", "8",
        "--seq-len", "512",
        "--max-steps", "2",
    ]  # fmt: skip
    proc = subprocess.run(sft, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = map(json.loads, (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines())
    losses = [m["loss"] for m in lines if "loss" in m]
    assert len(losses) == 2 and all(0 < loss < 20 for loss in losses)
