import subprocess

import pytest
import torch.distributed as dist

from prime_rl.trainer.parallel.distributed import init_distributed


@pytest.fixture
def one_rank():
    """A one-process world (gloo), as a plain `trainer` without torchrun runs; destroyed after the test whatever
    happened, so the next test can start its own."""
    world = init_distributed()
    yield world
    dist.destroy_process_group()


def run_at_once(commands: list[list[str]], timeout: float) -> list[subprocess.CompletedProcess]:
    """`subprocess.run(command, capture_output=True, text=True, timeout=timeout)` for each command, all started together:
    probes that each spend seconds importing on one core take the time of one on two. None outlives the call."""
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in commands]
    try:
        outputs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return [
        subprocess.CompletedProcess(p.args, p.returncode, out, err)
        for p, (out, err) in zip(procs, outputs, strict=True)
    ]


TEST_SECRET = "0123456789abcdef" * 4
"""A run secret in the format `utils.secret` takes (hex, 64 digits)."""
TEST_KEY = __import__("prime_rl.utils.secret", fromlist=["derive"]).derive(TEST_SECRET, "weight-broadcast-store")
"""The store key derived from it."""


@pytest.fixture
def trainer_store(monkeypatch):
    """A real weight-broadcast store as trainer rank 0 hosts it (its session written), with the run secret in this
    process's environment; `settings` is what a server configured for it holds."""
    import uuid
    from types import SimpleNamespace

    from prime_rl.utils.secret import SECRET_VAR
    from prime_rl.weight_broadcast.protocol import SESSION, set_json
    from prime_rl.weight_broadcast.store import StoreServer, Table

    monkeypatch.setenv(SECRET_VAR, TEST_SECRET)
    table, session = Table(), uuid.uuid4().hex
    set_json(table, SESSION, {"id": session, "backend": "gloo"})
    server = StoreServer("127.0.0.1", 0, TEST_KEY, table)
    settings = {"type": "gloo", "host": "127.0.0.1", "port": server.port, "timeout": 10.0, "key": TEST_KEY.hex()}
    yield SimpleNamespace(server=server, table=table, session=session, settings=settings)
    server.close()
