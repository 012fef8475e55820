"""Rollouts/s of an MCP tool environment with our in-process `prime-chat` harness against verifiers' `null` harness
(a `uv` script subprocess per rollout), both through the real `eval` CLI against one real vLLM server.

    uv run python benchmarks/bench_tool_env.py
    uv run python benchmarks/bench_tool_env.py --rollouts 64 --harness prime-chat null --servers s t

Starts one vLLM server on a local tiny model (context 1024, so Qwen3's own renderer and its full tools block fit),
then per (harness, tool server lifecycle) runs `eval` on `vf_tools_env` (tests/integration): every rollout makes
two model turns, the first a `bump` call that the harness runs against the env's MCP server (`s`: one server for
the worker; `t`: one started per rollout). The random tiny model is made to write the call by a vLLM
structured-output regex, exactly as the integration tests do. Reported: rollouts/s over eval's rollout phase (its
`seconds` in summary.json), errors, and whether every rollout ran its tool call. Takes /tmp/bench.lock exclusively
(timings on a shared 2-core machine); prints a markdown table and writes it as JSON to `{output_dir}/bench_tool_env.json`.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tomli_w

from prime_rl.inference.process import InferenceServer
from prime_rl.models.tiny import TinyModelConfig, build_tiny_model

ROOT = Path(__file__).resolve().parents[1]
TESTS = str(ROOT / "tests" / "integration")
EVAL = str(Path(sys.executable).parent / "eval")
API_KEY = "bench-key"
KEY_VAR = "PRIME_BENCH_API_KEY"
REGEX = r'<tool_call>\n\{"name": "NAME_bump", "arguments": \{\}\}\n</tool_call>'


def allowed_ids(tokenizer) -> list[int]:
    """Every token id except those whose text has a `<`: `<tool_call>` can only be its own token (Qwen3's parser
    looks for it), as in tests/integration/test_tool_envs.py."""
    keep = {tokenizer.convert_tokens_to_ids(t) for t in ("<tool_call>", "</tool_call>", "<|im_end|>", "<|endoftext|>")}
    return [i for i in range(len(tokenizer)) if i in keep or "<" not in tokenizer.decode([i])]


def run_eval(server: InferenceServer, base: Path, out: Path, harness: str, scope: str, rollouts: int, allowed) -> dict:
    sampling = {"structured_outputs": {"regex": REGEX.replace("NAME", scope)}, "allowed_token_ids": allowed}
    env = {
        "id": "vf-tools-env",
        "name": "tools",
        "num_examples": rollouts,
        "args": {"num_tasks": rollouts, "task": {"servers": [scope], "tools": ["bump"]}},
        "harness": harness,
        "env_args": {"agent": {"max_turns": 2, "sampling": sampling}},
    }
    out.mkdir(parents=True)
    (out / "eval.toml").write_text(tomli_w.dumps({"env": [env]}))
    args = [
        EVAL, "@", str(out / "eval.toml"), "--output-dir", str(out),
        "--model.name", str(base), "--model.renderer", '{"name": "qwen3", "enable_thinking": false}',
        "--client.base-url", f'["{server.url}/v1"]', "--client.api-key-var", KEY_VAR,
        "--seq-len", "1024", "--sampling.max-tokens", "48", "--max-concurrent", "64",
    ]  # fmt: skip
    path = os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")]))
    started = time.perf_counter()
    proc = subprocess.run(
        args, env={**os.environ, KEY_VAR: API_KEY, "PYTHONPATH": path}, capture_output=True, text=True, timeout=1800
    )
    wall = time.perf_counter() - started
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"eval ({harness}, {scope}) failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    seconds = json.loads((out / "summary.json").read_text())["policies"][0]["envs"]["tools"]["seconds"]
    ok = [r for r in records if r["error"] is None]
    return {
        "harness": harness,
        "servers": {"s": "worker-shared", "t": "per rollout"}[scope],
        "rollouts": len(records),
        "errors": len(records) - len(ok),
        "tool_called": sum(r["metrics"].get("tool_results", 0) >= 1 for r in ok),
        "seconds": seconds,
        "rollouts_per_s": round(len(records) / seconds, 2),
        "eval_wall_s": round(wall, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=32, help="rollouts per (harness, servers) run")
    parser.add_argument("--harness", nargs="+", default=["prime-chat", "null"])
    parser.add_argument("--servers", nargs="+", default=["s", "t"], choices=["s", "t"])
    parser.add_argument("--output-dir", type=Path, default=None)
    args = parser.parse_args()
    out = args.output_dir or Path(tempfile.mkdtemp(prefix="bench_tool_env_"))
    out.mkdir(parents=True, exist_ok=True)
    with open("/tmp/bench.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a timing benchmark: nobody else's heavy work meanwhile
        base = build_tiny_model(TinyModelConfig(output=out / "model"))
        extra = ["--model.enforce-eager", "--model.max-model-len", "1024", "--max-num-seqs", "64"]
        server = InferenceServer(base, out / "server", extra=extra, api_key=API_KEY)
        try:
            server.wait_healthy()
            from transformers import AutoTokenizer

            allowed = allowed_ids(AutoTokenizer.from_pretrained(base))
            rows = []
            for scope in args.servers:
                for harness in args.harness:
                    rows.append(
                        run_eval(server, base, out / f"{harness}-{scope}", harness, scope, args.rollouts, allowed)
                    )
                    print(json.dumps(rows[-1]), flush=True)
        finally:
            server.stop()
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(r[c]) for c in columns) + " |" for r in rows]
    print("\n".join(lines))
    (out / "bench_tool_env.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
