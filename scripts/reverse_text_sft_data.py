"""Write a reverse-text SFT dataset (prompt/completion chat rows) as JSONL, to try `sft` without a hub.

    uv run python scripts/reverse_text_sft_data.py [--output outputs/reverse-text-sft.jsonl] [--num 2000] [--seed 0]

Each row asks to reverse a random lowercase string of 5-10 letters and answers with the reversed string,
the same task (and system prompt) as the bundled `reverse-text` environment.
"""

import argparse
import json
import random
import string
from pathlib import Path

SYSTEM_PROMPT = "Reverse the text. Reply with the reversed text only."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=Path("outputs/reverse-text-sft.jsonl"))
    parser.add_argument("--num", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with open(args.output, "w") as f:
        for _ in range(args.num):
            text = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(5, 10)))
            row = {
                "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": text}],
                "completion": [{"role": "assistant", "content": text[::-1]}],
            }
            f.write(json.dumps(row) + "\n")
    print(f"wrote {args.num} examples to {args.output}")


if __name__ == "__main__":
    main()
