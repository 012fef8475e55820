"""Write reverse-text SFT conversations (prompt/completion chat rows, JSONL) from the `reverse-text` taskset itself.

    uv run python scripts/reverse_text_sft_data.py [--output outputs/reverse-text-sft.jsonl] [--num 2000] [--seed 0]

Each row is one task of the bundled environment (same system prompt, same user message) answered with its
reference answer, so SFT trains exactly the conversation format that RL and eval later use. `--seed` picks
the taskset's generator seed; evaluate on a different seed to hold tasks out.

`--wrong-fraction F` makes the demonstrations imperfect, like real ones: a seeded fraction F of the answers is
the text copied as is instead of reversed. A model fine-tuned on them copies about as often; the reward then
shows RL what imitation cannot (the reverse-text demo uses this).
"""

import argparse
import random
from pathlib import Path

from reverse_text import ReverseTextConfig, ReverseTextTaskset

from prime_rl.trainer.sft.data import chat_example, write_examples


def sft_rows(config: ReverseTextConfig, wrong_fraction: float = 0.0) -> list[dict]:
    rng = random.Random(f"wrong-{config.seed}")
    rows = []
    for task in ReverseTextTaskset(config).load():
        data = task.data
        answer = data.text if rng.random() < wrong_fraction else data.answer
        rows.append(chat_example(data.system_prompt, data.prompt, answer))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=Path("outputs/reverse-text-sft.jsonl"))
    parser.add_argument("--num", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--alphabet", default=None, help="characters of the strings (taskset default: a-z)")
    parser.add_argument("--min-len", type=int, default=None)
    parser.add_argument("--max-len", type=int, default=None)
    parser.add_argument("--wrong-fraction", type=float, default=0.0, help="answers copied instead of reversed")
    args = parser.parse_args()
    overrides = {"alphabet": args.alphabet, "min_len": args.min_len, "max_len": args.max_len}
    config = ReverseTextConfig(
        num_tasks=args.num, seed=args.seed, **{k: v for k, v in overrides.items() if v is not None}
    )
    write_examples(args.output, sft_rows(config, args.wrong_fraction))
    print(
        f"wrote {args.num} reverse-text conversations (seed {args.seed}, wrong {args.wrong_fraction:.0%}) to {args.output}"
    )


if __name__ == "__main__":
    main()
