"""The GPU checks' scripts (`scripts/gpu/`), tested every day on CPU: the wheels they carry match the lock, the
whole of `run.sh` runs in its dry-run mode, and the trainer's code names no torch API that the GPU machines'
torch (2.11) lacks, against the record `run.sh` made there."""

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from prime_rl.models.tiny import TinyModelConfig, build_tiny_model

ROOT = Path(__file__).resolve().parents[2]
RECORD = ROOT / "scripts/gpu/torch-2.11-api.json"
sys.path[:0] = [str(ROOT / "scripts/gpu"), str(ROOT / "tests/gpu")]
import fixed_batch  # noqa: E402
import torch_api  # noqa: E402


def test_carried_wheels_are_pinned_to_the_lock():
    """A wheel of another version than uv.lock's would test, on the GPU, code that CI never ran with."""
    locked = {p["name"]: p["version"] for p in tomllib.loads((ROOT / "uv.lock").read_text())["package"]}
    pins = [
        line.split("==")
        for line in (ROOT / "scripts/gpu/requirements.txt").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert pins and all(len(p) == 2 for p in pins), pins
    assert {name: locked.get(name) for name, _ in pins} == dict(pins)


@pytest.fixture(scope="module")
def record() -> dict:
    return json.loads(RECORD.read_text())


def test_the_trainer_uses_only_torch_names_the_gpu_machines_torch_has(record):
    assert record["torch"].startswith("2.11"), record["torch"]
    assert torch_api.problems(record) == []


def test_the_check_names_what_the_recorded_torch_lacks(record):
    """Control: take out of the record a name the trainer uses (a module function, a tensor method) and a name it
    was never asked about, and the check reports each."""
    refs, attributes = torch_api.used()
    assert "torch.distributed.fsdp.fully_shard" in refs and "detach" in attributes
    crippled = json.loads(json.dumps(record))
    crippled["present"].remove("torch.distributed.fsdp.fully_shard")
    crippled["module_dirs"]["torch.distributed.fsdp"].remove("fully_shard")
    crippled["tensor"].remove("detach")
    crippled["present"].remove("torch.nn.functional")
    del crippled["module_dirs"]["torch.nn"]
    found = torch_api.problems(crippled)
    assert "torch.distributed.fsdp.fully_shard: not in torch 2.11.0+cu130" in found, found
    assert "torch.Tensor.detach: used as an attribute, and new after torch 2.11.0+cu130" in found, found
    assert any(f.startswith("torch.nn.functional: torch 2.11.0+cu130 was not asked") for f in found), found


@pytest.mark.slow
def test_gpu_run_dry_run_on_cpu(tmp_path):
    """`prepare.sh` downloads the wheels (PyPI), `run.sh --dry-run` installs them for CPython 3.12 and runs every part
    at toy size on CPU; the CUDA-only parts say they were skipped."""
    env = {**os.environ, "PYTHON": sys.executable}
    prepare = subprocess.run(["bash", "scripts/gpu/prepare.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert prepare.returncode == 0, prepare.stderr[-3000:]
    assert "prepare: 10 wheels" in prepare.stdout, prepare.stdout
    out = tmp_path / "gpu"
    run = subprocess.run(
        ["bash", "scripts/gpu/run.sh", "--out", str(out), "--dry-run"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    status = (out / "status.tsv").read_text() if (out / "status.tsv").exists() else ""
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:] + status
    parts = dict(line.split("\t")[:2] for line in status.splitlines())
    assert parts == {
        "env": "ok", "api": "ok", "model": "ok", "tests": "ok", "bench": "ok", "logprobs": "ok",
        "overhead": "ok", "bench-ac": "ok", "bench-offload": "skipped: needs CUDA", "bench-compile": "ok",
    }  # fmt: skip
    assert "no CUDA device: the CUDA parts are skipped" in (out / "env.log").read_text()
    assert "skipped" in (out / "tests.log").read_text()
    assert "summary over" in (out / "bench.log").read_text()
    assert "ours (FSDP2, 1 rank)" in (out / "overhead.log").read_text()
    assert json.loads((out / "torch-api.json").read_text())["missing"] == []


def test_the_gpu_fixed_batch_script_learns_on_cpu(tmp_path):
    """`tests/gpu/fixed_batch.py`, which the GPU test runs on NCCL, on gloo with a tiny model: GRPO's loss on one
    fixed batch falls step by step (lr 1e-4 moves the policy by far less than the clip range, so every step descends)."""
    model = build_tiny_model(TinyModelConfig(output=tmp_path / "model", hidden_size=64, num_heads=2, head_dim=32))
    losses = fixed_batch.losses(model, False, 256)
    assert len(losses) == 5 and all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses
