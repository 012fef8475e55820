"""`trainer` entry point: the RL training loop, readable top to bottom.

    uv run trainer @ cfg.toml                                   # one process
    uv run torchrun --nproc-per-node 2 -m prime_rl.trainer.rl.train @ cfg.toml

Step n: wait for `rollouts/step_n/batch.bin` -> rank 0 packs it into rows and deals them out ->
forward/backward every micro-batch of rows (each loss component normalised by its own count in the step: loss
tokens, ce tokens, ref_kl tokens) -> clip, optimizer and
scheduler step -> publish pi_n: write `broadcasts/step_n`, or (in-memory broadcast) announce it and wait until
the orchestrator has taken it -> delete the trained batch and the published steps nothing needs any more ->
maybe checkpoint. What `sft` does alike (the process around the loop, model and optimizer setup, dealing out
rows, the common metrics) is `trainer/scaffold.py`'s.
"""

import math
import random
import time
from functools import partial

import torch.distributed as dist
from loguru import logger

from prime_rl.batch import TrainingSample, batch_path, remove_batch
from prime_rl.config.loader import load_config
from prime_rl.trainer.ckpt import Progress
from prime_rl.trainer.config import TrainerConfig
from prime_rl.trainer.parallel.distributed import World
from prime_rl.trainer.perf import TRAINER_BENCH_COLUMNS, PhaseTimer
from prime_rl.trainer.rl.batches import BATCH_ERRORS, load_batch, policy_versions, wait_until
from prime_rl.trainer.rl.broadcast import WeightSender
from prime_rl.trainer.rl.critic import build_critic, critic_metrics, prepare, train_values, with_token_rewards
from prime_rl.trainer.rl.loss import step_loss_scale
from prime_rl.trainer.rl.reference import load_reference
from prime_rl.trainer.rl.step import rl_metrics, stream_scales, train_step
from prime_rl.trainer.rl.train_lora import train_lora
from prime_rl.trainer.scaffold import (
    Run,
    StepMeter,
    all_reduce_sums,
    build_run,
    exit_finished,
    load_tokenizer,
    next_rows,
    trainer_process,
)
from prime_rl.trainer.weights import (
    STABLE,
    NonFiniteWeights,
    broadcast_dir,
    full_state_dict,
    prune_broadcasts,
    save_hf_dir,
)
from prime_rl.utils.bench import format_bench_table
from prime_rl.utils.monitor import Monitor
from prime_rl.utils.secret import take_keys_at_start


def main(argv: list[str] | None = None) -> None:
    take_keys_at_start("trainer")  # first: nothing this process starts may inherit the secret (`utils.secret`)
    config, _ = load_config(TrainerConfig, "trainer", argv)
    with trainer_process("trainer", config, (*BATCH_ERRORS, NonFiniteWeights)) as (world, monitor):
        if config.model.lora is not None:
            train_lora(config, world, monitor)
        else:
            train(config, world, monitor)
    exit_finished()


def train(config: TrainerConfig, world: World, monitor: Monitor | None) -> None:
    """Train until `max_steps`; `monitor` is rank 0's (None on the other ranks)."""
    tokenizer = load_tokenizer(config.model)
    max_steps = config.bench.steps if config.bench else config.max_steps
    in_memory = config.weight_broadcast.in_memory and config.bench is None
    sender = WeightSender(config.weight_broadcast, world) if in_memory else None  # listening before the model loads
    run = build_run(config, world, "trainer", max_steps, "training")
    reference = load_reference(config, world, run.model)
    if sender is not None:
        sender.publish(run.progress.step)  # a server (re)starting before step 1 gets these weights
    critic = None
    if config.critic is not None:
        resume_step = run.progress.step if config.ckpt is not None and config.ckpt.resuming else None
        critic = build_critic(config, world, max_steps, resume_step, run.progress)
    vocab_size = run.model.config.vocab_size
    meter = StepMeter(run.model.config, config.seq_len, world)
    timer = PhaseTimer(world.device)
    bench_rows: list[dict] = []

    while max_steps is None or run.progress.step < max_steps:
        step = run.progress.step + 1
        t0 = time.perf_counter()
        if config.bench is None:
            path = batch_path(config.output_dir, step)
            what = f"{path}, which the orchestrator writes (is one running on this output_dir?)"
            wait_until(world, path.exists, what, config.batch_timeout, sender, run)
        t_wait = time.perf_counter() - t0
        rows, info = next_rows(
            world,
            config.seq_len,
            config.model.attn,
            run.model.config,
            partial(take_batch, config, step, vocab_size),
            BATCH_ERRORS,
        )
        t_data = time.perf_counter() - t0

        loss_scale = max(info["loss_tokens"], 1)
        if critic is not None:  # the rows' token rewards become GAE advantages under the values at the step's start
            prepared, critic_sums = prepare(critic.model, rows, config.critic, world)
        run.model.train()
        policy_scale = step_loss_scale(config.loss, info["loss_tokens"], info["samples"])  # GSPO: per sequence
        streams = stream_scales(info)  # ce and ref_kl tokens of the step: each stream's own normalisation
        totals = train_step(run.model, rows, {0: policy_scale}, config, world, reference=reference, timer=timer,
                            stream_scales=streams)[0]  # fmt: skip
        with timer("optimizer"):
            grad_norm, lr = run.optimizer_step(config.optim.max_norm)
        if critic is not None:
            value_sums, critic_grad_norm = train_values(critic, rows, prepared, loss_scale, config.critic, world)
            totals |= critic_sums | value_sums
        run.progress = Progress(step, run.progress.tokens + info["tokens"], run.progress.samples + info["samples"])
        sums = all_reduce_sums(totals, world)
        t_train = time.perf_counter() - t0 - t_data

        times = {}
        if config.bench is None:
            times = publish(run, tokenizer, step, max_steps, config, world, sender)
            if world.is_main:
                remove_batch(config.output_dir, step)  # trained: nothing reads it again
                live = run.ckpt.live_steps() if run.ckpt else set()
                prune_broadcasts(config.output_dir, step, config.max_async_level, keep=live)
            if critic is not None:  # first: a policy checkpoint that is complete has its critic's
                critic.progress = run.progress
                critic.maybe_checkpoint(step, max_steps)
            run.maybe_checkpoint(step, max_steps)

        times |= timer.pop() | {"time_wait_batch": t_wait}
        metrics = meter.step(sums, info, grad_norm, lr, t_data, t_train) | rl_metrics(sums, info, times) | times
        if critic is not None:
            metrics |= critic_metrics(sums, info["loss_tokens"], critic_grad_norm)
        if world.is_main:
            log_step(step, metrics, monitor)
            bench_rows.append({"step": step, "seconds": t_train, **metrics})

    if sender is not None:
        sender.close()
    if critic is not None and critic.ckpt is not None:
        critic.ckpt.wait()
    if run.ckpt is not None:
        run.ckpt.wait()
        if world.is_main and config.bench is None:  # the last save may have pruned checkpoints: their weights too
            prune_broadcasts(config.output_dir, run.progress.step, config.max_async_level, run.ckpt.live_steps())
    if config.bench is not None and world.is_main:
        print(format_bench_table(bench_rows, TRAINER_BENCH_COLUMNS))


def take_batch(config: TrainerConfig, step: int, vocab_size: int) -> tuple[list[TrainingSample], dict]:
    """Rank 0: the checked samples of batch `step` (random ones with `--bench`) and the policy versions that
    sampled them (the batch file is deleted once trained, so the metrics keep them)."""
    if config.bench is not None:
        samples = fake_samples(config, vocab_size, step)
    else:
        samples = load_batch(config.output_dir, step, vocab_size, config.seq_len)  # there: the loop waited for it
    if config.critic is not None:  # the rows carry each token's reward until `critic.prepare` computes advantages
        samples = [with_token_rewards(s) for s in samples]
    return samples, policy_versions(samples)


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


def publish(
    run: Run,
    tokenizer,
    step: int,
    max_steps: int | None,
    config: TrainerConfig,
    world: World,
    sender: WeightSender | None,
) -> dict[str, float]:
    """Make pi_step available to inference; returns the time it took (writing, sending, waiting to be taken).

    Filesystem: rank 0 writes `broadcasts/step_n` (marked `STABLE` once complete). In-memory broadcast: announce
    the step and wait until the orchestrator has taken it (sending it whenever asked); the directory is still
    written for a checkpoint step (a resumed orchestrator serves it first) and the last step (the run's result).
    The announcement comes before the directory: an orchestrator that found `STABLE` first would load the policy
    from disk and never ask for it, while this waited for it to be taken.
    """
    start = time.perf_counter()
    announce = sender is not None and step != max_steps  # the orchestrator never asks for the last policy
    if announce:
        sender.publish(step)
    due = run.ckpt is not None and run.ckpt.config.due(step, max_steps)
    if sender is None or due or step == max_steps:
        state = full_state_dict(run.model, run.export_dtype, f"policy step {step}")  # a collective; empty off rank 0
        if world.is_main:
            save_hf_dir(state, run.model.config, tokenizer, broadcast_dir(config.output_dir, step), STABLE,
                        run.model.generation_config)  # fmt: skip
        del state
        dist.barrier()
    written = time.perf_counter() - start
    if announce:
        what = f"the orchestrator to take policy step {step}"
        wait_until(world, partial(sender.taken_or_unwanted, step), what, config.batch_timeout, sender, run)
    sent = sender.pop_seconds() if sender is not None else 0.0
    return {"time_publish": written + sent, "time_wait_taken": time.perf_counter() - start - written - sent}


def phase_times(metrics: dict) -> str:
    """Where the step's time went: waiting for the batch, loading it, forward, backward, the optimizer step (their
    sum and the rest: `train`), publishing the policy and waiting for the orchestrator to take it."""
    t = {key: metrics.get(f"time_{key}", 0.0) for key in ("forward", "backward", "optimizer", "wait_taken")}
    load = metrics["time_data"] - metrics["time_wait_batch"]
    return (
        f"wait {metrics['time_wait_batch']:.2f}s load {load:.2f}s fwd {t['forward']:.2f}s bwd {t['backward']:.2f}s "
        f"opt {t['optimizer']:.2f}s (train {metrics['time_train']:.2f}s) publish {metrics['time_publish']:.2f}s"
        + (f" taken {t['wait_taken']:.2f}s" if t["wait_taken"] else "")
    )


def log_step(step: int, metrics: dict, monitor: Monitor) -> None:
    mfu = f" mfu {metrics['mfu']:.1f}%" if metrics["mfu"] is not None else ""
    critic = f"value_loss {metrics['value_loss']:.4f} | " if "value_loss" in metrics else ""
    ref_kl = f"ref_kl {metrics['ref_kl']:.2e} | " if "ref_kl" in metrics else ""
    ref_kl += f"ce_loss {metrics['ce_loss']:.4f} | " if "ce_loss" in metrics else ""
    ref_kl += f"ref_kl_stream {metrics['ref_kl_stream']:+.2e} | " if "ref_kl_stream" in metrics else ""
    logger.info(
        f"step {step} | loss {metrics['loss']:+.4f} | entropy {metrics['entropy']:.3f} | "
        f"mismatch_kl {metrics.get('mismatch_kl', 0.0):.2e} | {critic}{ref_kl}grad_norm {metrics['grad_norm']:.3f} | "
        f"lr {metrics['lr']:.2e} | {metrics['tokens_per_s']:.0f} tok/s{mfu} | "
        f"pad {100 * metrics['padding_fraction']:.0f}% | {phase_times(metrics)} | mem {metrics['peak_memory_gib']:.2f} GiB"
    )
    monitor.log(step, metrics)


if __name__ == "__main__":
    main()
