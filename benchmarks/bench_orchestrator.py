"""Orchestrator throughput and CPU cost against a real `inference` server on the tiny model.

    uv run python benchmarks/bench_orchestrator.py
    uv run python benchmarks/bench_orchestrator.py --inflight 64 256 --workers 1 --min-rollouts 2048

Starts one vLLM server on a local tiny model, then for every (rollouts in flight, workers) pair runs the real
`orchestrator` CLI as a subprocess (single-turn `reverse-text`, short generations, no trainer: the async bound is
set high enough never to wait for weights). In flight = batch_size x oversampling rollouts; batch_size is the
in-flight count capped at `--max-batch`, oversampling makes up the rest.

Step 1 is warm-up; steady state is measured from its end over at least `--steps` more steps and `--min-rollouts`
rollouts: rollouts/s, CPU time per rollout of the orchestrator's main process, of its rollout workers (its spawned
children) and of the vLLM process tree (psutil), and the event-loop lags both report in `metrics.jsonl`. The CPU the
rest of the machine used meanwhile ("other") and, on a VM, the CPU time the hypervisor withheld ("stolen") are
reported too: anything well above zero in either distorts the numbers.
Prints a markdown table and writes it as JSON to `{output_dir}/bench_orchestrator.json`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from prime_rl.inference.process import InferenceServer
from prime_rl.models.tiny import TinyModelConfig, build_tiny_model

ORCHESTRATOR = str(Path(sys.executable).parent / "orchestrator")
API_KEY = "bench-key"
KEY_VAR = "PRIME_BENCH_API_KEY"
RENDERER = '{"name": "qwen3", "enable_thinking": false}'


def cpu_by_pid(procs: list[psutil.Process]) -> dict[tuple[int, float], float]:
    """user + system CPU seconds of each live process, keyed by (pid, create time) so reused pids do not mix."""
    times = {}
    for p in procs:
        try:
            t = p.cpu_times()
            times[(p.pid, p.create_time())] = t.user + t.system
        except psutil.Error:
            pass
    return times


def cpu_delta(before: dict, after: dict) -> float:
    """CPU used between two snapshots by the processes alive at the second (new ones count from zero)."""
    return sum(seconds - before.get(key, 0.0) for key, seconds in after.items())


def tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def orchestrator_parts(pid: int) -> tuple[list[psutil.Process], list[psutil.Process]]:
    """(main process, rollout workers with their descendants): workers are the `multiprocessing` spawn children."""
    try:
        main = psutil.Process(pid)
        children = main.children()
    except psutil.Error:
        return [], []
    workers = []
    for child in children:
        try:
            if "spawn_main" in " ".join(child.cmdline()):
                workers += [child, *child.children(recursive=True)]
        except psutil.Error:
            pass
    return [main], workers


class Snapshot:
    def __init__(self, orchestrator_pid: int, server_pid: int):
        main, workers = orchestrator_parts(orchestrator_pid)
        self.time = time.perf_counter()
        machine = psutil.cpu_times()
        self.machine_busy = machine.user + machine.nice + machine.system + getattr(machine, "irq", 0.0)
        self.machine_busy += getattr(machine, "softirq", 0.0)
        self.steal = getattr(machine, "steal", 0.0)  # a VM's CPU time the hypervisor gave to someone else
        self.main, self.workers, self.server = cpu_by_pid(main), cpu_by_pid(workers), cpu_by_pid(tree(server_pid))
        self.num_workers = len(workers)


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    text = path.read_text()
    complete = text[: text.rfind("\n") + 1].splitlines()  # a line being appended is not complete yet
    return [m for m in map(json.loads, complete) if m.get("process") == "orchestrator"]


def stop(proc: subprocess.Popen) -> None:
    """SIGINT to the orchestrator's process group (it and its workers shut down), SIGKILL if it lingers."""
    if proc.poll() is None:
        with_suppressed(os.killpg, proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
    with_suppressed(os.killpg, proc.pid, signal.SIGKILL)
    proc.wait()


def with_suppressed(fn, *args) -> None:
    try:
        fn(*args)
    except (ProcessLookupError, PermissionError):
        pass


def run_one(server: InferenceServer, base: Path, out: Path, inflight: int, workers: int, args) -> dict:
    batch_size = min(inflight, args.max_batch)
    if inflight % batch_size or batch_size % args.rollouts_per_example:
        raise SystemExit(f"in flight {inflight}: needs multiples of batch {batch_size} and group size")
    oversampling = inflight / batch_size
    steps = 1 + max(args.steps, math.ceil(args.min_rollouts / batch_size))  # step 1 is warm-up
    cmd = [
        ORCHESTRATOR,
        "--output-dir", str(out),
        "--model.name", str(base),
        "--model.renderer", RENDERER,
        "--client.base-url", f'["{server.url}/v1"]',
        "--client.api-key-var", KEY_VAR,
        "--env", json.dumps([{"id": args.env}]),
        "--workers", str(workers),
        "--seq-len", "512",
        "--sampling.max-tokens", str(args.max_tokens),
        "--batch-size", str(batch_size),
        "--rollouts-per-example", str(args.rollouts_per_example),
        "--oversampling", str(oversampling),
        "--max-async-level", "1000000",
        "--max-steps", str(steps + 1),  # never reached: stopped once step `steps` is measured
        "--weights-poll-interval", "0.5",
    ]  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    metrics_path = out / "metrics.jsonl"
    env = {**os.environ, KEY_VAR: API_KEY}
    with open(out / "console.out", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    first = last = None
    deadline = time.monotonic() + args.run_timeout
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"orchestrator exited with {proc.returncode}:\n{tail(out / 'console.out')}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no step {steps} after {args.run_timeout}s:\n{tail(out / 'console.out')}")
            done = len(read_metrics(metrics_path))
            if first is None and done >= 1:
                first = Snapshot(proc.pid, server.proc.pid)
            if done >= steps:
                last = Snapshot(proc.pid, server.proc.pid)
                break
            time.sleep(0.05)
    finally:
        stop(proc)
    steady = [m for m in read_metrics(metrics_path) if 1 < m["step"] <= steps]
    rollouts = sum(v for m in steady for k, v in m.items() if k.startswith("rollouts/"))  # per environment
    wall = last.time - first.time
    measured = sum(cpu_delta(getattr(first, k), getattr(last, k)) for k in ("main", "workers", "server"))
    return {
        "inflight": inflight,
        "workers": workers,
        "batch_size": batch_size,
        "oversampling": oversampling,
        "steps_measured": len(steady),
        "rollouts": rollouts,
        "wall_s": wall,
        "rollouts_per_s": rollouts / wall,
        "rollouts_per_s_steps": rollouts / sum(m["time/step"] for m in steady),
        "event_loop_lag_max_s": max(m["event_loop_lag/max"] for m in steady),
        "event_loop_lag_mean_s": statistics.fmean(m["event_loop_lag/mean"] for m in steady),
        "worker_loop_lag_max_s": max(m["worker_loop_lag/max"] for m in steady),
        "cpu_ms_per_rollout_main": 1000 * cpu_delta(first.main, last.main) / rollouts,
        "cpu_ms_per_rollout_workers": 1000 * cpu_delta(first.workers, last.workers) / rollouts,
        "cpu_ms_per_rollout_vllm": 1000 * cpu_delta(first.server, last.server) / rollouts,
        "cores_main": cpu_delta(first.main, last.main) / wall,
        "cores_workers": cpu_delta(first.workers, last.workers) / wall,
        "cores_vllm": cpu_delta(first.server, last.server) / wall,
        "cores_other": max(0.0, last.machine_busy - first.machine_busy - measured) / wall,
        "cores_stolen": (last.steal - first.steal) / wall,
        "errors": sum(m["errors"] for m in steady),
        "reward_mean": statistics.fmean(m["reward/mean"] for m in steady),
        "worker_processes": last.num_workers,
    }


def tail(path: Path, n: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else ""


COLUMNS = [
    ("in flight", "inflight", "{}"),
    ("workers", "workers", "{}"),
    ("rollouts", "rollouts", "{}"),
    ("rollouts/s", "rollouts_per_s", "{:.1f}"),
    ("main loop lag max / mean (ms)", None, None),
    ("worker loop lag max (ms)", "worker_loop_lag_max_s", "ms"),
    ("CPU ms/rollout main", "cpu_ms_per_rollout_main", "{:.2f}"),
    ("CPU ms/rollout workers", "cpu_ms_per_rollout_workers", "{:.1f}"),
    ("CPU ms/rollout vLLM", "cpu_ms_per_rollout_vllm", "{:.1f}"),
    ("cores main / workers / vLLM / other / stolen", None, None),
    ("errors", "errors", "{}"),
]


def cell(row: dict, title: str, key: str | None, fmt: str | None) -> str:
    if title.startswith("main loop lag"):
        return f"{1000 * row['event_loop_lag_max_s']:.0f} / {1000 * row['event_loop_lag_mean_s']:.1f}"
    if title.startswith("cores"):
        keys = ("cores_main", "cores_workers", "cores_vllm", "cores_other", "cores_stolen")
        return " / ".join(f"{row[k]:.2f}" for k in keys)
    if fmt == "ms":
        return f"{1000 * row[key]:.0f}"
    return fmt.format(row[key])


def markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(t for t, _, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        lines.append("| " + " | ".join(cell(row, *c) for c in COLUMNS) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inflight", type=int, nargs="+", default=[64, 256, 1024], help="rollouts in flight")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="rollout worker processes")
    parser.add_argument("--steps", type=int, default=1, help="fewest steps measured per run (after a warm-up step)")
    parser.add_argument("--min-rollouts", type=int, default=512, help="fewest rollouts measured per run")
    parser.add_argument("--max-batch", type=int, default=1024, help="batch_size cap; oversampling covers the rest")
    parser.add_argument("--rollouts-per-example", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per generation")
    parser.add_argument("--env", default="reverse-text")
    parser.add_argument("--max-num-seqs", type=int, default=1024, help="vLLM's concurrent sequences")
    parser.add_argument("--run-timeout", type=float, default=600.0, help="seconds one orchestrator run may take")
    parser.add_argument("--output-dir", type=Path, default=None, help="default: a fresh temporary directory")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be at least 1")

    out = args.output_dir or Path(tempfile.mkdtemp(prefix="bench_orchestrator_"))
    out.mkdir(parents=True, exist_ok=True)
    base = build_tiny_model(TinyModelConfig(output=out / "model"))
    extra = ["--model.enforce-eager", "--model.max-model-len", "512", "--max-num-seqs", str(args.max_num_seqs)]
    server = InferenceServer(base, out / "server", extra=extra, api_key=API_KEY)
    rows, failed = [], []
    result_path = out / "bench_orchestrator.json"

    def save() -> None:
        config = {k: v if isinstance(v, int | float | list) else str(v) for k, v in vars(args).items()}
        result = {"config": config, "cpu_count": os.cpu_count(), "rows": rows, "failed": failed}
        result_path.write_text(json.dumps(result, indent=2))

    try:
        server.wait_healthy(timeout=900)
        print(f"server healthy after {server.startup_seconds:.0f}s", flush=True)
        for inflight in args.inflight:
            for workers in args.workers:
                run_dir = out / "runs" / f"inflight{inflight}_workers{workers}"
                try:
                    row = run_one(server, base, run_dir, inflight, workers, args)
                except (RuntimeError, TimeoutError) as e:  # report it and measure the other settings
                    print(f"in flight {inflight}, {workers} worker(s) failed: {e}", flush=True)
                    failed.append({"inflight": inflight, "workers": workers, "error": str(e)[-2000:]})
                    save()
                    continue
                rows.append(row)
                save()
                print(markdown([row]).splitlines()[-1], flush=True)
    finally:
        server.stop()
    print(f"\n{args.env}, {args.max_tokens} tokens per rollout, groups of {args.rollouts_per_example}, "
          f"{os.cpu_count()} CPU cores\n")  # fmt: skip
    print(markdown(rows))
    print(f"\nwritten to {result_path}")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
