"""One writer per role and output directory: `{output_dir}/.locks/<role>.lock`, an exclusive `flock`.

Two trainers (or two orchestrators) writing the same output directory consume each other's batches and
overwrite each other's checkpoints, so every writing process holds the lock of its role for its whole life.
The kernel releases a `flock` when its holder dies, however it dies, so a crashed run never leaves a lock
behind. The file's text (pid, host, command) is only there to name the holder in the error message.

The lock also tells others whether its holder still lives (`holder_alive`): a LoRA trainer uses that to see that a
run's orchestrator is gone without waiting out its batch timeout.
"""

from __future__ import annotations

import fcntl
import os
import socket
import sys
import time
from pathlib import Path

from loguru import logger

LOCK_DIR = ".locks"
TAKE_RETRY = 2.0
"""Seconds a new holder retries a busy lock: `holder_alive` probes take it for microseconds."""


class OutputDirBusy(RuntimeError):
    """Another live process holds the role's lock on this output directory."""


def lock_path(output_dir: Path, role: str) -> Path:
    return Path(output_dir) / LOCK_DIR / f"{role}.lock"


def _holder(path: Path) -> str:
    try:
        return path.read_text().strip() or "unknown process"
    except OSError:
        return "unknown process"


class OutputDirLock:
    """Holds `{output_dir}/.locks/<role>.lock` until `release()` or the process exits."""

    def __init__(self, output_dir: Path, role: str):
        self.path = lock_path(output_dir, role)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.role = role
        # O_CLOEXEC (Python's default): children never inherit the lock, so a child outliving us cannot hold it.
        self.fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            _flock_retrying(self.fd, fcntl.LOCK_EX)
        except BlockingIOError:
            os.close(self.fd)
            self.fd = None
            raise OutputDirBusy(
                f"another {role} writes to {Path(output_dir)} ({_holder(self.path)}); stop it first, "
                "or use another output_dir"
            ) from None
        except OSError as e:  # a filesystem without flock support (some network mounts): warn, do not block
            logger.warning(f"cannot lock {self.path} ({e}); two {role}s on this output_dir would not be detected")
            return
        os.ftruncate(self.fd, 0)
        os.write(self.fd, f"pid {os.getpid()} on {socket.gethostname()}: {' '.join(sys.argv)[:300]}\n".encode())

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None


def _flock_retrying(fd: int, operation: int) -> None:
    """`flock` without blocking, retried for `TAKE_RETRY` seconds; `BlockingIOError` while a holder keeps it."""
    deadline = time.monotonic() + TAKE_RETRY
    while True:
        try:
            fcntl.flock(fd, operation | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def holder_alive(output_dir: Path, role: str) -> bool | None:
    """Whether a live process holds the role's lock on `output_dir`: True, False (the lock file is there, so a
    holder was, and it has exited or died), or None (no lock file, or a filesystem without `flock`: unknown)."""
    try:
        fd = os.open(lock_path(output_dir, role), os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # never blocks a holder: it retries for `TAKE_RETRY`
        return False
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        os.close(fd)  # drops the probe's shared lock at once


def check_free(output_dir: Path, roles: list[str]) -> None:
    """Raise `OutputDirBusy` if a live process holds any of `roles` on `output_dir` (takes nothing)."""
    for role in roles:
        if lock_path(output_dir, role).exists():
            OutputDirLock(output_dir, role).release()
