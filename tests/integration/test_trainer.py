"""The real trainer under torchrun (gloo, 2 CPU ranks) on a tiny model with batches written by a helper."""

import json
import os
import random
import signal
import subprocess
import sys
import time
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


def trainer(model_dir: Path, output_dir: Path, *args: str, nproc: int = 2, check: bool = True, popen: bool = False):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd += ["-m", "prime_rl.trainer.rl.train"] if nproc > 1 else []
    if nproc == 1:
        cmd = [str(Path(sys.executable).parent / "trainer")]
    cmd += ["--model.name", str(model_dir), "--output-dir", str(output_dir), "--seq-len", "96"]
    cmd += ["--optim.lr", "1e-2", "--model.dtype", "float32", "--batch-timeout", "60", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if popen:  # the caller waits for it (`communicate`)
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def trainer_params(ckpt: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """The model weights of a DCP checkpoint, read without a process group."""
    dcp_to_torch_save(ckpt, tmp / "ckpt.pt")
    return torch.load(tmp / "ckpt.pt", weights_only=False)["model"]


def steps_in(output_dir: Path, kind: str) -> list[int]:
    """The steps of `rollouts/step_n` or `broadcasts/step_n` directories present."""
    return sorted(int(p.name.removeprefix("step_")) for p in (output_dir / kind).glob("step_*"))


def published(output_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(output_dir / "broadcasts" / f"step_{step}" / "model.safetensors")


def test_three_steps_on_two_ranks_publish_loadable_weights(model_dir, tmp_path):
    """Also with a KL penalty against the initial policy (a second, frozen model, which nothing publishes)."""
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
        "--reference.beta",
        "0.1",
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
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 3
    # Trained batches are deleted; the metrics keep the policies that sampled them (make_batch: pi_{n-1}).
    assert not any((out / "rollouts").iterdir())
    assert [(m["policy_version/min"], m["policy_version/max"]) for m in lines] == [(0, 0), (1, 1), (2, 2)]
    # Step 1 trains pi_0 itself, the reference: the same forward on the same weights, bit for bit. Then it drifts.
    assert lines[0]["ref_kl"] == 0.0 and lines[1]["ref_kl"] > 0 and lines[2]["ref_kl"] > 0
    log = (out / "logs" / "trainer.log").read_text()
    assert "step 3 |" in log and "tok/s" in log and "ref_kl" in log


def test_resume_matches_straight_run_and_reshards(model_dir, tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    for out in (straight, split):
        write_batches(out, range(1, 5))
    # The straight run also recomputes activations (--model.ac): recomputation must not change a single bit.
    trainer(model_dir, straight, "--max-steps", "4", "--model.ac")
    # The split run keeps one checkpoint and no published step beyond the current one (async level 0).
    keep = ("--ckpt", "--ckpt.interval", "2", "--ckpt.keep-last", "1", "--max-async-level", "0")
    trainer(model_dir, split, "--max-steps", "2", *keep)
    assert steps_in(split, "broadcasts") == [2] and steps_in(split, "rollouts") == [3, 4]
    # A crash during a later save leaves a checkpoint without its marker: resume must skip it.
    broken = split / "checkpoints" / "step_3" / "trainer"
    broken.mkdir(parents=True)
    (broken / "__0_0.distcp").write_bytes(b"partial")
    resumed = trainer(model_dir, split, "--max-steps", "4", *keep, "--ckpt.resume-step", "-1")
    assert "has no COMPLETE marker" in resumed.stderr + resumed.stdout
    assert "resumed from step 2" in resumed.stderr + resumed.stdout
    a, b = published(straight, 4), published(split, 4)
    for name in a:
        # Same data, same order of operations, same world size: bit-identical.
        assert torch.equal(a[name], b[name]), name
    # Bounded disk: every trained batch is gone; published steps are those the async bound needs (k = 2: pi_2..4)
    # plus those of live checkpoints: step 2's left with its checkpoint (keep_last 1), the unfinished 3 never was.
    assert steps_in(straight, "rollouts") == [] and steps_in(straight, "broadcasts") == [2, 3, 4]
    assert steps_in(split, "rollouts") == [] and steps_in(split, "broadcasts") == [4]
    assert [p.parent.parent.name for p in split.glob("checkpoints/step_*/trainer/COMPLETE")] == ["step_4"]


def test_two_ranks_by_checkpoint_resharding_or_by_context_parallelism_train_like_one(model_dir, tmp_path):
    """DCP reshards 2 -> 1; and 2 ranks sharing every row by context parallelism (each runs half of its tokens,
    attention exchanged all-to-all) train the same weights as one rank. SGD with momentum (stateful) instead of
    Adam: Adam's normalisation turns reduction-order noise on near-zero gradients into +-lr updates, which would
    hide what we test. All with a KL penalty against the initial policy: the resumed run loads it again from
    model.name (not from the checkpoint), and context parallelism shards its rows as the policy's."""
    sgd = ("--optim.type", "sgd", "--optim.momentum", "0.9", "--optim.lr", "0.5", "--reference.beta", "1.0")
    reference, split, cp = tmp_path / "reference", tmp_path / "split", tmp_path / "cp"
    for out in (reference, split, cp):
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
    trainer(model_dir, cp, "--max-steps", "4", "--model.cp", "2", *sgd)
    c = published(cp, 4)
    for name in a:
        # The same sums split at another place (each rank half the row): fp32 noise again, while a token that saw
        # across its sample, or a chunk's gradient counted twice or lost, would move weights by a whole update.
        torch.testing.assert_close(c[name], a[name], rtol=1e-5, atol=1e-6)
    assert json.loads((cp / "metrics.jsonl").read_text().splitlines()[0])["loss"] == pytest.approx(
        json.loads((reference / "metrics.jsonl").read_text().splitlines()[0])["loss"], rel=1e-5
    )  # counted once, not once per rank of the group


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


def start_trainer(model_dir: Path, output_dir: Path) -> subprocess.Popen:
    """A 2-rank torchrun trainer in the background, waiting for batch 1, which never comes."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += ["-m", "prime_rl.trainer.rl.train", "--model.name", str(model_dir), "--output-dir", str(output_dir)]
    cmd += ["--seq-len", "96", "--model.dtype", "float32", "--max-steps", "3", "--batch-timeout", "300"]
    output_dir.mkdir(parents=True)
    with open(output_dir / "torchrun.out", "w") as out:
        agent = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    log = output_dir / "logs" / "trainer.log"
    deadline = time.monotonic() + 300
    while not (log.exists() and " rank(s) " in log.read_text()):  # model loaded: now waiting for the batch
        assert agent.poll() is None and time.monotonic() < deadline, (output_dir / "torchrun.out").read_text()
        time.sleep(0.5)
    return agent


def ranks_of(agent: subprocess.Popen) -> list[int]:
    """The pids of the trainer ranks the torchrun agent started (its children running our module)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == agent.pid and b"prime_rl.trainer.rl.train" in cmdline:
            pids.append(int(stat.parent.name))
    return sorted(pids)


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has died
    except OSError:
        return False


def stop(agent: subprocess.Popen, ranks: list[int]) -> None:
    agent.kill()
    agent.wait()
    for pid in ranks:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_ranks_die_with_their_torchrun_agent(model_dir, tmp_path):
    """torchrun starts ranks in sessions of their own: a `kill -9` of the agent reaches them only through the
    parent-death signal each rank arms at start. Otherwise they would keep waiting and train a later run's batches."""
    agent = start_trainer(model_dir, tmp_path / "run")
    ranks = ranks_of(agent)
    try:
        assert len(ranks) == 2
        agent.kill()
        agent.wait()
        deadline = time.monotonic() + 5
        while any(alive(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [pid for pid in ranks if alive(pid)], "trainer ranks outlived their torchrun agent"
    finally:
        stop(agent, ranks)


def test_a_second_trainer_on_the_same_output_dir_stops_before_loading_the_model(model_dir, tmp_path):
    out = tmp_path / "run"
    first = start_trainer(model_dir, out)
    try:
        holder = (out / ".locks" / "trainer.lock").read_text().split()[1]  # "pid <rank 0's pid> on <host>: ..."
        assert int(holder) in ranks_of(first)
        resolved = (out / "configs" / "trainer.toml").read_text()
        second = trainer(model_dir, out, "--max-steps", "1", nproc=1, check=False)
        assert second.returncode == 1
        assert f"trainer stopped: another trainer writes to {out} (pid {holder} on " in second.stderr, second.stderr
        # Before it loaded the model or wrote anything of its own (its resolved config says --max-steps 1).
        assert "Loading weights" not in second.stderr and " rank(s) " not in second.stderr
        assert (out / "configs" / "trainer.toml").read_text() == resolved
        assert first.poll() is None  # the first trainer is undisturbed
    finally:
        stop(first, ranks_of(first))
