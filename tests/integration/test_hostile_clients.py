"""The real vLLM server (the session's shared one) under hostile and careless clients: every route behind the key,
broadcast bodies that name addresses or oversize integers, a silent peer on the store's address, and a trainer that
sends broken headers. Each is refused with a 4xx (or a 502 when the trainer's store is what fails) before generation
pauses, and the served weights never change: a fixed greedy completion keeps its exact logprobs."""

import asyncio
import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import API_KEY, RUN_SECRET
from test_inference_server import admin, generate
from test_weight_broadcast import published, servers_for, start_sender

from prime_rl.orchestrator.servers import ServerError
from prime_rl.utils.net import free_port
from prime_rl.utils.secret import SECRET_VAR

pytestmark = pytest.mark.slow

PUBLIC = {"/health", "/ping", "/version"}
NAMED_IN_THE_REPORT = [
    ("POST", "/invocations"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("POST", "/generative_scoring"),
    ("POST", "/scale_elastic_ep"),
    ("GET", "/metrics"),
    ("GET", "/load"),
    ("GET", "/kv_event_sources"),
    ("GET", "/docs"),
    ("GET", "/openapi.json"),
]


@pytest.fixture
def unchanged(tied_server):
    """The server serves the base weights before the test and exactly the same after it."""
    assert admin(tied_server, "reload_weights").status_code == 200  # other tests may have left other weights
    before = generate(tied_server, max_tokens=12)
    yield before
    assert generate(tied_server, max_tokens=12) == before
    weights = httpx.get(f"{tied_server.url}/weights", headers=tied_server.headers, timeout=10).json()
    assert weights["version"] == "base" and httpx.get(f"{tied_server.url}/health", timeout=10).status_code == 200


def test_every_route_but_health_ping_and_version_needs_the_key(tied_server):
    """vLLM's own routes too, including the ones the report found open and whatever the installed vLLM mounts (read
    from its OpenAPI schema, with the key): a route a later vLLM adds is closed until listed as public."""
    srv = tied_server
    schema = httpx.get(f"{srv.url}/openapi.json", headers=srv.headers, timeout=30).json()
    routes = set(NAMED_IN_THE_REPORT)
    for path, methods in schema["paths"].items():
        for method in methods:
            routes.add((method.upper(), path.replace("{", "").replace("}", "")))
    assert len(routes) > 30, sorted(routes)
    opened = []
    with httpx.Client(base_url=srv.url, timeout=30) as client:
        for method, path in sorted(routes):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
                r = client.request(method, path, headers=headers)
                if path in PUBLIC:
                    assert r.status_code != 401, (method, path)
                elif r.status_code != 401:
                    opened.append((method, path, headers, r.status_code))
    assert not opened, opened
    assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200


def hostile_bodies() -> list[tuple[dict, int, str]]:
    spec = {"session": "ab" * 16, "group": "cd" * 16, "rank": 1, "world_size": 2}
    return [
        # An address of the caller's choosing: one call made the server open 7 connections to it (a port scanner).
        ({"broadcast": {**spec, "host": "10.9.9.9", "port": 22}}, 422, "broadcast.host"),
        ({"broadcast": {**spec, "timeout": 5}}, 422, "broadcast.timeout"),
        ({"broadcast": {**spec, "backend": "mpi"}}, 422, "broadcast.backend"),
        ({"broadcast": {**spec, "rank": 10**30, "world_size": 10**30}}, 422, "broadcast.rank"),  # was a 500
        ({"broadcast": {**spec, "rank": 2**63, "world_size": 2**63 + 1}}, 422, "broadcast.rank"),
        ({"broadcast": {**spec, "rank": -1}}, 422, "broadcast.rank"),
        ({"broadcast": {**spec, "rank": 5}}, 422, "exceed world_size"),
        ({"broadcast": {**spec, "world_size": "2"}}, 422, "broadcast.world_size"),
        ({"broadcast": {**spec, "session": "x" * 10_000}}, 422, "broadcast.session"),
        ({"broadcast": spec, "version": "step_1\nINFO | forged log line"}, 422, "version"),
        ({"broadcast": spec, "version": "v" * 300}, 422, "version"),
        ({"broadcast": spec, "version": "weights_unknown"}, 422, "reserved"),
        # Well-formed, but no trainer holds the store address the server is configured with: 502, nothing paused.
        ({"broadcast": spec}, 502, "did not answer"),
    ]


def test_hostile_broadcast_bodies_are_refused_at_once_and_change_nothing(tied_server, unchanged):
    srv = tied_server
    for body, status, needle in hostile_bodies():
        start = time.monotonic()
        r = admin(srv, "update_weights", body)
        assert r.status_code == status and needle in r.json()["error"]["message"], (body, r.text)
        assert time.monotonic() - start < 10, body
        assert len(r.content) < 1500 and "\nINFO" not in r.text
    log = (srv.output_dir / "server.out").read_text(errors="replace")
    assert "forged log line" not in log
    assert API_KEY not in log and RUN_SECRET not in log  # neither the key nor the secret is ever logged


def test_a_silent_peer_on_the_store_address_fails_the_swap_in_seconds_and_generation_goes_on(tied_server, unchanged):
    """Something accepts on the store's address and never answers: the request fails within the connect bound (5 s;
    a TCPStore client waited 35-70 s), and completions are served meanwhile: nothing paused."""
    srv = tied_server
    listener = socket.create_server(("127.0.0.1", srv.broadcast_port))
    held: list = []
    threading.Thread(target=lambda: held.append(listener.accept()), daemon=True).start()
    body = {"broadcast": {"session": "ab" * 16, "group": "cd" * 16, "rank": 1, "world_size": 2}}
    try:
        reply: list[httpx.Response] = []
        swap = threading.Thread(target=lambda: reply.append(admin(srv, "update_weights", body)))
        start = time.monotonic()
        swap.start()
        time.sleep(1)
        generate(srv, max_tokens=4)  # served while the swap waits for the silent peer
        served_after = time.monotonic() - start
        swap.join(30)
        elapsed = time.monotonic() - start
    finally:
        listener.close()
    assert reply and reply[0].status_code == 502 and "did not authenticate" in reply[0].text, reply
    assert served_after < 4.5 and elapsed < 10, (served_after, elapsed)


def test_broken_headers_from_a_trainer_are_refused_before_generation_pauses(
    tied_server, tmp_path, unchanged, monkeypatch
):
    """A trainer holding the secret but sending a header that is not JSON, a list, a step of 10**400 (which once
    killed vLLM's output thread), a step "abc", dtype "BF16", or a size of -1 or 2**62: each is a 422 naming what is
    wrong, the weights never change, and the next good transfer works."""
    monkeypatch.setenv("PRIME_TEST_BROADCAST_KEY", API_KEY)
    monkeypatch.setenv(SECRET_VAR, RUN_SECRET)
    srv, log = tied_server, tmp_path / "sender.log"
    kinds = ["not-json", "a-list", "huge-step", "string-step", "wrong-dtype", "negative-size", "huge-size"]
    sender = start_sender(srv.broadcast_port, {1: srv.step_1}, "--bad-headers", ",".join(kinds), log=log)
    servers = servers_for(srv, srv.broadcast_port, tmp_path)
    url = f"{srv.url}/v1"
    needles = {
        "not-json": "not JSON",
        "a-list": "must be an object",
        "huge-step": "step must be an integer",
        "string-step": "step must be an integer",
        "wrong-dtype": "dtype must be one of",
        "negative-size": "header of -1 bytes",
        "huge-size": f"header of {2**62} bytes",
    }

    async def scenario() -> None:
        try:
            await servers.wait_healthy()
            await published(servers, 1, sender, log)
            for kind in kinds:
                outcomes = await servers._broadcast_to([url])
                error = outcomes[0][1]
                assert isinstance(error, ServerError) and "422" in str(error), (kind, error)
                assert needles[kind] in str(error), (kind, error)
                assert "still serving base" in str(error)
            await servers.load_policy(1)  # the next, good header is received
            assert servers.version == 1
        finally:
            await servers.close(finished=True)

    try:
        asyncio.run(scenario())
        assert sender.wait(60) == 0, log.read_text()
        weights = httpx.get(f"{srv.url}/weights", headers=srv.headers, timeout=10).json()
        assert weights["version"] == "step_1"
    finally:
        if sender.poll() is None:
            sender.kill()
        assert admin(srv, "reload_weights").status_code == 200  # back to base for `unchanged`


def test_no_key_is_on_the_servers_command_line_or_in_its_environment(tied_server):
    """A command line is visible to every user of the machine (`ps`), and `/proc/<pid>/environ` to every process of
    the same user: the shared server got its API key on stdin and its run secret by environment, which it took out
    and wiped once read (issue 52, finding 10)."""
    pid = tied_server.proc.pid
    for name in ("cmdline", "environ"):
        seen = Path(f"/proc/{pid}/{name}").read_bytes()
        assert API_KEY.encode() not in seen and RUN_SECRET.encode() not in seen, name


def test_the_server_refuses_to_start_open_beyond_loopback(tmp_path):
    """No API key, no run secret, listening on every interface: it stops before loading anything."""
    from prime_rl.inference.process import INFERENCE
    from prime_rl.models.tiny import TinyModelConfig, build_tiny_model

    model = build_tiny_model(TinyModelConfig(output=tmp_path / "model"))
    env = {k: v for k, v in os.environ.items() if k not in (SECRET_VAR, "VLLM_API_KEY")}
    cmd = [INFERENCE, "--model.name", str(model), "--server.host", "0.0.0.0", "--server.port", str(free_port())]
    cmd += ["--output-dir", str(tmp_path / "o")]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "--server.allow-unauthenticated" in out.stderr, out.stderr[-2000:]


def test_a_trainer_that_stalls_after_joining_does_not_stall_generation(tied_server, tmp_path, monkeypatch):
    """The server joins the group and waits for the header in a worker thread: generation goes on meanwhile (an RPC
    would have blocked the engine's loop for as long as the trainer took); only the reload itself pauses it."""
    monkeypatch.setenv("PRIME_TEST_BROADCAST_KEY", API_KEY)
    monkeypatch.setenv(SECRET_VAR, RUN_SECRET)
    srv, log = tied_server, tmp_path / "sender.log"
    sender = start_sender(srv.broadcast_port, {1: srv.step_1}, "--header-delay", "6", log=log)
    servers = servers_for(srv, srv.broadcast_port, tmp_path)

    async def scenario() -> tuple[float, float]:
        try:
            await servers.wait_healthy()
            await servers.load_policy(0)
            await published(servers, 1, sender, log)
            start = time.monotonic()
            swap = asyncio.create_task(servers.load_policy(1))
            await asyncio.sleep(2)  # joined by now, waiting for the header
            assert not swap.done()
            await asyncio.to_thread(generate, srv, max_tokens=4)
            served = time.monotonic() - start
            await swap
            return served, time.monotonic() - start
        finally:
            await servers.close(finished=True)

    try:
        served, swapped = asyncio.run(scenario())
        assert sender.wait(60) == 0, log.read_text()
        assert served < 5 < swapped, (served, swapped)  # a completion while the trainer stalled, then the weights
        assert httpx.get(f"{srv.url}/weights", headers=srv.headers, timeout=10).json()["version"] == "step_1"
    finally:
        if sender.poll() is None:
            sender.kill()
        assert admin(srv, "reload_weights").status_code == 200
