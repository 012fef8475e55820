"""The in-memory weight broadcast into the real vLLM server (the session's shared one): the orchestrator's real
`InferenceServers` asks, a stand-in trainer (`broadcast_trainer.py`, the trainer's real sending code) sends.

Exactness: after a broadcast the server serves bit-identical tokens and logprobs to a filesystem swap of the same
weights. Faults: a trainer dying mid-transfer is an error within seconds on both sides, and the server serves
nothing under the new label (nor anything at all: its weights are half new, half old); weights that do not fit the
model are refused before any changes."""

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import API_KEY, RUN_SECRET
from test_inference_server import admin, generate

from prime_rl.config import WeightBroadcastConfig
from prime_rl.models.tiny import TinyModelConfig, build_tiny_model
from prime_rl.orchestrator.broadcast import BroadcastClient, TrainerGone
from prime_rl.orchestrator.servers import InferenceServers, ServerError
from prime_rl.utils.secret import SECRET_VAR

pytestmark = pytest.mark.slow

SENDER = Path(__file__).with_name("broadcast_trainer.py")
KEY_VAR = "PRIME_TEST_BROADCAST_KEY"


def start_sender(port: int, steps: dict[int, Path], *args: str, log: Path) -> subprocess.Popen:
    """The stand-in trainer on `port`: the shared server's configured store address (one sender at a time), with the
    shared server's run secret (given explicitly: a store client of this process took it out of our environment)."""
    cmd = [sys.executable, str(SENDER), "--port", str(port), *args, *(f"{s}={d}" for s, d in steps.items())]
    env = {**os.environ, SECRET_VAR: RUN_SECRET}
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)


def servers_for(srv, port: int, tmp_path: Path) -> InferenceServers:
    config = WeightBroadcastConfig(type="gloo", port=port, timeout=60)
    return InferenceServers([f"{srv.url}/v1"], KEY_VAR, 120, tmp_path, BroadcastClient(config, ack_timeout=120))


async def published(servers: InferenceServers, step: int, sender: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 120
    while await servers.latest_published() < step:
        assert sender.poll() is None and time.monotonic() < deadline, log.read_text()
        await asyncio.sleep(0.1)


def outputs(srv) -> list[dict]:
    """Greedy and sampled generations with their logprobs and per-token versions."""
    return [generate(srv, max_tokens=12), generate(srv, max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)]


@pytest.fixture
def key(monkeypatch):
    """The server's API key for our admin client, and the run secret for the stand-in trainer and our store client."""
    monkeypatch.setenv(KEY_VAR, API_KEY)
    monkeypatch.setenv(SECRET_VAR, RUN_SECRET)


def test_a_broadcast_serves_exactly_what_a_filesystem_swap_of_the_same_weights_serves(tied_server, tmp_path, key):
    srv, log = tied_server, tmp_path / "sender.log"
    port = srv.broadcast_port
    sender = start_sender(port, {1: srv.step_1}, log=log)
    servers = servers_for(srv, port, tmp_path)

    async def scenario():
        try:
            await servers.wait_healthy()
            await servers.load_policy(0)
            await published(servers, 1, sender, log)
            seconds = await servers.load_policy(1)
            assert servers.version == 1 and servers.healthy() == [f"{srv.url}/v1"], seconds
        finally:
            await servers.close(finished=True)  # tells the sender we are done

    assert admin(srv, "reload_weights").status_code == 200  # other tests may have left other weights
    base = outputs(srv)
    asyncio.run(scenario())
    try:
        assert sender.wait(60) == 0, log.read_text()
        info = httpx.get(f"{srv.url}/weights", headers=srv.headers, timeout=10).json()
        assert info == {"version": "step_1", "source": "broadcast", "workers": 1, "adapters": {}, "unknown": None}
        by_broadcast = outputs(srv)
        assert by_broadcast != base and by_broadcast[0]["versions"] == [{"version": "step_1", "start": 0, "end": 12}]
        r = admin(srv, "update_weights", {"weight_dir": str(srv.step_1), "version": "step_1"})
        assert r.status_code == 200, r.text
        assert outputs(srv) == by_broadcast  # bit-identical tokens, logprobs and versions
    finally:
        assert admin(srv, "reload_weights").status_code == 200


def test_a_trainer_dying_mid_transfer_leaves_nothing_served_under_the_new_label(tied_server, tmp_path, key):
    """The trainer dies after sending the first layer buffer of step 2: the server cannot restore step 1 (it came by
    broadcast), so it serves nothing (503) until given weights again, and the orchestrator learns within seconds that
    the trainer is gone."""
    srv, log = tied_server, tmp_path / "sender.log"
    port = srv.broadcast_port
    sender = start_sender(port, {1: srv.step_1, 2: srv.base}, "--die-in-step", "2", "--die-after-groups", "1", log=log)
    servers = servers_for(srv, port, tmp_path)
    health = f"{srv.url}/health"

    async def scenario() -> float:
        try:
            await servers.wait_healthy()
            await servers.load_policy(0)
            await published(servers, 1, sender, log)
            await servers.load_policy(1)
            await published(servers, 2, sender, log)
            start = time.monotonic()
            with pytest.raises(TrainerGone, match=f"store at 127.0.0.1:{port} stopped answering"):
                await servers.load_policy(2)
            return time.monotonic() - start  # the orchestrator stops on this: no trainer, no run
        finally:
            await servers.close(finished=True)

    try:
        elapsed = asyncio.run(scenario())
        assert sender.wait(30) == 7, log.read_text()
        assert elapsed < 30, elapsed  # gloo sees the dead peer at once; nothing waits for a timeout (60 s here)
        assert httpx.get(health, timeout=10).status_code == 503
        info = httpx.get(f"{srv.url}/weights", headers=srv.headers, timeout=10).json()
        assert info["version"] == "step_1" and info["source"] is None  # never labelled step_2
        assert "came by broadcast" in info["unknown"]
        body = {"model": str(srv.base), "token_ids": srv.prompt_ids, "sampling_params": {"max_tokens": 2}}
        r = httpx.post(f"{srv.url}/inference/v1/generate", json=body, headers=srv.headers, timeout=30)
        assert r.status_code == 503 and "weights are unknown" in r.json()["error"]["message"]
    finally:
        sender.kill()
        healed = admin(srv, "reload_weights")
    assert healed.status_code == 200 and httpx.get(health, timeout=10).status_code == 200


def test_weights_that_do_not_fit_the_model_are_refused_before_anything_changes(tied_server, tmp_path, key):
    srv, log = tied_server, tmp_path / "sender.log"
    port = srv.broadcast_port
    other = build_tiny_model(TinyModelConfig(output=tmp_path / "wider", hidden_size=96))
    sender = start_sender(port, {1: other}, log=log)
    servers = servers_for(srv, port, tmp_path)
    before = outputs(srv)

    async def scenario():
        try:
            await servers.wait_healthy()
            await published(servers, 1, sender, log)
            with pytest.raises(ServerError, match="422.*broadcast refused.*shapes differ"):
                await servers.load_policy(1)
        finally:
            await servers.close(finished=True)

    try:
        asyncio.run(scenario())
        assert sender.wait(60) == 0, log.read_text()
        assert outputs(srv) == before  # untouched, still labelled base
    finally:
        sender.kill()
