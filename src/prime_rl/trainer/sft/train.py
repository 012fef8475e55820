"""`sft` entry point: supervised fine-tuning on chat data, readable top to bottom.

    uv run sft @ configs/sft/tiny.toml                                   # one process
    uv run torchrun --nproc-per-node 2 -m prime_rl.trainer.sft.train @ cfg.toml

Step n: rank 0 takes the samples of the next `batch_size` examples of the data stream, packs them into rows
and deals them out (as the RL trainer does with a batch) -> forward/backward every micro-batch of rows (minus the
log-prob of the loss tokens, summed, divided by the step's total) -> clip, optimizer and scheduler step -> maybe
export `weights/step_n` -> maybe checkpoint, data position included, so a resumed run reads on from the very next
example. `--bench` runs on random rows and writes neither. What the RL trainer does alike (the process around the
loop, model and optimizer setup, dealing out rows, the common metrics) is `trainer/scaffold.py`'s; the forward is
`logprobs.forward_logprobs`.

With `[model.lora]` (`--model.lora`) the base stays frozen (FSDP2-sharded as ever) and one LoRA adapter trains
(`model/lora.py`: replicated on every rank, drawn from `seed`, its gradients summed over the ranks before the step).
`weights/step_n` is then a peft adapter directory (`adapter_config.json`, `adapter_model.safetensors`) of the base
`model.name`, and a checkpoint holds the adapter, its optimizer, the schedule and the data position (`trainer/ckpt.py`). To
use the adapter: `PeftModel.from_pretrained(base, "weights/step_n")` (`.merge_and_unload()` for plain weights), or
an `inference --lora` server of the base and `/load_lora_adapter` of the directory (README, "LoRA adapters").
"""

import os
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from loguru import logger

from prime_rl.batch import TrainingSample
from prime_rl.config.loader import load_config
from prime_rl.trainer.ckpt import Progress
from prime_rl.trainer.model.logprobs import forward_logprobs, forward_passes
from prime_rl.trainer.packing import PackedRow
from prime_rl.trainer.parallel.distributed import World, broadcast_object
from prime_rl.trainer.perf import TRAINER_BENCH_COLUMNS, PhaseTimer
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
from prime_rl.trainer.sft.config import ChatDataConfig, SFTConfig
from prime_rl.trainer.sft.data import ChatStream, DataError, DataState, fake_samples, load_examples
from prime_rl.trainer.sft.evals import EvalFailed, FollowingEval, check_eval_config
from prime_rl.trainer.weights import NonFiniteWeights, full_state_dict, save_hf_dir, weights_dir
from prime_rl.utils.bench import format_bench_table
from prime_rl.utils.monitor import Monitor

DATA_ERRORS = (DataError,)
"""A dataset or example that cannot be trained on: the run stops with a message naming it."""


@dataclass
class SFTProgress(Progress):
    data: DataState = field(default_factory=DataState)
    """Where the example stream stands after this step (rank 0's, shared with every rank each step)."""

    def __post_init__(self) -> None:
        if isinstance(self.data, dict):  # as stored in a checkpoint
            self.data = DataState(**self.data)


def open_stream(config: SFTConfig, world: World, tokenizer) -> ChatStream | None:
    """Rank 0 loads the examples (other ranks, fake data and `--bench` get None); a bad dataset stops every rank
    with its message."""
    stream, error = None, None
    if world.is_main and isinstance(config.data, ChatDataConfig) and config.bench is None:
        try:
            examples = load_examples(config.data)
            stream = ChatStream(examples, tokenizer, config.data, config.seq_len, config.seed)
            logger.info(f"{len(examples)} examples from {config.data.name}")
        except DataError as e:
            error = str(e)
    if (error := broadcast_object(error, world)) is not None:
        raise DataError(error)
    return stream


def take_examples(
    config: SFTConfig, step: int, stream: ChatStream | None, vocab_size: int
) -> tuple[list[TrainingSample], dict]:
    """Rank 0: the samples of the step's next `batch_size` examples (random rows for `data.type = "fake"` and
    `--bench`), and where the stream stands after them (part of the checkpoint)."""
    if stream is None:
        bench = config.bench
        count, variable = (bench.samples, bench.variable_length) if bench else (config.batch_size, False)
        samples = fake_samples(config.seed, step, count, config.seq_len, vocab_size, variable)
        return samples, {"data": asdict(DataState()), "examples": None}
    samples, example_ids = stream.take(config.batch_size)
    logger.debug(f"step {step} examples {example_ids}")
    return samples, {"data": asdict(stream.state), "examples": len(stream.examples)}


def train_step(
    model,
    rows: list[PackedRow],
    loss_scale: float,
    config: SFTConfig,
    world: World,
    adapters=None,
    timer: PhaseTimer | None = None,
) -> dict[str, float]:
    """Forward/backward every micro-batch of this rank: Σ over loss tokens of -log p(token | what precedes it in
    its sample), divided by the step's loss-token count. Returns summed statistics (not yet reduced across ranks;
    a context-parallel group's first rank reports its group's). `adapters`: with `model.lora`, every token goes
    through slot 0's adapter; `timer`: where forward and backward time go.
    """
    loss = torch.zeros((), dtype=torch.float64, device=world.device)
    processed = padding = 0
    phase = timer or (lambda _: nullcontext())
    for batch in forward_passes(rows, config.micro_batch_tokens or config.seq_len, config.model.attn, world):
        with adapters.tokens(batch.slots, carrier=0) if adapters is not None else nullcontext():
            with phase("forward"):
                logp, _ = forward_logprobs(model, batch, world)  # temperature 1: sft samples carry the default
                batch_loss = -torch.where(batch.loss_mask, logp, 0.0).sum() / loss_scale
            with phase("backward"):
                batch_loss.backward()
        loss += batch_loss.detach().double()
        processed += batch.num_tokens
        padding += batch.num_padding
    if world.cp_rank != 0:
        return {"loss": 0.0, "processed_tokens": 0.0, "padding_tokens": 0.0}
    return {"loss": loss.item(), "processed_tokens": float(processed), "padding_tokens": float(padding)}


def export_weights(run: Run, tokenizer, target: Path, world: World, base_model: str) -> None:
    """Write a Hugging Face directory (atomically) that `from_pretrained` and the inference server load; with
    `model.lora` a peft adapter directory of `base_model` (rank 0 holds the whole adapter) that peft and vLLM load."""
    if run.adapters is not None:
        if world.is_main:
            run.adapters.save(0, target, base_model, run.export_dtype)
            logger.info(f"exported the LoRA adapter to {target}")
        dist.barrier()
        return
    state = full_state_dict(run.model, run.export_dtype, f"the export to {target}")  # a collective; empty off rank 0
    if world.is_main:
        save_hf_dir(state, run.model.config, tokenizer, target, generation_config=run.model.generation_config)
        logger.info(f"exported weights to {target}")
    del state
    dist.barrier()


def main(argv: list[str] | None = None) -> None:
    config, _ = load_config(SFTConfig, "sft", argv)
    evals = config.eval is not None and config.bench is None
    if evals and int(os.environ.get("RANK", "0")) == 0:
        check_eval_config(config)  # a bad eval config ends the run now, not after training
    with trainer_process("sft", config, (*DATA_ERRORS, NonFiniteWeights, EvalFailed)) as (world, monitor):
        follower = FollowingEval(config, monitor) if evals and world.is_main else None
        try:
            fine_tune(config, world, monitor, follower)
            if follower is not None:
                follower.finish()
        finally:  # an error, Ctrl-C: the eval goes with sft (a kill of sft: its parent-death signal)
            if follower is not None:
                follower.stop()
    exit_finished()


def fine_tune(config: SFTConfig, world: World, monitor: Monitor | None, evals: FollowingEval | None = None) -> None:
    """Fine-tune for `max_steps` (`bench.steps` with `--bench`); `monitor` is rank 0's (None on the other ranks), as
    is `evals`, the eval of the exports, started once the model is built and read between steps."""
    tokenizer = load_tokenizer(config.model)
    stream = open_stream(config, world, tokenizer)  # before the model: a bad dataset fails fast
    max_steps = config.bench.steps if config.bench else config.max_steps
    run = build_run(config, world, "sft", max_steps, "fine-tuning", SFTProgress)
    if stream is not None and run.progress.step > 0:  # resumed: read on from the checkpoint's position
        stream.state = DataState(**asdict(run.progress.data))
        logger.info(f"the data continues at epoch {stream.state.epoch}, example {stream.state.index} of its order")
    if evals is not None:
        evals.start(run.progress.step)
    vocab_size = run.model.config.vocab_size
    meter = StepMeter(run.model.config, config.seq_len, world)
    timer = PhaseTimer(world.device)
    bench_rows: list[dict] = []

    while run.progress.step < max_steps:
        step = run.progress.step + 1
        t0 = time.perf_counter()
        take = partial(take_examples, config, step, stream, vocab_size)
        rows, info = next_rows(world, config.seq_len, config.model.attn, run.model.config, take, DATA_ERRORS)
        t_data = time.perf_counter() - t0

        run.model.train()
        totals = train_step(run.model, rows, max(info["loss_tokens"], 1), config, world, run.adapters, timer)
        with timer("optimizer"):
            grad_norm, lr = run.optimizer_step(config.optim.max_norm)
        tokens, samples = run.progress.tokens + info["tokens"], run.progress.samples + info["samples"]
        run.progress = SFTProgress(step, tokens, samples, DataState(**info["data"]))
        sums = all_reduce_sums(totals, world)
        t_train = time.perf_counter() - t0 - t_data

        t_save = time.perf_counter()
        if config.bench is None:
            if step == max_steps or (config.weights_interval and step % config.weights_interval == 0):
                export_weights(run, tokenizer, weights_dir(config.output_dir, step), world, config.model.name)
            run.maybe_checkpoint(step, max_steps)
        t_save = time.perf_counter() - t_save

        data = run.progress.data
        metrics = (
            meter.step(sums, info, grad_norm, lr, t_data, t_train)
            | {
                "loss_tokens": info["loss_tokens"],
                "epoch": data.epoch,
                "data_index": data.index,
                "skipped_too_long": data.skipped_too_long,
                "skipped_no_loss": data.skipped_no_loss,
                "truncated": data.truncated,
                "time_save": t_save,
            }
            | timer.pop()
        )
        if world.is_main:
            log_step(step, max_steps, metrics, info["examples"], monitor)
            bench_rows.append({"step": step, "seconds": t_train, **metrics})
        if evals is not None:
            evals.poll()
    if run.ckpt is not None:
        run.ckpt.wait()
    if config.bench is not None and world.is_main:
        print(format_bench_table(bench_rows, TRAINER_BENCH_COLUMNS))


def log_step(step: int, max_steps: int, metrics: dict, examples: int | None, monitor: Monitor) -> None:
    mfu = f" mfu {metrics['mfu']:.1f}%" if metrics["mfu"] is not None else ""
    data = f" | epoch {metrics['epoch']} ({metrics['data_index']}/{examples})" if examples is not None else ""
    skipped = metrics["skipped_too_long"] + metrics["skipped_no_loss"]
    if skipped:
        data += f" skipped {metrics['skipped_too_long']} too long, {metrics['skipped_no_loss']} untrained"
    if metrics["truncated"]:
        data += f" cut {metrics['truncated']} to seq_len"
    logger.info(
        f"step {step}/{max_steps} | loss {metrics['loss']:.4f} | grad_norm {metrics['grad_norm']:.3f} | "
        f"lr {metrics['lr']:.2e} | {metrics['tokens_per_s']:.0f} tok/s{mfu} | pad {100 * metrics['padding_fraction']:.0f}%"
        f"{data} | data {metrics['time_data']:.2f}s train {metrics['time_train']:.2f}s save {metrics['time_save']:.2f}s"
        f" | mem {metrics['peak_memory_gib']:.2f} GiB"
    )
    monitor.log(step, metrics)


if __name__ == "__main__":
    main()
