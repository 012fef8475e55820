"""Write tower-of-hanoi SFT conversations (prompt/completion chat rows, JSONL) from the `tower-of-hanoi` taskset.

    uv run python scripts/tower_of_hanoi_sft_data.py [--output outputs/tower-of-hanoi-sft.jsonl] [--num 2000]
        [--seed 0] [--min-disks 1] [--max-disks 3] [--detour-fraction 0.0]

Each row is one task of the bundled environment (same system prompt, same user message) answered with the
solver's optimal solution, so SFT trains exactly the conversation format that RL and eval later use. `--seed`
picks the taskset's generator seed; evaluate on a different seed to hold the draw out.

`--detour-fraction F` makes the demonstrations imperfect, like real ones: a seeded fraction F of the answers takes
a detour, moving the tower to the spare peg first and from there to the target. That is a legal solution of
twice the optimal length (reward 0.5); a model fine-tuned on them detours about as often, and the reward then
shows RL what imitation cannot (the tower-of-hanoi demo uses this).
"""

import argparse
import random
from pathlib import Path

from tower_of_hanoi import HanoiConfig, HanoiTaskset, format_moves, solve

from prime_rl.trainer.sft.data import chat_example, write_examples


def detour(n: int, start: str, target: str, spare: str) -> str:
    """All disks to `spare`, then on to `target`: legal, 2 * (2^n - 1) moves."""
    return format_moves(solve(n, start, spare, target) + solve(n, spare, target, start))


def sft_rows(config: HanoiConfig, detour_fraction: float = 0.0) -> list[dict]:
    rng = random.Random(f"detour-{config.seed}")
    rows = []
    for task in HanoiTaskset(config).load():
        data = task.data
        (spare,) = set(data.pegs) - {data.start, data.target}
        answer = detour(data.n, data.start, data.target, spare) if rng.random() < detour_fraction else data.answer
        rows.append(chat_example(data.system_prompt, data.prompt, answer))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=Path("outputs/tower-of-hanoi-sft.jsonl"))
    parser.add_argument("--num", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-disks", type=int, default=1)
    parser.add_argument("--max-disks", type=int, default=3)
    parser.add_argument("--detour-fraction", type=float, default=0.0, help="answers that detour via the spare peg")
    args = parser.parse_args()
    config = HanoiConfig(num_tasks=args.num, seed=args.seed, min_disks=args.min_disks, max_disks=args.max_disks)
    write_examples(args.output, sft_rows(config, args.detour_fraction))
    print(
        f"wrote {args.num} tower-of-hanoi conversations (seed {args.seed}, {args.min_disks}-{args.max_disks} disks, "
        f"detour {args.detour_fraction:.0%}) to {args.output}"
    )


if __name__ == "__main__":
    main()
