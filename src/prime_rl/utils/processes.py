"""Child processes of the launchers (`rl`, `eval`, tests): own process group, death with the parent, clean stop."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import os
import signal
import subprocess
import time
from pathlib import Path

from loguru import logger

from prime_rl.utils.secret import KEYS_VAR, RunKeys


def die_with_parent() -> None:
    """Linux: SIGTERM the child if `rl` itself dies (even by SIGKILL), so nothing of the run outlives it."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def prepare_child(cpus: set[int] | None) -> None:
    """Run in a `Process`'s child before its command: death with the parent, and its CPUs when given."""
    die_with_parent()
    if cpus is not None:
        os.sched_setaffinity(0, cpus)


LAUNCHER_VAR = "PRIME_RL_LAUNCHER_PID"
"""Set in every `Process`'s environment: the pid of the launcher it must not outlive (`exit_when_orphaned`)."""

ORPHAN_GRACE = 30.0
"""Seconds a child whose launcher died may spend on its own shutdown before it exits by force."""


def exit_when_orphaned() -> None:
    """For a process a launcher started: once the launcher is gone, exit by force after `ORPHAN_GRACE` seconds. The
    parent-death signal is one SIGTERM, and a graceful shutdown can wait forever (vLLM's HTTP server waited 35 min
    on connections from a torn-down network namespace); nothing sends the SIGKILL that `stop_all` would. A process
    started by hand (no `LAUNCHER_VAR`, or another parent) is left alone."""
    launcher = os.environ.get(LAUNCHER_VAR)
    if launcher is None or str(os.getppid()) != launcher:
        return
    exit_when_parent_changes(int(launcher), ORPHAN_GRACE)


def exit_when_parent_changes(parent: int, grace: float = 0.0) -> None:
    """Exit by force `grace` seconds after this process's parent is no longer `parent` (it died and we were
    re-parented). Polls once a second on a daemon thread, so a busy event loop cannot delay it."""
    import threading

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        time.sleep(grace)
        os._exit(1)

    threading.Thread(target=watch, name="exit-when-parent-changes", daemon=True).start()


class SigtermCancels:
    """Until `disarm()`, SIGTERM cancels the task that made this, as Ctrl-C cancels `asyncio.run`'s main task.

    `rl`, `stop_all` and the parent-death signal stop a process with SIGTERM, whose default action ends it at once,
    before any `finally`: the rollouts in flight then leave their working directories (under ~/.cache/verifiers)
    behind and the monitor never closes its run. A cancelled task unwinds instead. Disarm where the cleanup starts:
    a SIGTERM then (after an error that a SIGTERM follows, as when `rl` stops every process of a run) must not cut the
    cleanup short; `stop_all`'s SIGKILL after its grace, and `exit_when_orphaned`, still bound how long it takes."""

    def __init__(self) -> None:
        self.task, self.armed = asyncio.current_task(), True
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self) -> None:
        if self.armed:  # read when the callback runs: a signal that came just before `disarm` cancels nothing
            self.armed = False  # one cancellation: a second SIGTERM must not cancel the cleanup the first started
            self.task.cancel()

    def disarm(self) -> None:
        self.armed = False


class Process:
    """A command in its own process group (so stopping it stops everything it started), writing its console to
    `output`, that receives SIGTERM if the process that started it dies. `keys`: written on its stdin at start, the
    only way keys reach a child (`utils.secret`)."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], output: Path, keys: RunKeys | None = None):
        self.name, self.cmd, self.env, self.output, self.keys = name, cmd, env, output, keys
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0
        """`time.monotonic()` when it was started."""

    def start(self, cpus: set[int] | None = None) -> None:
        """`cpus`: the CPUs it (and all it starts) may use until told otherwise (`utils.affinity`); None: all."""
        self.started_at = time.monotonic()
        env = {**self.env, LAUNCHER_VAR: str(os.getpid())}
        if self.keys is not None:
            env[KEYS_VAR] = "1"
        with open(self.output, "ab") as out:
            self.proc = subprocess.Popen(
                self.cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL if self.keys is None else subprocess.PIPE,
                env=env,
                start_new_session=True,
                preexec_fn=functools.partial(prepare_child, cpus),
            )
        if self.keys is not None:  # one short line: the pipe's buffer holds it (a child that died at once: no reader)
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.write(self.keys.encode())
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()
        logger.info(f"started {self.name} (pid {self.proc.pid}): {' '.join(self.cmd)}")

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def tail(self, n: int = 20) -> str:
        lines = self.output.read_text(errors="replace").splitlines() if self.output.exists() else []
        return "\n".join(lines[-n:])

    def signal(self, sig: int) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass


def stop_all(processes: list[Process], grace: float) -> None:
    """SIGTERM every process group, wait up to `grace` seconds, SIGKILL what is left (groups outlive their leader)."""
    for p in processes:
        p.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in processes:
        if p.proc is not None:
            try:
                p.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    for p in processes:
        p.signal(signal.SIGKILL)
        if p.proc is not None and p.proc.poll() is None:
            p.proc.wait()
