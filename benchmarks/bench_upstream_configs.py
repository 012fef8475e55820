"""How many of upstream prime-rl's config files our entry points read: point it at a checkout of that repository
(or any folder of its TOML files) and it loads each file the way `<entrypoint> @ file.toml --dry-run` does.

    python benchmarks/bench_upstream_configs.py path/to/prime-rl [--show-fails]

Each file is sorted into: loads; refused (a key whose feature we lack, named); fails (anything else: what to fix
next). The entry point is guessed from the file's tables. Prints a line per folder, the totals with the load rate
of the files not refused, and the blocking errors ranked by how many files they stop.
"""

from __future__ import annotations

import argparse
import collections
import tomllib
from pathlib import Path

from prime_rl.config.argv import ParsedArgv
from prime_rl.config.entrypoints import config_class
from prime_rl.config.keys import ConfigError, config_keys
from prime_rl.config.loader import build_config

INFERENCE_KEYS = {"vllm", "server", "parallel", "gpu_memory_utilization", "enable_lora", "max_loras", "max_model_len"}


def guess_entrypoint(path: Path, data: dict) -> str:
    """The entry point a file is written for, from its tables (a `[slurm]` overlay by its name)."""
    keys = set(data) - {"toml_files", "output_dir", "max_steps"}
    if keys <= {"slurm"}:
        return "sft" if "sft" in path.name else "rl"
    if not {"orchestrator", "trainer"} & keys and (
        "data" in keys or {"optim", "scheduler"} & keys and {"deployment", "slurm", "eval"} & keys
    ):
        return "sft"
    if {"orchestrator", "trainer", "deployment", "inference_gpu_ids", "trainer_gpu_ids"} & keys:
        return "rl"
    if "source" in keys or isinstance(data.get("model"), str) or "num_examples" in keys:
        return "eval"
    if INFERENCE_KEYS & keys or keys <= {"model"}:
        return "inference"
    if {"batch_size", "env", "sampling", "rollouts_per_example"} & keys:
        return "orchestrator"
    return "trainer"


def older_layout(data: dict) -> bool:
    """The layout before October 2025 (`[environment]`, `[batch]`, `rollouts_per_prompt`, an orchestrator's
    `micro_batch_size`): older than either generation we read."""
    sections = [data, data.get("orchestrator", {})]
    return any({"environment", "batch", "rollouts_per_prompt"} & set(d) for d in sections) or (
        "micro_batch_size" in data and "batch_size" in data and "data" not in data
    )


def outcome(path: Path) -> tuple[str, str, str]:
    """(entry point, loads | refused | fails | older, the first error line)."""
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        return "?", "fails", f"not valid TOML: {e}"
    if older_layout(data):
        return "?", "older", ""
    entrypoint = guess_entrypoint(path, data)
    cls = config_class(entrypoint)
    try:
        build_config(cls, config_keys(cls), ParsedArgv(toml_files=[(path, ())]), {}, entrypoint)
    except ConfigError as e:
        lines = [line.strip() for line in str(e).splitlines()[1:]] or [str(e)]
        first = lines[0].split(" (from ")[0] + (" ..." if len(lines) > 1 else "")
        return entrypoint, "refused" if str(e).startswith("not supported here") else "fails", first
    return entrypoint, "loads", ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path, help="a checkout of upstream prime-rl (its configs/ and examples/)")
    parser.add_argument("--show-fails", action="store_true", help="list every failing file with its error")
    args = parser.parse_args()
    files = sorted(p for d in ("configs", "examples") for p in (args.root / d).rglob("*.toml")) or sorted(
        args.root.rglob("*.toml")
    )
    totals: collections.Counter = collections.Counter()
    blockers: collections.Counter = collections.Counter()
    refusals: collections.Counter = collections.Counter()
    for path in files:
        entrypoint, result, error = outcome(path)
        totals[result] += 1
        if result == "refused":
            refusals[error.split("): ", 1)[-1].removesuffix(" ...")] += 1
        if result == "fails":
            blockers[error] += 1
            if args.show_fails:
                print(f"fails  {entrypoint:12} {path.relative_to(args.root)}: {error}")
    tried = totals["loads"] + totals["fails"]
    print(
        f"{len(files)} files ({totals['older']} in the layout before October 2025, left out): "
        f"{totals['loads']} load, {totals['refused']} refused naming a feature, "
        f"{totals['fails']} fail; {totals['loads']}/{tried} = {totals['loads'] / max(1, tried):.0%} of those not refused"
    )
    print("first feature refused, by files:")
    for feature, count in refusals.most_common(12):
        print(f"{count:4} {feature}")
    print("blocking errors, by files:")
    for error, count in blockers.most_common(15):
        print(f"{count:4} {error}")


if __name__ == "__main__":
    main()
