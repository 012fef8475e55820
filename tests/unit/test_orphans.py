"""A child `rl` (or any launcher) started does not outlive it even when its own shutdown hangs: the parent-death
signal is a single SIGTERM, so the child exits by force a grace period after its launcher is gone."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

CHILD = textwrap.dedent(
    """
    import signal, sys, time
    from prime_rl.utils import processes
    processes.ORPHAN_GRACE = 1.0
    processes.exit_when_orphaned()
    signal.signal(signal.SIGTERM, lambda *_: None)  # a graceful shutdown that never ends
    print("ready", flush=True)
    time.sleep(600)
    """
)

LAUNCHER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from prime_rl.utils.processes import Process
    child = Process("child", [sys.executable, "-c", sys.argv[1]], {**__import__("os").environ}, Path(sys.argv[2]))
    child.start()
    print(child.proc.pid, flush=True)
    time.sleep(600)
    """
)


def test_child_of_a_killed_launcher_exits_after_the_grace_even_ignoring_sigterm(tmp_path):
    out = tmp_path / "child.out"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, CHILD, str(out)], stdout=subprocess.PIPE, text=True)
    child = psutil.Process(int(launcher.stdout.readline()))
    try:
        deadline = time.monotonic() + 60
        while "ready" not in (out.read_text() if out.exists() else ""):
            assert time.monotonic() < deadline, "the child never got ready"
            time.sleep(0.1)
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(10)
        # SIGTERM arrives (and is ignored); 1 s of grace after the watcher sees the new parent (it looks every 1 s).
        child.wait(10)
    finally:
        if child.is_running():
            child.kill()
        if launcher.poll() is None:
            launcher.kill()


def test_a_process_started_by_hand_has_no_watcher():
    """No launcher variable: nothing armed (a server started from a shell outlives that shell, as nohup expects)."""
    env = {k: v for k, v in os.environ.items() if k != "PRIME_RL_LAUNCHER_PID"}
    code = (
        "import threading; from prime_rl.utils.processes import exit_when_orphaned; exit_when_orphaned(); "
        "print(sorted(t.name for t in threading.enumerate()))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert result.stdout.strip() == "['MainThread']", result.stderr


STOPPED_BY_SIGTERM = textwrap.dedent(
    """
    import asyncio, os, signal, sys
    from prime_rl.utils.processes import SigtermCancels

    async def main():
        sigterm = SigtermCancels()
        try:
            print("ready", flush=True)
            await asyncio.sleep(60)
        finally:
            if sys.argv[1] == "disarm":  # where the cleanup starts (the orchestrator); eval disarms only at the end
                sigterm.disarm()
            os.kill(os.getpid(), signal.SIGTERM)  # another one while cleaning up, as when rl stops a run that failed
            await asyncio.sleep(0.3)
            print("cleaned up", flush=True)

    try:
        asyncio.run(main())
    except asyncio.CancelledError:
        print("cancelled", flush=True)
        sys.exit(143)
    """
)


@pytest.mark.parametrize("disarm", ["disarm", "armed"])
def test_sigterm_cancels_the_task_and_its_cleanup_runs_to_the_end(disarm):
    """`rl` stops its processes with SIGTERM. An armed `SigtermCancels` turns it into the task's cancellation (its
    `finally` runs: the orchestrator cancels its rollouts and verifiers removes their working directories), and a
    second SIGTERM, whether the cleanup disarmed it or not, does not cut that cleanup short. By default the first
    SIGTERM would end the process before any `finally` ran, and a second cancellation the cleanup's own awaits."""
    command = [sys.executable, "-c", STOPPED_BY_SIGTERM, disarm]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (proc.returncode, out) == (143, "cleaned up\ncancelled\n")
