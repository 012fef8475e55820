"""The real LoRA trainer under torchrun (gloo, 2 CPU ranks) on the tiny model, with batches written by the test in
each run's directory, as orchestrators would: several runs in one trainer train as each would alone, a run found
mid-training joins, a run with an unusable batch leaves the others training, and one run resumes from its own
checkpoint."""

import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_trainer import make_batch, trainer

from prime_rl.batch import batch_path, write_batch
from prime_rl.models.tiny import TinyModelConfig, build_tiny_model
from prime_rl.utils.fs import write_atomic

pytestmark = pytest.mark.slow

LORA = ["--model.lora", "--model.lora.rank", "4", "--batch-timeout", "20"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(TinyModelConfig(output=tmp_path_factory.mktemp("model") / "tiny", dtype="float32"))


def add_run(root: Path, name: str, lr: float, seed: int, steps: range, resume: int | None = None, max_steps: int = 3):
    """What an orchestrator leaves in its run directory: its resolved config, then batches."""
    run = root / f"run_{name}"
    resume_line = f"resume_step = {resume}\n" if resume is not None else ""
    config = (f'max_steps = {max_steps}\n[adapter]\nname = "{name}"\nseed = {seed}\n[adapter.optim]\ntype = "sgd"\n'
              f"lr = {lr}\n[ckpt]\ninterval = 1\n{resume_line}")  # fmt: skip
    write_atomic(run / "configs" / "orchestrator.toml", config.encode())
    for step in steps:
        write_batch(make_batch(step, seed=seed), batch_path(run, step))
    return run


def adapter(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(run / "broadcasts" / f"step_{step}" / "adapter_model.safetensors")


def assert_same_adapter(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        # Two ranks sum the gradients of rows dealt out differently when other runs' rows are in the step: fp32
        # reordering, a few ulp of the largest entry; a gradient from another run's rows would be of its own size.
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6 * float(b[name].abs().max()) + 1e-9)


def test_runs_in_one_trainer_train_as_alone_join_leave_and_resume(model_dir, tmp_path):
    alone = tmp_path / "alone"
    add_run(alone, "a", 0.05, seed=0, steps=range(1, 4))
    trainer(model_dir, alone, *LORA, "--max-concurrent-runs", "2")

    together = tmp_path / "together"
    run_a = add_run(together, "a", 0.05, seed=0, steps=range(1, 2))
    add_run(together, "c", 0.05, seed=9, steps=range(1, 2))
    (together / "run_c" / "rollouts" / "step_2").mkdir(parents=True)
    (together / "run_c" / "rollouts" / "step_2" / "batch.bin").write_bytes(b"not a batch")  # fails run c only
    proc = trainer(model_dir, together, *LORA, "--max-concurrent-runs", "3", popen=True)

    def wait_for(path: Path) -> None:
        deadline = time.monotonic() + 120
        while not path.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)

    wait_for(run_a / "broadcasts" / "step_1" / "STABLE")
    run_b = add_run(together, "b", 0.2, seed=5, steps=range(1, 4))  # found while training: joins without a restart
    wait_for(run_b / "broadcasts" / "step_1" / "STABLE")
    for step in (2, 3):
        write_batch(make_batch(step, seed=0), batch_path(run_a, step))
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:] + err[-5000:]
    log = (together / "logs" / "trainer.log").read_text()
    assert "run run_c leaves: failed" in log and "run run_b joins" in log
    assert "run run_a leaves: finished (3 steps)" in log and "run run_b leaves: finished (3 steps)" in log
    assert (together / "run_c" / "broadcasts" / "step_1").exists()
    assert not (together / "run_c" / "broadcasts" / "step_2").exists()

    for step in (1, 2, 3):
        assert_same_adapter(adapter(together / "run_a", step), adapter(alone / "run_a", step))
    # run b had its own lr and seed: another adapter; its metrics are its own (metrics.jsonl in its directory)
    assert not torch.equal(adapter(together / "run_b", 3)["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"],
                           adapter(together / "run_a", 3)["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"])  # fmt: skip
    lines = (together / "run_b" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3 and all('"process": "trainer"' in line for line in lines)

    # Resume run b alone from its step-1 checkpoint (its orchestrator restarted: a new config) on one rank: steps 2
    # and 3 again give the adapters of the uninterrupted run.
    resumed = tmp_path / "resumed"
    (resumed / "run_b").mkdir(parents=True)
    subprocess.run(["cp", "-r", str(together / "run_b" / "checkpoints"), str(resumed / "run_b")], check=True)
    for step in (2, 3):
        subprocess.run(["rm", "-rf", str(resumed / "run_b" / "checkpoints" / f"step_{step}")], check=True)
    add_run(resumed, "b", 0.2, seed=5, steps=range(2, 4), resume=1)
    trainer(model_dir, resumed, *LORA, "--max-concurrent-runs", "2", nproc=1)  # saved on 2 ranks, resumed on 1
    for step in (2, 3):
        assert_same_adapter(adapter(resumed / "run_b", step), adapter(together / "run_b", step))
