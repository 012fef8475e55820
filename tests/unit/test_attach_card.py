"""The card of an attachable server and the checks of attaching to it (`inference/attach.py`), without a server: the
card round trip and its privacy, a dead or foreign card, each mismatch a run can have with the server, the weight
roots and the attachment lock."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from prime_rl.inference.attach import (
    AttachError,
    card_path,
    hold,
    mismatches,
    outside_roots,
    read_card,
    remove_card,
    tokenizer_fingerprint,
    write_card,
)
from prime_rl.inference.config import InferenceConfig
from prime_rl.utils.secret import RunKeys

PORT = 18123


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.fixture
def model_dir(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "tokenizer.json").write_text('{"vocab": 1}')
    (model / "chat_template.jinja").write_text("{{ messages }}")
    return model


def served(model_dir, tmp_path, **extra) -> InferenceConfig:
    return InferenceConfig(
        model={"name": str(model_dir), "dtype": "float32", "max_model_len": 512},
        server={"port": PORT, "attachable": True},
        weight_broadcast={"type": "gloo", "port": 29999},
        allowed_weight_roots=[tmp_path / "runs"],
        **extra,
    )


def test_the_card_round_trips_privately_and_goes_with_its_server(model_dir, tmp_path):
    keys = RunKeys(b"\x01" * 32, "token-1")
    path = write_card(served(model_dir, tmp_path), keys)
    assert path == card_path("127.0.0.1", PORT) and oct(path.stat().st_mode & 0o777) == "0o600"
    assert oct(path.parent.stat().st_mode & 0o777) == "0o700"
    card = read_card("127.0.0.1", PORT)
    assert (card.pid, card.url, card.model, card.dtype, card.max_model_len) == (
        os.getpid(),
        f"http://127.0.0.1:{PORT}",
        str(model_dir),
        "float32",
        512,
    )
    assert card.keys == keys and card.weight_broadcast == {"type": "gloo", "host": "127.0.0.1", "port": 29999}
    assert card.weight_roots == [str((tmp_path / "runs").resolve())] and card.max_lora_rank is None
    path.with_suffix(".lock").touch()  # what an attached run left
    remove_card(path)
    assert not path.exists() and not path.with_suffix(".lock").exists()


def test_a_filesystem_server_keeps_no_store_key_on_its_card(model_dir, tmp_path):
    config = served(model_dir, tmp_path).model_copy(update={"weight_broadcast": {"type": "filesystem"}})
    config = InferenceConfig.model_validate(config.model_dump())
    write_card(config, RunKeys(b"\x02" * 32, "token-2"))
    assert read_card("127.0.0.1", PORT).keys == RunKeys(None, "token-2")


def test_no_card_a_dead_server_and_a_readable_card_are_refused(model_dir, tmp_path):
    with pytest.raises(AttachError, match=f"no attachable server on port {PORT} .*--server.attachable"):
        read_card("127.0.0.1", PORT)
    path = write_card(served(model_dir, tmp_path), RunKeys(None, "t"))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    data = json.loads(path.read_text()) | {"pid": int(dead.stdout)}  # a pid that has exited
    path.write_text(json.dumps(data))
    with pytest.raises(AttachError, match=f"\\(pid {int(dead.stdout)}\\) is gone"):
        read_card("127.0.0.1", PORT)
    remove_card(path)  # not its pid any more: a newer server's card stays
    assert path.exists()
    path.chmod(0o644)
    with pytest.raises(AttachError, match="is not private to this user"):
        read_card("127.0.0.1", PORT)


def test_each_mismatch_between_run_and_server_is_named(model_dir, tmp_path):
    write_card(served(model_dir, tmp_path, lora={"max_lora_rank": 8}), RunKeys(None, "t"))
    card = read_card("127.0.0.1", PORT)
    assert mismatches(card, str(model_dir), "float32", 256, 8) == []  # a shorter context and a small adapter fit
    assert mismatches(card, str(model_dir) + "/", "float32", None, None) == []  # the same directory spelt otherwise
    other = tmp_path / "other"
    other.mkdir()
    assert mismatches(card, str(other), "float32", None, None) == [
        f"the server serves {str(model_dir)!r}, this run's model is {str(other)!r}"
    ]
    (model_dir / "chat_template.jinja").write_text("{{ messages | other }}")  # the same model, another template
    assert mismatches(card, str(model_dir), "float32", None, None) == [
        f"{str(model_dir)!r} tokenizes differently now than when the server loaded it (its tokenizer files)"
    ]
    (model_dir / "chat_template.jinja").write_text("{{ messages }}")
    assert mismatches(card, str(model_dir), "bfloat16", 1024, 16) == [
        "the server computes in float32, this run asks for bfloat16 (inference.model.dtype)",
        "the server's max_model_len is 512, this run needs 1024",
        "the server serves adapters up to rank 8, this run trains a rank-16 adapter",
    ]


def test_tokenizer_fingerprints_tell_files_apart_and_keep_hub_names(model_dir):
    first = tokenizer_fingerprint(str(model_dir))
    assert tokenizer_fingerprint(str(model_dir)) == first and len(first) == 64
    (model_dir / "tokenizer.json").write_text('{"vocab": 2}')
    assert tokenizer_fingerprint(str(model_dir)) != first
    assert tokenizer_fingerprint("Qwen/Qwen3-0.6B") == "name:Qwen/Qwen3-0.6B"


def test_weight_roots_and_the_attachment_lock(model_dir, tmp_path):
    write_card(served(model_dir, tmp_path), RunKeys(None, "t"))
    card = read_card("127.0.0.1", PORT)
    assert outside_roots(card, [tmp_path / "runs" / "a", tmp_path / "elsewhere"]) == [tmp_path / "elsewhere"]
    lock = hold(card, "127.0.0.1", PORT)
    other = subprocess.run(
        [sys.executable, "-c", f"from prime_rl.inference.attach import *; hold(read_card('127.0.0.1', {PORT}), "
         f"'127.0.0.1', {PORT})"],
        capture_output=True, text=True, env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")},
    )  # fmt: skip
    assert other.returncode == 1 and f"another run is attached to the server on port {PORT}" in other.stderr
    lock.close()
    hold(card, "127.0.0.1", PORT).close()  # free again once the holder let go


def test_rl_attach_without_a_server_or_an_inference_section_is_refused_before_anything_starts(model_dir, tmp_path):
    config = tmp_path / "rl.toml"
    config.write_text(f'output_dir = "{tmp_path / "out"}"\n[model]\nname = "{model_dir}"\n')
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    rl = [os.path.join(os.path.dirname(sys.executable), "rl"), "@", str(config), "--attach"]
    done = subprocess.run(rl, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2 and "--attach needs the `[inference]` section" in done.stderr, done.stderr
    config.write_text(config.read_text() + f"[inference.server]\nport = {PORT}\n")
    done = subprocess.run(rl, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2 and f"no attachable server on port {PORT}" in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()  # nothing started, nothing written


def test_a_run_keeps_the_filesystem_or_takes_the_servers_in_memory_store(model_dir, tmp_path):
    from types import SimpleNamespace

    from prime_rl.config import WeightBroadcastConfig
    from prime_rl.rl.attach import broadcast_flags

    write_card(served(model_dir, tmp_path), RunKeys(b"\x03" * 32, "t"))
    gloo = read_card("127.0.0.1", PORT)

    def run(broadcast_type: str | None):
        given = None if broadcast_type is None else WeightBroadcastConfig(type=broadcast_type, port=1234)
        return SimpleNamespace(weight_broadcast=given)

    store = ["--weight-broadcast.type=gloo", "--weight-broadcast.host=127.0.0.1", "--weight-broadcast.port=29999"]
    assert broadcast_flags(run(None), gloo) == store  # unsaid: the server's store
    assert broadcast_flags(run("gloo"), gloo) == store  # its port, not the run's
    assert broadcast_flags(run("filesystem"), gloo) == []  # the server also loads directories under its roots
    with pytest.raises(SystemExit) as refused:
        broadcast_flags(run("nccl"), gloo)
    assert refused.value.code == 2
    files = dataclasses.replace(gloo, weight_broadcast={"type": "filesystem"})
    assert broadcast_flags(run(None), files) == ["--weight-broadcast.type", "filesystem"]
    with pytest.raises(SystemExit):
        broadcast_flags(run("gloo"), files)


def test_claim_checks_everything_before_it_takes_the_lock(model_dir, tmp_path):
    from prime_rl.inference.attach import claim

    config = served(model_dir, tmp_path)
    write_card(config, RunKeys(None, "t"))
    with pytest.raises(AttachError, match=f"may load weights only under .*, not from {tmp_path / 'elsewhere'}"):
        claim(config.server, config.model, None, [tmp_path / "elsewhere"])
    card, lock = claim(config.server, config.model, None, [tmp_path / "runs" / "a"])  # not locked by the refusal
    assert card.model == str(model_dir)
    with pytest.raises(AttachError, match="another run is attached"):
        claim(config.server, config.model, None, [])
    lock.close()
