"""The control plane under attack, end to end: `rl` on the shared server while strangers flood and trickle the trainer's
weight-broadcast store, and a model-written command in a `bash`-harness seat (verifiers' default `subprocess` runtime)
looks for the run's keys everywhere a process of the same user can look without a debugger: its environment and
every process's initial environment (`/proc/<pid>/environ`, which `ps e` shows too).

The random tiny model writes no command on its own: the seat's sampling carries a structured-output regex that is the
one tool call (as `test_tool_envs` does), which the server samples token by token and the renderer parses."""

import json
import os
import re
from pathlib import Path

import pytest
import tomli_w
from conftest import RUN_SECRET
from test_rl import orchestrator_metrics, start_rl, trainer_steps, wait_rl, write_config
from test_tool_envs import RENDERER, allowed_ids, call

from prime_rl.utils.secret import derive_keys

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent


def regex_literal(text: str) -> str:
    """`text` as a regex that matches it alone, escaping only what the server's regex engine reads as syntax."""
    return re.sub(r"([()\[\]{}?*+|^$\\.])", r"\\\1", text)


def bash_seat_env(srv, out_dir: Path) -> dict:
    """A seat whose harness is verifiers' `bash` agent on the default runtime, made to run one command: write its
    environment and every process's initial environment to a file of its own under `out_dir`."""
    command = f"(env; cat /proc/[0-9]*/environ) > {out_dir}/seen-$$ 2>/dev/null"
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


def test_no_model_written_command_finds_a_key_of_the_run(tied_server, tmp_path, monkeypatch):
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
    assert wait_rl(proc, 600) == 0, log.read_text()[-4000:]
    assert trainer_steps(out) == [1, 2, 3]
    rows = orchestrator_metrics(out)
    assert rows and all(m["errors"] == 0 for m in rows), rows

    keys = derive_keys(RUN_SECRET)  # what `rl` derived from the secret it was given, as the server did
    seen = [p.read_bytes() for p in seen_dir.glob("seen-*")]
    assert seen, "the model-written command never ran"
    for text in seen:
        assert b"PATH=" in text and b"PRIME_RL_LAUNCHER_PID=" in text  # it did read environments, the run's among them
        for value in (RUN_SECRET, keys.store.hex(), keys.http):
            assert value.encode() not in text
