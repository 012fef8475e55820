"""`rl` end to end on the tiny model: async levels, failures of each process, resume, bad configs.

Most runs use the session's inference server as an external server (`orchestrator.client.base_url`, no
`[inference]` section) to save vLLM's ~100 s start; the inference-failure test lets `rl` start its own."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import API_KEY

from prime_rl.batch import batch_path, read_batch

RL = str(Path(sys.executable).parent / "rl")
KEY_VAR = "PRIME_TEST_API_KEY"


def write_config(
    path: Path, srv, out: Path, k: int, steps: int, managed_inference: bool = False, extra: str = ""
) -> Path:
    client = (
        "" if managed_inference else f'[orchestrator.client]\nbase_url = ["{srv.url}/v1"]\napi_key_var = "{KEY_VAR}"\n'
    )
    inference = "[inference.model]\nmax_model_len = 512\nenforce_eager = true\n" if managed_inference else ""
    path.write_text(
        f"""
output_dir = "{out}"
max_steps = {steps}
max_async_level = {k}
seq_len = 512
trainer_gpu_ids = [0]
{extra}
[model]
name = "{srv.base}"

{inference}
[orchestrator]
batch_size = 8
rollouts_per_example = 4
workers = 1
weights_poll_interval = 0.2
[orchestrator.model]
renderer = {{ name = "qwen3", enable_thinking = false }}
[orchestrator.sampling]
max_tokens = 12
[[orchestrator.env]]
id = "reverse-text"
{client}
[trainer.optim]
lr = 1e-3
"""
    )
    return path


def start_rl(config: Path, *args: str, log: Path) -> subprocess.Popen:
    env = {**os.environ, KEY_VAR: API_KEY}
    return subprocess.Popen([RL, "@", str(config), *args], stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)


def trainer_steps(out: Path, skip_lines: int = 0) -> list[int]:
    lines = (out / "metrics.jsonl").read_text().splitlines()[skip_lines:]
    return [m["step"] for m in map(json.loads, lines) if m["process"] == "trainer"]


@pytest.mark.slow
@pytest.mark.parametrize("k", [0, 1, 2])
def test_rl_respects_the_async_level_and_trains_every_batch_once(tied_server, k):
    srv = tied_server
    out = srv.root / "rl" / f"k{k}"
    out.mkdir(parents=True)
    config = write_config(out.parent / f"k{k}.toml", srv, out, k=k, steps=4)
    # k=1 also checks the W&B sink of the real processes, offline: no network needed.
    wandb = ["--wandb.name", "exp", "--wandb.offline", "--orchestrator.log-extras.interval", "2"] if k == 1 else []
    proc = start_rl(config, *wandb, log=out.parent / f"k{k}.log")
    assert proc.wait(600) == 0, (out.parent / f"k{k}.log").read_text()[-4000:]
    console = (out.parent / f"k{k}.log").read_text()
    assert "[trainer] step 4 |" in console and "[orchestrator] step 4 |" in console
    assert trainer_steps(out) == [1, 2, 3, 4]  # every batch consumed exactly once, in order
    for n in range(1, 5):
        versions = [v for s in read_batch(batch_path(out, n)).samples for v in s.policy_versions]
        assert min(versions) >= n - 1 - k, (n, versions)  # realised lag never exceeds k
        assert max(versions) <= n - 1  # and nothing claims a policy the trainer had not published yet
    if k == 1:
        check_offline_wandb_runs(out)


def check_offline_wandb_runs(out: Path) -> None:
    """Two offline runs, `exp-trainer` and `exp-orchestrator`, in group `exp`, with their step metrics (steps 1-4)
    and, from the orchestrator, the samples table and the reward histogram (log extras at steps 2 and 4)."""
    from wandb_offline import wandb_records

    runs = {}
    for path in out.glob("wandb/offline-run-*/run-*.wandb"):
        records = list(wandb_records(path))
        (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
        history = [r.history for r in records if r.WhichOneof("record_type") == "history"]
        keys = {item.key or "/".join(item.nested_key) for h in history for item in h.item}
        runs[run.display_name] = (run.run_group, keys, sorted({h.step.num for h in history}))
    assert set(runs) == {"exp-trainer", "exp-orchestrator"}, runs.keys()
    group, keys, steps = runs["exp-trainer"]
    assert group == "exp" and {"loss", "entropy", "mismatch_kl"} <= keys and steps == [1, 2, 3, 4]
    group, keys, steps = runs["exp-orchestrator"]
    assert group == "exp" and {"reward/mean", "async_lag/max", "samples/_type", "distribution/reward/_type"} <= keys
    assert steps == [1, 2, 3, 4]


def run_pids(rl: psutil.Process) -> list[psutil.Process]:
    return [rl, *rl.children(recursive=True)]


def started_pid(log: Path, name: str, timeout: float = 600) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if m := re.search(rf"started {name} \(pid (\d+)\)", log.read_text()):
            return int(m.group(1))
        time.sleep(0.2)
    raise TimeoutError(f"{name} never started:\n{log.read_text()[-3000:]}")


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["trainer", "orchestrator", "inference"])
def test_rl_stops_everything_when_a_process_dies(tied_server, tmp_path, victim):
    """kill -9 one process mid-run: rl exits non-zero within 30 s naming it, and nothing of the run survives."""
    srv = tied_server
    out = srv.root / "rl" / f"kill_{victim}"
    out.mkdir(parents=True)
    managed = victim == "inference"
    config = write_config(tmp_path / "rl.toml", srv, out, k=1, steps=1000, managed_inference=managed)
    log = tmp_path / "rl.log"
    args = ["--inference.server.port", str(_free_port())] if managed else []
    proc = start_rl(config, *args, log=log)
    try:
        started_pid(log, "trainer")
        while not batch_path(out, 2).exists():  # mid-run: a couple of steps in
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)
        tree = run_pids(psutil.Process(proc.pid))
        target = psutil.Process(started_pid(log, victim))
        if victim == "trainer":  # the training rank itself, as the OOM killer would
            target = next(
                p for p in target.children(recursive=True) if "prime_rl.trainer.train" in " ".join(p.cmdline())
            )
        killed_at = time.monotonic()
        target.kill()
        code = proc.wait(60)
        elapsed = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert code != 0 and elapsed < 30, (code, elapsed, text[-3000:])
    assert re.search(rf"{victim} (failed with exit code|exited)", text), text[-3000:]
    time.sleep(1)
    alive = [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [(p.pid, p.cmdline()) for p in alive]


def _free_port() -> int:
    from prime_rl.utils.net import free_port

    return free_port()


@pytest.mark.slow
def test_rl_resume_after_a_crash(tied_server, tmp_path):
    """6 steps, checkpoints every 2, the run killed during step 5; resumed with -1 it continues from step 4:
    the trainer trains 5 and 6 (nothing twice, nothing skipped) and the server serves pi_4 before new rollouts."""
    srv = tied_server
    out = srv.root / "rl" / "resume"
    out.mkdir(parents=True)
    config = write_config(tmp_path / "rl.toml", srv, out, k=1, steps=6, extra="[ckpt]\ninterval = 2\n")
    log1 = tmp_path / "run1.log"
    proc = start_rl(config, log=log1)
    try:
        while not (out / "checkpoints" / "step_4" / "trainer" / "COMPLETE").exists() or not batch_path(out, 5).exists():
            assert proc.poll() is None, log1.read_text()[-3000:]
            time.sleep(0.1)
        tree = run_pids(psutil.Process(proc.pid))
        for p in tree:  # a crash of the whole machine/job: everything dies at once
            p.kill()
    finally:
        proc.wait(30)
    before = len((out / "metrics.jsonl").read_text().splitlines())
    first_run = trainer_steps(out)
    assert first_run[:4] == [1, 2, 3, 4] and max(first_run) <= 5

    log2 = tmp_path / "run2.log"
    proc = start_rl(config, "--ckpt.resume-step", "-1", log=log2)
    assert proc.wait(600) == 0, log2.read_text()[-4000:]
    assert "resuming trainer and orchestrator from step 4" in log2.read_text()
    assert trainer_steps(out, skip_lines=before) == [5, 6]
    orch_log = (out / "logs" / "orchestrator.log").read_text().split("resuming from step 4")[-1]
    assert orch_log.index("serve policy step 4") < orch_log.index("step 5 |")
    for n in (5, 6):
        assert min(v for s in read_batch(batch_path(out, n)).samples for v in s.policy_versions) >= 4


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--trainer.max-steps", "7"], "max_steps = 3 contradicts trainer.max_steps = 7"),
        (["--orchestrator.bogus", "1"], "unknown option --orchestrator.bogus"),
        (["--model.name", "/nonexistent/tiny-model"], "does not exist"),
        (["--trainer.seq-len", "100"], "trainer.seq_len (100) < orchestrator.seq_len (512)"),
    ],
)
def test_bad_config_fails_before_anything_starts(tmp_path, args, needle):
    out = tmp_path / "out"
    config = tmp_path / "rl.toml"
    config.write_text(
        f'output_dir = "{out}"\nmax_steps = 3\n[model]\nname = "{tmp_path}"\n[orchestrator]\nseq_len = 512\n'
    )
    start = time.monotonic()
    result = subprocess.run([RL, "@", str(config), *args], capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - start
    assert result.returncode == 2, result.stderr
    assert needle in result.stderr, result.stderr
    assert not (out / "logs").exists()  # nothing was started, nothing written
    print(f"{args}: failed in {elapsed:.1f}s")
