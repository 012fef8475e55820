"""The scaffold both training loops stand in: the RL `trainer` (rl/train.py) and `sft` (sft/train.py).

A loop keeps only what is its own (where samples come from, the loss, what it publishes, its extra metrics)
and reads top to bottom; the rest is here, once:

    with trainer_process("sft", config, errors) as (world, monitor):  # one rank's life: group, lock, logs, exit
        tokenizer = load_tokenizer(config.model)
        run = build_run(config, world, "sft", max_steps, "fine-tuning")  # FSDP2 model, optimizer, schedule, resume
        meter = StepMeter(run.model.config, config.seq_len, world)
        ...
        rows, info = next_rows(world, config.seq_len, config.model.attn, run.model.config, take_samples, errors)
        ...  forward/backward every row (the loop's loss)
        grad_norm, lr = run.optimizer_step(config.optim.max_norm)
        sums = all_reduce_sums(totals, world)
        run.maybe_checkpoint(step, max_steps)
        metrics = meter.step(sums, info, grad_norm, lr, t_data, t_train) | the loop's own
"""

from __future__ import annotations

import faulthandler
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from loguru import logger
from transformers import AutoTokenizer, PreTrainedModel

from prime_rl.batch import TrainingSample
from prime_rl.config.loader import write_resolved_config
from prime_rl.trainer.ckpt import CheckpointManager, P, Progress, resolve_resume_step
from prime_rl.trainer.config import TrainerModelConfig
from prime_rl.trainer.model.build import SetupError, build_model, check_device, export_dtype, load_arch
from prime_rl.trainer.model.logprobs import HeadError
from prime_rl.trainer.model.lora import LoRAAdapters
from prime_rl.trainer.optim import build_optimizer, build_scheduler, clip_grad_norm, move_optimizer_state
from prime_rl.trainer.packing import PackedRow, layout_units, pack_units, packs_across_samples, row_capacity, shard_rows
from prime_rl.trainer.parallel.distributed import World, broadcast_object, die_with_torchrun_agent, init_distributed
from prime_rl.trainer.perf import (
    ThroughputMeter,
    attention_entry_cost,
    flops_per_token,
    peak_flops,
    peak_memory_gib,
)
from prime_rl.utils.locks import OutputDirBusy, OutputDirLock
from prime_rl.utils.logging import setup_logging
from prime_rl.utils.malloc import keep_freed_memory
from prime_rl.utils.monitor import Monitor, MonitorError

SETUP_ERRORS = (FileNotFoundError, SetupError, HeadError, MonitorError, OutputDirBusy)
"""Failures of settings or surroundings (a missing checkpoint, a busy output dir, ...): a message, not a bug."""


# ---------------------------------------------------------------------------------------------------------
# One rank's life.


@contextmanager
def trainer_process(role: str, config, errors: tuple[type[Exception], ...]) -> Iterator[tuple[World, Monitor | None]]:
    """Run the body as one rank of `role` ("trainer" or "sft"); yields the world and rank 0's monitor (else None).

    In order: die with the torchrun agent, join the process group, keep freed memory on CPU, take
    `{output_dir}/.locks/<role>.lock` on rank 0 (a second run of the role on the same output_dir stops here, before
    it writes anything), then logs, the resolved config and the monitor. An expected failure (`errors`,
    `SETUP_ERRORS`) exits 1 without a traceback; rank 0 prints its message once (`next_rows` and the lock raise
    it on every rank alike).
    """
    die_with_torchrun_agent()
    faulthandler.enable(all_threads=True)  # a fatal signal prints this rank's Python stacks to its log
    world = init_distributed(config.model.cp)
    if world.device.type == "cpu":
        keep_freed_memory()  # every step reuses the memory the last one freed, instead of faulting it in again
    setup_logging(role, config.log.level)  # the console only, until the output dir is ours
    if not world.is_main:
        logger.remove()  # one console, rank 0's: loguru drops messages when no sink is left
    lock, monitor, exit_code = None, None, 1
    try:
        if world.world_size % world.cp:
            raise SetupError(f"model.cp={world.cp} must divide the number of ranks ({world.world_size})")
        lock = claim_output_dir(config.output_dir, role, world)
        if world.is_main:
            setup_logging(role, config.log.level, config.output_dir / "logs", file_name=config.log.file)
            write_resolved_config(config, role)
            resume = config.ckpt is not None and config.ckpt.resuming
            run_config = config.model_dump(mode="json")
            monitor = Monitor(config.output_dir, role, config.wandb, run_config, resume, config.tensorboard)
        yield world, monitor
        exit_code = 0
    except (*errors, *SETUP_ERRORS) as e:
        if world.is_main:
            logger.error(f"{role} stopped: {e}")
        raise SystemExit(1) from None
    finally:
        if monitor is not None:
            monitor.close(exit_code)
        if dist.is_initialized():
            if exit_code == 0:
                dist.barrier()  # every rank tears gloo down together: one leaving early can abort another at exit
            dist.destroy_process_group()
        if lock is not None:
            lock.release()


def exit_finished() -> None:
    """A rank whose run finished: flush and leave without the interpreter's teardown. Everything is closed by now
    (monitor, process group, lock); the teardown of torch's C++ state has aborted a finished two-rank gloo run
    ("terminate called without an active exception", exit code -6) after it had trained and saved correctly."""
    logger.complete()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def claim_output_dir(output_dir: Path, role: str, world: World) -> OutputDirLock | None:
    """Rank 0 takes the role's lock for the whole run (held by the process: the kernel drops it when the rank
    dies); when another process holds it, every rank raises `OutputDirBusy` naming that process."""
    lock, error = None, None
    if world.is_main:
        try:
            lock = OutputDirLock(output_dir, role)
        except OutputDirBusy as e:
            error = str(e)
    if (error := broadcast_object(error, world)) is not None:
        raise OutputDirBusy(error)
    return lock


# ---------------------------------------------------------------------------------------------------------
# The run: model, optimizer, schedule, checkpoints.


def load_tokenizer(config: TrainerModelConfig):
    try:
        return AutoTokenizer.from_pretrained(config.name, trust_remote_code=config.trust_remote_code)
    except OSError as e:  # a missing directory, an unknown hub id, no network
        raise SetupError(f"model.name {config.name!r}: {e}") from None


@dataclass
class Run:
    """What a training loop steps: the FSDP2-sharded model, its optimizer and schedule, checkpoints, progress."""

    model: PreTrainedModel
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    ckpt: CheckpointManager | None
    progress: Progress
    """Where the run stands (restored from the checkpoint on resume); the loop replaces it after each step."""
    export_dtype: torch.dtype
    """What published and exported weights are written in: the checkpoint's dtype, or float32 when training in it."""
    offload_device: torch.device | None = None
    """With `optim.cpu_offload`: the device the optimizer state comes to for each step (it lives on the host)."""
    adapters: LoRAAdapters | None = None
    """With `model.lora` (sft): the one adapter (slot 0) that trains on the frozen base; the optimizer has its
    parameters only."""

    def trained_parameters(self) -> list[torch.nn.Parameter]:
        return self.adapters.slot_params(0) if self.adapters is not None else list(self.model.parameters())

    def optimizer_step(self, max_norm: float) -> tuple[float, float]:
        """Clip, then step optimizer and schedule; returns the gradient norm before clipping and the lr used.
        An adapter's gradients are summed over the ranks first (FSDP reduces the sharded weights' in backward)."""
        if self.adapters is not None:
            self.adapters.all_reduce_grads([0], dist.get_world_size())
        grad_norm = clip_grad_norm(self.trained_parameters(), max_norm)
        lr = self.scheduler.get_last_lr()[0]
        if self.offload_device is not None:
            move_optimizer_state(self.optimizer, self.offload_device)
        self.optimizer.step()
        if self.offload_device is not None:
            move_optimizer_state(self.optimizer, torch.device("cpu"))
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return grad_norm, lr

    def maybe_checkpoint(self, step: int, max_steps: int | None) -> None:
        """Save every `ckpt.interval` steps and after the last one (a collective: every rank calls it)."""
        if self.ckpt is not None and self.ckpt.config.due(step, max_steps):
            self.ckpt.save(step, self.model, self.optimizer, self.scheduler, self.progress)


def load_model(config, world: World) -> tuple[PreTrainedModel, torch.dtype]:
    """The sharded model (seeded) and the dtype published and exported weights are written in (`export_dtype`)."""
    check_device(config.model, config.optim, world.device)
    torch.manual_seed(config.seed)
    arch = load_arch(config.model)
    dtype = export_dtype(arch, config.model.dtype)
    model = build_model(config.model, arch, world, config.seed)
    model.config.dtype = dtype
    return model, dtype


def build_run(
    config, world: World, name: str, max_steps: int | None, verb: str, progress_type: type[P] = Progress
) -> Run:
    """Load and shard the model, build optimizer and schedule, and resume from `config.ckpt.resume_step`.

    `name` is the checkpoint's subdirectory (`checkpoints/step_n/<name>/`); `progress_type` a `Progress` that
    records more when the loop needs it (sft: the data position). With `model.lora` (sft; the RL trainer's LoRA
    loop has runs of its own) the base is frozen and one adapter, drawn from `seed`, is what trains and is saved.
    """
    model, export_dtype = load_model(config, world)
    adapters = None
    if config.model.lora is not None:
        adapters = LoRAAdapters(model, config.model.lora, 1, world.device)
        adapters.reset_slot(0, config.seed)
    trained = adapters.slot_params(0) if adapters is not None else model.parameters()
    optimizer = build_optimizer(trained, config.optim)
    scheduler = build_scheduler(optimizer, config.scheduler, max_steps)
    ckpt = None
    if config.ckpt is not None:
        ckpt = CheckpointManager(config.output_dir, config.ckpt, world.is_main, name, adapters)
    progress = progress_type()
    if ckpt is not None and config.ckpt.resuming:
        step = resolve_resume_step(config.output_dir, config.ckpt.resume_step, name)
        progress = ckpt.load(step, model, optimizer, scheduler, progress_type)
        logger.info(f"resumed from step {progress.step} ({progress.tokens} tokens, {progress.samples} samples)")
    lora = ""
    if adapters is not None:
        trained_count = sum(p.numel() for p in adapters.slot_params(0))
        lora = f" (a LoRA adapter of rank {config.model.lora.rank} on {len(adapters.targets)} layers trains: "
        lora += f"{trained_count / 1e6:.2f}M params)"
    logger.info(
        f"{verb} {config.model.name} on {world.world_size} rank(s) ({world.device.type}), "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params{lora}, "
        f"steps {progress.step + 1}..{max_steps or 'inf'}"
    )
    offload = world.device if config.optim.cpu_offload else None
    return Run(model, optimizer, scheduler, ckpt, progress, export_dtype, offload, adapters)


# ---------------------------------------------------------------------------------------------------------
# One step: rows in, statistics out.


STEP_TOTALS = ("loss_tokens", "tokens", "samples", "ce_tokens", "ref_kl_tokens")
"""What `next_rows` counts per slot and over the step: the loss streams' tokens too (`rl/step.py: stream_scales`)."""


def next_rows(
    world: World,
    seq_len: int,
    attn: str,
    model_config,
    take_samples: Callable[[], tuple[list[TrainingSample] | dict[int, list[TrainingSample]], dict]],
    errors: tuple[type[Exception], ...],
) -> tuple[list[PackedRow], dict]:
    """Rank 0 takes the step's samples and packs them; every rank gets its own rows and the step's totals.

    Rows are at most `seq_len` long, or as long as the longest unit where the attention kernel `attn` computes
    the whole row (`row_capacity`); there a group's samples share one copy of their prompt where that costs the
    model (`model_config`) less (`layout_units`).
    `take_samples()` runs on rank 0 only and returns the samples (or, for several runs, samples per adapter slot:
    each run's are packed apart and their rows carry its slot) plus facts every rank should see (they join the totals
    `loss_tokens`, `tokens`, `samples`, `ce_tokens`, `ref_kl_tokens` (the loss streams' tokens), and per slot
    `slots` = {slot: those five}). An `errors` exception there is
    raised on every rank with rank 0's message, instead of leaving the other ranks blocked in the next collective.
    """
    payload: dict = {}
    if world.is_main:
        try:
            samples, facts = take_samples()
            by_slot = samples if isinstance(samples, dict) else {0: samples}
            rows, slots = [], {}
            varlen = packs_across_samples(attn, world.cp)
            cost = None if varlen else attention_entry_cost(model_config)
            units = {slot: layout_units(ss, seq_len, cost) for slot, ss in by_slot.items()}
            capacity = row_capacity([u.length for us in units.values() for u in us], seq_len, varlen)
            for slot, slot_samples in by_slot.items():
                slot_rows = pack_units(slot_samples, units[slot], capacity)
                for row in slot_rows:
                    row.slot = slot
                rows += slot_rows
                slots[slot] = {
                    "loss_tokens": sum(row.num_loss_tokens for row in slot_rows),
                    "tokens": sum(len(s.token_ids) for s in slot_samples),
                    "samples": len(slot_samples),
                    "ce_tokens": sum(row.num_ce_tokens for row in slot_rows),  # the loss streams' counts
                    "ref_kl_tokens": sum(row.num_ref_kl_tokens for row in slot_rows),
                }
            payload = {
                "shards": [shard for shard in shard_rows(rows, world.dp_size) for _ in range(world.cp)],
                **{key: sum(totals[key] for totals in slots.values()) for key in STEP_TOTALS},
                "slots": slots,
                **facts,
            }
        except errors as e:
            payload = {"error": e}
    shards = payload.pop("shards", None)
    payload = broadcast_object(payload, world)  # the totals, or the error
    if "error" in payload:
        raise payload["error"]
    mine: list = [None]
    dist.scatter_object_list(mine, shards, src=0)  # each rank receives only its own rows (a CP group the same ones)
    return mine[0], payload


def all_reduce_sums(totals: dict[str, float], world: World) -> dict[str, float]:
    """Sum each statistic over the ranks (one collective for all of them)."""
    keys = sorted(totals)
    tensor = torch.tensor([totals[k] for k in keys], dtype=torch.float64, device=world.device)
    dist.all_reduce(tensor)
    return dict(zip(keys, tensor.tolist(), strict=True))


class StepMeter:
    """The metrics every loop logs per step; throughput and MFU measure the training work only."""

    def __init__(self, model_config, seq_len: int, world: World):
        self.flops_per_token = flops_per_token(model_config, seq_len)
        self.peak = peak_flops(torch.cuda.get_device_name(world.device)) if world.device.type == "cuda" else None
        self.meter = ThroughputMeter()
        self.world = world

    def step(self, sums: dict, info: dict, grad_norm: float, lr: float, t_data: float, t_train: float) -> dict:
        """`sums`: the all-reduced statistics of `train_step` (`loss`, `processed_tokens` the positions computed,
        `padding_tokens` those of them that only pad); `info`: the totals
        of `next_rows`; `t_data`: the wait for the samples, reported apart from `t_train`."""
        padding = int(sums.get("padding_tokens", 0))
        self.meter.update(t_train, info["tokens"], max(0, int(sums["processed_tokens"]) - padding))
        return {
            "loss": sums["loss"],
            "grad_norm": float(grad_norm),
            "lr": lr,
            "tokens": info["tokens"],
            "samples": info["samples"],
            "padding_fraction": min(1.0, padding / max(sums["processed_tokens"], 1)),
            "tokens_per_s": self.meter.tokens_per_s or info["tokens"] / max(t_train, 1e-9),
            "mfu": self.meter.mfu(self.flops_per_token, self.peak, self.world.world_size) if self.peak else None,
            "peak_memory_gib": peak_memory_gib(self.world.device),
            "time_data": t_data,
            "time_train": t_train,
        }
