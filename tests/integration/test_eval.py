"""`eval` against the real vLLM server on the tiny model: results and summary agree, several policies in one
server lifetime, and failing endpoints give per-rollout errors and a summary instead of a stack trace."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import API_KEY, make_adapter

from prime_rl.eval.eval import summarize
from prime_rl.models.tiny import perturb_weights

pytestmark = pytest.mark.slow

EVAL = str(Path(sys.executable).parent / "eval")
KEY_VAR = "PRIME_TEST_API_KEY"


def eval_args(srv, out: Path, *extra: str, url: str | None = None) -> list[str]:
    return [
        EVAL,
        "--output-dir", str(out),
        "--model.name", str(srv.base),
        "--model.renderer", '{"name": "qwen3", "enable_thinking": false}',
        "--client.base-url", f'["{url or srv.url}/v1"]',
        "--client.api-key-var", KEY_VAR,
        "--seq-len", "512",
        "--sampling.max-tokens", "8",
        *extra,
    ]  # fmt: skip


def run_eval(srv, out: Path, *extra: str, key: str = API_KEY, url: str | None = None, timeout: float = 300):
    args = eval_args(srv, out, *extra, url=url)
    return subprocess.run(args, env={**os.environ, KEY_VAR: key}, capture_output=True, text=True, timeout=timeout)


TWO_ENVS = json.dumps(
    [
        {"id": "reverse-text", "num_examples": 5, "rollouts_per_example": 2, "args": {"seed": 7}},
        {"id": "arithmetic", "num_examples": 3, "rollouts_per_example": 4},
    ]
)


def test_results_and_summary_agree(tied_server, tmp_path):
    proc = run_eval(tied_server, tmp_path, "--env", TWO_ENVS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(records) == 5 * 2 + 3 * 4
    fields = {"policy", "env", "example_id", "rollout", "prompt", "completion", "reward", "metrics", "error"}
    assert all(fields <= r.keys() for r in records)
    assert {r["env"] for r in records} == {"reverse-text", "arithmetic"}
    assert all(r["error"] is None and r["completion_tokens"] >= 1 for r in records)
    assert all(r["prompt"].startswith("Reverse this text: ") for r in records if r["env"] == "reverse-text")
    summary = json.loads((tmp_path / "summary.json").read_text())
    (policy,) = summary["policies"]
    for env, n in (("reverse-text", 2), ("arithmetic", 4)):
        mine = [r for r in records if r["env"] == env]
        recomputed = summarize(mine, n, 1.0)
        got = policy["envs"][env]
        assert got["reward_mean"] == pytest.approx(sum(r["reward"] for r in mine) / len(mine))
        for key in ("reward_mean", "reward_std", f"pass@{n}", f"avg@{n}", "completion_tokens_total", "metrics"):
            assert got[key] == recomputed[key], key
    assert "reward/lcs" in policy["envs"]["reverse-text"]["metrics"]
    assert "pass@1" in policy["envs"]["arithmetic"] and "pass@4" in policy["envs"]["arithmetic"]
    assert proc.stdout.strip().splitlines()[-2].startswith("reverse-text reward: base ")


def test_base_an_adapter_and_two_saved_steps_in_one_server_lifetime(tied_server, tmp_path):
    srv = tied_server
    # The server is shared by the session: earlier tests may have left trained weights on it. Start from its own.
    assert httpx.post(f"{srv.url}/reload_weights", headers=srv.headers, json={}, timeout=60).status_code == 200
    weights = srv.root / "eval_weights"
    perturb_weights(srv.base, weights / "step_1", scale=8.0, seed=1)
    perturb_weights(srv.base, weights / "step_2", scale=8.0, seed=2)
    adapter, _ = make_adapter(srv.base, srv.root / "eval_adapter", seed=3)
    env = json.dumps([{"id": "reverse-text", "num_examples": 4, "rollouts_per_example": 2}])
    extra = ["--weights", json.dumps({"lora-eval": str(adapter)}), "--weights-dir", str(weights)]
    proc = run_eval(srv, tmp_path, "--env", env, *extra, "--sampling.temperature", "0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    labels = ["base", "lora-eval", "step_1", "step_2"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [p["label"] for p in summary["policies"]] == labels
    table = proc.stdout.splitlines()
    assert sum(line.split(" | ")[0].strip() in labels for line in table) == 4
    assert (tmp_path / "reward_vs_step.png").stat().st_size > 1000
    # Greedy decoding: each policy's completions are its own (heavily perturbed weights, or an adapter that moves
    # every weight by ~5x its spread, answer differently): the adapter was requested by its name.
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    by_policy = {p: [r["completion"] for r in records if r["policy"] == p] for p in labels}
    assert by_policy["base"] != by_policy["lora-eval"] != by_policy["step_1"] != by_policy["step_2"]
    served = httpx.get(f"{srv.url}/weights", headers=srv.headers).json()
    assert "lora-eval" not in served.get("adapters", {})  # someone else's server: our adapter is unloaded again
    # The server was put back on its own weights: a greedy request matches the base policy's answer again.
    rerun = run_eval(srv, tmp_path / "again", "--env", env, "--sampling.temperature", "0")
    again = [json.loads(line)["completion"] for line in (tmp_path / "again" / "results.jsonl").read_text().splitlines()]
    assert rerun.returncode == 0 and again == by_policy["base"]


def test_chat_api_works_and_counts_tokens_from_usage(tied_server, tmp_path):
    """`--api chat` talks plain /v1/chat/completions (what OpenAI and every other endpoint serve): the server
    applies its own chat template, and the token counts come from its usage report."""
    env = json.dumps([{"id": "reverse-text", "num_examples": 4, "rollouts_per_example": 1}])
    by_api = {}
    for api in ("tokens", "chat"):
        proc = run_eval(tied_server, tmp_path / api, "--env", env, "--sampling.temperature", "0", "--api", api)
        assert proc.returncode == 0, proc.stderr[-3000:]
        records = [json.loads(line) for line in (tmp_path / api / "results.jsonl").read_text().splitlines()]
        by_api[api] = sorted(records, key=lambda r: r["example_id"])  # the file is in completion order
    assert all(r["error"] is None and 1 <= r["completion_tokens"] <= 8 for r in by_api["chat"])
    # Our renderer (enable_thinking false) prefills an empty think block; the server's template, given no
    # template arguments, does not: the prompts differ by exactly that block, on every example.
    tok = tied_server.tokenizer
    messages = [{"role": "user", "content": "x"}]
    prefill = len(tok.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False)["input_ids"])
    prefill -= len(tok.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])
    assert prefill > 0
    assert [r["prompt_tokens"] + prefill for r in by_api["chat"]] == [r["prompt_tokens"] for r in by_api["tokens"]]
    assert [r["prompt"] for r in by_api["chat"]] == [r["prompt"] for r in by_api["tokens"]]


def test_bad_key_is_an_error_per_rollout_not_a_crash(tied_server, tmp_path):
    env = json.dumps([{"id": "reverse-text", "num_examples": 3, "rollouts_per_example": 2}])
    proc = run_eval(tied_server, tmp_path, "--env", env, key="wrong-key")
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr + proc.stdout
    assert "6 rollout(s) failed" in proc.stderr
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(records) == 6 and all(r["error"] for r in records)
    assert json.loads((tmp_path / "summary.json").read_text())["policies"][0]["envs"]["reverse-text"]["errors"] == 6


def test_unreachable_server_is_retried_then_recorded(tied_server, tmp_path):
    env = json.dumps([{"id": "reverse-text", "num_examples": 2, "rollouts_per_example": 2}])
    proc = run_eval(
        tied_server, tmp_path, "--env", env, "--max-retries", "2", "--retry-backoff", "0.2",
        url="http://127.0.0.1:9",  # nothing listens on the discard port
    )  # fmt: skip
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr + proc.stdout
    assert "retry 2/2" in proc.stderr
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(records) == 4 and all(r["error"] for r in records)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["policies"][0]["envs"]["reverse-text"]["errors"] == 4


def test_multi_agent_env_counts_every_seat_and_seats_that_never_acted(tied_server, tmp_path):
    """nim (two seats) with piles of at most 3 sticks: the first seat wins at once with a valid move, or forfeits,
    so the second seat often never acts. Such a trace has a reward and no tokens: not an error (it used to be
    reported as one, and eval exited 1). Each game has exactly one winner, so the seats' mean rewards sum to 1.
    The progress bar counts episodes (6 examples x 2), not the rollouts they yield (one per seat)."""
    env = json.dumps([{"id": "nim", "num_examples": 6, "rollouts_per_example": 2, "args": {"max_sticks": 3}}])
    proc = run_eval(tied_server, tmp_path, "--env", env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(records) == 6 * 2 * 2 and all(r["error"] is None for r in records)
    assert sorted({r["seat"] for r in records}) == ["first", "second"]
    idle = [r for r in records if r["completion_tokens"] == 0]
    assert idle and all(r["seat"] == "second" for r in idle)  # the first seat always moves
    nim = json.loads((tmp_path / "summary.json").read_text())["policies"][0]["envs"]["nim"]
    first, second = nim["seats"]["first"], nim["seats"]["second"]
    assert first["rollouts"] == second["rollouts"] == 12 and nim["errors"] == 0
    assert first["reward_mean"] + second["reward_mean"] == pytest.approx(1.0)
    assert nim["reward_mean"] == pytest.approx(0.5)
    assert "pass@2" in first and "pass@2" in second  # per seat: two rollouts of each example each
    assert "nim/first reward: base " in proc.stdout and "nim/second reward: base " in proc.stdout
    assert "12/12" in proc.stderr and "24/12" not in proc.stderr


def test_a_bad_environment_fails_in_seconds_and_stops_the_server_it_started(tmp_path):
    """`eval --inference` loads the environments while its server starts: a bad environment config is an error in
    seconds, not after vLLM's start-up, and the server started meanwhile is stopped (nothing left running)."""
    args = [EVAL, "--output-dir", str(tmp_path), "--model.name", str(tmp_path), "--inference"]
    args += ["--env", json.dumps([{"id": "nim", "env_args": {"first": {"max_turns": "many"}}}])]
    start = time.monotonic()
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "eval: error: environment 'nim'" in proc.stderr and "max_turns" in proc.stderr
    assert time.monotonic() - start < 60  # the server's start is not waited for
    pid = int(re.search(r"started inference \(pid (\d+)\)", (tmp_path / "logs" / "eval.log").read_text()).group(1))
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_sigterm_mid_eval_cancels_the_rollouts_and_leaves_no_working_directory(tied_server, tmp_path):
    """A SIGTERM (a Kubernetes Job stopped, `timeout`, a scheduler's preemption) unwinds eval as Ctrl-C does: the
    rollouts in flight are cancelled and verifiers removes each one's working directory under ~/.cache/verifiers,
    exit 143. It used to end the process at once, leaving up to `max_concurrent` directories behind per stop."""
    home = tmp_path / "home"
    runtimes = home / ".cache" / "verifiers" / "runtimes" / "subprocess"
    env = json.dumps([{"id": "reverse-text", "num_examples": 1000, "rollouts_per_example": 2}])
    args = eval_args(tied_server, tmp_path / "out", "--env", env)
    environ = {**os.environ, KEY_VAR: API_KEY, "HOME": str(home)}
    proc = subprocess.Popen(args, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (runtimes.is_dir() and any(runtimes.iterdir())):  # rollouts running
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM and "eval stopped (SIGTERM)" in err, err[-3000:]
    assert "Traceback" not in err + out, err[-3000:]
    assert sorted(p.name for p in runtimes.iterdir()) == []
    assert not (tmp_path / "out" / "summary.json").exists()


def test_evals_own_server_takes_a_fresh_token_that_nobody_else_holds(tied_server, tmp_path, monkeypatch):
    """`eval --inference` serves on loopback, which is no boundary: any local user, or a web page's cross-site
    `text/plain` POST, could swap the served weights of a server without a token (issue 52, finding 7). Its server
    takes a fresh random token on stdin, which this process holds in memory (and, for verifiers' clients, in a
    variable set after it started); the server's command line and environment hold none."""
    from prime_rl.config.loader import load_config
    from prime_rl.eval.config import EvalConfig
    from prime_rl.eval.rollouts import start_inference, wait_served
    from prime_rl.utils.net import free_port
    from prime_rl.utils.processes import stop_all

    monkeypatch.setenv(KEY_VAR, "stale-value")  # restored after the test; eval replaces it with its server's token
    port = free_port()
    args = ["--output-dir", str(tmp_path), "--model.name", str(tied_server.base), "--client.api-key-var", KEY_VAR]
    args += ["--inference", "--inference.server.port", str(port), "--inference.model.enforce-eager"]
    config, _ = load_config(EvalConfig, "eval", args + ["--inference.model.max-model-len", "512"])
    server = start_inference("eval", config, [])
    try:
        wait_served(config, server)
        token, url = os.environ[KEY_VAR], f"http://127.0.0.1:{port}"
        assert len(token) == 64 and int(token, 16) >= 0 and token != "stale-value"
        assert httpx.get(f"{url}/health").status_code == 200  # public
        assert httpx.get(f"{url}/weights").status_code == 401
        forged = httpx.post(f"{url}/reload_weights", content=b"{}", headers={"Content-Type": "text/plain"})
        assert forged.status_code == 401  # what a browser sends cross-site without asking
        assert httpx.get(f"{url}/weights", headers={"Authorization": f"Bearer {token}"}).status_code == 200
        pid = server.proc.pid
        seen = Path(f"/proc/{pid}/cmdline").read_bytes() + Path(f"/proc/{pid}/environ").read_bytes()
        assert token.encode() not in seen
    finally:
        stop_all([server], grace=15.0)
