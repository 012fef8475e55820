"""`sft` entry point: supervised fine-tuning on chat data, readable top to bottom.

    uv run sft @ configs/sft/tiny.toml                                   # one process
    uv run torchrun --nproc-per-node 2 -m prime_rl.trainer.sft @ cfg.toml

Step n: rank 0 takes the samples of the next `batch_size` examples of the data stream, packs them into rows
and deals them out (as the RL trainer does with a batch) -> forward/backward every row (cross-entropy summed
over the loss tokens, divided by the step's total) -> clip, optimizer and scheduler step -> maybe export `weights/step_n`
-> maybe checkpoint, data position included, so a resumed run reads on from the very next example.
"""

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from loguru import logger
from transformers import AutoTokenizer

from prime_rl.config.loader import load_config, write_resolved_config
from prime_rl.trainer.ckpt import CheckpointManager, Progress, resolve_resume_step
from prime_rl.trainer.distributed import World, broadcast_object, init_distributed
from prime_rl.trainer.model import SetupError, check_device, load_model, shard_model, stored_dtype
from prime_rl.trainer.optim import build_optimizer, build_scheduler, clip_grad_norm
from prime_rl.trainer.packing import PackedRow, pack_samples, shard_rows
from prime_rl.trainer.perf import ThroughputMeter, flops_per_token, peak_flops, peak_memory_gib
from prime_rl.trainer.sft_config import ChatDataConfig, SFTConfig
from prime_rl.trainer.sft_data import ChatStream, DataError, DataState, fake_samples, load_examples
from prime_rl.trainer.train import all_reduce_sums
from prime_rl.trainer.weights import full_state_dict, save_hf_dir, weights_dir
from prime_rl.utils.logging import setup_logging
from prime_rl.utils.monitor import Monitor, MonitorError


@dataclass
class SFTProgress(Progress):
    data: DataState = field(default_factory=DataState)
    """Where the example stream stands after this step (rank 0's, shared with every rank each step)."""

    def __post_init__(self) -> None:
        if isinstance(self.data, dict):  # as stored in a checkpoint
            self.data = DataState(**self.data)


def open_stream(config: SFTConfig, world: World, tokenizer) -> ChatStream | None:
    """Rank 0 loads the examples (other ranks get None); a bad dataset stops every rank with its message."""
    stream, error = None, None
    if world.is_main and isinstance(config.data, ChatDataConfig):
        try:
            examples = load_examples(config.data)
            stream = ChatStream(examples, tokenizer, config.data, config.seq_len, config.seed)
            logger.info(f"{len(examples)} examples from {config.data.name}")
        except DataError as e:
            error = str(e)
    if (error := broadcast_object(error, world)) is not None:
        raise DataError(error)
    return stream


def next_rows(
    config: SFTConfig, world: World, step: int, stream: ChatStream | None, vocab_size: int
) -> tuple[list[PackedRow], dict]:
    """Rank 0 takes and packs the step's samples; every rank gets its rows and the step totals.

    An unusable example fails on every rank with rank 0's message, instead of leaving the others blocked.
    """
    payload: dict = {}
    if world.is_main:
        try:
            if stream is None:
                samples = fake_samples(config.seed, step, config.batch_size, config.seq_len, vocab_size)
            else:
                samples, example_ids = stream.take(config.batch_size)
                logger.debug(f"step {step} examples {example_ids}")
            rows = pack_samples(samples, config.seq_len)
            payload = {
                "shards": shard_rows(rows, world.world_size),
                "loss_tokens": sum(row.num_loss_tokens for row in rows),
                "tokens": sum(len(s.token_ids) for s in samples),
                "samples": len(samples),
                "data": asdict(stream.state) if stream is not None else asdict(DataState()),
                "examples": len(stream.examples) if stream is not None else None,
            }
        except DataError as e:
            payload = {"error": str(e)}
    shards = payload.pop("shards", None)
    payload = broadcast_object(payload, world)
    if "error" in payload:
        raise DataError(payload["error"])
    mine: list = [None]
    dist.scatter_object_list(mine, shards, src=0)  # each rank receives only its own rows
    return mine[0], payload


def token_cross_entropy(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Σ over loss tokens of -log p(token | what precedes it in its sample), fp32; logits[t-1] predict token t.

    A sample's first token is never a loss token, so no prediction across the samples of a row counts.
    """
    nll = F.cross_entropy(logits[:-1].float(), input_ids[1:], reduction="none")
    return torch.where(loss_mask[1:], nll, 0.0).sum()


def train_step(model, rows: list[PackedRow], loss_scale: float, device) -> dict[str, float]:
    """Forward/backward every row of this rank; returns summed statistics (not yet reduced across ranks)."""
    loss = torch.zeros((), dtype=torch.float64, device=device)
    for row in rows:
        ids, pos, mask = (t.to(device) for t in (row.input_ids, row.position_ids, row.loss_mask))
        # No attention mask and no KV cache: transformers derives a block-diagonal mask (or varlen flash
        # attention) from the position ids restarting at 0, so packed samples never see each other.
        logits = model(input_ids=ids[None], position_ids=pos[None], use_cache=False).logits[0]
        row_loss = token_cross_entropy(logits, ids, mask) / loss_scale
        del logits
        row_loss.backward()
        loss += row_loss.detach().double()
    return {"loss": loss.item(), "processed_tokens": float(sum(row.num_tokens for row in rows))}


def export_weights(model, tokenizer, dtype: torch.dtype, target: Path, world: World) -> None:
    """Write a Hugging Face directory (atomically) that `from_pretrained` and the inference server load."""
    state = full_state_dict(model, dtype)  # a collective; empty on ranks other than 0
    if world.is_main:
        save_hf_dir(state, model.config, tokenizer, target, generation_config=model.generation_config)
        logger.info(f"exported weights to {target}")
    del state
    dist.barrier()


def main(argv: list[str] | None = None) -> None:
    config, _ = load_config(SFTConfig, "sft", argv)
    world = init_distributed()
    setup_logging("sft", config.log.level, config.output_dir / "logs" if world.is_main else None)
    if not world.is_main:
        logger.remove()  # one console, rank 0's: loguru drops messages when no sink is left
    if world.is_main:
        write_resolved_config(config, "sft")
    monitor, exit_code = None, 1
    try:
        if world.is_main:
            resume = config.ckpt is not None and config.ckpt.resume_step is not None
            monitor = Monitor(config.output_dir, "sft", config.wandb, config.model_dump(mode="json"), resume)
        run(config, world, monitor)
        exit_code = 0
    except (DataError, FileNotFoundError, SetupError, MonitorError) as e:
        # Bad data or settings: every rank raises the same message; print it once, without a traceback.
        if world.is_main:
            logger.error(f"sft stopped: {e}")
        raise SystemExit(1) from None
    finally:
        if monitor is not None:
            monitor.close(exit_code)
        if dist.is_initialized():
            dist.destroy_process_group()


def run(config: SFTConfig, world: World, monitor: Monitor | None) -> None:
    """Fine-tune for `max_steps`; `monitor` is rank 0's (None on the other ranks)."""
    check_device(config.model, world.device)
    torch.manual_seed(config.seed)
    export_dtype = stored_dtype(config.model)
    tokenizer = AutoTokenizer.from_pretrained(config.model.name, trust_remote_code=config.model.trust_remote_code)
    stream = open_stream(config, world, tokenizer)  # before the model: a bad dataset fails fast
    model = shard_model(load_model(config.model, config.seed), config.model, world)
    model.config.dtype = export_dtype
    vocab_size = model.config.vocab_size
    optimizer = build_optimizer(model.parameters(), config.optim)
    scheduler = build_scheduler(optimizer, config.scheduler, config.max_steps)
    ckpt = CheckpointManager(config.output_dir, config.ckpt, world.is_main, name="sft") if config.ckpt else None
    progress = SFTProgress()
    if ckpt is not None and config.ckpt.resume_step is not None:
        step = resolve_resume_step(config.output_dir, config.ckpt.resume_step, name="sft")
        progress = ckpt.load(step, model, optimizer, scheduler, SFTProgress)
        logger.info(f"resumed from step {progress.step} ({progress.samples} samples, {progress.tokens} tokens)")
        if stream is not None:
            stream.state = DataState(**asdict(progress.data))
            logger.info(
                f"the data continues at epoch {progress.data.epoch}, example {progress.data.index} of its order"
            )

    n_flops = flops_per_token(model.config, config.seq_len)
    peak = peak_flops(torch.cuda.get_device_name(world.device)) if world.device.type == "cuda" else None
    meter = ThroughputMeter()
    logger.info(
        f"fine-tuning {config.model.name} on {world.world_size} rank(s) ({world.device.type}), "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, steps {progress.step + 1}..{config.max_steps}"
    )

    while progress.step < config.max_steps:
        step = progress.step + 1
        t0 = time.perf_counter()
        rows, info = next_rows(config, world, step, stream, vocab_size)
        t_data = time.perf_counter() - t0

        model.train()
        totals = train_step(model, rows, max(info["loss_tokens"], 1), world.device)
        grad_norm = clip_grad_norm(model.parameters(), config.optim.max_norm)
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        progress = SFTProgress(
            step, progress.tokens + info["tokens"], progress.samples + info["samples"], DataState(**info["data"])
        )
        sums = all_reduce_sums(totals, world)
        t_train = time.perf_counter() - t0 - t_data

        t_save = time.perf_counter()
        if step == config.max_steps or (config.weights_interval and step % config.weights_interval == 0):
            export_weights(model, tokenizer, export_dtype, weights_dir(config.output_dir, step), world)
        if ckpt is not None and (step % config.ckpt.interval == 0 or step == config.max_steps):
            ckpt.save(step, model, optimizer, scheduler, progress)
        t_save = time.perf_counter() - t_save

        meter.update(t_train, info["tokens"], int(sums["processed_tokens"]))
        metrics = {
            "loss": sums["loss"],
            "grad_norm": float(grad_norm),
            "lr": lr,
            "tokens": info["tokens"],
            "loss_tokens": info["loss_tokens"],
            "samples": info["samples"],
            "padding_fraction": 1 - info["tokens"] / max(sums["processed_tokens"], 1),
            "tokens_per_s": meter.tokens_per_s or info["tokens"] / max(t_train, 1e-9),
            "mfu": meter.mfu(n_flops, peak, world.world_size) if peak else None,
            "peak_memory_gib": peak_memory_gib(world.device),
            "epoch": progress.data.epoch,
            "data_index": progress.data.index,
            "skipped_too_long": progress.data.skipped_too_long,
            "skipped_no_loss": progress.data.skipped_no_loss,
            "time_data": t_data,
            "time_train": t_train,
            "time_save": t_save,
        }
        if world.is_main:
            log_step(step, config.max_steps, metrics, info["examples"], monitor)
    if ckpt is not None:
        ckpt.wait()


def log_step(step: int, max_steps: int, metrics: dict, examples: int | None, monitor: Monitor) -> None:
    mfu = f" mfu {metrics['mfu']:.1f}%" if metrics["mfu"] is not None else ""
    data = f" | epoch {metrics['epoch']} ({metrics['data_index']}/{examples})" if examples is not None else ""
    skipped = metrics["skipped_too_long"] + metrics["skipped_no_loss"]
    if skipped:
        data += f" skipped {metrics['skipped_too_long']} too long, {metrics['skipped_no_loss']} untrained"
    logger.info(
        f"step {step}/{max_steps} | loss {metrics['loss']:.4f} | grad_norm {metrics['grad_norm']:.3f} | "
        f"lr {metrics['lr']:.2e} | {metrics['tokens_per_s']:.0f} tok/s{mfu} | pad {100 * metrics['padding_fraction']:.0f}%"
        f"{data} | data {metrics['time_data']:.2f}s train {metrics['time_train']:.2f}s save {metrics['time_save']:.2f}s"
        f" | mem {metrics['peak_memory_gib']:.2f} GiB"
    )
    monitor.log(step, metrics)


if __name__ == "__main__":
    main()
