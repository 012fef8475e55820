"""Start a real `inference` server as a child process and wait for it (tests, benchmarks)."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

from prime_rl.utils.health import wait_healthy
from prime_rl.utils.net import free_port
from prime_rl.utils.processes import Process, stop_all
from prime_rl.utils.secret import RunKeys

INFERENCE = str(Path(sys.executable).parent / "inference")


class InferenceServer(Process):
    """`inference` on `model_dir`, on a free port (or `port`), logging to `{output_dir}/server.out`; `env` is added to
    this process's environment."""

    def __init__(
        self,
        model_dir: Path,
        output_dir: Path,
        extra: list[str] = (),
        api_key: str | None = None,
        port: int | None = None,
        log_name: str = "server.out",
        env: dict[str, str] | None = None,
    ):
        self.model_dir, self.extra, self.api_key = Path(model_dir), list(extra), api_key
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.output_dir = Path(output_dir)
        cmd = [INFERENCE, "--model.name", str(model_dir), "--output-dir", str(output_dir)]
        cmd += ["--server.port", str(self.port), *self.extra]
        self.output_dir.mkdir(parents=True, exist_ok=True)
        keys = RunKeys(http=api_key) if api_key else None  # on its stdin: a command line is visible to every user
        super().__init__("inference", cmd, {**os.environ, **(env or {})}, self.output_dir / log_name, keys)
        self.started = time.perf_counter()
        self.start()
        self.startup_seconds: float | None = None

    @property
    def log(self) -> Path:
        return self.output

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def wait_healthy(self, timeout: float = 400) -> None:
        try:
            asyncio.run(wait_healthy([self.url], timeout, process=self))
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.perf_counter() - self.started

    def stop(self, grace: float = 30.0) -> None:
        stop_all([self], grace)
