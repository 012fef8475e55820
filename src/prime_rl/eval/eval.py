"""`eval` entry point: mean reward (and pass@k, metrics, tokens, timings) of one or more policies on environments.

    uv run eval @ cfg.toml
    uv run eval --model.name outputs/model --inference --env '[{"id": "reverse-text", "num_examples": 50}]'
    uv run eval @ cfg.toml --weights-dir outputs/rl/broadcasts      # base + every saved step, one server
    uv run eval @ cfg.toml --weights-dir outputs/sft/weights --follow-until 100   # + each step as a run saves it

Against any OpenAI-compatible endpoint (`client.base_url`, key from `client.api_key_var`), or a model this
command serves itself (`[inference]`). Policies after the first are loaded in place with `/update_weights`, so
the server starts once. With `follow_until`, the steps of `weights_dir` that a running training writes are evaluated
as they appear, until that step. Writes `results.jsonl` (one line per rollout) and `summary.json` to `output_dir`,
`policies.jsonl` (each finished policy's summary, rewritten atomically as each one finishes: a running training reads
it), plus `reward_vs_step.png` when several policies are evaluated; prints a table and, per environment, one line
`<env> reward: <policy> <mean>, ...`. Exit code 0 when every rollout ran, 1 when some failed (they are
recorded with their error), 2 for a bad config.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import statistics
import sys
from pathlib import Path

import httpx
from loguru import logger

from prime_rl.config.loader import load_config, write_resolved_config
from prime_rl.eval.config import EvalConfig, RolloutsConfig
from prime_rl.eval.rollouts import Job, plan_jobs, rollout_worker, run_jobs, serve_and_run
from prime_rl.inference.adapter_checks import ADAPTER_CONFIG
from prime_rl.orchestrator.messages import RolloutResult
from prime_rl.utils.fs import write_atomic
from prime_rl.utils.logging import setup_logging
from prime_rl.utils.processes import exit_when_orphaned
from prime_rl.utils.secret import take_keys_at_start

STEP_DIR = re.compile(r"^step_(\d+)$")
POLICIES_FILE = "policies.jsonl"
"""One line per finished policy (its `summary.json` entry), rewritten atomically after each: read while eval runs."""
FOLLOW_POLL = 1.0
"""Seconds between looks for a new `step_*` export (`follow_until`)."""


# ---------------------------------------------------------------------------------------------------------
# The math (pure).


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k) (Chen et al., 2021)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_ks(n: int) -> list[int]:
    """The k reported for n rollouts per example: 1, 2, 4, ... below n, and n."""
    ks = [k for k in (2**i for i in range(n.bit_length())) if k < n]
    return ks + [n]


def summarize(records: list[dict], rollouts_per_example: int, pass_threshold: float) -> dict:
    """Summary of one policy on one environment, from its `results.jsonl` records alone; an environment with
    several seats (multi-agent) also gets one summary per seat under `seats`, each seat's pass@k over its own
    rollouts of each example."""
    seats = sorted({r.get("seat", "agent") for r in records})
    summary = summarize_seat(records, rollouts_per_example, pass_threshold)
    if len(seats) > 1:
        summary["seats"] = {
            seat: summarize_seat(
                [r for r in records if r.get("seat", "agent") == seat], rollouts_per_example, pass_threshold
            )
            for seat in seats
        }
    return summary


def summarize_seat(records: list[dict], rollouts_per_example: int, pass_threshold: float) -> dict:
    ok = [r for r in records if r["error"] is None]
    rewards = [r["reward"] for r in ok]
    summary: dict = {
        "rollouts": len(records),
        "errors": len(records) - len(ok),
        "reward_mean": statistics.fmean(rewards) if rewards else None,
        "reward_std": statistics.pstdev(rewards) if rewards else None,
    }
    n = rollouts_per_example
    if n > 1:
        by_example: dict[tuple, list[float]] = {}
        for r in ok:
            by_example.setdefault((r["example_id"], r.get("seat", "agent")), []).append(r["reward"])
        complete = [v for v in by_example.values() if len(v) == n]
        for k in pass_ks(n):
            values = [pass_at_k(n, sum(x >= pass_threshold for x in v), k) for v in complete]
            summary[f"pass@{k}"] = statistics.fmean(values) if values else None
        summary[f"avg@{n}"] = statistics.fmean(statistics.fmean(v) for v in complete) if complete else None
    names = sorted({name for r in ok for name in r["metrics"]})
    summary["metrics"] = {
        name: statistics.fmean(r["metrics"][name] for r in ok if name in r["metrics"]) for name in names
    }
    if ok:
        summary["prompt_tokens_mean"] = statistics.fmean(r["prompt_tokens"] for r in ok)
        summary["completion_tokens_mean"] = statistics.fmean(r["completion_tokens"] for r in ok)
        summary["completion_tokens_total"] = sum(r["completion_tokens"] for r in ok)
        summary["seconds_per_rollout_mean"] = statistics.fmean(r["seconds"] for r in ok)
    return summary


def env_metrics(name: str, summary: dict, n: int, pass_threshold: float, records: list[dict]) -> dict[str, float]:
    """One environment's metrics of a pass, from `eval`'s summary: avg@n and pass@k (k = 1, 2, 4, ..., n; with
    n = 1 avg@1 is the mean reward and pass@1 the share solved), reward mean and std, completion length."""
    prefix = f"eval/{name}"
    metrics = {f"{prefix}/rollouts": summary["rollouts"], f"{prefix}/errors": summary["errors"]}
    if summary["reward_mean"] is None:
        return metrics
    metrics |= {f"{prefix}/reward_mean": summary["reward_mean"], f"{prefix}/reward_std": summary["reward_std"]}
    if n == 1:
        ok = [r for r in records if r["error"] is None]
        metrics[f"{prefix}/avg@1"] = summary["reward_mean"]
        metrics[f"{prefix}/pass@1"] = sum(pass_at_k(1, int(r["reward"] >= pass_threshold), 1) for r in ok) / len(ok)
    metrics |= {f"{prefix}/{k}": v for k, v in summary.items() if k.startswith(("avg@", "pass@")) and v is not None}
    metrics[f"{prefix}/completion_len"] = summary["completion_tokens_mean"]
    for seat, seat_summary in summary.get("seats", {}).items():
        if seat_summary["reward_mean"] is not None:
            metrics[f"{prefix}/{seat}/reward_mean"] = seat_summary["reward_mean"]
    return metrics


def eval_line(step: int, metrics: dict, envs: list[str], n: dict[str, int], seconds: float) -> str:
    """The pass's console line, e.g. `eval step 2 | reverse-text avg@2 0.6100 pass@1 0.2500 pass@2 0.3750 len 8.4 |
    32 rollouts in 1.3s`."""
    parts, rollouts = [], 0
    for env in envs:
        p = f"eval/{env}"
        rollouts += metrics[f"{p}/rollouts"]
        if f"{p}/reward_mean" not in metrics:
            parts.append(f"{env} no rollout succeeded ({metrics[f'{p}/errors']} errors)")
            continue
        k = n[env]
        scores = [f"avg@{k} {metrics[f'{p}/avg@{k}']:.4f}", f"pass@1 {metrics[f'{p}/pass@1']:.4f}"]
        scores += [f"pass@{k} {metrics[f'{p}/pass@{k}']:.4f}"] if k > 1 and f"{p}/pass@{k}" in metrics else []
        errors = f" errors {metrics[f'{p}/errors']}" if metrics[f"{p}/errors"] else ""
        parts.append(f"{env} {' '.join(scores)} len {metrics[f'{p}/completion_len']:.1f}{errors}")
    return f"eval step {step} | {' | '.join(parts)} | {rollouts} rollouts in {seconds:.1f}s"


# ---------------------------------------------------------------------------------------------------------
# Policies: the served model, then weight directories loaded in place.


POLICY_FILES = ("config.json", ADAPTER_CONFIG)
"""What makes a directory a policy: a Hugging Face model, or a LoRA adapter (PEFT) of the served model."""


def is_adapter(path: Path) -> bool:
    return (path / ADAPTER_CONFIG).exists()


def resolve_weights(path: Path) -> Path:
    """A model or adapter directory as is; a directory of `step_*` subdirectories: its latest complete step."""
    path = Path(path)
    if any((path / name).exists() for name in POLICY_FILES):
        return path
    steps = step_dirs(path)
    if not steps:
        raise ValueError(
            f"{path} is neither a model directory (config.json), an adapter (adapter_config.json) nor a directory "
            "of step_* weights"
        )
    return steps[-1][1]


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """`step_*` subdirectories that hold a complete model or adapter (a `STABLE` marker where others have one)."""
    found = []
    for path in Path(root).glob("step_*"):
        match = STEP_DIR.match(path.name)
        if match and any((path / name).exists() for name in POLICY_FILES):
            found.append((int(match.group(1)), path))
    return sorted(found)


def new_exports(root: Path, after: int, until: int) -> list[tuple[int, Path]]:
    """The complete `step_*` policies of `root` with `after` < step <= `until`, oldest first. Writers rename a finished
    directory into place (`atomic_dir`), so a `step_*` with its model or adapter config is whole; the temporary
    `.step_*.tmp-*` of an export being written is never matched."""
    return [(step, path) for step, path in step_dirs(root) if after < step <= until]


def policies(config: EvalConfig) -> list[tuple[str, Path | None]]:
    """(label, weights) in evaluation order; the first is the model as served (None: nothing to load). Following a
    run (`follow_until`), the steps already there; later ones come from `follow_exports`."""
    result: list[tuple[str, Path | None]] = [("base", None)]
    result += [(label, resolve_weights(path)) for label, path in config.weights.items()]
    if config.weights_dir is not None:
        if config.follow_until is not None:
            steps = new_exports(config.weights_dir, -1, config.follow_until)
        elif not (steps := step_dirs(config.weights_dir)):
            raise ValueError(f"--weights-dir {config.weights_dir}: no step_* model directories in it")
        result += [(f"step_{step}", path) for step, path in steps]
    labels = [label for label, _ in result]
    if len(set(labels)) != len(labels):
        raise ValueError(f"policy labels must be unique, got {labels}")
    return result


def admin_headers(config: RolloutsConfig) -> dict[str, str]:
    key = os.environ.get(config.client.api_key_var)
    return {"Authorization": f"Bearer {key}"} if key else {}


def load_weights(config: RolloutsConfig, label: str, path: Path | None) -> None:
    """Every server serves `path` (None: its own model again, `/reload_weights`) when this returns; an adapter is
    loaded beside the base model under the name `label`, which the policy's requests then give as `model`."""
    headers = admin_headers(config)
    for url in config.client.base_url:
        root = url.removesuffix("/v1")
        if path is None:
            route, body = "/reload_weights", {}
        elif is_adapter(path):
            route, body = "/load_lora_adapter", {"lora_name": label, "lora_path": str(path.resolve()), "version": label}
        else:
            route, body = "/update_weights", {"weight_dir": str(path.resolve()), "version": label}
        response = httpx.post(f"{root}{route}", json=body, headers=headers, timeout=config.client.timeout)
        if response.status_code != 200:
            raise RuntimeError(f"{root}: loading {path} ({label}) failed ({response.status_code}): {response.text}")
        logger.info(
            f"{root} now serves {label} ({path or 'its own weights'}, {response.json().get('seconds', 0):.2f}s)"
        )


def unload_adapters(config: RolloutsConfig, labels: list[str]) -> None:
    headers = admin_headers(config)
    for url in config.client.base_url:
        for label in labels:
            body = {"lora_name": label}
            response = httpx.post(f"{url.removesuffix('/v1')}/unload_lora_adapter", json=body, headers=headers)
            if response.status_code not in (200, 404):
                raise RuntimeError(f"{url}: unloading adapter {label} failed ({response.status_code}): {response.text}")


# ---------------------------------------------------------------------------------------------------------
# Records and reports.


def rollout_record(label: str, job: Job, index: int, result: RolloutResult) -> dict:
    return {
        "policy": label,
        "env": job.env,
        "example_id": job.example_id,
        "rollout": index,
        "episode": result.episode,
        "seat": result.seat,
        "prompt": result.prompt,
        "completion": result.completion,
        "reward": result.reward,
        "metrics": result.metrics,
        "error": result.error,
        "truncated": result.truncated,
        "num_turns": result.num_turns,
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "seconds": round(result.seconds, 4),
    }


def format_table(summary: dict) -> str:
    envs = list(summary["envs"])
    header = ["policy"] + [f"{env} reward" for env in envs] + ["errors"]
    rows = []
    for policy in summary["policies"]:
        cells = [policy["label"]]
        for env in envs:
            s = policy["envs"][env]
            mean = "n/a" if s["reward_mean"] is None else f"{s['reward_mean']:.3f} ± {s['reward_std']:.3f}"
            cells.append(mean)
        cells.append(str(sum(s["errors"] for s in policy["envs"].values())))
        rows.append(cells)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in [header, *rows]]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def reward_lines(summary: dict) -> list[str]:
    """`<env> reward: base 0.052, sft 0.412, rl 0.655` per environment, and `<env>/<seat> reward: ...` per seat of
    a multi-agent environment (in self-play the seats' mean is fixed by the game; each seat's is not)."""
    lines = []
    for env in summary["envs"]:
        seats = sorted({seat for p in summary["policies"] for seat in p["envs"][env].get("seats", {})})
        for name, seat in [(env, None)] + [(f"{env}/{seat}", seat) for seat in seats]:
            parts = []
            for policy in summary["policies"]:
                s = policy["envs"][env] if seat is None else policy["envs"][env].get("seats", {}).get(seat, {})
                mean = s.get("reward_mean")
                parts.append(f"{policy['label']} {'n/a' if mean is None else f'{mean:.3f}'}")
            lines.append(f"{name} reward: {', '.join(parts)}")
    return lines


def plot_rewards(summary: dict, path: Path) -> Path | None:
    """Mean reward per policy and environment: a line over training steps when every policy is a `step_N`
    (a series), grouped bars otherwise (named policies such as base, sft, rl are categories, not a series)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no reward plot")
        return None
    labels = [p["label"] for p in summary["policies"]]
    envs = list(summary["envs"])
    steps = step_axis(labels)
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, env in enumerate(envs):
        means = [p["envs"][env]["reward_mean"] for p in summary["policies"]]
        means = [m if m is not None else float("nan") for m in means]
        if steps is not None:
            ax.plot(steps, means, marker="o", label=env)
        else:
            width = 0.8 / len(envs)
            ax.bar([x + (i - (len(envs) - 1) / 2) * width for x in range(len(labels))], means, width, label=env)
    if steps is None:
        ax.set_xticks(range(len(labels)), labels, rotation=45 if len(labels) > 6 else 0)
    ax.set_xlabel("training step" if steps is not None else "policy")
    ax.set_ylabel("mean reward")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def step_axis(labels: list[str]) -> list[int] | None:
    """The training steps of a series of policies (`base` is step 0, `step_N` is N), or None if any label is a
    name that is not a step."""
    steps = []
    for label in labels:
        match = STEP_DIR.match(label)
        if label != "base" and match is None:
            return None
        steps.append(0 if match is None else int(match.group(1)))
    return steps


# ---------------------------------------------------------------------------------------------------------
# The run.


async def follow_exports(config: EvalConfig, plan: list[tuple[str, Path | None]]):
    """The planned policies, then (`follow_until`) each `step_*` of `weights_dir` as it appears, until that step."""
    for policy in plan:
        yield policy
    if config.follow_until is None:
        return
    last = max((int(m.group(1)) for label, _ in plan if (m := STEP_DIR.match(label))), default=-1)
    waiting = False
    while last < config.follow_until:
        found = new_exports(config.weights_dir, last, config.follow_until)
        if not found:
            if not waiting:
                logger.info(f"waiting for {config.weights_dir}/step_* (until step_{config.follow_until})")
            waiting = True
            await asyncio.sleep(FOLLOW_POLL)
            continue
        waiting = False
        for step, path in found:
            yield f"step_{step}", path
            last = step


async def evaluate(config: EvalConfig, plan: list[tuple[str, Path | None]], planned: list[Job]) -> dict:
    out = config.output_dir
    out.mkdir(parents=True, exist_ok=True)
    summary: dict = {"model": config.model.name, "envs": {e.display_name: e.model_dump() for e in config.env}}
    summary["policies"] = []
    write_atomic(out / POLICIES_FILE, b"")  # an earlier run's policies are not this one's
    results_tmp = out / "results.jsonl.tmp"
    loaded: list[tuple[str, Path | None]] = []
    async with rollout_worker(config) as worker:
        with open(results_tmp, "w") as results:
            try:
                async for label, path in follow_exports(config, plan):
                    loaded.append((label, path))
                    await run_policy(config, label, path, planned, worker, results, summary)
                    lines = "".join(json.dumps(p) + "\n" for p in summary["policies"])
                    write_atomic(out / POLICIES_FILE, lines.encode())
            finally:
                if any(path is not None for _, path in loaded) and config.inference is None:
                    # Someone else's server: leave it serving what it served before, without our adapters.
                    adapters = [label for label, path in loaded if path is not None and is_adapter(path)]
                    try:
                        await asyncio.to_thread(load_weights, config, "base", None)
                        await asyncio.to_thread(unload_adapters, config, adapters)
                    except (httpx.HTTPError, RuntimeError) as e:
                        logger.warning(f"could not put the served model back: {e}")
    results_tmp.replace(out / "results.jsonl")
    write_atomic(out / "summary.json", json.dumps(summary, indent=2).encode())
    return summary


async def run_policy(
    config: EvalConfig, label: str, path: Path | None, planned: list[Job], worker, results, summary: dict
) -> None:
    """Serve the policy, run every planned job on it, and add its summary to `summary["policies"]`."""
    if path is not None:
        await asyncio.to_thread(load_weights, config, label, path)
    jobs = [Job(j.env, j.example_id, j.task, j.n) for j in planned]
    model = label if path is not None and is_adapter(path) else None
    records: list[dict] = []

    def keep(job: Job, result: RolloutResult) -> None:
        record = rollout_record(label, job, len(job.results) - 1, result)
        records.append(record)
        results.write(json.dumps(record) + "\n")

    seconds = await run_jobs(worker, jobs, config, f"eval {label}", keep, model)
    envs, metrics = {}, {}
    for env in config.env:
        mine = [r for r in records if r["env"] == env.display_name]
        envs[env.display_name] = summarize(mine, env.rollouts_per_example, config.pass_threshold)
        envs[env.display_name]["seconds"] = round(seconds, 3)
        n = env.rollouts_per_example
        metrics |= env_metrics(env.display_name, envs[env.display_name], n, config.pass_threshold, mine)
    # `metrics`: as the online evals of `rl` name them, for a run that logs this eval (`sft`'s `eval`)
    policy = {"label": label, "weights": str(path) if path else None, "envs": envs, "metrics": metrics}
    summary["policies"].append(policy)
    for line in reward_lines({"envs": envs, "policies": [policy]}):
        logger.info(f"{line} ({seconds:.1f}s)")


def main(argv: list[str] | None = None) -> None:
    take_keys_at_start("eval")  # no run secret reaches the environments this process runs (`utils.secret`)
    exit_when_orphaned()  # started by a launcher (`sft`): never outlive it, even when a graceful stop hangs
    config, _ = load_config(EvalConfig, "eval", argv)
    setup_logging("eval", config.log.level, config.output_dir / "logs", file_name=config.log.file)
    write_resolved_config(config, "eval")
    try:
        plan = policies(config)
    except (ValueError, RuntimeError) as e:
        print(f"eval: error: {e}", file=sys.stderr)
        sys.exit(2)
    weights = [p for _, p in plan if p is not None]
    if config.follow_until is not None:  # not there yet: the server must be allowed to load it (and its siblings)
        weights.append(config.weights_dir / f"step_{config.follow_until}")
    # The environments load while the server starts; a bad one stops it again (exit 2).
    summary = serve_and_run(
        "eval", config, weights, lambda: plan_jobs(config), lambda jobs: evaluate(config, plan, jobs)
    )
    print(format_table(summary))
    if len(summary["policies"]) > 1 and (plot := plot_rewards(summary, config.output_dir / "reward_vs_step.png")):
        logger.info(f"plot: {plot}")
    logger.info(f"results: {config.output_dir / 'results.jsonl'}, summary: {config.output_dir / 'summary.json'}")
    for line in reward_lines(summary):
        print(line)
    errors = sum(s["errors"] for p in summary["policies"] for s in p["envs"].values())
    if errors:
        logger.error(f"{errors} rollout(s) failed; their errors are in results.jsonl")
        sys.exit(1)
