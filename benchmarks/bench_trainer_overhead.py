"""Our trainer's step against a bare transformers forward + backward + AdamW loop on the identical batch.

    uv run python benchmarks/bench_trainer_overhead.py                        # the demo's model and step shape
    uv run python benchmarks/bench_trainer_overhead.py --model DIR --samples 16 --prompt-tokens 35 --sample-tokens 87

The batch is GRPO's: `--samples` samples of `--sample-tokens` tokens in groups of `--rollouts-per-prompt` that
share their first `--prompt-tokens` tokens (random tokens, a random advantage per sample; the defaults are the
demo's step: 8 prompts of ~108 tokens, 8 rollouts each, ~123 tokens a sample). With `--min-sample-tokens` each
group's samples are as long as each other but groups differ (drawn between the two), so rows differ in length.

The bare loop is the reference for what one process can do here: the same model (loaded by `from_pretrained`),
device, dtype (fp32 weights under autocast for bf16) and samples, each sample in full (position ids restarting per
sample), the same per-token policy-gradient arithmetic (log-softmax of the logits, the target's log-prob,
advantage-weighted mean over the loss tokens) and plain `torch.optim.AdamW`, with no FSDP, no chunked head, no
metrics. It runs once with one forward per row packed to `--seq-len` (our trainer before its rows and micro-batches
were sized by the attention kernel and a token budget), and once with every sample in a row of its own and all rows
in one forward (the best layout for sdpa without shared prompts).

Ours is `build_run` (FSDP2 on a one-process group: gloo, or NCCL on a GPU; the chunked log-prob head) +
`train_step` + `optimizer_step` on the rows the trainer makes: a group's prompt once where that costs less
(`layout_units`), rows as long as the longest unit (`row_capacity`), micro-batches of `--micro-batch-tokens` grouped
at least cost (`micro_batches`); `--no-share` lays every sample out whole, `--stack-all` stacks rows as many as fit
whatever the padding. Timed as forward+backward and optimizer separately (`PhaseTimer`: CUDA events on a GPU).
Each variant runs `--warmup` steps first, then `--steps` timed ones on the same batch; the table gives the median
step time and tokens/s over the samples' tokens, trained and prompt alike (what the bare loop puts through forward
and backward).
"""

import argparse
import statistics
import tempfile
import tomllib
from pathlib import Path

import torch

from prime_rl.batch import TrainingSample
from prime_rl.models.tiny import TinyModelConfig, build_tiny_model
from prime_rl.trainer.config import TrainerConfig
from prime_rl.trainer.packing import (
    FORWARD_COST,
    collate,
    layout_units,
    micro_batches,
    pack_samples,
    pack_units,
    row_capacity,
)
from prime_rl.trainer.parallel.distributed import init_distributed
from prime_rl.trainer.perf import PhaseTimer, attention_entry_cost
from prime_rl.trainer.rl.step import train_step
from prime_rl.trainer.scaffold import build_run
from prime_rl.utils.malloc import keep_freed_memory

ROOT = Path(__file__).resolve().parents[1]


def demo_model(directory: Path) -> Path:
    """The reverse-text demo's model (configs/reverse_text/model.toml), built fresh: random init suits a timing."""
    spec = tomllib.loads((ROOT / "configs/reverse_text/model.toml").read_text())
    spec["output"] = directory / "model"
    return build_tiny_model(TinyModelConfig(**spec))


def grpo_samples(vocab: int, samples: int, per_prompt: int, prompt_tokens: int, sample_tokens: int, shortest: int):
    """`samples` random samples in groups of `per_prompt` sharing their first `prompt_tokens` tokens. A group's
    samples are all L tokens long, L drawn per group from `shortest`..`sample_tokens` (uniform): as in reverse-text,
    where the answer is as long as the prompt's text."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(samples):
        if i % per_prompt == 0:
            prompt = torch.randint(0, vocab, (prompt_tokens,), generator=g).tolist()
            length = int(torch.randint(shortest, sample_tokens + 1, (), generator=g))
        completion = torch.randint(0, vocab, (length - prompt_tokens,), generator=g).tolist()
        n = len(completion)
        advantage = float(torch.randn((), generator=g))
        out.append(
            TrainingSample(
                token_ids=prompt + completion,
                loss_mask=[False] * prompt_tokens + [True] * n,
                inference_logprobs=[0.0] * prompt_tokens + [-5.0] * n,
                advantages=[advantage] * (prompt_tokens + n),
            )
        )
    return out


def bare_step(model, optimizer, batches, loss_tokens: int, dtype: torch.dtype, timer: PhaseTimer) -> None:
    """One step of the plain loop over `batches` (MicroBatch objects), timed as `fwd_bwd` and `optimizer`.
    The weights stay fp32 and the forward runs under autocast to `dtype`: the plain mixed-precision loop, as our
    trainer keeps fp32 masters and computes in `model.dtype`."""
    device_type = next(model.parameters()).device.type
    with timer("fwd_bwd"):
        for batch in batches:
            with torch.autocast(device_type, dtype=dtype, enabled=dtype != torch.float32):
                logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
            logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
            logp = logp.gather(-1, batch.input_ids[:, 1:, None])[..., 0]
            # a token's log-prob is scored at the position before it; a sample's first token has none (its position
            # id is 0), which is where the shifted mask drops it
            mask = batch.loss_mask[:, 1:] & (batch.position_ids[:, 1:] > 0)
            loss = -(batch.advantages[:, 1:] * logp * mask).sum() / loss_tokens
            loss.backward()
    with timer("optimizer"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU, {torch.get_num_threads()} threads"


def timed(step, timer: PhaseTimer, warmup: int, steps: int) -> tuple[float, float]:
    """Median (forward+backward s, optimizer s) of `steps` calls of `step` after `warmup` untimed ones; `step` times
    its phases on `timer` (CUDA events on a GPU, the clock on a CPU)."""
    for _ in range(warmup):
        step()
    timer.pop()
    times = []
    for _ in range(steps):
        step()
        times.append(timer.pop())
    return statistics.median(t["time_fwd_bwd"] for t in times), statistics.median(t["time_optimizer"] for t in times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="a HF model directory (default: build the demo's model)")
    parser.add_argument("--samples", type=int, default=64, help="samples per step (the demo: 64 rollouts)")
    parser.add_argument("--seq-len", type=int, default=512, help="row length the samples are packed into")
    parser.add_argument("--sample-tokens", type=int, default=123, help="tokens per sample (the demo: ~123)")
    parser.add_argument("--min-sample-tokens", type=int, help="vary groups' sample lengths down to this")
    parser.add_argument("--prompt-tokens", type=int, default=108, help="of which the prompt (the demo: ~108)")
    parser.add_argument("--rollouts-per-prompt", type=int, default=8, help="samples sharing a prompt (the demo: 8)")
    parser.add_argument("--no-share", action="store_true", help="ours: lay every sample out whole")
    parser.add_argument(
        "--stack-all", action="store_true", help="ours: stack as many rows per forward as fit, whatever the padding"
    )
    parser.add_argument("--micro-batch-tokens", type=int, default=8192, help="ours: positions per forward")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument(
        "--malloc-defaults",
        action="store_true",
        help="both loops with glibc's default malloc, as before the trainer kept freed memory",
    )
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    shortest = args.min_sample_tokens or args.sample_tokens
    if not args.prompt_tokens < shortest <= args.sample_tokens:
        parser.error("need --prompt-tokens < --min-sample-tokens <= --sample-tokens")
    if args.stack_all:
        FORWARD_COST.clear()  # every device stacks as many rows as fit (the trainer before its cost model)
    torch.set_num_threads(args.threads)
    tmp = tempfile.TemporaryDirectory()
    model_dir = args.model or demo_model(Path(tmp.name))

    config = TrainerConfig(
        model={"name": str(model_dir), "dtype": args.dtype},
        seq_len=args.seq_len,
        micro_batch_tokens=args.micro_batch_tokens,
        optim={"type": "adamw", "lr": 1e-6},
        output_dir=Path(tmp.name) / "out",
    )
    world = init_distributed()
    if world.device.type == "cpu" and not args.malloc_defaults:
        keep_freed_memory()  # as the trainer's process does, for both loops alike
    run = build_run(config, world, "trainer", 1, "benchmarking")
    samples = grpo_samples(
        run.model.config.vocab_size,
        args.samples,
        args.rollouts_per_prompt,
        args.prompt_tokens,
        args.sample_tokens,
        shortest,
    )
    rows = pack_samples(samples, args.seq_len)
    tokens = sum(r.num_tokens for r in rows)
    loss_tokens = sum(r.num_loss_tokens for r in rows)
    lengths = [len(s.token_ids) for s in samples]
    cost = None if args.no_share else attention_entry_cost(run.model.config)  # what the trainer does for sdpa
    units = layout_units(samples, args.seq_len, cost)
    our_rows = pack_units(samples, units, row_capacity([u.length for u in units], args.seq_len, varlen=False))

    timer = PhaseTimer(world.device)

    def ours() -> None:
        with timer("fwd_bwd"):
            train_step(run.model, our_rows, {0: float(loss_tokens)}, config, world)
        with timer("optimizer"):
            run.optimizer_step(1.0)

    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    bare = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    bare = bare.to(world.device).train()
    optimizer = torch.optim.AdamW(bare.parameters(), lr=1e-6, weight_decay=0.01)
    per_row = [collate([r], concatenate=False).to(world.device) for r in rows]
    one_pass = [collate(pack_samples(samples, max(lengths)), concatenate=False).to(world.device)]

    results = {
        "ours (FSDP2, 1 rank)": timed(ours, timer, args.warmup, args.steps),
        "bare, a forward per row": timed(
            lambda: bare_step(bare, optimizer, per_row, loss_tokens, dtype, timer), timer, args.warmup, args.steps
        ),
        "bare, a row per sample, one fwd": timed(
            lambda: bare_step(bare, optimizer, one_pass, loss_tokens, dtype, timer), timer, args.warmup, args.steps
        ),
    }
    params = sum(p.numel() for p in bare.parameters())
    forwards = micro_batches(
        our_rows, args.micro_batch_tokens, False, FORWARD_COST.get(world.device.type, float("inf"))
    )
    sizes = f"{shortest}-{args.sample_tokens}" if shortest < args.sample_tokens else f"{args.sample_tokens}"
    print(
        f"{params / 1e6:.2f}M params, {args.dtype}, {device_name(world.device)}; {len(samples)} samples x "
        f"{sizes} tokens in {len(rows)} rows of <= {args.seq_len} ({tokens} tokens, {loss_tokens} scored); "
        f"ours: {sum(r.num_tokens for r in our_rows)} positions in {len(our_rows)} rows"
        f"{' (prompts shared)' if any(u.prompt for u in units) else ''}, {len(forwards)} forward(s) of <= "
        f"{args.micro_batch_tokens} positions ({sum(len(g) * g[0].num_tokens for g in forwards)} with padding); "
        f"median of {args.steps} steps after {args.warmup} warm-up"
    )
    reference = sum(results["bare, a forward per row"])
    print(f"{'variant':<32} {'fwd+bwd s':>10} {'optim s':>9} {'step s':>8} {'tokens/s':>9} {'vs bare/row':>11}")
    for name, (fwd_bwd, opt) in results.items():
        step = fwd_bwd + opt
        print(f"{name:<32} {fwd_bwd:>10.3f} {opt:>9.3f} {step:>8.3f} {tokens / step:>9.0f} {reference / step:>10.2f}x")


if __name__ == "__main__":
    main()
