"""Distillation against GRPO on the demo's RL stage: held-out reward against steps and wall time.

    uv run python benchmarks/bench_distill.py --runs 2 --steps 30 [--algos opd,sft,grpo] [--student DIR]

The student is the demo's SFT policy (`--student outputs/reverse-text/model`: the random-init model, same tokenizer),
the teacher the demo's RL policy (`bash configs/reverse_text/run.sh` makes all three). Each run is the real
`rl @ configs/reverse_text/rl.toml` from the student for `--steps` steps with online evals every `--eval-interval`
steps (16 held-out tasks x 2); `opd` (the policy samples, reverse KL to the teacher's prefill) and `sft` (the teacher
samples, ce on its tokens) add `[orchestrator.algo] type = ...` and `[teacher]` (rl serves the teacher beside the
policy), `grpo` is the demo as it is. One more run measures the teacher's own held-out reward (its step-0 eval). While
a teacher runs, its server's memory (RSS of its process tree, peak) and CPU time are sampled. Runs alternate between
the algorithms and hold `--lock` (/tmp/bench.lock).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from prime_rl.utils.bench import hold_timing_lock
from prime_rl.utils.net import free_port

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
STUDENT = ROOT / "outputs" / "reverse-text" / "sft" / "weights" / "step_450"
TEACHER = ROOT / "outputs" / "reverse-text" / "rl" / "broadcasts" / "step_100"
DISTILL = '[orchestrator.algo]\ntype = "{algo}"\n\n[teacher]\nmodel = "{teacher}"\n'


class TeacherUsage:
    """Samples the teacher server's process tree (`rl` starts it on `configs/rl/teacher.toml`) every 0.5 s: peak RSS,
    and CPU seconds at the last sample."""

    def __init__(self, marker: str):
        self.marker, self.peak_rss, self.cpu_s = marker, 0, 0.0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _tree(self) -> list[psutil.Process]:
        for p in psutil.process_iter(["cmdline"]):
            if any(self.marker in a for a in p.info["cmdline"] or []) and "inference" in " ".join(p.info["cmdline"]):
                return [p, *p.children(recursive=True)]
        return []

    def _watch(self) -> None:
        while not self.stop.wait(0.5):
            try:
                tree = self._tree()
                rss = sum(p.memory_info().rss for p in tree)
                cpu = sum(sum(p.cpu_times()[:2]) for p in tree)
            except psutil.Error:
                continue
            if tree:
                self.peak_rss, self.cpu_s = max(self.peak_rss, rss), max(self.cpu_s, cpu)

    def close(self) -> tuple[float, float]:
        self.stop.set()
        self.thread.join()
        return self.peak_rss / 2**30, self.cpu_s


def run(algo: str, model: Path, teacher: Path, steps: int, interval: int, tmp: Path) -> dict:
    """One `rl` run; its held-out curve {step: avg@2}, mean step and teacher seconds, wall time, and the teacher
    server's peak RSS (GiB) and CPU seconds."""
    out = tmp / f"{algo}-{time.monotonic_ns()}"
    cmd = [str(BIN / "rl"), "@", str(ROOT / "configs" / "reverse_text" / "rl.toml")]
    usage = None
    if algo in ("opd", "sft"):
        overlay = tmp / f"{algo}.toml"
        overlay.write_text(DISTILL.format(algo=algo, teacher=teacher))
        cmd += ["@", str(overlay)]
        usage = TeacherUsage(str(out / "configs" / "rl" / "teacher.toml"))
    cmd += ["--model.name", str(model), "--max-steps", str(steps), "--output-dir", str(out)]
    cmd += ["--inference.server.port", str(free_port())]  # not 8000: another run's server may hold it
    cmd += ["--orchestrator.eval.interval", str(interval)]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    wall = time.monotonic() - start
    rss, cpu = usage.close() if usage is not None else (None, None)
    if proc.returncode != 0:
        raise RuntimeError(f"{algo} exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    curve = {m["step"]: v for m in rows for k, v in m.items() if k.startswith("eval/") and k.endswith("/avg@2")}
    orch = [m for m in rows if m["process"] == "orchestrator" and "time/step" in m]
    return {
        "curve": curve,
        "step_s": statistics.fmean(m["time/step"] for m in orch),
        "teacher_s": statistics.fmean(m["time/teacher"] for m in orch) if "time/teacher" in orch[0] else None,
        "wall": wall,
        "teacher_rss_gib": rss,
        "teacher_cpu_s": cpu,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--eval-interval", type=int, default=5)
    parser.add_argument("--student", type=Path, default=STUDENT)
    parser.add_argument("--teacher", type=Path, default=TEACHER)
    parser.add_argument("--algos", default="opd,sft,grpo", help="comma-separated: opd, sft, grpo")
    parser.add_argument("--lock", type=Path, default=Path("/tmp/bench.lock"))
    args = parser.parse_args()
    for model in (args.student, args.teacher):
        if not (model / "config.json").exists():
            sys.exit(f"{model}: not a model directory (build the demo's with `bash configs/reverse_text/run.sh`)")
    lock = hold_timing_lock(args.lock)  # noqa: F841 - held until the process ends
    results: dict[str, list[dict]] = {algo: [] for algo in args.algos.split(",")}
    with tempfile.TemporaryDirectory(prefix="bench-distill-") as tmp:
        teacher = run("grpo", args.teacher, args.teacher, 1, 1, Path(tmp))["curve"][0]
        print(f"teacher held-out (its step-0 eval): {teacher:.3f}", flush=True)
        for i in range(args.runs):
            for algo in results:
                r = run(algo, args.student, args.teacher, args.steps, args.eval_interval, Path(tmp))
                results[algo].append(r)
                print(f"{algo} run {i + 1}: {json.dumps(r)}", flush=True)
    evals = sorted(next(iter(results.values()))[0]["curve"])
    print(f"\nheld-out reward (avg@2, 16 tasks) against steps; teacher {teacher:.3f}\n")
    print("| step | " + " | ".join(f"{a} run {i + 1}" for a in results for i in range(args.runs)) + " |")
    print("|---" * (1 + 2 * args.runs) + "|")
    for step in evals:
        cells = [f"{r['curve'].get(step, float('nan')):.3f}" for a in results for r in results[a]]
        print(f"| {step} | " + " | ".join(cells) + " |")
    for algo, rs in results.items():
        teacher_s = [r["teacher_s"] for r in rs if r["teacher_s"] is not None]
        walls = ", ".join(f"{r['wall']:.0f}" for r in rs)
        line = f"{algo}: wall {walls} s, step {statistics.fmean(r['step_s'] for r in rs):.2f} s"
        line += f", teacher prefill {statistics.fmean(teacher_s):.2f} s a step" if teacher_s else ""
        if rs[0]["teacher_rss_gib"] is not None:
            rss = max(r["teacher_rss_gib"] for r in rs)
            cpu = statistics.fmean(r["teacher_cpu_s"] / r["wall"] for r in rs)
            line += f", teacher server peak RSS {rss:.2f} GiB, {cpu:.0%} of a core over the run"
        print(line)


if __name__ == "__main__":
    main()
