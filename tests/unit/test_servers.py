"""The orchestrator's admin view of its servers, against a real closed port, or our real admin routes over a fake
engine (no vLLM needed)."""

import asyncio

import httpx
import pytest
from fake_engine import LORA_SHAPES, SHAPES, FakeEngine, admin_app, lora_tensors, make_dir, write_adapter

from prime_rl.orchestrator.servers import InferenceServers, ServerError
from prime_rl.utils.net import free_port


def test_a_swap_that_hits_a_dead_server_takes_it_out_of_rotation_instead_of_ending_the_run(tmp_path):
    """The server died while the orchestrator waited for new weights: the swap's connection fails. The run goes on
    (no exception), the version moves, and the server is paused until recovery can give it that version. (The
    orchestrator used to exit with `ConnectError: All connection attempts failed`.) Recovery bringing a restarted
    server to the current policy is the multi-host test's."""
    dead = f"http://127.0.0.1:{free_port()}/v1"

    async def swap() -> tuple[list[str], int, bool]:
        servers = InferenceServers([dead], "NO_SUCH_KEY_VAR", timeout=5, output_dir=tmp_path)
        try:
            await servers.load_policy(3)
            return servers.healthy(), servers.version, dead in servers.recovering
        finally:
            await servers.close()

    healthy, version, recovering = asyncio.run(swap())
    assert healthy == [] and version == 3 and recovering


def adapter_server(tmp_path, engine: FakeEngine) -> tuple[object, str]:
    """Our real admin routes over a fake engine, reached by httpx in-process; the URL the orchestrator knows it by."""
    client, _ = admin_app(tmp_path, engine, shapes=LORA_SHAPES)
    asyncio.run(client.app.state.prime_adapters.init())
    return client.app, "http://server/v1"


def connect(servers: InferenceServers, app, url: str) -> InferenceServers:
    servers.admin[url] = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=servers.root(url))
    return servers


def test_adapter_mode_moves_only_its_own_adapter_and_never_the_base_weights(tmp_path):
    """Two runs share a server, each with its adapter: a policy step is a load of `broadcasts/step_n` under the run's
    name, step 0 is the base model (the run's adapter unloaded, which is fine when none is loaded), and a server that
    lost the adapter (restarted) gets the current step again."""
    engine = FakeEngine()
    app, url = adapter_server(tmp_path, engine)
    for run in ("run-a", "run-b"):
        for step in (1, 2):
            write_adapter(tmp_path / run / "broadcasts" / f"step_{step}", lora_tensors(fill=step))

    async def scenario() -> None:
        a = connect(InferenceServers([url], "NO_SUCH_KEY_VAR", 5, tmp_path / "run-a", adapter="run-a"), app, url)
        b = connect(InferenceServers([url], "NO_SUCH_KEY_VAR", 5, tmp_path / "run-b", adapter="run-b"), app, url)

        async def adapters() -> dict:
            return (await a.admin[url].get("/weights")).json()["adapters"]

        try:
            await a.load_policy(0)
            assert await adapters() == {} and a.model_name(0, "base-model") == "base-model"
            await a.load_policy(1)
            await b.load_policy(2)
            assert await adapters() == {"run-a": "step_1", "run-b": "step_2"}
            assert a.model_name(1, "base-model") == "run-a" and b.model_name(2, "base-model") == "run-b"
            assert engine.loras[-1].lora_path == str((tmp_path / "run-b" / "broadcasts" / "step_2").resolve())
            await a.load_policy(2)
            assert await adapters() == {"run-a": "step_2", "run-b": "step_2"}

            # The server lost run-a's adapter (restarted): catching it up loads the current step again.
            assert (await a.admin[url].post("/unload_lora_adapter", json={"lora_name": "run-a"})).status_code == 200
            await a._catch_up(url)
            assert await adapters() == {"run-a": "step_2", "run-b": "step_2"}

            # Back to step 0 (a fresh run under the same name): run-a's adapter goes, run-b's stays.
            await a.load_policy(0)
            assert await adapters() == {"run-b": "step_2"} and a.version == 0
        finally:
            await a.close()
            await b.close()

    asyncio.run(scenario())
    assert not [c for c in engine.calls if c[0] in ("prime_load_weights", "version")]  # base weights untouched


def test_adapter_mode_against_a_server_without_lora_fails_naming_it(tmp_path):
    app, url = adapter_server(tmp_path, FakeEngine(lora=False))
    write_adapter(tmp_path / "run" / "broadcasts" / "step_1", lora_tensors())

    async def load(step: int) -> None:
        servers = connect(InferenceServers([url], "NO_SUCH_KEY_VAR", 5, tmp_path / "run", adapter="a"), app, url)
        try:
            await servers.load_policy(step)
        finally:
            await servers.close()

    for step in (0, 1):
        with pytest.raises(ServerError, match="409.*not enabled on this server"):
            asyncio.run(load(step))


def test_a_server_that_returns_after_its_policy_was_pruned_moves_everyone_to_the_newest(tmp_path):
    """The servers serve step 3; one of them failed and comes back after the trainer pruned step 3 from disk (it
    keeps only what inference may still need). Loading step 3 would get a 404, which ended the whole run; instead
    every server moves to the newest published policy, step 5 (newer is never too old)."""
    from fake_engine import SHAPES, make_dir

    engine = FakeEngine()
    client, swapper = admin_app(tmp_path, engine)
    out = tmp_path / "run"
    for step in (4, 5):
        make_dir(out / "broadcasts" / f"step_{step}", SHAPES)
        (out / "broadcasts" / f"step_{step}" / "STABLE").touch()
    url = "http://server/v1"

    async def scenario() -> None:
        servers = connect(InferenceServers([url], "NO_SUCH_KEY_VAR", 5, out), client.app, url)
        try:
            servers.version = 3  # step 3's directory is gone
            servers.mark_failed(url, "a test")
            await servers.recovering[url]
            assert servers.fatal is None, servers.fatal
            assert servers.version == 5 and servers.healthy() == [url]
        finally:
            await servers.close()

    asyncio.run(scenario())
    assert swapper.version == "step_5"
    assert engine.calls[-2:] == [
        ("prime_load_weights", str((out / "broadcasts" / "step_5").resolve())),
        ("version", "step_5"),
    ]


def test_the_trainers_word_on_this_run_is_read_only_when_newer_than_the_orchestrators_config(tmp_path):
    """A LoRA trainer that ends a run (its adapter diverged) or refuses it (its config is invalid) writes why to
    `configs/trainer_error.txt`: the orchestrator stops with that instead of waiting out `stall_timeout` for a policy
    that will never come. A file older than its own config is an earlier launch's, and ignored."""
    import os

    servers = InferenceServers([f"http://127.0.0.1:{free_port()}/v1"], "NO_SUCH_KEY_VAR", 5, tmp_path)
    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "trainer_error.txt").write_text("the trainer ended this run: it diverged at step 3 (in x)\n")
    os.utime(configs / "trainer_error.txt", (1_000_000, 1_000_000))  # written by an earlier launch
    (configs / "orchestrator.toml").write_text("")
    assert servers.trainer_error() is None
    (configs / "trainer_error.txt").write_text("the trainer ended this run: it diverged at step 5 (in y)\n")
    assert servers.trainer_error() == "the trainer ended this run: it diverged at step 5 (in y)"
    asyncio.run(servers.close())


def test_policy_0_is_not_read_again_from_disk_on_a_server_that_serves_its_base_weights(tmp_path):
    """A server that just started (or was reset on attach) serves `base`: the orchestrator's start-up skips reloading
    the whole model from disk (0.8 s for SmolLM2-135M on CPU, far more for large models on GPUs); a server left on
    another policy by an earlier run is still reset."""
    engine = FakeEngine()
    client, swapper = admin_app(tmp_path, engine)
    url = "http://server/v1"
    step_3 = make_dir(tmp_path / "step_3", SHAPES)

    async def start(version_before: str) -> int:
        servers = connect(InferenceServers([url], "NO_SUCH_KEY_VAR", 5, tmp_path), client.app, url)
        try:
            loads = len(engine.calls)
            await servers.load_policy(0)
            state = (await servers.admin[url].get("/weights")).json()
            assert state["version"] == "base", (version_before, state)
            return len(engine.calls) - loads
        finally:
            await servers.close()

    assert asyncio.run(start("base")) == 0
    assert client.post("/update_weights", json={"weight_dir": str(step_3), "version": "step_3"}).status_code == 200
    assert asyncio.run(start("step_3")) > 0  # reloaded
