"""Keep the CPUs clear for a starting inference server: the rest of a run waits on its own CPUs until it is healthy.

`rl` starts the server, the orchestrator and the trainer at once so that their imports overlap. On a small machine
they then share every CPU, and the server's start (vLLM's import, ~6 s of one core) is what the first step waits for:
on 2 CPUs it took ~9 s beside the others. Nice values do not help: each process is its own session, and the kernel's
autogroups share the CPUs between sessions whatever their nice values. So the others start on the upper half of the
CPUs (`side_cpus`) and the server has the lower half to itself; once it is healthy every thread of theirs (threads and
processes started meanwhile included) gets all the CPUs back (`set_group_affinity`). 2-core machine: the demo's first
step at 9.8 s instead of 10.9 (docs/throughput.md).
"""

from __future__ import annotations

import os
from pathlib import Path

PROC = Path("/proc")


def side_cpus(cpus: set[int]) -> set[int] | None:
    """The upper half of `cpus` (at least one): where the processes that wait for a starting server run meanwhile.
    None with a single CPU, where there is nothing to split."""
    if len(cpus) < 2:
        return None
    ordered = sorted(cpus)
    return set(ordered[len(ordered) // 2 :])


def group_members(pgid: int) -> list[int]:
    """The pids of every live process in process group `pgid` (a `Process` and whatever it started)."""
    members = []
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # ended meanwhile
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state, ppid, pgrp, ...
        if int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def set_group_affinity(pgid: int, cpus: set[int]) -> int:
    """Every thread of every process in group `pgid` may run on `cpus`; returns how many threads changed. A thread
    inherits its creator's CPUs, so this goes over the group until a pass changes nothing (at most 3), catching what was
    started while it ran. Threads that end meanwhile are skipped."""
    changed = 0
    for _ in range(3):
        this_pass = 0
        for pid in group_members(pgid):
            try:
                tids = [int(t.name) for t in (PROC / str(pid) / "task").iterdir()]
            except OSError:
                continue
            for tid in tids:
                try:
                    if os.sched_getaffinity(tid) != cpus:
                        os.sched_setaffinity(tid, cpus)
                        this_pass += 1
                except (ProcessLookupError, PermissionError):
                    continue
        changed += this_pass
        if this_pass == 0:
            break
    return changed
