#!/usr/bin/env bash
# The GPU checks of ../shared/gpu-checklist.md as one command, for a short window on a bare GPU machine that has
# torch and transformers but none of our other packages and no network (run `scripts/gpu/prepare.sh` here first and
# carry .gpu-wheels along with the source tree).
#
#   bash scripts/gpu/run.sh --out DIR              # there: everything, at most ~8 minutes
#   bash scripts/gpu/run.sh --out DIR --only bench # a part again: env, api, tests, bench, logprobs, overhead
#   bash scripts/gpu/run.sh --out DIR --dry-run    # here, on CPU: the same steps at toy size; CUDA parts say skipped
#
# Every part runs under its own timeout, cut further so the whole stays inside the budget (one hang cannot eat
# the rest), and writes its log to DIR; DIR/summary.md collects the results and DIR/status.tsv each part's end.
set -uo pipefail
cd "$(dirname "$0")/../.."

out="" only="" dry_run=0 budget=${PRIME_RL_GPU_BUDGET_S:-470}
while [ $# -gt 0 ]; do
    case "$1" in
        --out) out=$2; shift 2 ;;
        --only) only=$2; shift 2 ;;
        --dry-run) dry_run=1; shift ;;
        *) echo "run.sh: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
    esac
done
[ -n "$out" ] || { echo "run.sh: --out DIR is required" >&2; exit 2; }
mkdir -p "$out"
out=$(cd "$out" && pwd)
python=${PYTHON:-python3}
start=$SECONDS
: >"$out/status.tsv"
{ echo "# GPU checks, $(date -u +%FT%TZ)"; [ $dry_run = 1 ] && echo "DRY RUN on CPU: toy sizes, CUDA parts skipped"; } >"$out/summary.md"

note() { echo "$*" | tee -a "$out/summary.md"; }

# part NAME TIMEOUT CMD...: run CMD with its log in $out/NAME.log, within both its own timeout and what is left.
part() {
    local name=$1 limit=$2
    shift 2
    if [ -n "$only" ] && [[ ",$only," != *",$name,"* ]]; then return 0; fi
    local left=$((budget - (SECONDS - start)))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -le 5 ]; then
        printf '%s\tnot run: the %ss budget is spent\t-\n' "$name" "$budget" >>"$out/status.tsv"
        note "## $name: not run, the ${budget}s budget is spent"
        return 0
    fi
    local t0=$SECONDS rc
    echo "== $name (limit ${limit}s)"
    timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1
    rc=$?
    local verdict=ok
    [ $rc -ne 0 ] && verdict="failed (exit $rc)"
    [ $rc -eq 124 ] || [ $rc -eq 137 ] && verdict="timed out after ${limit}s"
    printf '%s\t%s\t%ss\n' "$name" "$verdict" "$((SECONDS - t0))" >>"$out/status.tsv"
    note "## $name: $verdict in $((SECONDS - t0)) s"
    tail -n 25 "$out/$name.log" | sed 's/^/    /' >>"$out/summary.md"
    return 0
}

# 1. The packages: the carried wheels into a private target (the machine's own Python is left alone).
site=${TMPDIR:-/tmp}/prime-rl-gpu-site
rm -rf "$site"
wheels=(.gpu-wheels/*.whl)
[ -e "${wheels[0]}" ] || { echo "run.sh: no wheels in .gpu-wheels: run scripts/gpu/prepare.sh first" >&2; exit 2; }
install=(--quiet --no-index --no-deps --no-compile --no-cache-dir --target "$site")
if [ $dry_run = 1 ]; then
    # Here the interpreter is not the GPU machine's 3.12: install for that one, to prove the wheels and the command.
    install+=(--only-binary=:all: --python-version 3.12 --implementation cp)
    for tag in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_28_x86_64 manylinux_2_34_x86_64; do
        install+=(--platform "$tag")
    done
    pip=(uvx --quiet pip)
else
    pip=("$python" -m pip)
fi
if ! "${pip[@]}" install "${install[@]}" "${wheels[@]}" >"$out/install.log" 2>&1; then
    cat "$out/install.log" >&2
    echo "run.sh: installing the carried wheels failed (log above)" >&2
    exit 1
fi
note "installed ${#wheels[@]} wheels into $site"
if [ $dry_run = 1 ]; then
    export PYTHONPATH=$PWD/src  # the project's environment has them all; the 3.12 target was the check
else
    export PYTHONPATH=$PWD/src:$site
fi
# Nothing is fetched: models are local directories, and a GPU machine here has no network to wait on.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

# 2. What we run on, and that the trainer imports with only the carried packages.
env_report() {
    nvidia-smi || echo "nvidia-smi: none (no GPU driver here)"
    "$python" - <<'EOF'
import sys

import torch
import transformers

print("python", sys.version.split()[0], "| torch", torch.__version__, "| CUDA", torch.version.cuda,
      "| transformers", transformers.__version__)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("GPU", p.name, f"{p.total_memory / 2**30:.0f} GiB,", p.multi_processor_count, "SMs")
else:
    print("no CUDA device: the CUDA parts are skipped")
import prime_rl.trainer.rl.train  # noqa: E402,F401

print("the trainer imports")
EOF
}
export -f env_report
export python
part env 60 bash -c env_report

# 3. The torch names our code uses, as this torch has them (the CI test compares new code against the record).
part api 120 "$python" scripts/gpu/torch_api.py dump --out "$out/torch-api.json"

# 4. A Qwen3-0.6B-shaped model (random init, local tokenizer, Qwen3's vocabulary); toy-sized in a dry run.
model=${TMPDIR:-/tmp}/prime-rl-gpu-model
if [ $dry_run = 1 ]; then
    shape=(--hidden-size 64 --num-layers 2 --num-heads 2 --num-kv-heads 1 --head-dim 32 --intermediate-size 128)
    seq_len=256 dtype=float32 vocab=4096
else
    shape=(--hidden-size 1024 --num-layers 28 --num-heads 16 --num-kv-heads 8 --head-dim 128
        --intermediate-size 3072 --pad-vocab-to 151936 --max-position-embeddings 40960)
    seq_len=16384 dtype=bfloat16 vocab=151936
fi
# (a rerun of one part on a fresh machine needs the model too)
[ -d "$model" ] && [ -n "$only" ] || only="" part model 180 "$python" -c 'import sys; from prime_rl.models.tiny import main; main(sys.argv[1:])' \
    --output "$model" "${shape[@]}"

# 5. The gpu tests (checklist 1, 3, 4, 5); they skip themselves without CUDA.
part tests 240 env PRIME_RL_GPU_MODEL="$model" "$python" -m pytest -m gpu tests/gpu -p no:cacheprovider -q \
    -o addopts="" --durations=10

# 6. The trainer's --bench (checklist 2): tokens/s, MFU, peak memory; then the variants worth knowing.
bench() {
    local name=$1
    shift
    # a dry run trains only the plain bench; a variant's flags are still parsed and validated by the trainer
    [ $dry_run = 1 ] && [ "$name" != bench ] && set -- "$@" --dry-run
    part "$name" 100 "$python" -m prime_rl.trainer.rl.train --model.name "$model" --model.dtype "$dtype" \
        --seq-len "$seq_len" --bench --bench.samples 2 --bench.steps 4 --output-dir "${TMPDIR:-/tmp}/prime-rl-gpu-out" "$@"
}
bench bench
part logprobs 90 "$python" benchmarks/bench_logprobs.py --tokens "$seq_len" --vocab "$vocab" --repeats 2
# our trainer step against a bare transformers loop on one GRPO batch of seq_len tokens: 16 samples, 8 per prompt
part overhead 120 "$python" benchmarks/bench_trainer_overhead.py --model "$model" --dtype "$dtype" --samples 16 \
    --sample-tokens $((seq_len / 16)) --prompt-tokens $((seq_len / 128)) --seq-len "$seq_len" \
    --micro-batch-tokens "$seq_len" --warmup 1 --steps 3
bench bench-ac --model.ac true
if [ $dry_run = 1 ]; then  # the trainer refuses optimizer offload without CUDA (a unit test checks that)
    printf 'bench-offload\tskipped: needs CUDA\t-\n' >>"$out/status.tsv"
    note "## bench-offload: skipped, needs CUDA"
else
    bench bench-offload --optim.cpu-offload true
fi
bench bench-compile --model.compile true

note "total $((SECONDS - start)) s"
column -t -s $'\t' "$out/status.tsv" 2>/dev/null || cat "$out/status.tsv"
# The run's verdict: every part ended well or was skipped for want of CUDA in a dry run.
! grep -v -e $'\tok\t' -e $'\tskipped: needs CUDA\t' "$out/status.tsv" | grep -q .
