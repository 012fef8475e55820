import os
import sys
import time
from pathlib import Path

import pytest

from prime_rl.utils.affinity import group_members, set_group_affinity, side_cpus
from prime_rl.utils.processes import Process, stop_all


def test_side_cpus_is_the_upper_half_and_nothing_on_one_cpu():
    assert side_cpus({0, 1}) == {1}
    assert side_cpus(set(range(16))) == set(range(8, 16))
    assert side_cpus({2, 5, 9}) == {5, 9}  # 3 CPUs: the server keeps one, the others get two
    assert side_cpus({3}) is None


# Starts a thread and a grandchild, then says so: all three are created while the process is held to its CPUs.
CHILD = """
import subprocess, sys, threading, time
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(grandchild.pid, flush=True)
time.sleep(60)
"""


def tasks_cpus(pid: int) -> dict[int, set[int]]:
    return {int(t.name): os.sched_getaffinity(int(t.name)) for t in Path(f"/proc/{pid}/task").iterdir()}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to hold a process to one of them")
def test_a_process_held_to_side_cpus_gets_every_cpu_back_threads_and_children_included(tmp_path):
    everything = os.sched_getaffinity(0)
    side = side_cpus(everything)
    out = tmp_path / "child.out"
    child = Process("child", [sys.executable, "-c", CHILD], dict(os.environ), out)
    child.start(side)
    try:
        deadline = time.monotonic() + 30
        while not out.read_text().strip():
            assert time.monotonic() < deadline, "the child did not start its grandchild"
            time.sleep(0.05)
        grandchild = int(out.read_text().split()[0])
        members = group_members(child.proc.pid)
        assert sorted(members) == sorted([child.proc.pid, grandchild])
        held = {**tasks_cpus(child.proc.pid), **tasks_cpus(grandchild)}
        assert len(held) >= 3 and all(cpus == side for cpus in held.values())  # main thread, its thread, grandchild

        assert set_group_affinity(child.proc.pid, everything) == len(held)
        freed = {**tasks_cpus(child.proc.pid), **tasks_cpus(grandchild)}
        assert all(cpus == everything for cpus in freed.values())
        assert set_group_affinity(child.proc.pid, everything) == 0  # nothing left to change
    finally:
        stop_all([child], grace=5)
