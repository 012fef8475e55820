"""Keep freed memory in the process (glibc malloc), so a CPU training step does not fault its memory back in.

torch's CPU tensors come straight from malloc. By default glibc serves a large block with its own `mmap` and gives
it back to the kernel (`munmap`) when freed, and trims the heap's freed top the same way. A training step frees
and reallocates the same activations and gradients every time, so each step took its memory from the kernel
anew: one minor page fault per 4 KiB, each page zeroed by the kernel. On the 2-core machine that was 7.4M faults
and 52 s of system time in one `bench_trainer_overhead.py` run at SmolLM2-135M (3.0M and 30 s with this), and
ours 12.4 -> 10.5 s a step. The price is resident memory: what a step freed stays held until the next step reuses
it, and the peak grows a little with the heap's fragmentation (+8% RSS in that run).
"""

import ctypes

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # mallopt's parameter numbers (malloc.h)
MMAP_THRESHOLD = 32 * 2**20
"""Blocks below this come from the heap and are reused; glibc refuses more on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX).
Setting it also stops glibc from moving the threshold, and the trim threshold with it, as it frees blocks."""
TRIM_THRESHOLD = 2**31 - 1
"""Give the heap's freed top back only beyond 2 GiB (mallopt takes a C int): the next step needs it again."""
TOP_PAD = 2**30
"""Grow the heap by 1 GiB of address space more than asked (pages are only taken when touched): a block that fits
the heap's free top comes from there whatever its size, so even the largest ones (a 135M model's embedding gradient,
113 MB) are reused rather than mapped anew."""


def keep_freed_memory() -> bool:
    """Set glibc's malloc to keep what the process frees; False where the C library is not glibc (nothing set)."""
    libc = ctypes.CDLL(None)  # the symbols already loaded, the C library's among them: no search for its file
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return False
    settings = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD))
    return all(libc.mallopt(ctypes.c_int(param), ctypes.c_int(value)) == 1 for param, value in settings)
