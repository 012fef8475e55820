"""`trainer` entry point: the RL training loop, readable top to bottom.

    uv run trainer @ cfg.toml                                   # one process
    uv run torchrun --nproc-per-node 2 -m prime_rl.trainer.train @ cfg.toml

Step n: wait for `rollouts/step_n/batch.bin` -> rank 0 packs it into rows and deals them out ->
forward/backward every micro-batch of rows (loss normalised by the step's total loss tokens) -> clip, optimizer and
scheduler step -> publish `broadcasts/step_n` (pi_n) -> delete the trained batch and the published steps
nothing needs any more -> maybe checkpoint. What `sft` does alike (the process around the loop, model and
optimizer setup, dealing out rows, the common metrics) is `scaffold.py`'s.
"""

import math
import random
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from loguru import logger

from prime_rl.batch import (
    BatchError,
    TrainingSample,
    batch_path,
    read_batch,
    remove_batch,
    validate_batch,
    wait_for_batch,
)
from prime_rl.config.loader import load_config
from prime_rl.trainer.ckpt import Progress
from prime_rl.trainer.config import TrainerConfig
from prime_rl.trainer.distributed import World
from prime_rl.trainer.logprobs import forward_logprobs
from prime_rl.trainer.loss import compute_loss
from prime_rl.trainer.packing import PackedRow, collate, micro_batches
from prime_rl.trainer.perf import format_bench_table
from prime_rl.trainer.scaffold import (
    Run,
    StepMeter,
    all_reduce_sums,
    build_run,
    load_tokenizer,
    next_rows,
    trainer_process,
)
from prime_rl.trainer.weights import STABLE, broadcast_dir, full_state_dict, prune_broadcasts, save_hf_dir
from prime_rl.utils.monitor import Monitor

BATCH_ERRORS = (BatchError, TimeoutError)
"""A batch that is unusable or never comes: the run stops with a message naming the file."""


def main(argv: list[str] | None = None) -> None:
    config, _ = load_config(TrainerConfig, "trainer", argv)
    with trainer_process("trainer", config, BATCH_ERRORS) as (world, monitor):
        train(config, world, monitor)


def train(config: TrainerConfig, world: World, monitor: Monitor | None) -> None:
    """Train until `max_steps`; `monitor` is rank 0's (None on the other ranks)."""
    tokenizer = load_tokenizer(config.model)
    max_steps = config.bench.steps if config.bench else config.max_steps
    run = build_run(config, world, "trainer", max_steps, "training")
    vocab_size = run.model.config.vocab_size
    meter = StepMeter(run.model.config, config.seq_len, world)
    bench_rows: list[dict] = []

    while max_steps is None or run.progress.step < max_steps:
        step = run.progress.step + 1
        t0 = time.perf_counter()
        rows, info = next_rows(world, config.seq_len, partial(take_batch, config, step, vocab_size), BATCH_ERRORS)
        t_data = time.perf_counter() - t0

        run.model.train()
        totals = train_step(run.model, rows, max(info["loss_tokens"], 1), config, world.device)
        grad_norm, lr = run.optimizer_step(config.optim.max_norm)
        run.progress = Progress(step, run.progress.tokens + info["tokens"], run.progress.samples + info["samples"])
        sums = all_reduce_sums(totals, world)
        t_train = time.perf_counter() - t0 - t_data

        t_pub = 0.0
        if config.bench is None:
            t_pub = time.perf_counter()
            publish(run, tokenizer, broadcast_dir(config.output_dir, step), world)
            t_pub = time.perf_counter() - t_pub
            if world.is_main:
                remove_batch(config.output_dir, step)  # trained: nothing reads it again
                live = run.ckpt.live_steps() if run.ckpt else set()
                prune_broadcasts(config.output_dir, step, config.max_async_level, keep=live)
            run.maybe_checkpoint(step, max_steps)

        metrics = meter.step(sums, info, grad_norm, lr, t_data, t_train) | rl_metrics(sums, info, t_pub)
        if world.is_main:
            log_step(step, metrics, monitor)
            bench_rows.append({"step": step, "seconds": t_train, **metrics})

    if run.ckpt is not None:
        run.ckpt.wait()
        if world.is_main and config.bench is None:  # the last save may have pruned checkpoints: their weights too
            prune_broadcasts(config.output_dir, run.progress.step, config.max_async_level, run.ckpt.live_steps())
    if config.bench is not None and world.is_main:
        print(format_bench_table(bench_rows))


def take_batch(config: TrainerConfig, step: int, vocab_size: int) -> tuple[list[TrainingSample], dict]:
    """Rank 0: the checked samples of batch `step` (random ones with `--bench`) and the policy versions that
    sampled them (the batch file is deleted once trained, so the metrics keep them)."""
    if config.bench is not None:
        samples = fake_samples(config, vocab_size, step)
    else:
        path = wait_for_batch(batch_path(config.output_dir, step), timeout=config.batch_timeout)
        batch = read_batch(path)
        if batch.step != step:
            raise BatchError(f"{path}: holds step {batch.step}, expected {step}")
        validate_batch(batch, path, vocab_size, config.seq_len)
        samples = batch.samples
    versions = [v for s in samples for v in s.policy_versions]
    return samples, {
        "policy_version/min": min(versions, default=None),
        "policy_version/max": max(versions, default=None),
    }


def fake_samples(config: TrainerConfig, vocab_size: int, step: int) -> list[TrainingSample]:
    """Random rows for `--bench`: full-length (or variable-length) samples, prompt = first eighth."""
    rng = random.Random(config.seed * 100_003 + step)
    samples = []
    for _ in range(config.bench.samples):
        n = rng.randint(max(2, config.seq_len // 8), config.seq_len) if config.bench.variable_length else config.seq_len
        prompt = max(1, n // 8)
        samples.append(
            TrainingSample(
                token_ids=[rng.randrange(vocab_size) for _ in range(n)],
                loss_mask=[False] * prompt + [True] * (n - prompt),
                inference_logprobs=[0.0] * prompt + [-math.log(vocab_size)] * (n - prompt),
                advantages=[rng.gauss(0, 1)] * n,
            )
        )
    return samples


def train_step(model, rows: list[PackedRow], loss_scale: float, config: TrainerConfig, device) -> dict[str, float]:
    """Forward/backward every micro-batch of this rank; returns summed statistics (not yet reduced across ranks)."""
    totals: dict[str, torch.Tensor] = {}

    def add(key: str, value: torch.Tensor) -> None:
        value = value.detach().double()
        totals[key] = totals[key] + value if key in totals else value

    concatenate = config.model.attn == "flash_attention_2"
    for group in micro_batches(rows, config.micro_batch_size):
        batch = collate(group, concatenate).to(device)
        logp, entropy = forward_logprobs(model, batch)
        mask = batch.loss_mask.view(-1)
        loss, stats = compute_loss(
            logp.view(-1), batch.inference_logprobs.view(-1), batch.advantages.view(-1), mask,
            batch.sample_ids.view(-1), batch.num_samples, loss_scale, config.loss,
        )  # fmt: skip
        loss.backward()
        add("loss", loss)
        add("entropy_sum", torch.where(mask, entropy.view(-1), 0.0).sum())
        add("processed_tokens", torch.tensor(batch.num_tokens))
        for key, value in stats.items():
            add(key, value)
    return {k: v.item() for k, v in totals.items()}  # one sync per statistic per step, not per micro-batch


def publish(run: Run, tokenizer, target: Path, world: World) -> None:
    """Rank 0 writes the policy as an HF directory at `target`, marked `STABLE` once complete, for inference."""
    state = full_state_dict(run.model, run.export_dtype)  # a collective; empty on ranks other than 0
    if world.is_main:
        save_hf_dir(state, run.model.config, tokenizer, target, STABLE, run.model.generation_config)
    del state
    dist.barrier()


def rl_metrics(sums: dict, info: dict, t_pub: float) -> dict:
    """What only RL logs: entropy, sampler/trainer mismatch, masked and clipped fractions, policy versions."""
    tokens = max(info["loss_tokens"], 1)
    samples = max(sums.get("samples", 0), 1)
    metrics = {
        "entropy": sums["entropy_sum"] / tokens,
        "time_publish": t_pub,
        "policy_version/min": info["policy_version/min"],
        "policy_version/max": info["policy_version/max"],
        "mismatch_kl": sums.get("mismatch_kl_sum", 0.0) / tokens,
    }
    for key in ("masked_tokens", "masked_low", "masked_high", "clipped_tokens"):
        metrics[key.removesuffix("_tokens") + "_fraction"] = sums.get(key, 0.0) / tokens
    for key in ("geo_masked_samples", "sequence_masked_samples"):
        metrics[key.removesuffix("_samples") + "_fraction"] = sums.get(key, 0.0) / samples
    return metrics


def log_step(step: int, metrics: dict, monitor: Monitor) -> None:
    mfu = f" mfu {metrics['mfu']:.1f}%" if metrics["mfu"] is not None else ""
    logger.info(
        f"step {step} | loss {metrics['loss']:+.4f} | entropy {metrics['entropy']:.3f} | "
        f"mismatch_kl {metrics.get('mismatch_kl', 0.0):.2e} | grad_norm {metrics['grad_norm']:.3f} | "
        f"lr {metrics['lr']:.2e} | {metrics['tokens_per_s']:.0f} tok/s{mfu} | "
        f"pad {100 * metrics['padding_fraction']:.0f}% | wait {metrics['time_data']:.2f}s "
        f"train {metrics['time_train']:.2f}s publish {metrics['time_publish']:.2f}s | mem {metrics['peak_memory_gib']:.2f} GiB"
    )
    monitor.log(step, metrics)


if __name__ == "__main__":
    main()
