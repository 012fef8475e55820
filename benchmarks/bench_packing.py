"""Rank 0's packing of a step and the collation of its micro-batches, CPU only: what a GRPO step pays before the
forward, and what the loss streams (`ce_weights`, `ref_logprobs`, `ref_kl_mask`) add when a batch carries them.

    uv run python benchmarks/bench_packing.py                       # 512 samples of 1,024 tokens, groups of 8
    uv run python benchmarks/bench_packing.py --streams             # the same samples with all three streams

Times `layout_units` + `pack_units` (sdpa: prompts shared where that costs less) and `collate` of every row as one
micro-batch each, median of `--repeats`.
"""

import argparse
import random
import statistics
import time

from prime_rl.batch import TrainingSample
from prime_rl.trainer.packing import collate, layout_units, pack_units, row_capacity


def grpo_samples(args) -> list[TrainingSample]:
    rng = random.Random(0)
    samples = []
    for _ in range(args.samples // args.group):
        prompt = [rng.randrange(50_000) for _ in range(args.prompt_tokens)]
        for _ in range(args.group):
            n = args.sample_tokens
            tail = [t >= args.prompt_tokens for t in range(n)]
            streams = {}
            if args.streams:
                streams = dict(
                    ce_weights=[1.0 if m else 0.0 for m in tail],
                    ref_logprobs=[-1.0 if m else 0.0 for m in tail],
                    ref_kl_mask=tail,
                )
            samples.append(
                TrainingSample(
                    token_ids=prompt + [rng.randrange(50_000) for _ in range(n - args.prompt_tokens)],
                    loss_mask=tail,
                    inference_logprobs=[-1.0 if m else 0.0 for m in tail],
                    advantages=[rng.gauss(0, 1)] * n,
                    **streams,
                )
            )
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--sample-tokens", type=int, default=1024)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--attention-cost", type=float, default=1 / 3840, help="Qwen3-0.6B's (`perf`)")
    parser.add_argument("--streams", action="store_true", help="every sample carries the three loss streams")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    samples = grpo_samples(args)
    pack_s, collate_s = [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        units = layout_units(samples, args.seq_len, args.attention_cost)
        rows = pack_units(samples, units, row_capacity([u.length for u in units], args.seq_len, varlen=False))
        packed = time.perf_counter()
        for row in rows:
            collate([row], concatenate=False)
        pack_s.append(packed - start)
        collate_s.append(time.perf_counter() - packed)
    tokens = sum(len(s.token_ids) for s in samples)
    print(
        f"{len(samples)} samples, {tokens} tokens, {len(rows)} rows, streams {args.streams}: "
        f"pack {statistics.median(pack_s) * 1e3:.1f} ms, collate {statistics.median(collate_s) * 1e3:.1f} ms "
        f"(median of {args.repeats})"
    )


if __name__ == "__main__":
    main()
