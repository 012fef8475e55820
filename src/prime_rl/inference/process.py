"""Start a real `inference` server as a child process and wait for it (tests, benchmarks, launchers)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from prime_rl.utils.net import free_port

INFERENCE = str(Path(sys.executable).parent / "inference")


class InferenceServer:
    """`inference` in its own process group, so stopping it also stops vLLM's engine processes."""

    def __init__(self, model_dir: Path, output_dir: Path, extra: list[str] = (), api_key: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.output_dir = output_dir
        self.log = output_dir / "server.out"
        cmd = [INFERENCE, "--model.name", str(model_dir), "--output-dir", str(output_dir)]
        cmd += ["--server.port", str(self.port), *extra]
        if api_key:
            cmd += ["--server.api-key", api_key]
        output_dir.mkdir(parents=True, exist_ok=True)
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(
            cmd, stdout=open(self.log, "w"), stderr=subprocess.STDOUT, start_new_session=True, env=os.environ.copy()
        )
        self.startup_seconds: float | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def wait_healthy(self, timeout: float = 400) -> None:
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"inference exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    self.startup_seconds = time.perf_counter() - self.started
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.stop()
        raise TimeoutError(f"inference not healthy after {timeout}s:\n{self.tail()}")

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        try:  # engine processes left behind by an abrupt exit
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
