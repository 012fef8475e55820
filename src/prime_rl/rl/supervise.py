"""Start this host's processes and supervise them as one run.

Inference first (`rl` starts it before the rest of its preflight checks), then the orchestrator(s) and the trainer at
once, so their imports overlap vLLM's start instead of following it; the orchestrator waits for the servers. Every
process runs in its own process group; when one fails, or on Ctrl-C, all are stopped (SIGTERM, then SIGKILL after
`stop_grace`) and `rl` exits non-zero naming the process, its exit code and the end of its output. Meanwhile the
console follows the orchestrators' and trainer's step lines and warnings (`follow_logs`).
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
from loguru import logger

from prime_rl.orchestrator.config import OrchestratorConfig
from prime_rl.rl.config import RLConfig
from prime_rl.rl.deploy import host_tag
from prime_rl.rl.processes import build_processes
from prime_rl.utils.affinity import set_group_affinity, side_cpus
from prime_rl.utils.health import HEALTHY, health_state
from prime_rl.utils.net import client_host
from prime_rl.utils.processes import Process, stop_all
from prime_rl.utils.secret import RunKeys

TRAINER_DONE_GRACE = 60.0
"""Seconds a run's orchestrator may still run after the trainer finished (its last checkpoint, W&B)."""

# Lines of the orchestrator's and trainer's logs shown on the console: step lines (the orchestrator's online evals'
# too), and warnings and errors.
STEP_LINE = re.compile(r"\| (?:INFO|SUCCESS)\s+\| \S+ \| [^|]+ \| ((?:eval )?step \d+ \|.*)$")
PROBLEM_LINE = re.compile(r"\| (WARNING|ERROR|CRITICAL)\s+\| \S+ \| [^|]+ \| (.*)$")


def follow_logs(logs: dict[str, Path], stop: threading.Event) -> None:
    """Print the step lines (and warnings) of the orchestrator and trainer logs (label -> file) on the console, from
    what is written after we start: a resumed run appends to the logs of the run it continues, whose lines were
    shown."""
    files: dict[str, object] = {}
    start_at = {name: path.stat().st_size if path.exists() else 0 for name, path in logs.items()}

    def show_new_lines() -> None:
        for name, path in logs.items():
            if name not in files:
                if not path.exists():
                    continue
                files[name] = open(path, errors="replace")
                files[name].seek(start_at[name])
            for line in files[name].readlines():
                if m := STEP_LINE.search(line.rstrip()):
                    print(f"[{name}] {m.group(1)}", flush=True)
                elif m := PROBLEM_LINE.search(line.rstrip()):
                    print(f"[{name}] {m.group(1)}: {m.group(2)}", flush=True)

    while not stop.is_set():
        show_new_lines()
        stop.wait(0.5)
    show_new_lines()  # what the processes wrote since the last pass: a run's last step lines, or why it failed
    for f in files.values():
        f.close()


def inference_url(config: RLConfig) -> str:
    return f"http://{client_host(config.inference.server.host)}:{config.inference.server.port}"


def probe_health(url: str) -> bool:
    """One `/health` probe (at most 2 s): does the server serve?"""
    try:
        return health_state(httpx.get(f"{url}/health", timeout=2.0, trust_env=False)) == HEALTHY
    except httpx.HTTPError:
        return False


def launch(
    config: RLConfig, orchs: dict[str, OrchestratorConfig], inference: Process | None, keys: RunKeys | None = None
) -> int:
    """Start this host's other roles next to `inference` (this host's server, started already, or None) and supervise
    them: the run ends when its orchestrator and trainer (those started here) finish; a host that only serves
    inference runs until it is stopped. With `runs`, a run whose orchestrator fails ends alone (the trainer sees it
    go and trains the others) and `rl` exits 1 once the rest have finished. The orchestrator waits for the servers
    itself; `rl` only holds vLLM to `inference_timeout`."""
    out = config.output_dir
    log_dir = out / "logs"
    tag = host_tag(config)
    processes = build_processes(config, orchs, log_dir, tag, keys, with_inference=False)
    if inference is not None:
        processes = {"inference": inference, **processes}
    finishers = [p for role, p in processes.items() if role not in ("inference", "teacher")]  # servers serve on
    runs = {role: p for role, p in processes.items() if role.startswith("orchestrator/")}
    failed_runs: list[str] = []
    trainer_done_at: float | None = None

    stop_following = threading.Event()
    followed = {role: Path(orch.output_dir) / "logs" / "orchestrator.log" for role, orch in orchs.items()}
    if "trainer" in processes:
        followed["trainer"] = log_dir / "trainer.log"
    follower = threading.Thread(target=follow_logs, args=(followed, stop_following))
    follower.daemon = True

    def stop_follower() -> None:
        """Show the logs' last lines (the follower's final pass) before what `rl` says about the end."""
        stop_following.set()
        if follower.is_alive():
            follower.join(2)

    interrupted = []

    def on_signal(signum, frame):
        interrupted.append(signum)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        url = inference_url(config) if inference is not None else None
        all_cpus = os.sched_getaffinity(0)
        # While our server starts, the others keep to their own CPUs: its start is what step 1 waits for.
        side = side_cpus(all_cpus) if url is not None else None
        if "teacher" in processes:  # a server like ours: all CPUs (it is not what step 1 waits for first)
            processes["teacher"].start()
        for p in finishers:
            p.start(side)
        follower.start()
        if url is not None:
            logger.info(f"waiting for inference at {url} (at most {config.inference_timeout:.0f}s, inference_timeout)")
        while True:
            if interrupted:
                raise KeyboardInterrupt
            if url is not None and inference.poll() is None:
                waited = time.monotonic() - inference.started_at
                if probe_health(url):
                    logger.info(f"inference is healthy ({waited:.0f}s after it started)")
                    url = None
                    if side is not None:
                        for p in finishers:
                            set_group_affinity(p.proc.pid, all_cpus)
                        logger.debug(f"{', '.join(p.name for p in finishers)} run on every CPU again")
                elif waited > config.inference_timeout:
                    raise RuntimeError(f"inference not healthy after {waited:.0f}s:\n{inference.tail()}")
            stopping = False
            for p in processes.values():  # every process found ended is named: the first to die may not come first
                code = p.poll()
                if code is None or (code == 0 and p.name not in ("inference", "teacher")) or p.name in failed_runs:
                    continue
                what = "exited" if code == 0 else f"failed with exit code {code}"
                if p.name in runs:
                    logger.error(f"{p.name} {what}; the other runs go on. Last lines of {p.output}:\n{p.tail()}")
                    failed_runs.append(p.name)
                    continue
                logger.error(f"{p.name} {what}; stopping the run. Last lines of {p.output}:\n{p.tail()}")
                stopping = True
            if stopping:
                return 1
            left = [role for role, p in runs.items() if p.poll() is None]
            if runs and "trainer" in processes and processes["trainer"].poll() == 0 and left:
                # The trainer ends once every run left it: an orchestrator still running gets a moment to finish.
                trainer_done_at = trainer_done_at or time.monotonic()
                if time.monotonic() - trainer_done_at > TRAINER_DONE_GRACE:
                    logger.error(f"the trainer has finished but {', '.join(left)} did not: stopping them")
                    return 1
            if finishers and all(p.poll() is not None for p in finishers) and failed_runs:
                logger.error(f"{', '.join(failed_runs)} failed; the others completed (output in {out})")
                return 1
            if finishers and all(p.poll() == 0 for p in finishers):
                stop_follower()
                logger.success(f"run finished: {' and '.join(p.name for p in finishers)} completed (output in {out})")
                return 0
            time.sleep(0.5 if url is None else 0.1)  # quick while the server starts: the others wait on it
    except KeyboardInterrupt:
        logger.warning("interrupted: stopping every process")
        return 130
    except RuntimeError as e:
        logger.error(str(e))
        return 1
    finally:
        # The orchestrators first, and alone: stopped after their trainer or server, they would report those gone.
        orchestrators = [p for p in processes.values() if p.name.startswith("orchestrator")]
        stop_all(orchestrators, config.stop_grace)
        stop_all([p for p in processes.values() if p not in orchestrators], config.stop_grace)
        stop_follower()
