"""The real trainer under torchrun (gloo, 2 CPU ranks) on a tiny model with batches written by a helper."""

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from transformers import AutoModelForCausalLM, GenerationConfig

from prime_rl.batch import TrainingBatch, TrainingSample, batch_path, write_batch
from prime_rl.models.tiny import TinyModelConfig, build_tiny_model

pytestmark = pytest.mark.slow

VOCAB = 512


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    # float32 weights: published directories then hold exactly the trainer's fp32 master weights.
    return build_tiny_model(TinyModelConfig(output=tmp_path_factory.mktemp("model") / "tiny", dtype="float32"))


def make_batch(step: int, n: int = 6, seed: int = 0) -> TrainingBatch:
    rng = random.Random(seed * 1000 + step)
    samples = []
    for _ in range(n):
        prompt, completion = rng.randint(4, 20), rng.randint(4, 30)
        samples.append(
            TrainingSample(
                token_ids=[rng.randrange(VOCAB - 30) for _ in range(prompt + completion)],
                loss_mask=[False] * prompt + [True] * completion,
                inference_logprobs=[0.0] * prompt + [rng.uniform(-7.0, -5.5) for _ in range(completion)],
                advantages=[rng.choice([-1.0, 1.0])] * (prompt + completion),
                temperature=rng.choice([1.0, 0.7]),
                policy_versions=[max(step - 1, 0)],
            )
        )
    return TrainingBatch(step=step, samples=samples)


def write_batches(output_dir: Path, steps: range) -> None:
    for step in steps:
        write_batch(make_batch(step), batch_path(output_dir, step))


def trainer(model_dir: Path, output_dir: Path, *args: str, nproc: int = 2, check: bool = True):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd += ["-m", "prime_rl.trainer.train"] if nproc > 1 else []
    if nproc == 1:
        cmd = [str(Path(sys.executable).parent / "trainer")]
    cmd += ["--model.name", str(model_dir), "--output-dir", str(output_dir), "--seq-len", "96"]
    cmd += ["--optim.lr", "1e-2", "--model.dtype", "float32", "--batch-timeout", "60", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def trainer_params(ckpt: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """The model weights of a DCP checkpoint, read without a process group."""
    dcp_to_torch_save(ckpt, tmp / "ckpt.pt")
    return torch.load(tmp / "ckpt.pt", weights_only=False)["model"]


def published(output_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(output_dir / "broadcasts" / f"step_{step}" / "model.safetensors")


def test_three_steps_on_two_ranks_publish_loadable_weights(model_dir, tmp_path):
    out = tmp_path / "run"
    write_batches(out, range(1, 4))
    trainer(
        model_dir,
        out,
        "--max-steps",
        "3",
        "--ckpt",
        "--ckpt.interval",
        "1",
        "--ckpt.save-async",
        "--max-async-level",
        "5",
    )
    base = load_file(model_dir / "model.safetensors")
    base_ends = GenerationConfig.from_pretrained(model_dir).eos_token_id
    assert len(base_ends) == 2  # config.json names only one
    previous = base
    for step in (1, 2, 3):
        directory = out / "broadcasts" / f"step_{step}"
        assert (directory / "STABLE").exists()
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)  # loads as a HF model
        assert model.generation_config.eos_token_id == base_ends  # both end tokens of the base's generation config
        weights = published(out, step)
        assert set(weights) == set(base)  # same names (tied: no lm_head), what the inference server checks
        master = trainer_params(out / "checkpoints" / f"step_{step}" / "trainer", tmp_path)
        for name, tensor in weights.items():
            assert torch.equal(tensor, master[name]), name  # exactly the trainer's parameters
        assert torch.equal(model.state_dict()["model.norm.weight"], weights["model.norm.weight"])
        assert any(not torch.equal(weights[n], previous[n]) for n in weights)  # training moved them
        previous = weights
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3
    log = (out / "logs" / "trainer.log").read_text()
    assert "step 3 |" in log and "tok/s" in log


def test_resume_matches_straight_run_and_reshards(model_dir, tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    for out in (straight, split):
        write_batches(out, range(1, 5))
    # The straight run also recomputes activations (--model.ac): recomputation must not change a single bit.
    trainer(model_dir, straight, "--max-steps", "4", "--model.ac")
    trainer(model_dir, split, "--max-steps", "2", "--ckpt", "--ckpt.interval", "2")
    # A crash during a later save leaves a checkpoint without its marker: resume must skip it.
    broken = split / "checkpoints" / "step_3" / "trainer"
    broken.mkdir(parents=True)
    (broken / "__0_0.distcp").write_bytes(b"partial")
    resumed = trainer(
        model_dir, split, "--max-steps", "4", "--ckpt", "--ckpt.interval", "2", "--ckpt.resume-step", "-1"
    )
    assert "has no COMPLETE marker" in resumed.stderr + resumed.stdout
    assert "resumed from step 2" in resumed.stderr + resumed.stdout
    a, b = published(straight, 4), published(split, 4)
    for name in a:
        # Same data, same order of operations, same world size: bit-identical.
        assert torch.equal(a[name], b[name]), name


def test_checkpoint_from_two_ranks_resumes_on_one(model_dir, tmp_path):
    """DCP reshards 2 -> 1. SGD with momentum (stateful) instead of Adam: Adam's normalisation turns
    reduction-order noise on near-zero gradients into +-lr updates, which would hide what we test."""
    sgd = ("--optim.type", "sgd", "--optim.momentum", "0.9", "--optim.lr", "0.5")
    reference, split = tmp_path / "reference", tmp_path / "split"
    for out in (reference, split):
        write_batches(out, range(1, 5))
    trainer(model_dir, reference, "--max-steps", "4", *sgd, nproc=1)
    trainer(model_dir, split, "--max-steps", "2", "--ckpt", "--ckpt.interval", "2", *sgd)
    resumed = trainer(model_dir, split, "--max-steps", "4", "--ckpt", "--ckpt.resume-step", "2", *sgd, nproc=1)
    assert "resumed from step 2" in resumed.stderr + resumed.stdout
    a, b = published(reference, 4), published(split, 4)
    assert any(not torch.equal(a[n], load_file(model_dir / "model.safetensors")[n]) for n in a)
    for name in a:
        # fp32 sums in a different order differ by ~1e-7 relative; a wrongly restored shard or momentum
        # buffer would be off by the size of an update (~1e-2 here).
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("problem", ["truncated", "out_of_vocab", "too_long"])
def test_bad_batches_fail_with_a_clear_message(model_dir, tmp_path, problem):
    out = tmp_path / problem
    path = batch_path(out, 1)
    batch = make_batch(1)
    if problem == "truncated":
        write_batch(batch, path)
        path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
        expected = [str(path), "corrupt or truncated"]
    elif problem == "out_of_vocab":
        bad = batch.samples[2]
        ids = list(bad.token_ids)
        ids[3] = VOCAB + 7
        samples = list(batch.samples)
        samples[2] = TrainingSample(ids, bad.loss_mask, bad.inference_logprobs, bad.advantages)
        write_batch(TrainingBatch(1, samples), path)
        expected = [str(path), "sample 2", str(VOCAB + 7)]
    else:
        n = 200
        samples = [*batch.samples[:4], TrainingSample([1] * n, [True] * n, [-1.0] * n, [0.0] * n)]
        write_batch(TrainingBatch(1, samples), path)
        expected = [str(path), "sample 4", "seq_len=96"]
    proc = trainer(model_dir, out, "--max-steps", "1", check=False)
    assert proc.returncode != 0
    for fragment in expected:
        assert fragment in proc.stderr, (fragment, proc.stderr[-3000:])
    assert "IndexError" not in proc.stderr and "index out of range" not in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error is about running without CUDA")
def test_cpu_offload_without_cuda_is_a_clear_error(model_dir, tmp_path):
    proc = trainer(model_dir, tmp_path / "out", "--model.cpu-offload", "--bench", nproc=1, check=False)
    assert proc.returncode == 1
    assert "--model.cpu-offload" in proc.stderr and "needs a CUDA device" in proc.stderr
    assert "Traceback" not in proc.stderr
