#!/usr/bin/env bash
# Run here, before a GPU window: download the wheels `scripts/gpu/run.sh` installs there (no network there) into
# .gpu-wheels/ (git-ignored), for CPython 3.12 on manylinux x86-64, and check they fit the transfer budget.
#
#   bash scripts/gpu/prepare.sh            # then carry .gpu-wheels along with the source tree
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/ensure_uv.sh

dest=.gpu-wheels
budget_mib=${PRIME_RL_GPU_WHEELS_MIB:-32}  # of the 64 MiB a GPU call may carry: the source tree needs the rest
rm -rf "$dest" && mkdir -p "$dest"
platforms=()
for tag in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_28_x86_64 manylinux_2_34_x86_64; do
    platforms+=(--platform "$tag")
done
# pip itself comes from PyPI through uvx: the project's environment has no pip, and the system's may refuse to run.
uvx --quiet pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" --dest "$dest" -r scripts/gpu/requirements.txt

wanted=$(grep -cE '^[a-z]' scripts/gpu/requirements.txt)
got=$(find "$dest" -name '*.whl' | wc -l)
if [ "$got" -ne "$wanted" ]; then
    echo "prepare: expected $wanted wheels in $dest, found $got" >&2
    exit 1
fi
kib=$(du -sk "$dest" | cut -f1)
if [ "$kib" -gt $((budget_mib * 1024)) ]; then
    echo "prepare: $dest is $((kib / 1024)) MiB, over the ${budget_mib} MiB budget" >&2
    exit 1
fi
echo "prepare: $got wheels, $((kib / 1024)).$(((kib % 1024) * 10 / 1024)) MiB in $dest (budget ${budget_mib} MiB)"
