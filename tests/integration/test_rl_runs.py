"""`rl` with two runs (`[[runs]]`) in one LoRA trainer on the session's inference server: each run trains its own
adapter with its own learning rate, a run whose orchestrator dies ends alone while the other finishes, and a third run
started by hand joins the running trainer."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
from conftest import API_KEY
from rl_run import run_metrics, started_pid
from test_rl import KEY_VAR, REVERSE_TEXT, run_pids, start_rl, write_config

RUNS = """
[trainer.model.lora]
rank = 8
[[runs]]
name = "lr-low"
orchestrator = { adapter = { optim = { lr = 1e-3 } } }
[[runs]]
name = "lr-high"
orchestrator = { adapter = { optim = { lr = 1e-2 } } }
"""


@pytest.mark.slow
def test_two_runs_in_one_trainer_and_a_dead_run_ends_alone(tied_server, tmp_path):
    srv, steps = tied_server, 6
    out = srv.root / "rl" / "runs"
    config = write_config(tmp_path / "rl.toml", srv, out, k=1, steps=steps, envs=REVERSE_TEXT, attach=False)
    config.write_text(config.read_text() + RUNS)
    low, high = out / "run_lr-low", out / "run_lr-high"
    log = tmp_path / "rl.log"
    late = out / "run_late"
    proc = start_rl(config, log=log, attach=False)  # several runs share the server: none attaches
    joining = None
    try:
        victim = psutil.Process(started_pid(log, "orchestrator/lr-high"))
        started_pid(log, "trainer")
        # A run added by hand while the trainer runs: the launch config of another run, its own name and directory.
        launched = out / "configs" / "rl" / "orchestrator.lr-low.toml"
        cmd = [str(Path(sys.executable).parent / "orchestrator"), "@", str(launched), "--output-dir", str(late)]
        cmd += ["--adapter.name", "late", "--max-steps", "3"]
        env = {**os.environ, KEY_VAR: API_KEY}
        joining = subprocess.Popen(cmd, stdout=open(tmp_path / "late.log", "w"), stderr=subprocess.STDOUT, env=env)
        # Its batch 2 lives only until the trainer trains it (a fraction of a second): wait on its step line instead.
        while len(run_metrics(high, "orchestrator")) < 2:
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.05)
        tree = run_pids(psutil.Process(proc.pid))
        victim.kill()
        code = proc.wait(300)
        assert joining.wait(60) == 0, (tmp_path / "late.log").read_text()[-3000:]
    finally:
        for p in (proc, joining):
            if p is not None and p.poll() is None:
                p.kill()
        served = httpx.get(f"{srv.url}/weights", headers=srv.headers).json().get("adapters", {})
        for name in ("lr-low", "lr-high", "late"):
            httpx.post(f"{srv.url}/unload_lora_adapter", json={"lora_name": name}, headers=srv.headers)
    console = log.read_text()
    assert code == 1, console[-4000:]
    assert re.search(r"orchestrator/lr-high failed with exit code -?\d+; the other runs go on", console), console
    assert "orchestrator/lr-high failed; the others completed" in console
    trainer_log = (out / "logs" / "trainer.log").read_text()
    assert "run run_lr-high leaves: failed: its orchestrator exited before writing" in trainer_log

    # The surviving run trained every step with its own learning rate, and its adapters reached the server.
    trained = run_metrics(low, "trainer")
    assert [m["step"] for m in trained] == list(range(1, steps + 1))
    assert {m["lr"] for m in trained} == {1e-3}
    assert [m["step"] for m in run_metrics(low, "orchestrator")] == list(range(1, steps + 1))
    assert (low / "broadcasts" / f"step_{steps}" / "adapter_model.safetensors").exists()
    # Batch n is sampled from policy n - 1 - k or newer (k = 1): the last batch from the adapter of step 2 at least.
    assert int(served["lr-low"].removeprefix("step_")) >= steps - 2, served
    assert "run run_late joins in slot" in trainer_log
    assert [m["step"] for m in run_metrics(late, "trainer")] == [1, 2, 3]
    # The dead run's steps before the kill were its own: its learning rate, in its own directory.
    assert {m["lr"] for m in run_metrics(high, "trainer")} <= {1e-2}
    time.sleep(1)
    alive = [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [(p.pid, p.cmdline()) for p in alive]
