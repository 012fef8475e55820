"""deploy/slurm/rl.sbatch without a cluster: `scontrol`, `srun` and `scancel` are stand-ins on PATH (SLURM cannot
run here); the script's node layout is checked for 1 and 3 nodes, every node's command is parsed by `rl`'s own
`--dry-run`, and its job control is run for real against the stand-ins."""

import os
import shlex
import subprocess
import time
import tomllib
from pathlib import Path
from unittest import mock

import pytest

from prime_rl.rl import main as rl_main

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "deploy" / "slurm" / "rl.sbatch"
CONFIG = ROOT / "configs" / "reverse_text" / "rl.toml"

SCONTROL = """#!/usr/bin/env bash
# show hostnames n[1-3] -> n1 n2 n3
spec="$3"; prefix="${spec%%[*}"; range="${spec#*[}"; range="${range%]}"
if [[ "$spec" == "$prefix" ]]; then echo "$spec"; exit; fi
for i in $(seq "${range%-*}" "${range#*-}"); do echo "$prefix$i"; done
"""
# srun: an inference-only node serves until stopped, node FAIL_NODE fails, the others finish at once.
SRUN = """#!/usr/bin/env bash
node="${3#--nodelist=}"; echo "$node" >> "$STUB_LOG"
if [[ "$node" == "$FAIL_NODE" ]]; then sleep 1; exit 3; fi
if [[ "$7" == *"'[inference]'"* ]]; then exec sleep 60; fi
sleep 1
"""
SCANCEL = """#!/usr/bin/env bash
echo "scancel $1" >> "$STUB_LOG"; pkill -f "^sleep 60$" || true
"""


@pytest.fixture
def slurm_env(tmp_path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", SCONTROL), ("srun", SRUN), ("scancel", SCANCEL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "42",
        "STUB_LOG": str(tmp_path / "log"),
    }


def node_commands(env: dict[str, str], nodelist: str, **extra: str) -> list[tuple[str, list[str]]]:
    out = subprocess.run(
        ["bash", str(SBATCH), str(CONFIG), "--max-steps", "7"],
        env={**env, "SLURM_JOB_NODELIST": nodelist, "PRINT_ONLY": "1", **extra},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    return [(line.split("|")[0], shlex.split(line.split("|", 1)[1])) for line in out.stdout.splitlines()]


def dry_run(argv: list[str], capsys) -> dict:
    assert argv[0] == "rl"
    with pytest.raises(SystemExit) as exit_:
        with mock.patch.dict(os.environ):  # rl maps the seed's variables into os.environ
            rl_main([*argv[1:], "--dry-run"])
    out = capsys.readouterr()
    assert exit_.value.code == 0, out.err
    return tomllib.loads(out.out)


def test_one_node_runs_plain_rl(slurm_env, capsys):
    ((host, argv),) = node_commands(slurm_env, "gpu7")
    assert host == "gpu7" and argv == ["rl", "@", str(CONFIG), "--max-steps", "7"]
    resolved = dry_run(argv, capsys)
    assert resolved["deployment"]["roles"] == ["inference", "orchestrator", "trainer"]
    assert resolved["max_steps"] == 7


def test_three_nodes_one_inference_two_trainer_nodes(slurm_env, capsys):
    commands = node_commands(slurm_env, "n[1-3]")
    assert [host for host, _ in commands] == ["n1", "n2", "n3"]
    resolved = [dry_run(argv, capsys) for _, argv in commands]
    deploy = [r["deployment"] for r in resolved]
    assert [d["roles"] for d in deploy] == [["inference", "orchestrator"], ["trainer"], ["trainer"]]
    assert [d["trainer_node_rank"] for d in deploy[1:]] == [0, 1]
    assert all(d["trainer_nodes"] == 2 for d in deploy[1:])
    assert all(d["master_addr"] == "n2" for d in deploy)  # every host knows trainer node 0 (broadcast store too)
    assert all(d["run_id"] == "slurm-42" and d["inference_hosts"] == ["n1"] for d in deploy)
    assert resolved[0]["orchestrator"]["client"]["base_url"] == ["http://n1:8000/v1"]
    assert resolved[0]["inference_gpu_ids"] == list(range(8)) and resolved[1]["trainer_gpu_ids"] == list(range(8))
    assert resolved[0]["inference"]["server"]["host"] == "0.0.0.0"


def test_too_many_inference_nodes_is_an_error(slurm_env):
    out = subprocess.run(
        ["bash", str(SBATCH), str(CONFIG)],
        env={**slurm_env, "SLURM_JOB_NODELIST": "n[1-2]", "PRINT_ONLY": "1", "INFERENCE_NODES": "2"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2 and "INFERENCE_NODES=2 needs 1 <= INFERENCE_NODES < nodes (2)" in out.stderr


def run_job(env: dict[str, str], **extra: str) -> tuple[int, float, list[str]]:
    started = time.monotonic()
    out = subprocess.run(
        ["bash", str(SBATCH), str(CONFIG)],
        env={**env, "SLURM_JOB_NODELIST": "n[1-4]", "INFERENCE_NODES": "2", **extra},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "inference node n2 failed (3)" in out.stderr or extra.get("FAIL_NODE") != "n2", out.stderr
    return out.returncode, time.monotonic() - started, Path(env["STUB_LOG"]).read_text().splitlines()


def test_the_job_ends_when_orchestrator_and_trainers_finish_not_waiting_for_servers(slurm_env):
    code, seconds, log = run_job(slurm_env, FAIL_NODE="none")
    assert code == 0 and seconds < 30  # n2 serves for 60 s: the job did not wait for it
    assert sorted(log[:4]) == ["n1", "n2", "n3", "n4"] and log[-1] == "scancel 42"


def test_a_failing_trainer_node_ends_the_job_with_its_status(slurm_env):
    code, seconds, log = run_job(slurm_env, FAIL_NODE="n4")
    assert code == 3 and seconds < 30 and log[-1] == "scancel 42"


def test_a_failing_inference_node_is_reported_and_the_run_goes_on(slurm_env):
    code, seconds, log = run_job(slurm_env, FAIL_NODE="n2")
    assert code == 0 and log[-1] == "scancel 42"
