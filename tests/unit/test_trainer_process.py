"""What keeps a trainer process honest about its surroundings: it dies with its torchrun agent, and its waits
(for a batch, for the orchestrator to take a policy) are bounded and say what they wait for."""

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from loguru import logger

from prime_rl.batch import batch_path
from prime_rl.trainer.config import TrainerConfig
from prime_rl.trainer.rl.batches import wait_until as wait_on_rank0

RANK = """
import sys, time
from prime_rl.trainer.parallel.distributed import die_with_torchrun_agent
time.sleep(float(sys.argv[1]))  # an agent that dies now has not yet been watched
die_with_torchrun_agent()
print("armed", flush=True)
time.sleep(120)
"""


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper has already died)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_until(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def rank_env() -> dict[str, str]:
    return {**os.environ, "TORCHELASTIC_RUN_ID": "test", "RANK": "0", "OMP_NUM_THREADS": "1"}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_rank_dies_when_its_agent_is_killed():
    # The "agent" starts the rank in a session of its own, as torchrun does, then is killed with SIGKILL:
    # nothing but the kernel's parent-death signal can reach the rank.
    agent_code = (
        "import subprocess, sys, time\n"
        f"rank = subprocess.Popen([sys.executable, '-c', {RANK!r}, '0'], start_new_session=True)\n"
        "print(rank.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    agent = subprocess.Popen([sys.executable, "-c", agent_code], stdout=subprocess.PIPE, text=True, env=rank_env())
    rank = int(agent.stdout.readline())
    try:
        assert agent.stdout.readline().strip() == "armed"  # the rank shares the agent's stdout
        agent.kill()
        agent.wait()
        assert wait_until(lambda: not alive(rank), 5.0), "the rank outlived its agent"
    finally:
        agent.kill()
        if alive(rank):
            os.kill(rank, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_rank_whose_agent_died_before_it_was_watched_exits(tmp_path):
    # `sh` starts the rank in the background and exits at once: the rank is handed to a reaper (init, or a
    # subreaper) before it arms the parent-death signal, which then can never fire. It must notice and exit.
    out = tmp_path / "rank.out"
    code = f'exec {sys.executable} -c "$0" 1 > {out} 2>&1 & echo $!'
    proc = subprocess.run(["sh", "-c", code, RANK], capture_output=True, text=True, env=rank_env(), check=True)
    rank = int(proc.stdout)
    try:
        assert wait_until(lambda: not alive(rank), 60.0), out.read_text()
        text = out.read_text()
        assert "armed" not in text and "its torchrun agent is gone" in text, text
    finally:
        if alive(rank):
            os.kill(rank, signal.SIGKILL)


def test_a_plain_process_is_not_watched():
    # Not under torchrun (no TORCHELASTIC_RUN_ID): a `trainer` started from a shell keeps its usual life.
    env = {k: v for k, v in rank_env().items() if k != "TORCHELASTIC_RUN_ID"}
    code = "from prime_rl.trainer.parallel.distributed import die_with_torchrun_agent; die_with_torchrun_agent(); print('ok')"
    # `& wait`: sh stays the parent (a lone command would be exec'd in its place), and sh is no Python.
    proc = subprocess.run(
        ["sh", "-c", f'{sys.executable} -c "$0" & wait', code], capture_output=True, text=True, env=env
    )
    assert proc.stdout.strip() == "ok"


def test_batch_wait_is_bounded_by_default():
    assert TrainerConfig().batch_timeout == 3600


def test_the_wait_warns_what_it_waits_for_and_times_out_saying_so(tmp_path, one_rank):
    path = batch_path(tmp_path, 3)
    warnings = []
    sink = logger.add(warnings.append, level="WARNING", format="{message}")
    start = time.monotonic()
    try:
        with pytest.raises(TimeoutError) as error:
            wait_on_rank0(one_rank, path.exists, f"{path} (the orchestrator's)", 2.5, None, None, warn_every=1.0)
    finally:
        logger.remove(sink)
    assert 2.5 <= time.monotonic() - start < 3.5
    # One warning a second (at 1 s and 2 s), each naming the file and the time waited.
    assert [w.strip() for w in warnings] == [
        f"waiting 1 s for {path} (the orchestrator's)",
        f"waiting 2 s for {path} (the orchestrator's)",
    ]
    assert re.fullmatch(
        rf"waited \d s for {re.escape(str(path))} \(the orchestrator's\) \(timeout 2.5 s\)", str(error.value)
    )


def test_the_wait_returns_soon_after_the_batch_appears_without_spinning(tmp_path, one_rank):
    path = batch_path(tmp_path, 1)
    looks = []

    def ready() -> bool:
        looks.append(time.monotonic())
        if len(looks) == 1:  # written right after the first look
            path.parent.mkdir(parents=True)
            threading.Timer(0.6, path.write_bytes, args=(b"x",)).start()
        return path.exists()

    start = time.monotonic()
    wait_on_rank0(one_rank, ready, "the batch", 5.0, None, None)
    elapsed = time.monotonic() - start
    # Polls back off from 10 ms to 250 ms: seen within a quarter second, after some 5-8 looks, not thousands.
    assert 0.6 <= elapsed < 0.9, elapsed
    assert 4 <= len(looks) <= 10, len(looks)
