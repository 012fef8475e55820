"""Process-wide logging: loguru to the console and to `{output_dir}/logs/<process>.log`.

Standard-library loggers (vLLM, transformers, httpx, warnings) are routed into loguru through one
root handler, and their own handlers are removed, so each library line appears once in each sink.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import warnings
from pathlib import Path

from loguru import logger

CONSOLE_FORMAT = "<green>{time:HH:mm:ss}</green> <level>{level: <7}</level> <cyan>{extra[process]}</cyan> {message}"
FILE_FORMAT = "{time:YYYY-MM-DD HH:mm:ss.SSS} | {level: <7} | {extra[process]} | {name}:{line} | {message}"

_configured: str | None = None


class _InterceptHandler(logging.Handler):
    """Forward a standard-library log record to loguru, keeping its level and logger name."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            level: str | int = logger.level(record.levelname).name
        except ValueError:
            level = record.levelno
        logger.opt(exception=record.exc_info, depth=6).bind(lib=record.name).log(level, record.getMessage())


def _tee_output(log_file: Path) -> None:
    """Copy everything written to this process's stdout/stderr fds, and its children's, into `log_file`.

    For processes whose children we do not control (vLLM's engine and workers are spawned and log
    through their own handlers), the file descriptors are the one place all their lines pass.
    """
    console = os.dup(1)
    read_end, write_end = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(write_end, 1)
    os.dup2(write_end, 2)
    os.close(write_end)

    def pump() -> None:
        with open(log_file, "ab", buffering=0) as f:
            while chunk := os.read(read_end, 65536):
                os.write(console, chunk)
                f.write(chunk)

    threading.Thread(target=pump, name="log-tee", daemon=True).start()


def setup_logging(
    process: str,
    level: str = "info",
    log_dir: Path | None = None,
    tee_fds: bool = False,
    console_level: str | None = None,
    file_name: str | None = None,
) -> Path | None:
    """Configure logging once per process; returns the log file path (None without `log_dir`).

    With `tee_fds`, the log file receives the raw console output of this process and of every child
    it starts (used by `inference`); otherwise loguru writes the file itself. `console_level` (default: `level`)
    lets helper processes keep the shared console to warnings while their file gets everything. `file_name`
    (default `<process>.log`) is the file's name under `log_dir`.
    Calling it again in the same process only reconfigures the sinks (tests do that).
    """
    global _configured
    log_file = None
    if log_dir is not None:
        log_dir = Path(log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        log_file = log_dir / (file_name or f"{process}.log")
        if tee_fds:
            _tee_output(log_file)
    logger.remove()
    logger.configure(extra={"process": process})
    logger.add(sys.stderr, level=(console_level or level).upper(), format=CONSOLE_FORMAT, colorize=None, enqueue=False)
    if log_file is not None and not tee_fds:
        logger.add(log_file, level=level.upper(), format=FILE_FORMAT, enqueue=False, mode="a")

    # One root handler for every stdlib logger; libraries that attach their own handlers
    # (vLLM, transformers) would otherwise print each line twice.
    logging.basicConfig(handlers=[_InterceptHandler()], level=logging.INFO, force=True)
    for name in ("vllm", "transformers", "httpx", "uvicorn", "uvicorn.access", "uvicorn.error"):
        lib = logging.getLogger(name)
        lib.handlers = []
        lib.propagate = True
    for name in ("httpx", "httpx2"):  # httpx2: the MCP client's, a line per tool call
        logging.getLogger(name).setLevel(logging.WARNING)
    logging.captureWarnings(True)
    warnings.simplefilter("default")
    _configured = process
    return log_file
