"""MCP tool environments through `eval` and `rl` on the real vLLM server: prime-chat offers the tools of
`vf_tools_env`'s servers (one per rollout, one per worker), the tiny model writes the calls, the renderer parses them
from its tokens, the harness runs them against the servers and the results go back as tool messages.

The random tiny model writes no tool call on its own, so each seat's sampling carries a vLLM structured-output regex
(a Qwen3 `<tool_call>` with a given name and arguments) and `allowed_token_ids` without the byte tokens that spell
`<`, so `<tool_call>` can only be its special token, which Qwen3's parser looks for. The tokens are still sampled
by the model on the server and parsed client-side. The tools are stated by `prime_rl.models.renderers`' compact
renderer (Qwen3's with a one-line tool list: the server's 512-token context does not hold Qwen3's tools block).
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import tomli_w
from conftest import API_KEY
from test_rl import orchestrator_metrics, start_rl, trainer_metrics, trainer_steps, wait_rl, write_config

pytestmark = pytest.mark.slow

HERE = str(Path(__file__).resolve().parent)
EVAL = str(Path(sys.executable).parent / "eval")
KEY_VAR = "PRIME_TEST_API_KEY"
RENDERER = {
    "name": "custom",
    "import_path": "prime_rl.models.renderers.CompactToolsQwen3Renderer",
    "enable_thinking": False,
}


@pytest.fixture
def tools_env_path(monkeypatch):
    """`vf_tools_env` importable by eval/rl and by the tool servers verifiers starts."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")])))


def allowed_ids(tokenizer) -> list[int]:
    """Every token id except those whose text has a `<` (the tool and stop markers are their own tokens)."""
    keep = {tokenizer.convert_tokens_to_ids(t) for t in ("<tool_call>", "</tool_call>", "<|im_end|>", "<|endoftext|>")}
    return [i for i in range(len(tokenizer)) if i in keep or "<" not in tokenizer.decode([i])]


def call(name: str, arguments: str) -> str:
    """A regex for one Qwen3 tool call: `name` (a regex) with the JSON `arguments` (a regex)."""
    return r'<tool_call>\n\{"name": "' + name + r'", "arguments": ' + arguments + r"\}\n</tool_call>"


def tools_env(srv, name: str, tools: list[str], servers: list[str], regex: str, turns: int, n: int, **harness) -> dict:
    sampling = {"structured_outputs": {"regex": regex}, "allowed_token_ids": allowed_ids(srv.tokenizer)}
    agent = {"max_turns": turns, "sampling": sampling} | (
        {"harness": {"id": "prime-chat", **harness}} if harness else {}
    )
    return {
        "id": "vf-tools-env",
        "name": name,
        "num_examples": n,
        "args": {"task": {"servers": servers, "tools": tools}},
        "env_args": {"agent": agent},
    }


def test_tools_of_both_lifecycles_and_every_failure_through_eval(tied_server, tmp_path, tools_env_path):
    srv = tied_server
    envs = [
        # Lifecycles: 3 turns, each a `bump` call (the third call's result is sent with the refused fourth turn).
        tools_env(srv, "per-rollout", ["bump"], ["t"], call("t_bump", r"\{\}"), turns=3, n=2),
        tools_env(srv, "per-worker", ["bump"], ["s"], call("s_bump", r"\{\}"), turns=3, n=2),
        # Failures: 2 turns, the first one's call fails.
        tools_env(srv, "raises", ["boom"], ["s"], call("s_boom", r"\{\}"), turns=2, n=1),
        tools_env(srv, "bad-args", ["add"], ["s"], call("s_add", r'\{"a": "x", "b": 1\}'), turns=2, n=1),
        tools_env(srv, "malformed", ["add"], ["s"], call("s_add", r'"oops"'), turns=2, n=1),
        tools_env(srv, "unknown", ["add"], ["s"], call("s_nope", r"\{\}"), turns=2, n=1),
        tools_env(srv, "hangs", ["nap"], ["s"], call("s_nap", r'\{"seconds": 30\}'), turns=2, n=1, tool_timeout=2),
    ]
    (tmp_path / "eval.toml").write_text(tomli_w.dumps({"env": envs}))
    args = [
        EVAL, "@", str(tmp_path / "eval.toml"),
        "--output-dir", str(tmp_path / "out"),
        "--model.name", str(srv.base),
        "--model.renderer", json.dumps(RENDERER),
        "--client.base-url", f'["{srv.url}/v1"]',
        "--client.api-key-var", KEY_VAR,
        "--seq-len", "512",
        "--sampling.max-tokens", "64",
    ]  # fmt: skip
    proc = subprocess.run(args, env={**os.environ, KEY_VAR: API_KEY}, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    by_env = {env["name"]: [r for r in records if r["env"] == env["name"]] for env in envs}
    for name, rows in by_env.items():
        assert rows and all(r["error"] is None for r in rows), (name, rows)
        # One token branch per rollout: every turn's prompt extended the tokens of the turn before (bridged),
        # tool results included: what the trainer gets is what the sampler saw.
        assert all(r["metrics"]["branches"] == 1 and r["metrics"]["tools_offered"] == 1 for r in rows), name
    pids = {}
    for name in ("per-rollout", "per-worker"):
        for r in by_env[name]:
            m = r["metrics"]
            assert r["num_turns"] == 3 and m["tool_calls"] == 3 and m["tool_results"] == 2 and m["tool_errors"] == 0
            assert (m["first_count"], m["last_count"]) == (1, 2)  # state per rollout: counted from 0 each time
            assert m["final_state"] == 3  # the third call ran too; its result went with the refused turn
        pids[name] = [int(r["metrics"]["server_pid"]) for r in by_env[name]]
    assert len(set(pids["per-rollout"])) == 2  # a server per rollout
    assert len(set(pids["per-worker"])) == 1  # one server for the worker's rollouts
    assert not any(psutil.pid_exists(pid) for pid in pids["per-rollout"] + pids["per-worker"])  # torn down
    kinds = {"raises": "err_raised", "bad-args": "err_args", "malformed": "err_json", "unknown": "err_unknown"}
    kinds["hangs"] = "err_timeout"
    for name, kind in kinds.items():
        (r,) = by_env[name]
        assert r["num_turns"] == 2 and r["metrics"]["tool_errors"] == 1 and r["metrics"][kind] == 1, (name, r)


def test_rl_trains_on_tool_calls_of_both_lifecycles(tied_server, tools_env_path):
    """Two steps of `rl` on a tool env whose calls go to a per-rollout or the per-worker server (the model picks):
    the rollouts are multi-turn with tool results in one token branch, rewards vary (the sum `add` returns), and
    the trainer takes both batches. It does not learn from them: the regex-constrained distribution the server
    samples and reports logprobs from is not the model's, so the trainer's mismatch masking drops those tokens
    (`masked_fraction` 1.0); learning to use a tool is the bundled `calculator` environment's business.

    The env runs `echo` (tool results at alpha 0.5): its rl part is grpo's, and the tool result's body, the sum `add`
    returned, trains with ce. The tiny tokenizer spells a digit as one token, so a rollout has 1 echo token for a sum
    under 10 and 2 for one of 10 or more, which is exactly when its reward is 1: echo_tokens = rollouts + their
    summed reward, and the trainer's ce_tokens of the step are those tokens."""
    srv = tied_server
    out = srv.root / "rl" / "tools"
    out.mkdir(parents=True)
    env = tools_env(srv, "tools", ["add"], ["t", "s"], call("[ts]_add", r'\{"a": [1-9], "b": [1-9]\}'), turns=2, n=1)
    del env["num_examples"]
    env["algo"] = {"type": "echo", "roles": {"tool": {"alpha": 0.5}}}
    envs = tomli_w.dumps({"orchestrator": {"env": [env]}})
    config = write_config(out.parent / "tools.toml", srv, out, k=1, steps=2, envs=envs)
    args = ["--orchestrator.model.renderer", json.dumps(RENDERER), "--orchestrator.sampling.max-tokens", "64"]
    proc = start_rl(config, *args, log=out.parent / "tools.log")
    assert wait_rl(proc, 480) == 0, (out.parent / "tools.log").read_text()[-4000:]
    assert trainer_steps(out) == [1, 2]
    rows = orchestrator_metrics(out)
    assert rows and all(m["errors"] == 0 for m in rows), rows
    for m in rows:
        assert m["turns/mean"] == 2 and m["metrics/tool_calls"] == 2 and m["metrics/tool_results"] == 1
        assert m["metrics/branches"] == 1 and m["metrics/tool_errors"] == 0
    assert any(m["reward/std"] > 0 for m in rows)  # the sums differ: a learning signal
    trained = {t["step"]: t for t in trainer_metrics(out)}
    for m in rows:
        assert m["echo_tokens"] == m["rollouts"] + round(m["rollouts"] * m["reward/mean"]), m
        assert trained[m["step"]]["ce_tokens"] == m["echo_tokens"], (trained[m["step"]], m)
        assert 0 < trained[m["step"]]["ce_loss"] < math.inf  # 0.5 x -log pi of the digits, per ce token
