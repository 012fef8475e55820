"""Tokenizers loaded without transformers' modeling stack: the same tokenizer `AutoTokenizer` gives, by the generic
class where the directory names it, and `AutoTokenizer` itself otherwise."""

import json
import shutil
import subprocess
import sys

import pytest
from conftest import run_at_once
from transformers import AutoTokenizer

from prime_rl.models.tiny import TinyModelConfig, build_tiny_model
from prime_rl.models.tokenizers import is_generic_tokenizer_dir, load_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(TinyModelConfig(output=tmp_path_factory.mktemp("m") / "tiny", dtype="float32"))


def with_config(source, target, **changes):
    shutil.copytree(source, target)
    path = target / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))
    return target


def test_a_generic_tokenizer_loads_as_auto_tokenizer_would(model_dir):
    assert is_generic_tokenizer_dir(str(model_dir))
    light, auto = load_tokenizer(str(model_dir), trust_remote_code=False), AutoTokenizer.from_pretrained(model_dir)
    assert type(light) is type(auto)
    messages = [{"role": "system", "content": "Reverse."}, {"role": "user", "content": "ABC déf"}]
    assert light.apply_chat_template(messages, add_generation_prompt=True) == auto.apply_chat_template(
        messages, add_generation_prompt=True
    )
    assert light("hello, world")["input_ids"] == auto("hello, world")["input_ids"]
    assert (light.eos_token_id, light.pad_token_id) == (auto.eos_token_id, auto.pad_token_id)


def test_anything_else_goes_through_auto_tokenizer(model_dir, tmp_path):
    named = with_config(model_dir, tmp_path / "named", tokenizer_class="Qwen2Tokenizer")
    assert not is_generic_tokenizer_dir(str(named))
    assert type(load_tokenizer(str(named))).__name__ == "Qwen2Tokenizer"  # AutoTokenizer's pick for that name
    assert not is_generic_tokenizer_dir(str(with_config(model_dir, tmp_path / "remote", auto_map={"x": "y"})))
    no_json = with_config(model_dir, tmp_path / "no-json")
    (no_json / "tokenizer.json").unlink()
    assert not is_generic_tokenizer_dir(str(no_json))
    assert not is_generic_tokenizer_dir("Qwen/Qwen3-0.6B")  # a hub id
    # a caller's own loader (renderers', with its fallbacks) takes the others, with their arguments, and only them
    calls = []
    fallback = lambda name, **kwargs: calls.append((name, kwargs)) or "theirs"  # noqa: E731
    assert load_tokenizer(str(named), fallback=fallback, revision="r") == "theirs"
    assert type(load_tokenizer(str(model_dir), fallback=fallback)).__name__ == "TokenizersBackend"
    assert calls == [(str(named), {"revision": "r"})]


def test_renderers_load_it_without_the_modeling_imports(model_dir):
    """What the orchestrator saves: renderers' tokenizer loading, patched, leaves torch._dynamo (and with it ~120
    MiB) out of the process; unpatched, it imports it (the control)."""
    probe = (
        "import sys, renderers.base as rb\n"
        "from prime_rl.orchestrator.patches import load_tokenizers_lightly\n"
        "if sys.argv[2] == 'patched': load_tokenizers_lightly()\n"
        "tokenizer = rb.load_tokenizer(sys.argv[1])\n"
        "print(type(tokenizer).__name__, 'torch._dynamo' in sys.modules)\n"
    )
    modes = (("patched", "False"), ("plain", "True"))
    # Both at once: each spends seconds importing renderers and transformers on one core.
    done = run_at_once([[sys.executable, "-c", probe, str(model_dir), mode] for mode, _ in modes], timeout=120)
    for (mode, imported), proc in zip(modes, done, strict=True):
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split() == ["TokenizersBackend", imported], mode


def test_the_orchestrator_imports_no_torch():
    """The orchestrator never runs a model: importing it with torch made unimportable must work (torch would add
    ~0.5 GiB to its process: advantages are NumPy, the weight-broadcast client and protocol carry no torch)."""
    probe = "import sys; sys.modules['torch'] = None; import prime_rl.orchestrator.orchestrator"
    subprocess.run([sys.executable, "-c", probe], check=True, timeout=120)
