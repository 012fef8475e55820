#!/usr/bin/env bash
# The multi-run demo on a CPU: two RL runs of LoRA adapters on the SFT model, with different learning rates, in one
# trainer and one vLLM server (configs/reverse_text/multi_run/rl.toml), then a held-out eval of the SFT model and both
# adapters. Builds the model and the SFT weights first (run.sh's steps 1-3) where outputs/reverse-text has none.
set -euo pipefail
cd "$(dirname "$0")/../.."

source scripts/ensure_uv.sh  # installs uv with pip where it is missing
uv sync --quiet
step() { echo "+ $*" >&2; uv run --no-sync "$@"; }

if [ ! -f outputs/reverse-text/sft/weights/step_450/config.json ]; then
    step tiny-model @ configs/reverse_text/model.toml
    step python scripts/reverse_text_sft_data.py --output outputs/reverse-text/sft-data.jsonl --num 8000 \
        --alphabet ABCDEFGHIJKLMNOPQRSTUVWXYZ --wrong-fraction 0.3
    step sft @ configs/reverse_text/sft.toml
fi
rm -rf outputs/reverse-text/lora outputs/reverse-text/lora-eval
step rl @ configs/reverse_text/multi_run/rl.toml
step eval @ configs/reverse_text/multi_run/eval.toml
