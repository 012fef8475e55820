"""`keep_freed_memory`: after it, a large tensor comes from the heap, whose freed memory the process keeps and the
next step reuses; by default glibc maps it from the kernel alone and unmaps it when freed."""

import json
import platform
import subprocess
import sys

import pytest

CHILD = """
import ctypes, ctypes.util, sys, torch
from prime_rl.utils.malloc import keep_freed_memory

class Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                 "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallinfo2.restype = Mallinfo2
if sys.argv[1] == "keep":
    assert keep_freed_memory()
mapped = []
for mib in (16, 40, 200):  # an activation, beyond the mmap threshold, a 135M model's embedding gradient and more
    before = libc.mallinfo2().hblkhd  # bytes in blocks mapped on their own
    x = torch.ones(mib * 2**18)
    mapped.append((libc.mallinfo2().hblkhd - before) // 2**20)
    del x
print(mapped)
"""


def mapped_alone(mode: str) -> list[int]:
    """MiB mapped on their own for a 16, a 40 and a 200 MiB tensor, in a fresh process (`mode`: keep or default)."""
    done = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_large_tensors_come_from_the_heap_only_after_keep_freed_memory():
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("not glibc: keep_freed_memory sets nothing")
    assert mapped_alone("default") == [16, 40, 200]  # the control: each mapped from the kernel, unmapped when freed
    assert mapped_alone("keep") == [0, 0, 0]
