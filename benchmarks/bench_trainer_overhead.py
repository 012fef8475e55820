"""Our trainer's step against a bare transformers forward + backward + AdamW loop on the identical packed batch.

    uv run python benchmarks/bench_trainer_overhead.py                        # the demo's model and step shape
    uv run python benchmarks/bench_trainer_overhead.py --model DIR --samples 16 --sample-tokens 80

The bare loop is the reference for what one process can do here: the same model (loaded by `from_pretrained`),
dtype, rows (packed by our `pack_samples`, restarting position ids), the same per-token policy-gradient arithmetic
(log-softmax of the logits, the target's log-prob, advantage-weighted mean over the loss tokens) and plain
`torch.optim.AdamW`, with no FSDP, no chunked head, no metrics. It runs once with one forward per row packed to
`--seq-len` (our trainer before its rows and micro-batches were sized by the attention kernel and a token budget),
and once with every sample in a row of its own and all rows in one forward (the best layout for sdpa here).

Ours is `build_run` (FSDP2 on a one-process gloo group, the chunked log-prob head) + `train_step` +
`optimizer_step` on the rows the trainer makes (`row_capacity`: as long as the longest sample for sdpa) in
micro-batches of `--micro-batch-tokens`, timed as forward+backward and optimizer separately. Each variant runs `--warmup` steps first, then
`--steps` timed ones on the same batch; the table gives the median step time and tokens/s over the loss-carrying
and prompt tokens alike (all of them go through forward and backward).
"""

import argparse
import statistics
import tempfile
import time
import tomllib
from pathlib import Path

import torch

from prime_rl.models.tiny import TinyModelConfig, build_tiny_model
from prime_rl.trainer.config import TrainerConfig
from prime_rl.trainer.packing import collate, pack_samples, packs_across_samples, row_capacity
from prime_rl.trainer.parallel.distributed import init_distributed
from prime_rl.trainer.rl.step import train_step
from prime_rl.trainer.rl.train import fake_samples
from prime_rl.trainer.scaffold import build_run

ROOT = Path(__file__).resolve().parents[1]


def demo_model(directory: Path) -> Path:
    """The reverse-text demo's model (configs/reverse_text/model.toml), built fresh: random init suits a timing."""
    spec = tomllib.loads((ROOT / "configs/reverse_text/model.toml").read_text())
    spec["output"] = directory / "model"
    return build_tiny_model(TinyModelConfig(**spec))


def bare_step(model, optimizer, batches, loss_tokens: int) -> tuple[float, float]:
    """One step of the plain loop over `batches` (MicroBatch objects); returns (forward+backward s, optimizer s)."""
    t0 = time.perf_counter()
    for batch in batches:
        logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        logp = logp.gather(-1, batch.input_ids[:, 1:, None])[..., 0]
        # a token's log-prob is scored at the position before it; a sample's first token has none (its position id
        # is 0), which is where the shifted mask drops it
        mask = batch.loss_mask[:, 1:] & (batch.position_ids[:, 1:] > 0)
        loss = -(batch.advantages[:, 1:] * logp * mask).sum() / loss_tokens
        loss.backward()
    t1 = time.perf_counter()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return t1 - t0, time.perf_counter() - t1


def timed(step, warmup: int, steps: int) -> tuple[float, float]:
    for _ in range(warmup):
        step()
    times = [step() for _ in range(steps)]
    return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="a HF model directory (default: build the demo's model)")
    parser.add_argument("--samples", type=int, default=64, help="samples per step (the demo: 64 rollouts)")
    parser.add_argument("--seq-len", type=int, default=512, help="row length the samples are packed into")
    parser.add_argument("--sample-tokens", type=int, default=123, help="tokens per sample (the demo: ~123)")
    parser.add_argument("--micro-batch-tokens", type=int, default=8192, help="ours: positions per forward")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tmp = tempfile.TemporaryDirectory()
    model_dir = args.model or demo_model(Path(tmp.name))

    config = TrainerConfig(
        model={"name": str(model_dir), "dtype": args.dtype},
        seq_len=args.sample_tokens,  # fake_samples makes samples of seq_len tokens; rows are packed below
        bench={"samples": args.samples},
        optim={"type": "adamw", "lr": 1e-6},
        output_dir=Path(tmp.name) / "out",
    )
    world = init_distributed()
    run = build_run(config, world, "trainer", 1, "benchmarking")
    samples = fake_samples(config, run.model.config.vocab_size, 1)
    rows = pack_samples(samples, args.seq_len)
    tokens = sum(r.num_tokens for r in rows)
    loss_tokens = sum(r.num_loss_tokens for r in rows)
    config = config.model_copy(update={"seq_len": args.seq_len, "micro_batch_tokens": args.micro_batch_tokens})
    lengths = [len(s.token_ids) for s in samples]
    our_rows = pack_samples(samples, row_capacity(lengths, args.seq_len, packs_across_samples("sdpa", 1)))

    def ours() -> tuple[float, float]:
        t0 = time.perf_counter()
        train_step(run.model, our_rows, {0: float(loss_tokens)}, config, world)
        t1 = time.perf_counter()
        run.optimizer_step(1.0)
        return t1 - t0, time.perf_counter() - t1

    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    bare = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").train()
    optimizer = torch.optim.AdamW(bare.parameters(), lr=1e-6, weight_decay=0.01)
    per_row = [collate([r], concatenate=False) for r in rows]
    one_pass = [collate(pack_samples(samples, max(lengths)), concatenate=False)]

    results = {
        "ours (FSDP2, 1 rank)": timed(ours, args.warmup, args.steps),
        "bare, a forward per row": timed(
            lambda: bare_step(bare, optimizer, per_row, loss_tokens), args.warmup, args.steps
        ),
        "bare, a row per sample, one fwd": timed(
            lambda: bare_step(bare, optimizer, one_pass, loss_tokens), args.warmup, args.steps
        ),
    }
    params = sum(p.numel() for p in bare.parameters())
    print(
        f"{params / 1e6:.2f}M params, {args.dtype}, {torch.get_num_threads()} threads; {len(samples)} samples x "
        f"{args.sample_tokens} tokens in {len(rows)} rows of <= {args.seq_len} ({tokens} tokens, {loss_tokens} scored); "
        f"ours: {len(our_rows)} rows, <= {args.micro_batch_tokens} positions per forward; "
        f"median of {args.steps} steps after {args.warmup} warm-up"
    )
    reference = sum(results["bare, a forward per row"])
    print(f"{'variant':<32} {'fwd+bwd s':>10} {'optim s':>9} {'step s':>8} {'tokens/s':>9} {'vs bare/row':>11}")
    for name, (fwd_bwd, opt) in results.items():
        step = fwd_bwd + opt
        print(f"{name:<32} {fwd_bwd:>10.3f} {opt:>9.3f} {step:>8.3f} {tokens / step:>9.0f} {reference / step:>10.2f}x")


if __name__ == "__main__":
    main()
