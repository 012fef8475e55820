"""`trainer` entry point: the RL training loop, readable top to bottom.

    uv run trainer @ cfg.toml                                   # one process
    uv run torchrun --nproc-per-node 2 -m prime_rl.trainer.train @ cfg.toml

Step n: wait for `rollouts/step_n/batch.bin` -> rank 0 packs it into rows and deals them out ->
forward/backward every row (loss normalised by the step's total loss tokens) -> clip, optimizer and
scheduler step -> publish `broadcasts/step_n` (pi_n) -> maybe checkpoint.
"""

import math
import random
import time

import torch
import torch.distributed as dist
from loguru import logger
from transformers import AutoTokenizer

from prime_rl.batch import BatchError, TrainingSample, batch_path, read_batch, validate_batch, wait_for_batch
from prime_rl.config.loader import load_config, write_resolved_config
from prime_rl.trainer.ckpt import CheckpointManager, Progress, resolve_resume_step
from prime_rl.trainer.config import TrainerConfig
from prime_rl.trainer.distributed import World, broadcast_object, init_distributed
from prime_rl.trainer.logprobs import shifted_logprobs
from prime_rl.trainer.loss import compute_loss
from prime_rl.trainer.model import SetupError, check_device, load_model, shard_model, stored_dtype
from prime_rl.trainer.optim import build_optimizer, build_scheduler, clip_grad_norm
from prime_rl.trainer.packing import PackedRow, pack_samples, shard_rows
from prime_rl.trainer.perf import (
    ThroughputMeter,
    flops_per_token,
    format_bench_table,
    peak_flops,
    peak_memory_gib,
)
from prime_rl.trainer.weights import STABLE, broadcast_dir, full_state_dict, prune_broadcasts, save_hf_dir
from prime_rl.utils.logging import setup_logging
from prime_rl.utils.monitor import Monitor, MonitorError


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


def next_rows(config: TrainerConfig, world: World, step: int, vocab_size: int) -> tuple[list[PackedRow], dict]:
    """Rank 0 reads, validates and packs batch `step`; every rank gets its rows and the step totals.

    A bad batch fails on every rank with rank 0's message, instead of leaving the others blocked.
    """
    payload: dict = {}
    if world.is_main:
        try:
            if config.bench is not None:
                samples = fake_samples(config, vocab_size, step)
            else:
                path = wait_for_batch(batch_path(config.output_dir, step), timeout=config.batch_timeout)
                batch = read_batch(path)
                if batch.step != step:
                    raise BatchError(f"{path}: holds step {batch.step}, expected {step}")
                validate_batch(batch, path, vocab_size, config.seq_len)
                samples = batch.samples
            rows = pack_samples(samples, config.seq_len)
            payload = {
                "shards": shard_rows(rows, world.world_size),
                "loss_tokens": sum(int(s.loss_mask.count(True)) for s in samples),
                "tokens": sum(len(s.token_ids) for s in samples),
                "samples": len(samples),
            }
        except (BatchError, TimeoutError) as e:
            payload = {"error": str(e)}
    shards = payload.pop("shards", None)
    payload = broadcast_object(payload, world)  # the totals, or the error
    if "error" in payload:
        raise BatchError(payload["error"])
    mine: list = [None]
    dist.scatter_object_list(mine, shards, src=0)  # each rank receives only its own rows
    return mine[0], payload


def train_step(model, rows: list[PackedRow], loss_scale: float, config: TrainerConfig, device) -> dict[str, float]:
    """Forward/backward every row of this rank; returns summed statistics (not yet reduced across ranks)."""
    totals: dict[str, torch.Tensor] = {}

    def add(key: str, value: torch.Tensor) -> None:
        value = value.detach().double()
        totals[key] = totals[key] + value if key in totals else value

    for row in rows:
        row = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in vars(row).items()}
        # No attention mask and no KV cache: transformers then derives a block-diagonal mask (or varlen
        # flash attention) from the position ids restarting at 0, so packed samples never see each other.
        ids, pos = row["input_ids"][None], row["position_ids"][None]
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
        logp, entropy = shifted_logprobs(logits, row["input_ids"], row["position_ids"], row["temperatures"])
        del logits
        loss, stats = compute_loss(
            logp, row["inference_logprobs"], row["advantages"], row["loss_mask"], row["sample_ids"],
            row["num_samples"], loss_scale, config.loss,
        )  # fmt: skip
        loss.backward()
        add("loss", loss)
        add("entropy_sum", entropy[row["loss_mask"]].sum())
        add("processed_tokens", torch.tensor(len(row["input_ids"])))
        for key, value in stats.items():
            add(key, value)
    return {k: v.item() for k, v in totals.items()}  # one sync per statistic per step, not per row


def all_reduce_sums(totals: dict[str, float], world: World) -> dict[str, float]:
    keys = sorted(totals)
    tensor = torch.tensor([totals[k] for k in keys], dtype=torch.float64, device=world.device)
    dist.all_reduce(tensor)
    return dict(zip(keys, tensor.tolist(), strict=True))


def main(argv: list[str] | None = None) -> None:
    config, _ = load_config(TrainerConfig, "trainer", argv)
    world = init_distributed()
    setup_logging("trainer", config.log.level, config.output_dir / "logs" if world.is_main else None)
    if not world.is_main:
        logger.remove()  # one console, rank 0's: loguru drops messages when no sink is left
    if world.is_main:
        write_resolved_config(config, "trainer")
    monitor, exit_code = None, 1
    try:
        if world.is_main:
            resume = config.ckpt is not None and config.ckpt.resume_step is not None
            monitor = Monitor(config.output_dir, "trainer", config.wandb, config.model_dump(mode="json"), resume)
        run(config, world, monitor)
        exit_code = 0
    except (BatchError, FileNotFoundError, SetupError, MonitorError) as e:
        # Bad input or settings: every rank raises the same message; print it once, without a traceback.
        if world.is_main:
            logger.error(f"trainer stopped: {e}")
        raise SystemExit(1) from None
    finally:
        if monitor is not None:
            monitor.close(exit_code)
        if dist.is_initialized():
            dist.destroy_process_group()


def run(config: TrainerConfig, world: World, monitor: Monitor | None) -> None:
    """Train until `max_steps`; `monitor` is rank 0's (None on the other ranks)."""
    check_device(config.model, world.device)
    torch.manual_seed(config.seed)
    publish_dtype = stored_dtype(config.model)
    tokenizer = AutoTokenizer.from_pretrained(config.model.name, trust_remote_code=config.model.trust_remote_code)
    model = shard_model(load_model(config.model, config.seed), config.model, world)
    model.config.dtype = publish_dtype
    vocab_size = model.config.vocab_size
    optimizer = build_optimizer(model.parameters(), config.optim)
    max_steps = config.bench.steps if config.bench else config.max_steps
    scheduler = build_scheduler(optimizer, config.scheduler, max_steps)
    ckpt = CheckpointManager(config.output_dir, config.ckpt, world.is_main) if config.ckpt else None
    progress = Progress()
    if ckpt is not None and config.ckpt.resume_step is not None:
        step = resolve_resume_step(config.output_dir, config.ckpt.resume_step)
        progress = ckpt.load(step, model, optimizer, scheduler)
        logger.info(f"resumed from step {progress.step} ({progress.tokens} tokens, {progress.samples} samples)")

    n_flops = flops_per_token(model.config, config.seq_len)
    peak = peak_flops(torch.cuda.get_device_name(world.device)) if world.device.type == "cuda" else None
    meter = ThroughputMeter()
    bench_rows: list[dict] = []
    logger.info(
        f"training {config.model.name} on {world.world_size} rank(s) ({world.device.type}), "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, steps {progress.step + 1}..{max_steps or 'inf'}"
    )

    while max_steps is None or progress.step < max_steps:
        step = progress.step + 1
        t0 = time.perf_counter()
        rows, info = next_rows(config, world, step, vocab_size)
        t_data = time.perf_counter() - t0
        loss_scale = max(info["loss_tokens"], 1)

        model.train()
        totals = train_step(model, rows, loss_scale, config, world.device)
        grad_norm = clip_grad_norm(model.parameters(), config.optim.max_norm)
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        progress = Progress(progress.step + 1, progress.tokens + info["tokens"], progress.samples + info["samples"])
        sums = all_reduce_sums(totals, world)
        t_train = time.perf_counter() - t0 - t_data

        if config.bench is None:
            t_pub = time.perf_counter()
            state = full_state_dict(model, publish_dtype)
            if world.is_main:
                target = broadcast_dir(config.output_dir, step)
                save_hf_dir(state, model.config, tokenizer, target, STABLE, model.generation_config)
                keep = set(range(0, step + 1, config.ckpt.interval)) if config.ckpt else set()
                prune_broadcasts(config.output_dir, step, config.max_async_level, keep)
            del state
            dist.barrier()
            t_pub = time.perf_counter() - t_pub
            if ckpt is not None and (step % config.ckpt.interval == 0 or step == max_steps):
                ckpt.save(step, model, optimizer, scheduler, progress)
        else:
            t_pub = 0.0

        # Throughput and MFU measure the training work; waiting for the orchestrator is reported separately.
        meter.update(t_train, info["tokens"], int(sums["processed_tokens"]))
        metrics = step_metrics(sums, info, grad_norm, lr, meter, n_flops, peak, world, t_data, t_train, t_pub)
        if world.is_main:
            log_step(step, metrics, monitor)
            bench_rows.append({"step": step, "seconds": t_train, **metrics})
    if ckpt is not None:
        ckpt.wait()
    if config.bench is not None and world.is_main:
        print(format_bench_table(bench_rows))


def step_metrics(sums, info, grad_norm, lr, meter, n_flops, peak, world, t_data, t_train, t_pub) -> dict[str, float]:
    tokens = max(info["loss_tokens"], 1)
    metrics = {
        "loss": sums["loss"],
        "entropy": sums["entropy_sum"] / tokens,
        "grad_norm": float(grad_norm),
        "lr": lr,
        "tokens": info["tokens"],
        "samples": info["samples"],
        "padding_fraction": 1 - info["tokens"] / max(sums["processed_tokens"], 1),
        "tokens_per_s": meter.tokens_per_s or info["tokens"] / max(t_train, 1e-9),
        "mfu": meter.mfu(n_flops, peak, world.world_size) if peak else None,
        "peak_memory_gib": peak_memory_gib(world.device),
        "time_data": t_data,
        "time_train": t_train,
        "time_publish": t_pub,
    }
    samples = max(sums.get("samples", 0), 1)
    metrics["mismatch_kl"] = sums.get("mismatch_kl_sum", 0.0) / tokens
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
