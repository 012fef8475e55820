"""Atomic writes: another process (or a resume after a crash) never sees half a file or directory."""

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def _fsync_dir(directory: Path) -> None:
    """Persist a rename; best effort, since some filesystems do not allow opening directories."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` so that `path` appears only once complete.

    The bytes go to a temp file in the same directory (same filesystem, so the rename is atomic), are fsynced,
    then renamed over `path`; the directory is fsynced too so the rename survives a crash.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


@contextmanager
def atomic_dir(target: Path) -> Iterator[Path]:
    """Yield an empty temporary directory beside `target`; on success it replaces `target` as a whole.

    An existing `target` is swapped out before it is deleted, so `target` is never missing or half-written.
    On failure the temporary directory is removed and `target` is left as it was.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
    tmp.chmod(0o755)  # mkdtemp makes it private; the result should be readable like any other directory
    try:
        yield tmp
        old = None
        if target.exists() or target.is_symlink():
            old = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.old-"))
            os.replace(target, old / "dir")
        os.replace(tmp, target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_steps_after(directory: Path, step: int) -> None:
    """Delete the `step_n` entries of `directory` with n > `step` (an earlier life's batches or weights)."""
    for path in Path(directory).glob("step_*"):
        number = path.name.removeprefix("step_")
        if number.isdigit() and int(number) > step:
            shutil.rmtree(path, ignore_errors=True)
