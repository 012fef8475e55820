"""Server-side pieces that need no engine: weight-dir checks, admin body parsing and replies, the weights-unknown
gate, the generate-route rewrite, vLLM args."""

import asyncio
import json
import logging
import os
import warnings

import pytest
import torch
from fake_engine import SHAPES, FakeEngine, admin_app, make_dir
from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.testclient import TestClient
from safetensors.torch import save_file
from starlette.websockets import WebSocketDisconnect

from prime_rl.inference.access import open_access_problem, server_tokens
from prime_rl.inference.config import InferenceConfig
from prime_rl.inference.http_io import MAX_BODY_BYTES, BodyError, parse_json_object
from prime_rl.inference.logprob_tokens import GENERATE_PATH, GenerateLogprobTokens, rewrite_sse
from prime_rl.inference.swapper import WeightsUnknownGate
from prime_rl.inference.weights import (
    ECHO_CHARS,
    TensorSpec,
    WeightDirError,
    check_weight_dir,
    clip,
    safetensors_shapes,
    safetensors_specs,
)
from prime_rl.utils.health import DOWN, WEIGHTS_UNKNOWN, health_state
from prime_rl.utils.net import free_port
from prime_rl.utils.secret import SECRET_VAR

EXPECTED = {"embed.weight": TensorSpec("F32", (10, 4)), "norm.weight": TensorSpec("F32", (4,))}
assert {name: spec.shape for name, spec in EXPECTED.items()} == SHAPES


def refusal(weight_dir, roots) -> WeightDirError:
    with pytest.raises(WeightDirError) as e:
        check_weight_dir(str(weight_dir), roots, EXPECTED)
    assert e.value.message
    return e.value


def status_of(weight_dir, roots) -> int:
    return refusal(weight_dir, roots).status


def test_weight_dir_checks(tmp_path):
    root = tmp_path / "run"
    good = make_dir(root / "good", SHAPES)
    assert check_weight_dir(str(good), [root], EXPECTED) == good.resolve()
    assert safetensors_shapes(good) == SHAPES and safetensors_specs(good) == EXPECTED
    outside = make_dir(tmp_path / "outside", SHAPES)
    assert status_of(outside, [root]) == 403
    assert status_of(root / "good" / ".." / ".." / "outside", [root]) == 403  # no escaping via ..
    (root / "link").symlink_to(outside)
    assert status_of(root / "link", [root]) == 403  # nor via a symlink
    assert status_of(root / "missing", [root]) == 404
    assert status_of(good / "model.safetensors", [root]) == 400
    assert status_of("relative/dir", [root]) == 400
    assert status_of(make_dir(root / "shape", {**SHAPES, "norm.weight": (5,)}), [root]) == 422
    assert status_of(make_dir(root / "extra", {**SHAPES, "other": (1,)}), [root]) == 422
    assert status_of(make_dir(root / "fewer", {"embed.weight": (10, 4)}), [root]) == 422
    (root / "empty").mkdir()
    assert status_of(root / "empty", [root]) == 422
    (root / "corrupt").mkdir()
    (root / "corrupt" / "model.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{bad}")
    assert status_of(root / "corrupt", [root]) == 422
    truncated = make_dir(root / "truncated", SHAPES)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[:-8])  # header promises more bytes than the file has
    assert status_of(truncated, [root]) == 422


def test_weight_dir_dtype_must_match_the_served_model(tmp_path):
    """Right names and shapes in int32 were loaded (by value conversion) and served as garbage."""
    root = tmp_path / "run"
    ints = refusal(make_dir(root / "int32", SHAPES, dtype=torch.int32), [root])
    assert ints.status == 422 and "I32 != F32" in ints.message
    # Other float dtypes load by value conversion, as the trainer's bf16/fp32 exports do.
    bf16 = make_dir(root / "bf16", SHAPES, dtype=torch.bfloat16)
    assert check_weight_dir(str(bf16), [root], EXPECTED) == bf16.resolve()
    int_base = {"embed.weight": TensorSpec("I64", (10, 4)), "norm.weight": TensorSpec("F32", (4,))}
    with pytest.raises(WeightDirError) as e:
        check_weight_dir(str(bf16), [root], int_base)  # a float where the model stores integers
    assert e.value.status == 422


def test_weight_dir_tensor_stored_twice_is_refused(tmp_path):
    """vLLM would load it twice, and its layerwise reload would take the layer as complete too early."""
    root = tmp_path / "run"
    twice = make_dir(root / "twice", SHAPES)
    save_file({"norm.weight": torch.zeros(4)}, str(twice / "model-extra.safetensors"))
    assert status_of(twice, [root]) == 422


def test_weight_files_must_resolve_inside_the_roots(tmp_path):
    """The directory was checked against the roots, its files were not: a directory inside them whose safetensors
    file links elsewhere was loaded. Now each file vLLM reads (the safetensors files, their index) is resolved and
    checked, unopened, and the reply does not say where it leads."""
    root = tmp_path / "run"
    elsewhere = make_dir(tmp_path / "elsewhere", SHAPES)
    linked = root / "linked"
    linked.mkdir(parents=True)
    (linked / "model.safetensors").symlink_to(elsewhere / "model.safetensors")
    e = refusal(linked, [root])
    assert e.status == 403 and "model.safetensors resolves outside the allowed roots" in e.message
    assert "elsewhere" not in e.message
    # The index vLLM reads to choose the files is a file it reads too.
    indexed = make_dir(root / "indexed", SHAPES)
    (elsewhere / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "model.safetensors"}}))
    (indexed / "model.safetensors.index.json").symlink_to(elsewhere / "model.safetensors.index.json")
    assert status_of(indexed, [root]) == 403
    # Links that stay inside the roots are fine (a hub-cache layout).
    blobs = make_dir(root / "blobs", SHAPES)
    cached = root / "snapshot"
    cached.mkdir()
    (cached / "model.safetensors").symlink_to("../blobs/model.safetensors")
    assert check_weight_dir(str(cached), [root], EXPECTED) == cached.resolve()
    assert blobs.exists()
    # A dangling link or a FIFO named like a weights file: refused, without blocking on the FIFO.
    odd = root / "odd"
    odd.mkdir()
    (odd / "model.safetensors").symlink_to(root / "missing.safetensors")
    assert "model.safetensors is not a readable file" in refusal(odd, [root]).message
    (odd / "model.safetensors").unlink()
    os.mkfifo(odd / "model.safetensors")
    assert status_of(odd, [root]) == 422
    # The served model's own directory is not checked against the roots.
    assert safetensors_specs(linked) == EXPECTED


def test_weight_dir_files_are_the_ones_vllm_loads(tmp_path):
    """vLLM globs `*.safetensors` (no dot-files) and keeps those its index names: checking other files than it loads
    let a directory of only `.hidden.safetensors` pass, after which vLLM fell back to reading `*.bin` files."""
    root = tmp_path / "run"
    hidden = root / "hidden"
    hidden.mkdir(parents=True)
    save_file({k: torch.zeros(v) for k, v in SHAPES.items()}, str(hidden / ".model.safetensors"))
    (hidden / "pytorch_model.bin").write_bytes(b"not checked")
    assert "holds no *.safetensors files" in refusal(hidden, [root]).message
    # An index: only the files it names are loaded (and checked); one it names that is missing fails vLLM's load.
    indexed = make_dir(root / "indexed", SHAPES)
    save_file({"other": torch.zeros(3)}, str(indexed / "stale.safetensors"))
    index = indexed / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {name: "model.safetensors" for name in SHAPES}}))
    assert check_weight_dir(str(indexed), [root], EXPECTED) == indexed.resolve()
    index.write_text(
        json.dumps({"weight_map": {"embed.weight": "model.safetensors", "norm.weight": "gone.safetensors"}})
    )
    assert "names files it does not hold: gone.safetensors" in refusal(indexed, [root]).message
    for bad in ("{not json", "[]", '{"weight_map": {"a": 1}}'):
        index.write_text(bad)
        assert status_of(indexed, [root]) == 422
    # Mistral's layout: vLLM loads only the consolidated file when there is one.
    mistral = make_dir(root / "mistral", SHAPES)
    save_file({k: torch.zeros(v) for k, v in SHAPES.items()}, str(mistral / "consolidated.safetensors"))
    assert check_weight_dir(str(mistral), [root], EXPECTED) == mistral.resolve()  # not "stored twice"


def test_unusable_paths_get_400_and_replies_stay_short(tmp_path):
    """These raised OSError/ValueError/RuntimeError out of the check (a 500), echoing the whole path."""
    root = tmp_path / "run"
    root.mkdir()
    long_name = refusal(root / ("a" * 300), [root])  # a component over NAME_MAX
    assert long_name.status == 400 and "File name too long" in long_name.message
    assert len(long_name.message) < 2 * ECHO_CHARS + 100
    assert status_of(str(root) + "/a" * 3000, [root]) == 400  # a path over PATH_MAX
    assert status_of(f"{root}/nul\x00byte", [root]) == 400
    (root / "loop1").symlink_to(root / "loop2")
    (root / "loop2").symlink_to(root / "loop1")
    assert status_of(root / "loop1", [root]) == 400
    huge = refusal("/elsewhere/" + "x" * 5_000_000, [root])
    assert huge.status == 403 and len(huge.message) < 2 * ECHO_CHARS + 100


def test_clip():
    assert clip("short") == "short"
    assert clip("x" * 1000) == "x" * ECHO_CHARS + "...(1000 chars)"


@pytest.mark.parametrize(
    ("raw", "empty_ok", "expected"),
    [
        (b'{"weight_dir": "/x"}', False, {"weight_dir": "/x"}),
        (b"", True, {}),
        (b"  \n", True, {}),
        (b"{}", True, {}),
        (b"", False, 400),
        (b"{not json", False, 400),
        (b"[1, 2]", False, 400),  # valid JSON, not an object
        (b'"/x"', False, 400),
        (b"null", True, 400),
        (b"5", False, 400),
        (b"[" * 100_000 + b"]" * 100_000, False, 400),  # RecursionError in the parser: was a 500
        (b'{"a": ' * 100_000 + b"1" + b"}" * 100_000, True, 400),
        (b'{"weight_dir": "\xff\xfe"}', False, 400),  # not UTF-8
        (b'{"version": ' + b"9" * 5000 + b"}", False, 400),  # over Python's int digit limit
    ],
)
def test_parse_json_object(raw, empty_ok, expected):
    if isinstance(expected, dict):
        assert parse_json_object(raw, empty_ok=empty_ok) == expected
        return
    with pytest.raises(BodyError) as e:
        parse_json_object(raw, empty_ok=empty_ok)
    assert e.value.status == expected and len(e.value.message) < 2 * ECHO_CHARS + 100


def test_admin_bodies_get_documented_4xx_with_short_replies(tmp_path):
    client, _ = admin_app(tmp_path)
    cases = [
        ("update_weights", b"", 400),  # was 422
        ("update_weights", b"[1, 2]", 400),  # was 422
        ("update_weights", b'"/x"', 400),
        ("update_weights", b"[" * 50_000, 400),  # was a 500 (RecursionError)
        ("reload_weights", b"[" * 50_000, 400),  # was a 500 (RecursionError)
        ("reload_weights", b"null", 400),
        ("reload_weights", b"[]", 400),
        ("update_weights", b"{}", 422),
        ("update_weights", b'{"weight_dir": 5}', 422),
        ("update_weights", json.dumps({"weight_dir": "/x", "v" * 100_000: 1}).encode(), 422),
        ("update_weights", json.dumps({"weight_dir": "/x", "version": "v" * 257}).encode(), 422),
        ("reload_weights", b'{"x": 1}', 422),
        ("update_weights", json.dumps({"weight_dir": "/etc/" + "x" * 500_000}).encode(), 403),  # echoed it all
        ("update_weights", json.dumps({"weight_dir": "rel/" + "x" * 500_000}).encode(), 400),  # echoed it all
        ("update_weights", json.dumps({"weight_dir": str(tmp_path / ("a" * 300))}).encode(), 400),  # was a 500
        ("update_weights", b" " * (MAX_BODY_BYTES + 1), 413),
        ("reload_weights", json.dumps({"weight_dir": "x" * 20_000_000}).encode(), 413),
    ]
    for route, content, status in cases:
        r = client.post(f"/{route}", content=content, headers={"content-type": "application/json"})
        assert r.status_code == status, (route, content[:80], r.text[:300])
        assert r.json()["error"]["code"] == status and len(r.content) < 1000, r.text[:300]


def test_streamed_body_over_the_limit_gets_413(tmp_path):
    client, _ = admin_app(tmp_path)
    chunks = (b" " * 65536 for _ in range(MAX_BODY_BYTES // 65536 + 2))  # no content-length: read until the cap
    json_type = {"content-type": "application/json"}
    assert client.post("/update_weights", content=chunks, headers=json_type).status_code == 413


def test_admin_key_is_checked_before_the_body(tmp_path):
    client, _ = admin_app(tmp_path, api_key="k")
    assert client.post("/update_weights", content=b"x" * (MAX_BODY_BYTES + 1)).status_code == 401
    assert client.post("/reload_weights", headers={"Authorization": "Bearer k"}, json={}).status_code == 200


@pytest.mark.parametrize(
    "content_type", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data"]
)
def test_admin_requests_without_a_json_content_type_get_415_and_change_nothing(tmp_path, content_type):
    """A web page can make a browser POST cross-site without asking first only with these types (a `text/plain` body
    was parsed as JSON, issue 52 finding 7): every admin route refuses them, even with an empty body, before
    anything is parsed or paused."""
    engine = FakeEngine()
    client, swapper = admin_app(tmp_path, engine)
    step = make_dir(tmp_path / "step_1", SHAPES)
    headers = {"content-type": content_type} if content_type else {}
    bodies = {
        "/update_weights": json.dumps({"weight_dir": str(step)}),
        "/reload_weights": "",
        "/load_lora_adapter": json.dumps({"lora_name": "a", "lora_path": str(step)}),
        "/unload_lora_adapter": json.dumps({"lora_name": "a"}),
    }
    for route, body in bodies.items():
        r = client.post(route, content=body.encode(), headers=headers)
        assert r.status_code == 415 and "Content-Type: application/json" in r.json()["error"]["message"], r.text
    assert engine.calls == [] and swapper.version == "base"
    r = client.post("/update_weights", content=bodies["/update_weights"], headers={"content-type": "application/json"})
    assert r.status_code == 200 and swapper.version == "step_1"  # the same body with the type is served


def test_the_access_guard_closes_every_route_but_the_public_ones(tmp_path):
    """Routes nobody listed (vLLM's /invocations, /tokenize, /metrics, ... and any route a later vLLM adds) need the
    token like ours; only /health, /ping and /version answer without it."""
    client, _ = admin_app(tmp_path, api_key="k")
    app = client.app
    for path in ("/invocations", "/tokenize", "/metrics", "/some/future/route", "/ping", "/version"):
        app.add_api_route(path, lambda: JSONResponse({"served": True}), methods=["GET", "POST"])
    for path in ("/invocations", "/tokenize", "/metrics", "/some/future/route", "/v1/completions", "/weights"):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "k"}, {"Authorization": "Basic k"}):
            r = client.post(path, headers=headers) if path != "/weights" else client.get(path, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == 401, (path, headers, r.text)
        r = (
            client.post(path, headers={"Authorization": "Bearer k"})
            if path != "/weights"
            else client.get(path, headers={"Authorization": "Bearer k"})
        )
        assert r.status_code == 200, (path, r.text)
    for path in ("/health", "/ping", "/version"):
        assert client.get(path).status_code == 200, path
    with pytest.raises(WebSocketDisconnect) as closed:  # a websocket without the token is closed before it opens
        with client.websocket_connect("/v1/realtime"):
            pass
    assert closed.value.code == 1008


def test_the_server_token_is_its_api_key_else_a_key_derived_from_the_run_secret_never_the_secret(monkeypatch):
    """A sniffed or handed-out `Authorization` header must not be the master key (issue 52, finding 2)."""
    from argparse import Namespace

    from prime_rl.utils.secret import HTTP_PURPOSE, derive, forget_keys

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.delenv(SECRET_VAR, raising=False)
    assert server_tokens(Namespace(api_key=None)) == []
    secret = "5a" * 32
    monkeypatch.setenv(SECRET_VAR, secret)
    forget_keys()
    (token,) = server_tokens(Namespace(api_key=None))
    assert token == derive(secret, HTTP_PURPOSE).hex() and secret not in token
    assert server_tokens(Namespace(api_key=["k1", "k2"])) == ["k1", "k2"]  # the API key wins: one rule
    monkeypatch.setenv(SECRET_VAR, "s" * 32)  # 128 bits' length, but no hex: refused, the format named
    forget_keys()
    with pytest.raises(ValueError, match="hexadecimal, at least 32 digits"):
        server_tokens(Namespace(api_key=None))


@pytest.mark.parametrize(
    ("host", "tokens", "allowed", "refused"),
    [
        ("127.0.0.1", [], False, False),
        ("localhost", [], False, False),
        ("::1", [], False, False),
        ("0.0.0.0", [], False, True),
        ("", [], False, True),  # vLLM's default: every interface
        ("10.1.2.3", [], False, True),
        ("my-host", [], False, True),
        ("0.0.0.0", ["k"], False, False),
        ("0.0.0.0", [], True, False),  # said explicitly
    ],
)
def test_a_server_beyond_loopback_refuses_to_start_without_a_token_unless_told(host, tokens, allowed, refused):
    problem = open_access_problem(host, tokens, allowed)
    assert (problem is not None) == refused
    if refused:
        assert "--server.allow-unauthenticated" in problem and "PRIME_RL_SECRET" in problem
        assert "--server.api-key" not in problem  # a key on a command line is visible to every user (`ps`)


def test_a_directory_name_that_is_no_valid_version_label_needs_an_explicit_one(tmp_path):
    """The label of a swap is written to the log and echoed per token: a newline in it forged a log line."""
    engine = FakeEngine()
    client, swapper = admin_app(tmp_path, engine)
    odd = make_dir(tmp_path / "step 1\nINFO forged", SHAPES)
    r = client.post("/update_weights", json={"weight_dir": str(odd)})
    assert r.status_code == 422 and 'give a "version"' in r.json()["error"]["message"], r.text
    assert engine.calls == []
    r = client.post("/update_weights", json={"weight_dir": str(odd), "version": "step_1"})
    assert r.status_code == 200 and swapper.version == "step_1"


def test_failed_restore_makes_the_server_unhealthy_until_a_load_succeeds(tmp_path):
    base_ok = tmp_path / "base"
    engine = FakeEngine()
    client, swapper = admin_app(tmp_path, engine)
    good = make_dir(tmp_path / "good", SHAPES)
    bad = make_dir(tmp_path / "bad", SHAPES)
    assert client.post("/update_weights", json={"weight_dir": str(good)}).json()["version"] == "good"

    # The load fails, the restore works: 500, same weights and label, still healthy.
    engine.failing = {str(bad)}
    r = client.post("/update_weights", json={"weight_dir": str(bad)})
    assert r.status_code == 500 and "still serving good" in r.json()["error"]["message"]
    assert engine.calls[-2:] == [("prime_load_weights", str(good)), ("version", "good")]
    assert client.get("/health").status_code == 200 and not engine.paused

    # The load fails and so does the restore: 503 everywhere but the admin routes, generation stays paused.
    engine.failing = {str(bad), str(good)}
    r = client.post("/update_weights", json={"weight_dir": str(bad)})
    assert r.status_code == 503, r.text
    health = client.get("/health")  # public: it says only that it does not serve
    assert health.status_code == 503 and health.json() == {"error": {"message": "not serving", "code": 503}}
    assert str(tmp_path) not in health.text and "restoring" not in health.text  # no path, no exception text
    weights = client.get("/weights")  # the reason is for the token's holders
    assert weights.status_code == 200 and "restoring good" in weights.json()["unknown"] and str(good) in weights.text
    assert health_state(health, weights) == WEIGHTS_UNKNOWN and health_state(health) == DOWN
    assert client.post("/v1/completions").status_code == 503 and engine.paused
    # The engine's label says so too: a token generated now would not be credited to the good weights.
    assert engine.calls[-2:] == [("prime_load_weights", str(good)), ("version", "weights_unknown")]
    # A failure while unknown restores nothing (there are no good weights to go back to).
    calls = len(engine.calls)
    assert client.post("/update_weights", json={"weight_dir": str(bad)}).status_code == 503
    assert engine.calls[calls:] == [("prime_load_weights", str(bad)), ("version", "weights_unknown")]

    # A successful load heals: new weights, their label, generation resumed.
    r = client.post("/reload_weights", json={})
    assert r.status_code == 200 and r.json()["version"] == "base"
    assert engine.calls[-2:] == [("prime_load_weights", str(base_ok)), ("version", "base")]
    assert client.get("/weights").json()["unknown"] is None
    assert client.get("/health").status_code == 200 and client.post("/v1/completions").json() == {"ok": 1}
    assert not engine.paused and swapper.unknown is None


BROADCAST = {"session": "ab" * 16, "group": "cd" * 16, "rank": 1, "world_size": 2}


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"weight_dir": "/x", "broadcast": BROADCAST}, "exactly one of weight_dir and broadcast"),
        ({"broadcast": {**BROADCAST, "session": "../x"}}, "broadcast.session"),
        ({"broadcast": {**BROADCAST, "group": "AB" * 16}}, "broadcast.group"),
        ({"broadcast": {**BROADCAST, "rank": 0}}, "broadcast.rank"),  # rank 0 is the trainer's
        ({"broadcast": {**BROADCAST, "rank": 10**30, "world_size": 10**30}}, "broadcast.rank"),  # was a 500
        ({"broadcast": {**BROADCAST, "world_size": 2**62}}, "broadcast.world_size"),
        ({"broadcast": {**BROADCAST, "rank": "1"}}, "broadcast.rank"),
        # An address, a backend or a timeout is the server's own configuration, never the caller's: one admin call
        # made the server open connections to any address (a port scanner).
        ({"broadcast": {**BROADCAST, "host": "10.0.0.1", "port": 22}}, "broadcast.host"),
        ({"broadcast": {**BROADCAST, "backend": "gloo"}}, "broadcast.backend"),
        ({"broadcast": {**BROADCAST, "timeout": 5}}, "broadcast.timeout"),
        ({"broadcast": BROADCAST, "version": "step_1\nINFO fake log line"}, "version"),
        ({"broadcast": BROADCAST, "version": "x" * 129}, "version"),
    ],
)
def test_bad_broadcast_requests_get_422_and_touch_nothing(tmp_path, trainer_store, body, needle):
    engine = FakeEngine()
    client, swapper = admin_app(tmp_path, engine, broadcast=trainer_store.settings)
    r = client.post("/update_weights", json=body)
    assert r.status_code == 422 and needle in r.json()["error"]["message"], r.text
    assert engine.calls == [] and swapper.version == "base" and not engine.paused


def test_a_broadcast_checks_the_server_setup_the_ranks_and_the_trainer_session_before_anything(tmp_path, trainer_store):
    """Nothing reaches the engine (no pause, no worker call) for a request that cannot succeed: 409 on a server not
    set up for broadcasts or for another trainer's session, 422 for ranks beyond world_size, 502 when the trainer's
    store does not answer or does not hold our run secret."""
    engine = FakeEngine()
    spec = {**BROADCAST, "session": trainer_store.session}
    client, _ = admin_app(tmp_path / "a", engine)  # no weight_broadcast settings
    r = client.post("/update_weights", json={"broadcast": spec})
    assert r.status_code == 409 and "receives no weight broadcasts" in r.json()["error"]["message"]
    client, _ = admin_app(tmp_path / "b", engine, broadcast=trainer_store.settings)
    r = client.post("/update_weights", json={"broadcast": {**spec, "rank": 2}})
    assert r.status_code == 422 and "ranks 2..2 of this server's 1 worker(s) exceed world_size" in r.text
    r = client.post("/update_weights", json={"broadcast": {**spec, "session": "ef" * 16}})
    assert r.status_code == 409 and "stale" in r.json()["error"]["message"]
    closed = {**trainer_store.settings, "port": free_port()}
    client, _ = admin_app(tmp_path / "c", engine, broadcast=closed)
    r = client.post("/update_weights", json={"broadcast": spec})
    assert r.status_code == 502 and "did not answer" in r.json()["error"]["message"]
    another_key = {**trainer_store.settings, "key": bytes(32).hex()}  # a server given another run's store key
    client, _ = admin_app(tmp_path / "d", engine, broadcast=another_key)
    r = client.post("/update_weights", json={"broadcast": spec})
    assert r.status_code == 502 and "refused our run secret" in r.json()["error"]["message"]
    assert engine.calls == [] and not engine.paused


def test_broadcast_state_machine_labels_refuses_and_cannot_restore_what_came_by_broadcast(tmp_path, trainer_store):
    engine = FakeEngine()
    client, swapper = admin_app(tmp_path, engine, broadcast=trainer_store.settings)
    base = {"version": "base", "source": str(swapper.base_dir), "workers": 1, "adapters": {}, "unknown": None}
    assert client.get("/weights").json() == base
    spec = {**BROADCAST, "session": trainer_store.session}

    # Received: labelled with the header's step, its source is the broadcast; joined unpaused, loaded paused.
    engine.receive = {"step": 3}
    r = client.post("/update_weights", json={"broadcast": spec})
    assert r.status_code == 200 and r.json()["version"] == "step_3" and r.json()["step"] == 3, r.text
    assert client.get("/weights").json() == {**base, "version": "step_3", "source": "broadcast"}
    assert [c[0] for c in engine.calls[-3:]] == ["prime_broadcast_join", "prime_broadcast_load", "version"]

    # Refused (a header that does not fit) or failed before any weight changed: nothing paused, still step_3.
    calls = len(engine.calls)
    engine.receive = {"refused": "the broadcast lacks tensors of the served model: x"}
    r = client.post("/update_weights", json={"broadcast": {**spec, "group": "12" * 16}})
    assert r.status_code == 422 and "lacks tensors" in r.json()["error"]["message"]
    engine.receive = {"not_started": "TimeoutError: a member never joined"}
    r = client.post("/update_weights", json={"broadcast": {**spec, "group": "34" * 16}})
    assert r.status_code == 502 and "before any weight changed" in r.json()["error"]["message"]
    assert "still serving step_3" in r.json()["error"]["message"]
    assert [c[0] for c in engine.calls[calls:]] == ["prime_broadcast_join"] * 2  # no load, no restore
    assert client.get("/health").status_code == 200 and not engine.paused

    # Failed mid-transfer: step_3 came by broadcast and cannot be read again, so nothing is served until a load.
    engine.receive, engine.load_error = {"step": 4}, RuntimeError("Connection reset by peer")
    r = client.post("/update_weights", json={"broadcast": {**spec, "group": "56" * 16}})
    assert r.status_code == 503 and "came by broadcast and cannot be read again" in r.json()["error"]["message"]
    assert client.get("/health").status_code == 503 and engine.paused
    assert client.get("/weights").json()["source"] is None
    assert "came by broadcast" in client.get("/weights").json()["unknown"]
    assert client.post("/reload_weights", json={}).status_code == 200 and not engine.paused


def test_weights_unknown_gate_ignores_lifespan_and_missing_state():
    async def app(scope, receive, send):
        pass

    asyncio.run(WeightsUnknownGate(app)({"type": "lifespan"}, None, None))  # no app, no state: passes through


GENERATE_BODY = {
    "choices": [
        {
            "token_ids": [7, 9],
            "weight_versions": [{"version": "base", "start": 0, "end": 2}],
            "logprobs": {
                "content": [
                    {"token_id": 7, "logprob": -0.5, "top_logprobs": [{"token_id": 7, "logprob": -0.5}]},
                    {"token_id": 9, "logprob": -1.5, "top_logprobs": []},
                ]
            },
        }
    ]
}


def expected_entries():
    return [
        {"token_id": 7, "logprob": -0.5, "token": "token_id:7", "top_logprobs": [
            {"token_id": 7, "logprob": -0.5, "token": "token_id:7"}]},
        {"token_id": 9, "logprob": -1.5, "token": "token_id:9", "top_logprobs": []},
    ]  # fmt: skip


def app_with(response_factory) -> TestClient:
    app = FastAPI()
    app.add_api_route(GENERATE_PATH, response_factory, methods=["POST"])
    app.add_api_route("/other", response_factory, methods=["POST"])
    app.add_middleware(GenerateLogprobTokens)
    return TestClient(app)


def test_generate_json_response_gets_token_strings():
    client = app_with(lambda: JSONResponse(GENERATE_BODY))
    data = client.post(GENERATE_PATH).json()
    assert data["choices"][0]["logprobs"]["content"] == expected_entries()
    assert data["choices"][0]["weight_versions"] == GENERATE_BODY["choices"][0]["weight_versions"]
    assert client.post("/other").json() == GENERATE_BODY  # other routes untouched


def test_generate_sse_response_gets_token_strings_across_chunk_boundaries():
    event = b"data: " + json.dumps(GENERATE_BODY).encode() + b"\n\n"
    stream = event + event + b"data: [DONE]\n\n"
    chunks = [stream[i : i + 17] for i in range(0, len(stream), 17)]  # events split mid-JSON

    def respond():
        return StreamingResponse(iter(chunks), media_type="text/event-stream")

    text = app_with(respond).post(GENERATE_PATH).text
    events = [e for e in text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and len(events) == 3
    for e in events[:2]:
        assert json.loads(e[6:])["choices"][0]["logprobs"]["content"] == expected_entries()


def test_rewrite_sse_keeps_incomplete_tail():
    done, rest = rewrite_sse(b'data: {"choices": []}\n\ndata: {"cho')
    assert done == b'data: {"choices": []}\n\n' and rest == b'data: {"cho'


def test_vllm_args_carry_our_fields_and_the_rl_essentials(tmp_path):
    cfg = InferenceConfig(
        model={"name": "m", "max_model_len": 256, "enforce_eager": True},
        server={"port": 1234, "api_key": "k"},
        parallel={"tp": 2},
        lora={},
        output_dir=tmp_path,
    )
    args = cfg.vllm_args()
    pairs = dict(zip(args, args[1:], strict=False))
    assert pairs["--model"] == "m" and pairs["--served-model-name"] == "m" and pairs["--port"] == "1234"
    assert pairs["--max-model-len"] == "256" and pairs["--tensor-parallel-size"] == "2" and pairs["--api-key"] == "k"
    assert pairs["--logprobs-mode"] == "processed_logprobs" and "--enable-scale-out" in args
    assert pairs["--worker-extension-cls"] == "prime_rl.inference.worker.WeightSwapExtension"
    assert "--enforce-eager" in args and "--enable-lora" in args and pairs["--max-lora-rank"] == "16"
    assert pairs["--api-server-count"] == "1"  # adapter names live in the API server process: one of them
    assert cfg.weight_roots == [tmp_path]


def test_logging_writes_each_library_line_once(tmp_path, capfd):
    from loguru import logger

    from prime_rl.utils.logging import setup_logging

    lib = logging.getLogger("vllm.fake")
    logging.getLogger("vllm").addHandler(logging.StreamHandler())  # what vLLM does at import
    log_file = setup_logging("unit", "info", tmp_path / "logs")
    lib.warning("library says hi")
    logger.info("we say hi")
    warnings.warn("deprecated thing", DeprecationWarning, stacklevel=1)
    logger.debug("not shown at info")
    text = log_file.read_text()
    assert text.count("library says hi") == 1 and text.count("we say hi") == 1
    assert "deprecated thing" in text and "not shown at info" not in text
    assert capfd.readouterr().err.count("library says hi") == 1
    assert log_file == tmp_path / "logs" / "unit.log" and os.path.getsize(log_file) > 0


def test_inference_refuses_a_port_another_server_holds(tmp_path):
    """vLLM binds with SO_REUSEPORT when it runs several API processes, so a second server on the same port would
    silently share connections with the first; `inference` must stop before loading anything."""
    import socket
    import subprocess
    import sys

    from prime_rl.utils.net import port_in_use

    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # as vLLM's own socket
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        assert port_in_use("127.0.0.1", port)
        entry = "from prime_rl.inference.server import main; main()"
        args = [sys.executable, "-c", entry, "--model.name", str(tmp_path), "--server.port", str(port)]
        args += ["--output-dir", str(tmp_path / "out")]
        done = subprocess.run(args, capture_output=True, text=True, timeout=120)
        assert done.returncode == 1
        assert f"port {port} on 127.0.0.1 is already in use" in done.stderr
        assert not (tmp_path / "out" / "logs").exists()  # stopped before logging, vLLM or the engine
    finally:
        holder.close()
    assert not port_in_use("127.0.0.1", port)


def test_the_api_key_never_reaches_the_log():
    from prime_rl.inference.server import masked

    args = InferenceConfig(server={"api_key": "s3cret"}).vllm_args() + ["--api-key=other", "--seed", "1"]
    assert "s3cret" in args  # vLLM gets it in-process (not on a command line)
    shown = " ".join(masked(args))
    assert "s3cret" not in shown and "other" not in shown and "--api-key ***" in shown and "--seed 1" in shown


def test_successful_sampling_requests_leave_no_access_line_and_everything_else_does():
    from prime_rl.inference.server import QuietSampling

    lines = []
    access = logging.Logger("uvicorn.access", logging.INFO)  # a fresh one, outside the logging tree
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    access.addHandler(handler)
    access.addFilter(QuietSampling())
    requests = [  # as uvicorn logs them: client, method, path with query, HTTP version, status
        ("POST", "/inference/v1/generate", 200),
        ("POST", "/v1/chat/completions?x=1", 200),
        ("GET", "/v1/models", 200),
        ("POST", "/inference/v1/generate", 401),
        ("POST", "/v1/chat/completions", 400),
        ("POST", "/v1/completions", 500),
        ("POST", "/update_weights", 200),
        ("GET", "/health", 200),
    ]
    for method, path, status in requests:
        access.info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:5", method, path, "1.1", status)
    access.info("a line of another shape")
    assert lines == [
        '127.0.0.1:5 - "POST /inference/v1/generate HTTP/1.1" 401',
        '127.0.0.1:5 - "POST /v1/chat/completions HTTP/1.1" 400',
        '127.0.0.1:5 - "POST /v1/completions HTTP/1.1" 500',
        '127.0.0.1:5 - "POST /update_weights HTTP/1.1" 200',
        '127.0.0.1:5 - "GET /health HTTP/1.1" 200',
        "a line of another shape",
    ]


def test_token_mode_requests_without_stop_strings_skip_detokenizing_and_the_plugin_installs_it():
    """vLLM detokenizes every sampled and logprob token of a generate request unless told not to, though a
    token-mode reply carries no text; stop strings need the text, and text mode returns it."""
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest
    from vllm.entrypoints.scale_out.token_in_token_out.serving import ServingTokens

    from prime_rl.inference.plugin import PrimeRLEndpoints
    from prime_rl.inference.tokens_mode import skip_detokenizing

    def detokenizes(body: dict) -> bool:
        request = GenerateRequest.model_validate({"model": "m", "token_ids": [1, 2], **body})
        skip_detokenizing(request)
        return request.sampling_params.detokenize

    params = {"max_tokens": 4, "logprobs": 1, "stop_token_ids": [3]}  # what the verifiers train client sends
    assert not detokenizes({"sampling_params": params})
    assert detokenizes({"sampling_params": {**params, "stop": ["</answer>"]}})
    assert detokenizes({"sampling_params": {**params, "stop": "x"}})
    assert detokenizes({"sampling_params": params, "output_mode": "text"})

    original = ServingTokens.serve_tokens
    try:
        PrimeRLEndpoints().attach_router(FastAPI())
        PrimeRLEndpoints().attach_router(FastAPI())  # a second app wraps nothing twice
        assert ServingTokens.serve_tokens.__wrapped__ is original
    finally:
        ServingTokens.serve_tokens = original
