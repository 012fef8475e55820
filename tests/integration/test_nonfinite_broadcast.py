"""A diverged policy offered by in-memory broadcast to the real server (the session's shared one): the stand-in trainer
(`broadcast_trainer.py`, the trainer's real sending code) holds weights with a NaN; asked for them, it sends a header
that says so and says no in the all-reduce, the server refuses (422 naming the tensor) before any weight changes, the
orchestrator's `InferenceServers` ends the run on it, and the trainer stops, naming the step and the tensor."""

import asyncio
import re
import shutil

import httpx
import pytest
from safetensors.torch import load_file, save_file
from test_weight_broadcast import key, outputs, published, servers_for, start_sender  # noqa: F401 (key: a fixture)

from prime_rl.orchestrator.servers import ServerError

pytestmark = pytest.mark.slow

TENSOR = "model.layers.1.self_attn.v_proj.weight"


def test_a_policy_with_a_nan_is_refused_by_the_server_and_the_trainer_stops(tied_server, tmp_path, key):  # noqa: F811
    srv, log = tied_server, tmp_path / "sender.log"
    nan = shutil.copytree(srv.step_1, tmp_path / "nan_step")
    tensors = load_file(str(nan / "model.safetensors"))
    tensors[TENSOR][0, 1] = float("nan")
    save_file(tensors, str(nan / "model.safetensors"))
    sender = start_sender(srv.broadcast_port, {1: nan}, log=log)
    servers = servers_for(srv, srv.broadcast_port, tmp_path)
    before = outputs(srv)
    version = httpx.get(f"{srv.url}/weights", headers=srv.headers, timeout=30).json()["version"]
    why = f"policy step 1 has non-finite values (NaN or inf) in {TENSOR}"

    async def scenario():
        try:
            await servers.wait_healthy()
            await published(servers, 1, sender, log)
            with pytest.raises(
                ServerError, match=rf"422.*broadcast refused: the trainer sends no weights: {re.escape(why)}"
            ):
                await servers.load_policy(1)
        finally:
            await servers.close(finished=True)

    try:
        asyncio.run(scenario())
        assert sender.wait(60) != 0  # the trainer stopped: its policy diverged
        assert f"NonFiniteWeights: {why}" in log.read_text(), log.read_text()[-3000:]
        assert httpx.get(f"{srv.url}/weights", headers=srv.headers, timeout=30).json()["version"] == version
        assert outputs(srv) == before  # nothing changed
    finally:
        sender.kill()
