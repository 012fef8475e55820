"""The trainer runs with torch, transformers and `scripts/gpu/requirements.txt` alone: what a GPU machine has once
`scripts/gpu/run.sh` installed the carried wheels. A module-level import of vLLM, verifiers, wandb, fastapi or any
other package of ours would make a GPU window fail on its first line; here it fails in CI."""

import importlib.metadata as md
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from prime_rl.models.tiny import TinyModelConfig, build_tiny_model

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = ROOT / "scripts/gpu/requirements.txt"
GPU_MACHINE_HAS = ("torch", "transformers", "safetensors", "tokenizers")
"""What ../shared/gpu-checklist.md says a GPU machine brings (with their own dependencies)."""


def carried() -> list[str]:
    return [line.split("==")[0] for line in REQUIREMENTS.read_text().splitlines() if re.match(r"[a-z]", line)]


def dependency_closure(roots) -> set[str]:
    """Distributions `roots` need when installed without extras, as this environment resolves them."""
    seen, todo = set(), list(roots)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        for spec in md.distribution(name).requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def importable_names(distributions: set[str]) -> set[str]:
    """Top-level import names those distributions provide."""
    return {
        module
        for module, owners in md.packages_distributions().items()
        if any(canonicalize_name(d) in distributions for d in owners)
    }


@pytest.fixture(scope="module")
def allowed() -> set[str]:
    return importable_names(dependency_closure([*GPU_MACHINE_HAS, *carried()])) | {"prime_rl"}


def test_the_hidden_packages_really_are_hidden(allowed):
    """Control: under the launcher, the packages the trainer must not need cannot be imported or even found."""
    probe = (
        "import importlib.util, sys\n"
        "for name in ('vllm', 'verifiers', 'wandb', 'fastapi', 'openai', 'prime_rl.orchestrator.orchestrator'):\n"
        "    try:\n"
        "        __import__(name)\n"
        "        print('IMPORTED', name)\n"
        "    except ImportError:\n"
        "        print('hidden', name, importlib.util.find_spec(name.partition('.')[0]) is None)\n"
    )
    out = subprocess.run(
        [sys.executable, "tests/unit/only_packages.py", ",".join(sorted(allowed)), "-c", probe],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    # vllm .. openai are installed here, so only the launcher can hide them; the orchestrator needs verifiers
    assert lines[:4] == [f"hidden {n} True" for n in ("vllm", "verifiers", "wandb", "fastapi")], out.stdout
    assert lines[4] == "hidden openai True" and lines[5].startswith("hidden prime_rl.orchestrator"), out.stdout


def test_one_trainer_step_runs_with_only_the_gpu_packages(allowed, tmp_path):
    """The real `trainer` entry module, `--bench` on a tiny model, one process: it imports and trains."""
    for name in ("vllm", "verifiers", "wandb", "fastapi", "openai"):
        assert name not in allowed  # the closure of torch + transformers + the wheels does not pull them in
    model = build_tiny_model(TinyModelConfig(output=tmp_path / "model", hidden_size=64, num_heads=2, head_dim=32))
    module = md.entry_points(group="console_scripts")["trainer"].value.split(":")[0]
    args = [
        "--model.name", str(model), "--model.dtype", "float32", "--seq-len", "64", "--output-dir", str(tmp_path / "o"),
        "--bench", "--bench.steps", "2", "--bench.samples", "2",
    ]  # fmt: skip
    out = subprocess.run(
        [sys.executable, "tests/unit/only_packages.py", ",".join(sorted(allowed)), "-m", module, *args],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-5000:]
    assert "summary over 1 steps after the first" in out.stdout, out.stdout[-2000:]
