"""The real `sft` under torchrun (gloo, 2 CPU ranks) on a tiny model and a procedural reverse-text chat dataset."""

import json
import os
import random
import shutil
import string
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
import torch
from conftest import API_KEY
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from prime_rl.models.tiny import TinyModelConfig, build_tiny_model
from prime_rl.trainer.sft.config import ChatDataConfig
from prime_rl.trainer.sft.data import ChatStream, load_examples

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(TinyModelConfig(output=tmp_path_factory.mktemp("model") / "tiny", dtype="float32"))


def reverse_example(rng: random.Random) -> dict:
    text = "".join(rng.choices(string.ascii_lowercase[:8], k=rng.randint(3, 6)))
    return {
        "prompt": [{"role": "user", "content": f"Reverse: {text}"}],
        "completion": [{"role": "assistant", "content": text[::-1]}],
    }


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    """24 usable examples (an epoch is 3 steps of 8) plus one too long and one with nothing to train."""
    rng = random.Random(0)
    rows = [reverse_example(rng) for _ in range(24)]
    rows.insert(5, {"prompt": [{"role": "user", "content": "a b " * 100}], "completion": [rows[0]["completion"][0]]})
    rows.insert(11, {"prompt": [{"role": "user", "content": "hello"}], "completion": []})
    path = tmp_path_factory.mktemp("data") / "reverse.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def sft_command(model_dir: Path, data: Path | None, output_dir: Path, *args: str, nproc: int = 2) -> list[str]:
    if nproc == 1:
        cmd = [str(Path(sys.executable).parent / "sft")]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        cmd += ["-m", "prime_rl.trainer.sft.train"]
    cmd += ["--model.name", str(model_dir), "--model.dtype", "float32"]
    cmd += ["--data.type", "fake"] if data is None else ["--data.name", str(data)]
    return cmd + ["--output-dir", str(output_dir), "--seq-len", "128", "--batch-size", "8", "--optim.lr", "3e-3", *args]


def sft(model_dir: Path, data: Path | None, output_dir: Path, *args: str, nproc: int = 2, check: bool = True):
    cmd = sft_command(model_dir, data, output_dir, *args, nproc=nproc)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def metrics(output_dir: Path) -> dict[int, dict]:
    lines = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(line["process"] == "sft" for line in lines)
    return {line["step"]: line for line in lines}


def nll(model_path: Path, tokenizer, example: dict) -> float:
    """Mean negative log-likelihood of the reply's tokens (after the generation prompt) under a saved model."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    prompt = tokenizer.apply_chat_template(example["prompt"], add_generation_prompt=True)["input_ids"]
    ids = tokenizer.apply_chat_template(example["prompt"] + example["completion"])["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
    logp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return -logp[len(prompt) - 1 : -1].mean().item()  # up to <|im_end|>, without the "\n" after it


def test_loss_falls_weights_load_and_resume_continues_the_data_stream(model_dir, data_file, tmp_path):
    straight = tmp_path / "straight"
    sft(
        model_dir, data_file, straight, "--max-steps", "12", "--ckpt", "--ckpt.interval", "4", "--weights-interval", "6"
    )
    steps = metrics(straight)
    assert sorted(steps) == list(range(1, 13))

    # Loss: a random-init model starts near ln(vocab) ~ 6.2 nats per token. Half of the trained tokens (the
    # empty think block, <|im_end|>) are the same in every reply and are learned within a few steps, so the
    # mean of the last three steps must be well below that of the first three: a run that learned nothing
    # moves by the step-to-step noise (~0.2), a working one by several nats.
    first = sum(steps[s]["loss"] for s in (1, 2, 3)) / 3
    last = sum(steps[s]["loss"] for s in (10, 11, 12)) / 3
    assert last < first - 1.5, (first, last)

    # The data stream: 3 steps of 8 samples use up the 24 usable examples of an epoch, and the two unusable
    # ones are skipped and counted once per epoch (the fourth epoch's maybe not yet, if they come last).
    assert [steps[s]["epoch"] for s in (3, 4, 6, 7, 12)] == [0, 1, 1, 2, 3]
    assert 3 <= steps[12]["skipped_too_long"] <= 4 and 3 <= steps[12]["skipped_no_loss"] <= 4
    assert all(steps[s]["samples"] == 8 for s in steps)

    # Exported weights load as a plain HF model and are the trained ones: the reply got more likely.
    tokenizer = AutoTokenizer.from_pretrained(straight / "weights" / "step_12")
    example = reverse_example(random.Random(99))
    base_nll = nll(model_dir, tokenizer, example)
    assert nll(straight / "weights" / "step_6", tokenizer, example) < base_nll
    assert nll(straight / "weights" / "step_12", tokenizer, example) < base_nll - 1.0
    assert not (straight / "weights" / "step_4").exists()
    # The export keeps the base's generation config: both end tokens, where config.json names one.
    ends = GenerationConfig.from_pretrained(straight / "weights" / "step_12").eos_token_id
    assert ends == GenerationConfig.from_pretrained(model_dir).eos_token_id and len(ends) == 2

    # Resume at step 4 (as if the run had stopped there): steps 5-8 must see the same data as the straight
    # run, and, with the same weights, optimizer state, data and world size on deterministic CPU kernels,
    # give the same losses. They are expected bit-identical; 1e-6 relative leaves room for nothing but float
    # rounding, while one example out of place changes a step's loss by > 1e-2.
    resumed = tmp_path / "resumed"
    shutil.copytree(straight / "checkpoints" / "step_4", resumed / "checkpoints" / "step_4")
    proc = sft(model_dir, data_file, resumed, "--max-steps", "8", "--ckpt", "--ckpt.resume-step", "-1")
    assert "resumed from step 4" in proc.stderr
    again = metrics(resumed)
    assert sorted(again) == [5, 6, 7, 8]
    for step in again:
        for key in ("epoch", "data_index", "skipped_too_long", "skipped_no_loss", "tokens", "loss_tokens"):
            assert again[step][key] == steps[step][key], (step, key)
        assert again[step]["loss"] == pytest.approx(steps[step]["loss"], rel=1e-6), step


def test_lora_trains_only_an_adapter_that_peft_loads_and_resumes_on_one_rank(model_dir, data_file, tmp_path):
    # A linear decay over the last 4 steps: a resume that lost the schedule would step 5 at the full lr, not 3/4.
    lora = ["--model.lora", "--optim.lr", "5e-3", "--scheduler.type", "linear", "--scheduler.decay-steps", "4"]
    straight = tmp_path / "straight"
    sft(model_dir, data_file, straight, *lora, "--max-steps", "8", "--ckpt", "--ckpt.interval", "4",
        "--weights-interval", "4")  # fmt: skip
    steps = metrics(straight)
    assert sorted(steps) == list(range(1, 9))
    # Learning: with the base alone (lr 1e-9) the steps' losses stay within 6.04-6.13; the adapter brings the mean
    # of the last three steps ~0.6 below that of the first three.
    first = sum(steps[s]["loss"] for s in (1, 2, 3)) / 3
    last = sum(steps[s]["loss"] for s in (6, 7, 8)) / 3
    assert last < first - 0.3, (first, last)

    # The exports are peft adapter directories; every B (zero at the start) has trained.
    for step in (4, 8):
        export = straight / "weights" / f"step_{step}"
        assert sorted(p.name for p in export.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((straight / "weights" / "step_8" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 8, 16)
    adapter = load_file(straight / "weights" / "step_8" / "adapter_model.safetensors")
    assert len(adapter) == 2 * 7 * 2  # A and B of 7 projections in each of the tiny model's 2 layers
    assert all(tensor.abs().max() > 0 for name, tensor in adapter.items() if "lora_B" in name)
    # The checkpoint is the adapter, its optimizer, schedule and progress: no copy of the base.
    ckpt = straight / "checkpoints" / "step_4" / "sft"
    assert sorted(p.name for p in ckpt.iterdir()) == ["COMPLETE", "adapter.safetensors", "extra.pt", "optimizer.pt"]

    # Only the adapter trained: peft's model of the base as it is on disk plus the adapter after step 4 gives the
    # loss the trainer logged for step 5 (its samples taken from the same stream). A changed base weight would
    # show here. Tolerance: the same fp32 products, summed per sample here and over packed rows on 2 ranks there.
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    data = ChatDataConfig(name=str(data_file))
    stream = ChatStream(load_examples(data), tokenizer, data, seq_len=128, seed=0)
    for _ in range(4):
        stream.take(8)
    samples, _ = stream.take(8)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, straight / "weights" / "step_4").eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for sample in samples:
            ids = torch.tensor([sample.token_ids])
            logp = torch.log_softmax(peft_model(input_ids=ids).logits[0, :-1].double(), -1)
            logp = logp.gather(-1, ids[0, 1:, None])[:, 0]  # log p(token t | tokens before it), t >= 1
            mask = torch.tensor(sample.loss_mask[1:])
            total -= logp[mask].sum().item()
            count += int(mask.sum())
    assert count == steps[5]["loss_tokens"]
    assert total / count == pytest.approx(steps[5]["loss"], rel=1e-5)

    # Resume on one rank, all rows of a step in one forward: the adapter, optimizer, schedule and data position come back, and
    # steps 5-8 match the straight run's up to fp32 summation order (as one rank matches two in the test below; a
    # gradient averaged over the ranks instead of summed would halve the grad norm).
    resumed = tmp_path / "resumed"
    shutil.copytree(straight / "checkpoints" / "step_4", resumed / "checkpoints" / "step_4")
    proc = sft(model_dir, data_file, resumed, *lora, "--max-steps", "8", "--ckpt", "--ckpt.resume-step", "-1",
               "--micro-batch-tokens", "65536", nproc=1)  # fmt: skip
    assert "resumed from step 4" in proc.stderr
    again = metrics(resumed)
    assert sorted(again) == [5, 6, 7, 8]
    for step in again:
        for key in ("epoch", "data_index", "tokens", "loss_tokens", "lr"):
            assert again[step][key] == steps[step][key], (step, key)
        assert again[step]["loss"] == pytest.approx(steps[step]["loss"], rel=1e-5), step
        assert again[step]["grad_norm"] == pytest.approx(steps[step]["grad_norm"], rel=1e-4), step


def test_fake_data_and_the_gradient_do_not_depend_on_the_world_size_micro_batches_or_context_parallelism(
    model_dir, tmp_path
):
    one, two, cp = tmp_path / "one", tmp_path / "two", tmp_path / "cp"
    proc = sft(model_dir, None, one, "--max-steps", "2", nproc=1)
    # `--bench` draws the same fake rows (its 8 samples per step = batch_size 8 here); on 2 ranks, 2 rows of 128
    # tokens per forward. It writes no weights and no checkpoints, even when asked for checkpoints.
    bench = sft(model_dir, None, two, "--bench", "--micro-batch-tokens", "256", "--ckpt", "--ckpt.interval", "1")
    a, b = metrics(one), metrics(two)
    assert sorted(a) == [1, 2] and sorted(b) == [1, 2, 3, 4, 5]  # bench.steps defaults to 5
    assert a[1]["tokens"] == 8 * 128 and a[1]["loss_tokens"] == 8 * 127
    assert "step 2/2 | loss" in proc.stderr and "tok/s" in proc.stderr
    assert (one / "weights" / "step_2" / "model.safetensors").exists()
    assert "summary over 4 steps after the first" in bench.stdout and "tokens/s" in bench.stdout
    assert not (two / "weights").exists() and not (two / "checkpoints").exists()
    # Same rows (fake data is a function of seed and step), split over 2 ranks and run 2 to a forward: each
    # rank's loss is divided by the whole step's token count, so the gradients must be summed over ranks, not
    # averaged (FSDP's default, which would halve the norm). Only the fp32 summation order differs.
    assert b[1]["loss"] == pytest.approx(a[1]["loss"], rel=1e-5)
    assert b[1]["grad_norm"] == pytest.approx(a[1]["grad_norm"], rel=1e-4)
    # Context parallelism: the 2 ranks share every row, each running half its tokens (the tiny model's 2 heads, 1 kv
    # head repeated); the loss is counted once and the step after an optimizer step still matches.
    sft(model_dir, None, cp, "--max-steps", "2", "--model.cp", "2")
    c = metrics(cp)
    for step in (1, 2):
        assert c[step]["tokens"] == a[step]["tokens"] and c[step]["loss_tokens"] == a[step]["loss_tokens"]
        assert c[step]["loss"] == pytest.approx(a[step]["loss"], rel=1e-5), step
        assert c[step]["grad_norm"] == pytest.approx(a[step]["grad_norm"], rel=1e-4), step


def test_multi_turn_rows_train_under_qwen3_and_a_bad_row_stops_every_rank_naming_it(model_dir, tmp_path):
    rows = [reverse_example(random.Random(i)) for i in range(3)]
    two_turns = rows[0]["prompt"] + rows[0]["completion"] + rows[1]["prompt"]  # Qwen3 re-renders turn 1
    rows.append({"prompt": two_turns, "completion": rows[1]["completion"]})
    rows.append({"prompt": [{"role": "narrator", "content": "x"}], "completion": []})
    data = tmp_path / "two_turns.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "out"
    proc = sft(model_dir, data, out, "--data.shuffle", "false", "--batch-size", "4", "--max-steps", "2", check=False)
    # Step 1 = examples 0-3; the two-turn one is a sample per assistant turn.
    assert f"example 3 of {data}: the chat template rewrites earlier turns" in proc.stderr
    step_1 = metrics(out)[1]
    assert step_1["samples"] == 5
    # Step 2 starts with example 4.
    assert proc.returncode != 0
    assert f"example 4 of {data}: message 0 needs a role" in proc.stderr
    assert proc.stderr.count("sft stopped:") == 1  # once, from rank 0, and no traceback through our code
    assert "prime_rl/trainer/sft" not in proc.stderr


def eval_processes(out: Path) -> list[psutil.Process]:
    """Live processes of the eval a run in `out` started (its `--output-dir {out}/eval` names it)."""
    procs = psutil.process_iter(["cmdline", "status"])
    return [p for p in procs if str(out / "eval") in (p.info["cmdline"] or []) and p.info["status"] != "zombie"]


def test_sft_evaluates_its_exports_while_it_trains(tied_server, data_file, tmp_path, monkeypatch):
    """`eval = <file>`: the real `eval` follows the run on the shared server (an external one: eval puts it back on
    its own weights). A run killed mid-training has already logged the evals of exports it made (so they ran while it
    trained), and its eval dies with it; a run that ends waits for the eval of its last step, and metrics.jsonl gets
    each policy's eval/<env>/... at its step, matching eval's own summary."""
    srv = tied_server
    eval_file = tmp_path / "eval.toml"
    eval_file.write_text(
        f'seq_len = 512\n[model]\nrenderer = {{ name = "qwen3", enable_thinking = false }}\n'
        f'[client]\nbase_url = ["{srv.url}/v1"]\napi_key_var = "PRIME_TEST_API_KEY"\n[sampling]\nmax_tokens = 8\n'
        '[[env]]\nid = "reverse-text"\nnum_examples = 2\nrollouts_per_example = 2\n'
    )
    monkeypatch.setenv("PRIME_TEST_API_KEY", API_KEY)  # sft's environment reaches the eval it starts
    try:
        # A run far too long to finish: the eval of its first export shows up in metrics.jsonl while it trains on.
        long = srv.root / "sft-evals-long"  # under the server's allowed weight root: it loads the exports
        cmd = sft_command(srv.base, data_file, long, "--max-steps", "100000", "--weights-interval", "10",
                          "--eval", str(eval_file), nproc=1)  # fmt: skip
        with open(tmp_path / "long.out", "wb") as console:
            proc = subprocess.Popen(
                cmd, stdout=console, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"}
            )
        try:
            deadline, evals = time.monotonic() + 180, []
            while not any(row["eval/step"] >= 10 for row in evals):
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "long.out").read_text()[-3000:]
                time.sleep(0.5)
                text = (long / "metrics.jsonl").read_text() if (long / "metrics.jsonl").exists() else ""
                evals = [row for row in map(json.loads, text.split("\n")[:-1]) if "eval/step" in row]  # whole lines
            assert evals[0]["eval/step"] == 0 and proc.poll() is None  # the starting model first; still training
            assert eval_processes(long), "no eval process while sft trains"
        finally:
            proc.kill()  # SIGKILL: no cleanup of sft's own runs; the eval's parent-death signal stops it
            proc.wait()
        deadline = time.monotonic() + 60
        while eval_processes(long):
            assert time.monotonic() < deadline, f"the eval outlived sft: {eval_processes(long)}"
            time.sleep(0.5)

        out = srv.root / "sft-evals"
        sft(srv.base, data_file, out, "--max-steps", "2", "--weights-interval", "1", "--eval", str(eval_file), nproc=1)
        assert not eval_processes(out)
    finally:  # the next test starts from the server's own weights
        httpx.post(f"{srv.url}/reload_weights", headers=srv.headers, json={}, timeout=60).raise_for_status()
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [m for m in lines if "eval/step" in m]
    assert [(m["step"], m["eval/step"]) for m in rows] == [(0, 0), (1, 1), (2, 2)], rows
    summary = json.loads((out / "eval" / "summary.json").read_text())
    assert [p["label"] for p in summary["policies"]] == ["base", "step_1", "step_2"]
    for row, policy in zip(rows, summary["policies"], strict=True):
        env = policy["envs"]["reverse-text"]
        assert row["eval/reverse-text/reward_mean"] == pytest.approx(env["reward_mean"])
        assert row["eval/reverse-text/pass@2"] == pytest.approx(env["pass@2"])
        assert row["eval/reverse-text/avg@2"] == pytest.approx(env["avg@2"]) and row["eval/reverse-text/rollouts"] == 4
