"""The LoRA training loop: one frozen base model, one adapter per run, several runs per step (`max_concurrent_runs`).

    uv run trainer @ cfg.toml --model.lora [--max-concurrent-runs 4]      (`rl/train.py`'s entry point picks this loop)

A step: rank 0 looks at the runs while it waits (who joins, who leaves, whose next batch is there; `runs.py`) ->
every rank applies the same changes -> rank 0 reads each ready run's batch and packs it apart (its rows carry the
run's adapter slot) and deals the rows out -> forward/backward of every micro-batch (each token through its run's
adapter, each run's loss divided by its own loss tokens) -> adapter gradients summed over the ranks -> per run: clip,
optimizer and schedule step -> rank 0 publishes each run's adapter as `broadcasts/step_n` of that run, checkpoints it
when due, and logs its metrics in its directory. A run's batch that cannot be used ends that run, not the trainer; so
does an adapter that diverged (a NaN or an infinity): it is not published, and the error names the run, the step and
the tensor (`Runs.publish`).
Training a run beside others gives it the same adapter as training it alone: its gradient is its own rows' alone.
"""

from __future__ import annotations

import time
from functools import partial

from loguru import logger

from prime_rl.batch import BatchError, remove_batch
from prime_rl.trainer.ckpt import Progress
from prime_rl.trainer.config import TrainerConfig
from prime_rl.trainer.model.lora import LoRAAdapters
from prime_rl.trainer.parallel.distributed import World, broadcast_object
from prime_rl.trainer.rl.batches import BATCH_ERRORS, load_batch, policy_versions, wait_until
from prime_rl.trainer.rl.loss import step_loss_scale
from prime_rl.trainer.rl.reference import load_reference
from prime_rl.trainer.rl.runs import Changes, Run, Runs
from prime_rl.trainer.rl.step import rl_metrics, train_step
from prime_rl.trainer.scaffold import StepMeter, all_reduce_sums, load_model, next_rows
from prime_rl.utils.monitor import Monitor


def train_lora(config: TrainerConfig, world: World, monitor: Monitor | None) -> None:
    """Train every run found until none is left (or stop when none ever comes within `batch_timeout`)."""
    model, export_dtype = load_model(config, world)
    adapters = LoRAAdapters(model, config.model.lora, config.max_concurrent_runs, world.device)
    runs = Runs(config, adapters, world.is_main, monitor)
    reference = load_reference(config, world, model, adapters)
    vocab_size = model.config.vocab_size
    meters: dict[str, StepMeter] = {}
    logger.info(
        f"training LoRA adapters (rank {config.model.lora.rank}, {len(adapters.targets)} layers) of "
        f"{config.model.name} for up to {config.max_concurrent_runs} run(s) on {world.world_size} rank(s)"
    )
    trainer_step = 0
    while True:
        t0 = time.perf_counter()
        changes = wait_for_changes(world, runs, config)
        runs.apply(changes)
        if changes.done:
            break
        ready = [runs.active[name] for name in changes.ready]
        if not ready:
            continue
        take = partial(take_batches, ready, vocab_size, config.seq_len)
        rows, info = next_rows(world, config.seq_len, config.model.attn, model.config, take, BATCH_ERRORS)
        t_data = time.perf_counter() - t0
        failed = info["failed"]
        trained = [run for run in ready if run.name not in failed]
        diverged: dict[str, str] = {}
        if trained:
            model.train()
            scales = {
                run.slot: step_loss_scale(
                    config.loss, info["slots"][run.slot]["loss_tokens"], info["slots"][run.slot]["samples"]
                )
                for run in trained
            }
            totals = train_step(model, rows, scales, config, world, adapters, reference)
            adapters.all_reduce_grads([run.slot for run in trained], world.world_size)
            steps = {run.name: runs.optimizer_step(run) for run in trained}
            sums = {run.name: all_reduce_sums(totals[run.slot], world) for run in trained}
            t_train = time.perf_counter() - t0 - t_data
            trainer_step += 1
            for run in trained:
                slot_info = info["slots"][run.slot] | info["versions"][run.name]
                progress = run.progress
                run.progress = Progress(progress.step + 1, progress.tokens + slot_info["tokens"],
                                        progress.samples + slot_info["samples"])  # fmt: skip
                run.waiting_since = time.monotonic()
                if world.is_main:
                    start = time.perf_counter()
                    if (why := runs.publish(run, config.model.name, export_dtype)) is not None:
                        diverged[run.name] = why
                        continue
                    remove_batch(run.path, run.progress.step)  # trained: nothing reads it again
                    meter = meters.setdefault(run.name, StepMeter(model.config, config.seq_len, world))
                    grad_norm, lr = steps[run.name]
                    times = {"time_publish": time.perf_counter() - start}
                    metrics = meter.step(sums[run.name], slot_info, grad_norm, lr, t_data, t_train)
                    metrics |= rl_metrics(sums[run.name], slot_info, times) | {"runs_in_step": len(trained)}
                    log_run_step(run, metrics)
            diverged = broadcast_object(diverged, world)  # rank 0 found them: every rank ends the same runs
        if failed or diverged:
            runs.apply(Changes(leaving={name: f"failed: {message}" for name, message in (failed | diverged).items()}))
    logger.info(f"every run ended after {trainer_step} trainer step(s)")


def wait_for_changes(world: World, runs: Runs, config: TrainerConfig) -> Changes:
    """Every rank: rank 0's next `Changes` worth acting on (a batch ready, a run joining or leaving, or the end)."""
    found: list[Changes] = []

    def worth_a_step() -> bool:
        changes = runs.changes(config.batch_timeout)
        if runs.worth_a_step(changes):
            found.append(changes)
            return True
        return False

    where = config.output_dir if config.max_concurrent_runs == 1 else f"{config.output_dir}/run_*"
    names = ", ".join(runs.active) or "none yet"
    what = f"a batch of the runs ({names}) or a new run in {where} (its orchestrator's configs/orchestrator.toml)"
    timeout = None if runs.active else config.batch_timeout
    wait_until(world, worth_a_step, what, timeout, None, None)
    return broadcast_object(found[-1] if world.is_main else None, world)


def take_batches(ready: list[Run], vocab_size: int, seq_len: int) -> tuple[dict[int, list], dict]:
    """Rank 0: each ready run's checked samples by slot; a run whose batch is unusable is reported in `failed`."""
    samples, versions, failed = {}, {}, {}
    for run in ready:
        try:
            run_samples = load_batch(run.path, run.progress.step + 1, vocab_size, seq_len)
        except BatchError as e:
            failed[run.name] = str(e)
            continue
        if any((s.ce_weights and max(s.ce_weights) > 0) or True in s.ref_kl_mask for s in run_samples):
            failed[run.name] = (
                f"{run.path}: step {run.progress.step + 1} carries loss streams (ce_weights / ref_kl_mask), which the "
                "LoRA multi-run trainer does not train; train this algorithm without model.lora"
            )
            continue
        samples[run.slot] = run_samples
        versions[run.name] = policy_versions(run_samples)
    return samples, {"failed": failed, "versions": versions}


def log_run_step(run: Run, metrics: dict) -> None:
    ref_kl = f"ref_kl {metrics['ref_kl']:.2e} | " if "ref_kl" in metrics else ""
    logger.info(
        f"step {run.progress.step} | run {run.name} | loss {metrics['loss']:+.4f} | entropy {metrics['entropy']:.3f} | "
        f"mismatch_kl {metrics['mismatch_kl']:.2e} | {ref_kl}grad_norm {metrics['grad_norm']:.3f} | lr {metrics['lr']:.2e} | "
        f"{metrics['samples']} samples | runs in step {metrics['runs_in_step']} | wait {metrics['time_data']:.2f}s "
        f"train {metrics['time_train']:.2f}s publish {metrics['time_publish']:.2f}s"
    )
    if run.monitor is not None:
        run.monitor.log(run.progress.step, metrics)
