"""The control plane under attack, end to end: `rl` on the shared server while strangers flood and trickle the trainer's
weight-broadcast store (`tests/unit/store_attacker.py`, without the run secret), and a model-written command in a
`bash`-harness seat (verifiers' default `subprocess` runtime) looks for the run's keys everywhere a process of the
same user can look without a debugger: its environment and every process's initial environment
(`/proc/<pid>/environ`, which `ps e` shows too). Before issue 52 either attack alone stopped the run (every broadcast
answered 502; no step for 240 s), and the command printed the run secret in full.

The random tiny model writes no command on its own: the seat's sampling carries a structured-output regex that is the
one tool call (as `test_tool_envs` does), which the server samples token by token and the renderer parses."""

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import tomli_w
from conftest import RUN_SECRET
from test_rl import orchestrator_metrics, start_rl, trainer_steps, wait_rl, write_config
from test_tool_envs import RENDERER, allowed_ids, call

from prime_rl.utils.secret import derive_keys

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
ATTACKER = HERE.parent / "unit" / "store_attacker.py"
ATTACKS = (["flood", "--threads", "64"], ["trickle", "--connections", "64", "--every", "2"])
"""A reconnect flood (64 threads connecting and closing as fast as they can) and a slow trickle (64 connections, a
byte every 2 s): each alone held every handshake slot of the store before issue 52."""


def attack_when_listening(port: int, log: Path, timeout: float = 300) -> list[subprocess.Popen]:
    """The attackers, started once the trainer's store listens on `port` (a trickle opened against a closed port would
    just be refused)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert time.monotonic() < deadline, f"the trainer's store never listened:\n{log.read_text()[-3000:]}"
            time.sleep(0.1)
    return [
        subprocess.Popen(
            [sys.executable, str(ATTACKER), *attack[:1], "127.0.0.1", str(port), "--seconds", "600", *attack[1:]],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for attack in ATTACKS
    ]


def regex_literal(text: str) -> str:
    """`text` as a regex that matches it alone, escaping only what the server's regex engine reads as syntax."""
    return re.sub(r"([()\[\]{}?*+|^$\\.])", r"\\\1", text)


def bash_seat_env(srv, out_dir: Path) -> dict:
    """A seat whose harness is verifiers' `bash` agent on the default runtime, made to run one command: write its
    environment and every process's initial environment to a file of its own under `out_dir` (`part-*` until complete:
    the end of the run may stop a command midway)."""
    command = f"cd {out_dir}; (env; cat /proc/[0-9]*/environ) > part-$$ 2>/dev/null; mv part-$$ seen-$$"
    arguments = regex_literal(json.dumps({"command": command}))
    sampling = {
        "structured_outputs": {"regex": call("bash", arguments)},
        "allowed_token_ids": allowed_ids(srv.tokenizer),
    }
    harness = {"id": "bash", "edit": False, "compaction": "None"}  # "None": null in TOML
    return {
        "id": "vf-tiny-env",
        "name": "agent-code",
        "ratio": 1,
        "env_args": {"agent": {"max_turns": 1, "harness": harness, "sampling": sampling}},
    }


def test_a_run_under_store_attack_keeps_stepping_and_no_model_written_command_finds_a_key(
    tied_server, tmp_path, monkeypatch
):
    srv = tied_server
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
    out = srv.root / "rl" / "control-plane"
    out.mkdir(parents=True)
    seen_dir = tmp_path / "seen"
    seen_dir.mkdir()
    envs = tomli_w.dumps({"orchestrator": {"env": [{"id": "reverse-text", "ratio": 1}, bash_seat_env(srv, seen_dir)]}})
    extra = f'[weight_broadcast]\ntype = "gloo"\nport = {srv.broadcast_port}\n'
    config = write_config(out.parent / "control-plane.toml", srv, out, k=1, steps=3, extra=extra, envs=envs)
    log = out.parent / "control-plane.log"
    args = ["--orchestrator.model.renderer", json.dumps(RENDERER), "--orchestrator.sampling.max-tokens", "200"]
    proc = start_rl(config, *args, log=log)
    attackers = attack_when_listening(srv.broadcast_port, log)
    try:
        assert wait_rl(proc, 600) == 0, log.read_text()[-4000:]
    finally:
        for attacker in attackers:
            attacker.terminate()
        # The session's shared server goes back to its own weights for the tests after this one.
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(f"{srv.url}/reload_weights", headers=srv.headers, json={}, timeout=60)
    summaries = [json.loads(a.communicate(timeout=60)[0].splitlines()[-1]) for a in attackers]
    assert summaries[0]["connections"] > 1000 and summaries[1]["opened"] >= 64, summaries  # the attack was on
    assert trainer_steps(out) == [1, 2, 3]
    rows = orchestrator_metrics(out)
    assert rows and all(m["errors"] == 0 for m in rows), rows
    orchestrator_log = (out / "logs" / "orchestrator.log").read_text()
    assert re.search(r"policy step \d+ -> \d+ on 1 server", orchestrator_log)  # weights went by broadcast meanwhile
    trainer_log = (out / "logs" / "trainer.log").read_text()
    assert re.search(r"connection\(s\) from 127\.0\.0\.1 did not authenticate", trainer_log)  # the operator sees it

    keys = derive_keys(RUN_SECRET)  # what `rl` derived from the secret it was given, as the server did
    seen = [p.read_bytes() for p in seen_dir.glob("seen-*")]
    assert seen, "the model-written command never ran to the end"
    for text in seen:
        assert b"PATH=" in text and b"PRIME_RL_LAUNCHER_PID=" in text  # it did read environments, the run's among them
    for text in seen + [p.read_bytes() for p in seen_dir.glob("part-*")]:
        for value in (RUN_SECRET, keys.store.hex(), keys.http):
            assert value.encode() not in text
