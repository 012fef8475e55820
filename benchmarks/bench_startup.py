"""Where the time to the first step goes: `rl` (or `eval`, or `inference` alone) from the command to its first result,
per phase and per process.

    uv run python benchmarks/bench_startup.py --runs 3                          # rl, the demo's RL stage, warm
    uv run python benchmarks/bench_startup.py --runs 3 --cold                   # empty bytecode and vLLM caches
    uv run python benchmarks/bench_startup.py --what eval --runs 3
    uv run python benchmarks/bench_startup.py --what inference --runs 3
    uv run python benchmarks/bench_startup.py --attach --runs 3                 # rl attached to a running server
    uv run python benchmarks/bench_startup.py --model outputs/models/smollm2-135m-instruct \
        --config configs/arithmetic/smollm2-135m/rl.toml --runs 3          # after `uv run fetch-model ...`

Each run starts the real command from the environment's bin/ (`rl @ configs/reverse_text/rl.toml --max-steps 3`
with `--model.name` the model under test; `--steps`: its last row, start-up, is the end of step 1 less one steady step,
as `bench_vs_trl.py` counts it), `eval` as the demo's on 8 tasks, `inference` until
its /health answers) and follows every process's log as it is written: a line's time is when it appeared (polled
every 20 ms), whatever resolution the log's own timestamps have. The phases are the first line matching each
pattern in `PHASES`, as seconds since the command was started. `--cold` gives each run an empty bytecode cache
(`PYTHONPYCACHEPREFIX`: every module is compiled again, as in a new virtual environment; `--compiled` keeps the
installed bytecode, as `uv sync --compile-bytecode` leaves it) and empty vLLM and torch-compile caches, and drops the
page cache where it may (root). `--attach` starts one `inference` first (not
timed) and runs `rl` attached to it (`--attach`). Runs hold the exclusive lock `--lock` (/tmp/bench.lock)
that the other CPU benchmarks take, so timings never overlap.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from prime_rl.utils.bench import hold_timing_lock

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
DEMO_MODEL = ROOT / "outputs" / "reverse-text" / "sft" / "weights" / "step_450"
DEMO_CONFIG = ROOT / "configs" / "reverse_text" / "rl.toml"
PORT = 8417
EVAL_TOML = """# the demo's eval (configs/reverse_text/eval.toml) on 8 tasks, the served model only
seq_len = 512
[model]
renderer = { name = "qwen3", enable_thinking = false }
[inference.model]
max_model_len = 512
enforce_eager = true
dtype = "float32"
[sampling]
max_tokens = 16
[[env]]
id = "reverse-text"
args = { seed = 1, num_tasks = 8, alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZ" }
rollouts_per_example = 2
"""


@dataclass(frozen=True)
class Phase:
    process: str  # the log file's stem under {output_dir}/logs
    label: str
    pattern: str


SERVER_PHASES = [
    Phase("inference", "inference: config parsed, vLLM imported", r"vLLM imported in"),
    Phase("inference", "inference: model weights loaded", r"Loading weights took"),
    Phase("inference", "inference: KV cache allocated, engine ready", r"init engine .* took"),
    Phase("inference", "inference: API server listening", r"Starting vLLM server on"),
]

PHASES = {
    "rl": [
        Phase("rl", "rl: config read, processes started", r"started trainer"),
        *SERVER_PHASES,
        Phase("rl", "inference: healthy (rl saw it)", r"inference is healthy|attached to"),
        Phase("orchestrator", "orchestrator: environments loaded", r"environment .*: \d+ tasks"),
        Phase("orchestrator", "orchestrator: servers serve policy 0", r"serve policy step 0"),
        Phase("orchestrator", "orchestrator: batch 1 written", r"\| step 1 \|"),
        Phase("trainer", "trainer: model built", r"training .* on \d+ rank"),
        Phase("trainer", "trainer: step 1 done", r"\| step 1 \|"),
    ],
    "eval": [
        Phase("eval", "eval: attached to the running server", r"attached to"),
        Phase("eval", "eval: environments loaded", r"environment .*: \d+ tasks"),
        Phase("inference", "inference: config parsed, vLLM imported", r"vLLM imported in"),
        Phase("inference", "inference: API server listening", r"Starting vLLM server on"),
        Phase("eval", "eval: first policy scored", r"avg@|reward"),
    ],
    "inference": SERVER_PHASES,
}


class LogFollower:
    """The arrival time of the first line matching each phase's pattern, for logs being written under `log_dir`."""

    def __init__(self, log_dir: Path, phases: list[Phase]):
        self.log_dir, self.phases = log_dir, phases
        self.offsets: dict[str, int] = {}
        self.partial: dict[str, str] = {}
        self.seen: dict[str, float] = {}

    def poll(self, now: float) -> None:
        for process in {p.process for p in self.phases}:
            path = self.log_dir / f"{process}.log"
            if not path.exists():
                continue
            with open(path, errors="replace") as f:
                f.seek(self.offsets.get(process, 0))
                text = self.partial.get(process, "") + f.read()
                self.offsets[process] = f.tell()
            *lines, self.partial[process] = text.split("\n")
            for line in lines:
                for phase in self.phases:
                    if phase.process == process and phase.label not in self.seen and re.search(phase.pattern, line):
                        self.seen[phase.label] = now


def cold_env(scratch: Path, compiled: bool) -> dict[str, str]:
    """Empty caches for one run: vLLM's and torch-compile's, the page cache, and bytecode (every module compiled again)
    unless `compiled` (an environment installed with `uv sync --compile-bytecode`)."""
    for name in ("pycache", "vllm", "inductor"):
        (scratch / name).mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run(["sync"], check=False)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        pass  # not root: the page cache stays warm
    env = {"VLLM_CACHE_ROOT": str(scratch / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(scratch / "inductor")}
    return env if compiled else {**env, "PYTHONPYCACHEPREFIX": str(scratch / "pycache")}


def step_phases(steps: int) -> list[Phase]:
    """The trainer's steps 2..steps: the steady step that `STARTUP` takes off step 1's end."""
    return [Phase("trainer", f"trainer: step {n} done", rf"\| step {n} \|") for n in range(2, steps + 1)]


STARTUP = "start-up before step 1 (step 1 done less one steady step)"
"""As `bench_vs_trl.py` counts it: the end of step 1 less the median of the later steps' spacing."""


def startup(seen: dict[str, float], steps: int) -> float | None:
    ends = [seen.get(f"trainer: step {n} done") for n in range(1, steps + 1)]
    if steps < 2 or None in ends:
        return None
    return ends[0] - statistics.median(b - a for a, b in zip(ends[:-1], ends[1:], strict=True))


def command(
    what: str, model: Path, out: Path, attach: bool, rl_config: Path = DEMO_CONFIG, steps: int = 1
) -> list[str]:
    if what == "rl":
        cmd = [str(BIN / "rl"), "@", str(rl_config), "--max-steps", str(steps)]
        cmd += ["--model.name", str(model), "--output-dir", str(out), "--no-orchestrator.eval"]
        cmd += ["--inference.server.port", str(PORT)]
        return cmd + (["--attach"] if attach else [])
    if what == "eval":
        (out / "eval.toml").write_text(EVAL_TOML)
        cmd = [str(BIN / "eval"), "@", str(out / "eval.toml"), "--model.name", str(model), "--output-dir", str(out)]
        return cmd + ["--inference.server.port", str(PORT)] + (["--attach"] if attach else [])
    cmd = [str(BIN / "inference"), "--model.name", str(model), "--model.max-model-len", "512"]
    cmd += ["--model.enforce-eager", "--model.dtype", "float32", "--server.port", str(PORT), "--output-dir", str(out)]
    if attach:  # the server the runs attach to: it receives the trainer's weights in memory, loads under /tmp
        cmd += ["--server.attachable", "--weight-broadcast.type", "gloo", "--weight-broadcast.port", str(PORT + 1)]
        cmd += ["--allowed-weight-roots", tempfile.gettempdir()]
    return cmd


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


def run_once(
    what: str, model: Path, cold: bool, compiled: bool, attach: bool, timeout: float, rl_config: Path, steps: int
) -> tuple[dict[str, float], float]:
    """One timed start: {phase label: seconds since the command}, and the command's total wall time."""
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        out = Path(tmp) / "out"
        (out / "logs").mkdir(parents=True)
        env = {**os.environ, **(cold_env(Path(tmp) / "caches", compiled) if cold else {})}
        follower = LogFollower(out / "logs", PHASES[what] + (step_phases(steps) if what == "rl" else []))
        t0 = time.monotonic()
        proc = subprocess.Popen(
            command(what, model, out, attach, rl_config, steps), cwd=ROOT, env=env, start_new_session=True,
            stdout=open(out / "console.out", "w"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            while time.monotonic() - t0 < timeout:
                now = time.monotonic() - t0
                follower.poll(now)
                if what == "inference" and healthy(PORT):
                    follower.seen["inference: healthy"] = now
                    break
                if proc.poll() is not None:
                    follower.poll(time.monotonic() - t0)
                    break
                time.sleep(0.02)
            else:
                raise RuntimeError(f"{what} did not finish within {timeout:.0f}s")
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT if what != "inference" else signal.SIGTERM)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
        total = time.monotonic() - t0
        if what != "inference" and proc.returncode != 0:
            tail = (out / "console.out").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{tail}")
        return follower.seen, total


def start_server(model: Path) -> subprocess.Popen:
    """The server `--attach` runs attach to, started once before the timed runs."""
    out = Path(tempfile.mkdtemp(prefix="bench-startup-server-"))
    (out / "logs").mkdir()
    proc = subprocess.Popen(
        command("inference", model, out, True), cwd=ROOT, start_new_session=True,
        stdout=open(out / "console.out", "w"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    deadline = time.monotonic() + 600
    while not healthy(PORT):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the server to attach to did not start; see {out / 'console.out'}")
        time.sleep(0.2)
    return proc


def table(what: str, runs: list[tuple[dict[str, float], float]], steps: int) -> str:
    labels = [p.label for p in PHASES[what]] + (["inference: healthy"] if what == "inference" else [])
    if what == "rl" and steps > 1:
        labels += [p.label for p in step_phases(steps)] + [STARTUP]
        runs = [({**seen, STARTUP: startup(seen, steps)}, total) for seen, total in runs]
    rows = [
        "| phase (seconds since the command) | " + " | ".join(f"run {i + 1}" for i in range(len(runs))) + " | median |"
    ]
    rows.append("|---" * (len(runs) + 2) + "|")
    for label in labels + ["command exited"]:
        values = [total if label == "command exited" else seen.get(label) for seen, total in runs]
        known = [v for v in values if v is not None]
        cells = ["-" if v is None else f"{v:.1f}" for v in values]
        median = f"{statistics.median(known):.1f}" if known else "-"
        rows.append(f"| {label} | " + " | ".join(cells) + f" | {median} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--what", choices=sorted(PHASES), default="rl")
    parser.add_argument("--model", type=Path, default=DEMO_MODEL, help="a model directory (default: the demo's SFT)")
    parser.add_argument("--config", type=Path, default=DEMO_CONFIG, help="the rl config (its model: --model)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--cold", action="store_true", help="empty bytecode, vLLM and compile caches per run")
    parser.add_argument("--compiled", action="store_true", help="with --cold: keep the installed bytecode")
    parser.add_argument("--attach", action="store_true", help="rl/eval attach to one server started beforehand")
    parser.add_argument("--steps", type=int, default=3, help="rl: steps to run (2+: the start-up row)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    parser.add_argument("--lock", type=Path, default=Path("/tmp/bench.lock"), help="held for all the runs")
    args = parser.parse_args()
    if not (args.model / "config.json").exists():
        sys.exit(f"{args.model}: not a model directory (build the demo's with `bash configs/reverse_text/run.sh`)")
    if args.attach and args.what == "inference":
        sys.exit("--attach times rl or eval attached to a server")
    lock = hold_timing_lock(args.lock)  # noqa: F841 - held until the process ends
    server = start_server(args.model) if args.attach else None
    try:
        runs = []
        for i in range(args.runs):
            run = run_once(
                args.what, args.model, args.cold, args.compiled, args.attach, args.timeout, args.config, args.steps
            )
            runs.append(run)
            print(f"run {i + 1}: {runs[-1][1]:.1f}s", flush=True)
    finally:
        if server is not None:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(60)
    mode = ("cold" + (" (bytecode kept)" if args.compiled else "") if args.cold else "warm") + (
        ", attached" if args.attach else ""
    )
    print(f"\n{args.what}, {args.model.name}, {mode}, {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d')}\n")
    print(table(args.what, runs, args.steps))


if __name__ == "__main__":
    main()
