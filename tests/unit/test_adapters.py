"""LoRA adapters on the server without an engine: the adapter-directory checks, and the load/unload routes' state
machine and replies (the real engine: tests/integration/test_inference_server.py)."""

import asyncio
import json
import os

import pytest
import torch
from fake_engine import BASE_NAME, LORA_SHAPES, FakeEngine, admin_app, lora_tensors, write_adapter

from prime_rl.inference import weights
from prime_rl.inference.adapter_checks import CONFIG_KEYS, check_adapter_dir
from prime_rl.inference.http_io import MAX_BODY_BYTES
from prime_rl.inference.weights import TensorSpec, WeightDirError

BASE = {name: TensorSpec("BF16", shape) for name, shape in LORA_SHAPES.items()}
MODULES = {"q_proj", "o_proj"}


def refusal(path, roots, modules=MODULES) -> WeightDirError:
    with pytest.raises(WeightDirError) as e:
        check_adapter_dir(str(path), roots, BASE, 8, modules)
    assert e.value.message and len(e.value.message) < 1000
    return e.value


def test_adapter_dir_checks(tmp_path):
    root = tmp_path / "run"
    both = {**lora_tensors(), **lora_tensors("layers.0.o_proj", out=4, inner=6)}
    good = write_adapter(root / "good", both)
    assert check_adapter_dir(str(good), [root], BASE, 8, MODULES) == good.resolve()
    assert check_adapter_dir(str(good), [root], BASE, 8, None) == good.resolve()  # layer names unknown: not checked

    # The path: the same rules as a weight directory.
    outside = write_adapter(tmp_path / "outside", lora_tensors())
    assert refusal(outside, [root]).status == 403
    assert refusal(root / "missing", [root]).status == 404
    assert refusal(good / "adapter_config.json", [root]).status == 400
    assert refusal("relative/x", [root]).status == 400

    cases = {  # what a 422 must name
        "rank 16 exceeds this server's max_lora_rank 8": write_adapter(root / "r16", lora_tensors(rank=16), rank=16),
        "rank 9 exceeds": write_adapter(root / "pattern", lora_tensors(), rank_pattern={"q_proj": 9}),
        "has no layer layers.5.q_proj": write_adapter(root / "lacks", lora_tensors("layers.5.q_proj")),
        "lora_A (2, 5), lora_B (6, 2) do not fit its weight [6, 4]": write_adapter(
            root / "shape", lora_tensors(inner=5)
        ),
        "lora_A and lora_B must both be given": write_adapter(
            root / "half", {k: v for k, v in lora_tensors().items() if "lora_A" in k}
        ),
        "rank 4 (adapter_config r 2": write_adapter(root / "rank_mismatch", lora_tensors(rank=4), rank=2),
        "not `base_model.model.<layer>.lora_A/lora_B.weight`": write_adapter(
            root / "bias_tensor", {**lora_tensors(), "base_model.model.layers.0.q_proj.lora_B.bias": torch.zeros(6)}
        ),
        "are not floats": write_adapter(root / "ints", {k: v.to(torch.int32) for k, v in lora_tensors().items()}),
        "peft_type as a string (vLLM takes 'LORA')": write_adapter(root / "ia3", lora_tensors(), peft_type="IA3"),
        "use_dora as a boolean (vLLM takes false or unset, as it does not support DoRA)": write_adapter(
            root / "dora", lora_tensors(), use_dora=True
        ),
        "bias as a string (vLLM takes 'none')": write_adapter(root / "bias", lora_tensors(), bias="all"),
    }
    for needle, path in cases.items():
        e = refusal(path, [root])
        assert e.status == 422 and needle in e.message, (needle, e.message)
    # A linear layer the model has but vLLM does not apply LoRA to (here: o_proj left out of the modules).
    e = refusal(good, [root], modules={"q_proj"})
    assert e.status == 422 and "applies LoRA only to q_proj" in e.message and "layers.0.o_proj" in e.message
    # Missing or broken files.
    (root / "no_config").mkdir()
    assert "has no adapter_config.json" in refusal(root / "no_config", [root]).message
    no_weights = write_adapter(root / "no_weights", lora_tensors())
    (no_weights / "adapter_model.safetensors").unlink()
    assert "has no adapter_model.safetensors" in refusal(no_weights, [root]).message
    bad_json = write_adapter(root / "bad_json", lora_tensors())
    (bad_json / "adapter_config.json").write_text("{not json")
    assert "not readable JSON" in refusal(bad_json, [root]).message
    corrupt = write_adapter(root / "corrupt", lora_tensors())
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{bad}")
    assert "not a readable safetensors file" in refusal(corrupt, [root]).message
    for status in [refusal(p, [root]).status for p in (root / "no_config", no_weights, bad_json, corrupt)]:
        assert status == 422


PEFT_CONFIG = {  # what peft 0.21 saves for LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"])
    **{"task_type": None, "peft_type": "LORA", "auto_mapping": None, "peft_version": "0.21.2"},
    **{"base_model_name_or_path": None, "revision": None, "inference_mode": True, "r": 2, "target_modules": ["q_proj"]},
    **{"exclude_modules": None, "lora_alpha": 4, "lora_dropout": 0.0, "fan_in_fan_out": False, "bias": "none"},
    **{"use_rslora": False, "modules_to_save": None, "init_lora_weights": True, "layers_to_transform": None},
    **{"layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {}, "megatron_config": None},
    **{"megatron_core": "megatron.core", "trainable_token_indices": None, "loftq_config": {}, "eva_config": None},
    **{"corda_config": None, "lora_ga_config": None, "use_dora": False, "velora_config": None},
    **{"alora_invocation_tokens": None, "use_qalora": False, "qalora_group_size": 16, "monteclora_config": None},
    **{"layer_replication": None, "lora_bias": False, "target_parameters": None, "use_bdlora": None},
    **{"arrow_config": None, "kasa_config": None, "ensure_weight_tying": False},
}
REMOVED = object()


def with_config(root, name: str, changes: dict):
    """A rank-2 adapter on q_proj whose config is PEFT's with `changes` (REMOVED: the key left out)."""
    path = write_adapter(root / name, lora_tensors())
    config = {key: value for key, value in {**PEFT_CONFIG, **changes}.items() if value is not REMOVED}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


REFUSED_CONFIGS = [  # (changes, what the 422 says): values vLLM's PEFTHelper fails on (a 500 from its worker)
    ({"lora_alpha": REMOVED}, "has no lora_alpha (required: peft_type, r, lora_alpha, target_modules)"),
    ({"target_modules": REMOVED, "r": REMOVED}, "has no r, target_modules"),
    ({"lora_alpha": "4"}, "lora_alpha as a string (vLLM takes a finite number)"),
    ({"lora_alpha": None}, "lora_alpha as null"),
    ({"lora_alpha": [4]}, "lora_alpha as an array"),
    ({"lora_alpha": 10**400}, "lora_alpha as an integer"),  # overflows vLLM's alpha / r
    ({"lora_alpha": float("inf")}, "lora_alpha as a number (vLLM takes a finite number)"),  # vLLM would serve NaN
    ({"lora_alpha": float("nan")}, "lora_alpha as a number"),
    ({"use_qalora": True}, "use_qalora as a boolean (vLLM takes false or unset, as it does not support QALoRA)"),
    ({"use_bdlora": {"target_modules_bd_a": ["q_proj"]}}, "use_bdlora as an object"),
    ({"use_bdlora": True}, "does not support block-diagonal LoRA"),
    ({"init_lora_weights": "pissa"}, "init_lora_weights as a string (vLLM takes true, false or one of gaussian"),
    ({"init_lora_weights": "pissa_niter_4"}, "init_lora_weights as a string"),
    ({"init_lora_weights": "OLoRA"}, "init_lora_weights as a string"),
    ({"init_lora_weights": "corda"}, "init_lora_weights as a string"),
    ({"init_lora_weights": "loftq"}, "init_lora_weights as a string"),
    ({"init_lora_weights": "true"}, "init_lora_weights as a string"),  # a string: vLLM refuses it too
    ({"alora_invocation_tokens": [1, 2]}, "Activated LoRA"),
    ({"layer_replication": [[0, 1]]}, "layer replication"),
    ({"lora_bias": True}, "LoRA biases"),
    ({"modules_to_save": ["lm_head"]}, "full modules"),
    ({"bias": None}, "bias as null"),
    ({"use_rslora": "false"}, "use_rslora as a string (vLLM takes true or false)"),  # vLLM would read it as true
    ({"rank_pattern": ["q_proj"]}, "rank_pattern as an array (vLLM takes an object of regexes to positive integers)"),
    ({"rank_pattern": {"q_proj": "2"}}, "rank_pattern as an object (vLLM takes an object of regexes to positive"),
    ({"rank_pattern": {"q_proj": 0}}, "rank_pattern as an object"),
    ({"alpha_pattern": ["q_proj"]}, "alpha_pattern as an array (vLLM takes an object of regexes to finite numbers)"),
    ({"alpha_pattern": {"q_proj": "4"}}, "alpha_pattern as an object"),
    ({"alpha_pattern": {"q_proj": None}}, "alpha_pattern as an object"),  # vLLM: lora_alpha; PEFT: fails
    # The patterns as vLLM compiles them, `(.*\.)?(<key>)$` with the `regex` module, named by their place:
    ({"rank_pattern": {"q_proj(": 2}}, "has a rank_pattern key (1 of 1) that is not a valid regex"),
    ({"rank_pattern": {"q_proj": 2, ")": 2}}, "has a rank_pattern key (2 of 2) that is not a valid regex"),
    ({"alpha_pattern": {"[q": 2}}, "has a alpha_pattern key (1 of 1) that is not a valid regex"),
    ({"alpha_pattern": {"(?<x>q)(?P=y)": 2}}, "that is not a valid regex"),
    ({"alpha_pattern": {"\\N{secret-name}": 2}}, "that is not a valid regex"),  # regex's message quotes the name
    # vLLM matches them in the engine with no limit: hours of backtracking, all of the machine's memory.
    ({"alpha_pattern": {"(.|.|.|.)*(?=X)": 2}}, "has a alpha_pattern key (1 of 1) that takes over 1.0s to match"),
    ({"rank_pattern": {"(?:a{10000}){1000}": 2}}, "that takes over 1024 MiB to compile"),
]


def quoted(changes: dict) -> list[str]:
    """The strings a refusal of `changes` must not quote: every string value and key, as JSON, and as is where it is
    distinctive (")" occurs in any message, "true" in what is accepted)."""
    accepted = " ".join(text for _, text in CONFIG_KEYS.values()).lower()
    found = []

    def walk(value):
        if isinstance(value, str):
            found.append(json.dumps(value))
            if len(value) > 3 and value.lower() not in accepted:
                found.append(value)
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(key)
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    walk({key: value for key, value in changes.items() if value is not REMOVED})
    return [text for text in found if text not in {json.dumps(key) for key in changes} and text not in changes]


def test_config_values_vllm_fails_on_get_422_naming_the_key(tmp_path):
    """These reached vLLM, whose PEFTHelper raised in the worker: a 500 instead of a 422."""
    root = tmp_path / "run"
    for i, (changes, needle) in enumerate(REFUSED_CONFIGS):
        e = refusal(with_config(root, f"case_{i}", changes), [root])
        assert e.status == 422 and needle in e.message, (changes, e.message)
        # The file's values are never quoted back (they used to be, up to 80 characters each).
        assert not [text for text in quoted(changes) if text in e.message], (changes, e.message)
    # Every refused key is named, none of the values.
    e = refusal(
        with_config(root, "long", {"lora_alpha": "x" * 5000, "use_qalora": 1, "init_lora_weights": "a" * 999}), [root]
    )
    assert "lora_alpha as a string" in e.message and "use_qalora as an integer" in e.message
    assert "init_lora_weights as a string" in e.message
    assert "xx" not in e.message and "aa" not in e.message


ACCEPTED_CONFIGS = [  # what vLLM serves (as PEFT computes it)
    {},  # PEFT's defaults
    *({"init_lora_weights": init} for init in ("gaussian", "Gaussian", "eva", "orthogonal", "mica", "lora_ga", False)),
    {"use_rslora": True, "lora_alpha": 2.5},
    {"lora_alpha": 0},
    {"lora_alpha": -8},
    {"target_modules": "all-linear"},
    {"target_modules": None},  # given (vLLM requires the key, not a value)
    {"bias": REMOVED, "use_dora": None, "modules_to_save": [], "use_bdlora": {}, "use_qalora": 0},
    {"rank_pattern": None, "alpha_pattern": []},  # vLLM reads a false pattern as {}
    {"rank_pattern": {"q_proj": 2}, "alpha_pattern": {r"layers\.0\..*_proj": 3.5, r"\p{L}+_proj": 1, "o_proj": 8}},
    {"alpha_pattern": {"(?:a{1000}){100}": 2}},  # a large pattern that compiles within the bounds
]


def test_configs_vllm_serves_are_accepted(tmp_path):
    root = tmp_path / "run"
    for i, changes in enumerate(ACCEPTED_CONFIGS):
        path = with_config(root, f"case_{i}", changes)
        assert check_adapter_dir(str(path), [root], BASE, 8, MODULES) == path.resolve(), changes


SECRET = "outside-secret-value"


def outside_adapter(tmp_path):
    """An adapter outside the roots whose config holds a value no reply may show."""
    return write_adapter(tmp_path / "elsewhere" / "adapter", lora_tensors(), peft_type=SECRET)


def test_adapter_files_must_resolve_inside_the_roots(tmp_path):
    """The directory was checked against the roots, its files were not: symlinks in it to an adapter elsewhere loaded
    that adapter, and a linked config's values were echoed. Now each file is resolved and checked, unopened."""
    root = tmp_path / "run"
    good = write_adapter(root / "good", lora_tensors())
    foreign = outside_adapter(tmp_path)
    for linked in ("adapter_config.json", "adapter_model.safetensors"):
        directory = root / f"linked_{linked.split('.')[0]}"
        directory.mkdir(parents=True)
        for file in ("adapter_config.json", "adapter_model.safetensors"):
            (directory / file).symlink_to((foreign if file == linked else good) / file)
        e = refusal(directory, [root])
        assert e.status == 403 and f"{linked} resolves outside the allowed roots" in e.message, e.message
        assert SECRET not in e.message and "elsewhere" not in e.message
    # A dangling link out of the roots: refused the same way (its target is not even looked at).
    dangling = root / "dangling_out"
    dangling.mkdir()
    (dangling / "adapter_config.json").symlink_to(tmp_path / "elsewhere" / "missing.json")
    assert refusal(dangling, [root]).status == 403
    # Links that stay inside the roots are fine (a hub-cache layout: files link to blobs next to them).
    blobs = root / "blobs"
    blobs.mkdir()
    cached = root / "snapshot"
    cached.mkdir()
    for file in ("adapter_config.json", "adapter_model.safetensors"):
        os.replace(write_adapter(root / f"src_{file}", lora_tensors()) / file, blobs / file)
        (cached / file).symlink_to(f"../blobs/{file}")
    assert check_adapter_dir(str(cached), [root], BASE, 8, MODULES) == cached.resolve()
    # Not a regular file: a dangling link inside, a directory, a FIFO (opened without blocking).
    odd = root / "odd"
    odd.mkdir()
    (odd / "adapter_config.json").symlink_to(root / "nothing.json")
    assert "has no adapter_config.json" in refusal(odd, [root]).message
    (odd / "adapter_config.json").unlink()
    (odd / "adapter_config.json").mkdir()
    assert "has no adapter_config.json" in refusal(odd, [root]).message
    fifo = write_adapter(root / "fifo", lora_tensors())
    (fifo / "adapter_model.safetensors").unlink()
    os.mkfifo(fifo / "adapter_model.safetensors")
    assert "has no adapter_model.safetensors" in refusal(fifo, [root]).message
    # The same outside files copied inside the roots are judged by their contents, which are not quoted either (the
    # value used to be echoed: a hard link passed for a file inside the roots, see the hard-link test below).
    copied = write_adapter(root / "copied", lora_tensors(), peft_type=SECRET)
    e = refusal(copied, [root])
    assert e.status == 422 and "peft_type as a string" in e.message and SECRET not in e.message


def test_a_link_swapped_in_after_the_path_was_resolved_is_caught(tmp_path, monkeypatch):
    """The file is resolved, then opened: a symlink swapped into its path in between is caught on the opened file,
    so what the check reads is what it checked."""
    root = tmp_path / "run"
    foreign = outside_adapter(tmp_path)
    real_resolve = weights.resolve

    def resolve_then_swap(swap):
        def resolve(path):
            resolved = real_resolve(path)
            swap()
            return resolved

        return resolve

    # A directory on the path replaced by a link out of the roots (the file name stays: opened through the link).
    adapter = write_adapter(root / "swapped" / "adapter", lora_tensors())

    def swap_dir():
        if adapter.is_symlink():
            return
        os.rename(adapter, root / "swapped" / "moved")
        adapter.symlink_to(foreign)

    monkeypatch.setattr(weights, "resolve", resolve_then_swap(swap_dir))
    e = refusal(adapter, [root])
    assert e.status == 403 and "resolves outside the allowed roots" in e.message and SECRET not in e.message

    # The file itself replaced by a link: not followed.
    other = write_adapter(root / "file_swapped", lora_tensors())

    def swap_file():
        config = other / "adapter_config.json"
        if not config.is_symlink():
            config.unlink()
            config.symlink_to(foreign / "adapter_config.json")

    monkeypatch.setattr(weights, "resolve", resolve_then_swap(swap_file))
    e = refusal(other, [root])
    assert e.status == 422 and "cannot be opened" in e.message and SECRET not in e.message


EMBED_BASE = {
    **BASE,
    "model.embed_tokens.weight": TensorSpec("BF16", (10, 4)),  # [vocab, dim]
    "lm_head.weight": TensorSpec("BF16", (10, 4)),  # [vocab, dim]: a linear layer's [out, in]
}
EMBED_MODULES = {*MODULES, "embed_tokens", "lm_head"}


def embed_tensors(a_shape=(2, 10), b_shape=(4, 2), peft_names=True, layer="model.embed_tokens") -> dict:
    a, b = (".lora_embedding_A", ".lora_embedding_B") if peft_names else (".lora_A.weight", ".lora_B.weight")
    prefix = f"base_model.model.{layer}"
    return {f"{prefix}{a}": torch.full(a_shape, 0.5), f"{prefix}{b}": torch.full(b_shape, 0.5)}


def test_embedding_and_lm_head_adapters_are_checked_in_their_own_orientation(tmp_path):
    """An input embedding's weight is [vocab, dim]: vLLM takes its LoRA as A [r, vocab], B [dim, r]. Checked as a
    linear layer's (A [r, dim], B [vocab, r]) a misfit passed and vLLM's worker failed on it (500)."""
    root = tmp_path / "run"

    def check(name, tensors, modules=EMBED_MODULES, base=EMBED_BASE):
        return check_adapter_dir(str(write_adapter(root / name, tensors)), [root], base, 8, modules)

    def refused(name, tensors, base=EMBED_BASE) -> str:
        with pytest.raises(WeightDirError) as e:
            check(name, tensors, base=base)
        assert e.value.status == 422 and len(e.value.message) < 1000
        return e.value.message

    copy = {"base_model.model.model.embed_tokens.base_layer.weight": torch.zeros(10, 4)}
    assert check("peft", {**lora_tensors(), **embed_tensors(), **copy})  # what PEFT saves: vLLM skips the copy
    assert check("plain_names", embed_tensors(peft_names=False))
    assert check("lm_head", embed_tensors((2, 4), (10, 2), peft_names=False, layer="lm_head"))

    linear_way = "do not fit its embedding [10, 4]: A [r, 10], B [4, r]"
    assert linear_way in refused("linear_way", embed_tensors((2, 4), (10, 2), peft_names=False))
    assert linear_way in refused("linear_way_peft", embed_tensors((2, 4), (10, 2)))
    assert linear_way in refused("short_vocab", embed_tensors((2, 9), (4, 2)))
    assert "lm_head: lora_A (2, 10), lora_B (4, 2) do not fit its weight [10, 4]" in refused(
        "lm_head_embedding_way", embed_tensors(peft_names=False, layer="lm_head")
    )
    assert "rank 9" in refused("rank", embed_tensors((9, 10), (4, 9)))
    resized = {"base_model.model.model.embed_tokens.base_layer.weight": torch.zeros(12, 4)}
    assert "(12, 4) is not the served (10, 4) (a resized vocabulary)" in refused(
        "resized", {**embed_tensors(), **resized}
    )
    both_names = {**embed_tensors(), **embed_tensors(peft_names=False)}
    assert "given twice" in refused("both_names", both_names)
    assert "are an input embedding's" in refused("misnamed", embed_tensors((2, 4), (6, 2), layer="layers.0.q_proj"))
    # A tied model stores no lm_head: an adapter for it (or a copy of it) has no layer to apply to.
    tied = {k: v for k, v in EMBED_BASE.items() if k != "lm_head.weight"}
    assert "has no layer lm_head" in refused("tied", embed_tensors((2, 4), (10, 2), False, "lm_head"), base=tied)
    lm_copy = {"base_model.model.lm_head.base_layer.weight": torch.zeros(10, 4)}
    assert "has no layer lm_head" in refused("tied_copy", {**embed_tensors(), **lm_copy}, base=tied)


def adapter_client(tmp_path, engine=None, api_key=None):
    client, swapper = admin_app(tmp_path, engine, api_key, shapes=LORA_SHAPES)
    adapters = client.app.state.prime_adapters
    asyncio.run(adapters.init())  # asks the (fake) worker which layers take LoRA
    return client, adapters


def test_load_replace_and_unload(tmp_path):
    engine = FakeEngine()
    client, adapters = adapter_client(tmp_path, engine)
    assert adapters.modules == MODULES
    step_1 = write_adapter(tmp_path / "a" / "step_1", lora_tensors())
    step_2 = write_adapter(tmp_path / "a" / "step_2", lora_tensors(fill=0.25))
    table = adapters.models.lora_requests

    r = client.post("/load_lora_adapter", json={"lora_name": "run-a", "lora_path": str(step_1)})
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "ok" and r.json()["version"] == "step_1" and r.json()["lora_name"] == "run-a"
    # The engine loaded it in place; the name table holds a request that does not re-read the directory each time.
    assert engine.loras[-1].load_inplace and engine.loras[-1].lora_path == str(step_1)
    first = table["run-a"]
    assert not first.load_inplace and first.lora_path == str(step_1)
    assert client.get("/weights").json()["adapters"] == {"run-a": "step_1"}

    # Replacing: same engine id, new path and label, no prefix-cache reset (a new path has its own cache keys).
    r = client.post("/load_lora_adapter", json={"lora_name": "run-a", "lora_path": str(step_2), "version": "v2"})
    assert r.status_code == 200 and r.json()["version"] == "v2"
    assert table["run-a"].lora_int_id == first.lora_int_id and table["run-a"].lora_path == str(step_2)
    assert engine.cache_resets == 0
    # Back to a path this name had: its cached KV may come from a later adapter, so the cache is reset.
    assert client.post("/load_lora_adapter", json={"lora_name": "run-a", "lora_path": str(step_1)}).status_code == 200
    assert engine.cache_resets == 1

    # A second name gets its own id; the server holds as many names as its cache keeps (here 2).
    b = write_adapter(tmp_path / "b" / "step_1", lora_tensors())
    assert client.post("/load_lora_adapter", json={"lora_name": "run-b", "lora_path": str(b)}).status_code == 200
    assert table["run-b"].lora_int_id != table["run-a"].lora_int_id
    r = client.post("/load_lora_adapter", json={"lora_name": "run-c", "lora_path": str(b)})
    assert r.status_code == 409 and "holds 2 adapters" in r.json()["error"]["message"]
    assert client.get("/weights").json()["adapters"] == {"run-a": "step_1", "run-b": "step_1"}

    # The engine failing: 500, and the adapter it had is still what the name serves.
    engine.lora_failure = RuntimeError("out of memory")
    r = client.post("/load_lora_adapter", json={"lora_name": "run-a", "lora_path": str(step_2)})
    assert r.status_code == 500 and "out of memory" in r.json()["error"]["message"]
    assert "still serving step_1" in r.json()["error"]["message"] and table["run-a"].lora_path == str(step_1)
    engine.lora_failure = None

    # Unloading: the name is gone (requests naming it get vLLM's 404), a second unload is a 404 here.
    assert client.post("/unload_lora_adapter", json={"lora_name": "run-a"}).json() == {
        "status": "ok",
        "lora_name": "run-a",
    }
    assert "run-a" not in table and client.get("/weights").json()["adapters"] == {"run-b": "step_1"}
    r = client.post("/unload_lora_adapter", json={"lora_name": "run-a"})
    assert r.status_code == 404 and "no adapter named 'run-a'" in r.json()["error"]["message"]
    # No full-weight swap happened at any point.
    assert not [c for c in engine.calls if c[0] in ("prime_load_weights", "version")]


def test_bad_adapter_requests_get_documented_4xx_and_change_nothing(tmp_path):
    engine = FakeEngine()
    client, adapters = adapter_client(tmp_path, engine, api_key="k")
    good = write_adapter(tmp_path / "good", lora_tensors())
    r16 = write_adapter(tmp_path / "r16", lora_tensors(rank=16), rank=16)
    qalora = write_adapter(tmp_path / "qalora", lora_tensors(), use_qalora=True)
    key = {"Authorization": "Bearer k"}
    cases = [
        ({"lora_name": "a", "lora_path": str(good)}, {}, 401),
        (b"x" * (MAX_BODY_BYTES + 1), key, 413),
        (b"{not json", key, 400),
        (b"[]", key, 400),
        ({"lora_name": "a"}, key, 422),
        ({"lora_name": "a", "lora_path": str(good), "load_inplace": True}, key, 422),  # unknown field
        ({"lora_name": "../a", "lora_path": str(good)}, key, 422),  # not a name
        ({"lora_name": "a" * 65, "lora_path": str(good)}, key, 422),
        ({"lora_name": "a", "lora_path": str(good), "version": "v" * 257}, key, 422),
        ({"lora_name": BASE_NAME, "lora_path": str(good)}, key, 422),  # the base model's name
        ({"lora_name": "a", "lora_path": "/etc"}, key, 403),
        ({"lora_name": "a", "lora_path": str(tmp_path / "missing")}, key, 404),
        ({"lora_name": "a", "lora_path": "rel/x"}, key, 400),
        ({"lora_name": "a", "lora_path": str(r16)}, key, 422),
        ({"lora_name": "a", "lora_path": str(qalora)}, key, 422),
    ]
    for body, headers, status in cases:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = client.post("/load_lora_adapter", content=content, headers={"Content-Type": "application/json", **headers})
        assert r.status_code == status, (body if isinstance(body, dict) else body[:40], r.text[:300])
        assert r.json()["error"]["code"] == status and len(r.content) < 1000
    assert client.post("/unload_lora_adapter", json={"lora_name": "a"}, headers=key).status_code == 404
    assert client.post("/unload_lora_adapter", json={"name": "a"}, headers=key).status_code == 422
    assert client.post("/unload_lora_adapter", json={"lora_name": "a"}).status_code == 401
    assert engine.loras == [] and adapters.models.lora_requests == {} and adapters.loaded == {}


def test_a_server_without_lora_answers_409(tmp_path):
    client, _ = adapter_client(tmp_path, FakeEngine(lora=False))
    good = write_adapter(tmp_path / "good", lora_tensors())
    for route, body in [
        ("/load_lora_adapter", {"lora_name": "a", "lora_path": str(good)}),
        ("/unload_lora_adapter", {"lora_name": "a"}),
    ]:
        r = client.post(route, json=body)
        assert r.status_code == 409 and "not enabled on this server" in r.json()["error"]["message"], r.text
    assert client.get("/weights").json()["adapters"] == {}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_adapters_with_non_finite_values_are_refused_naming_the_tensor(tmp_path, dtype):
    """A NaN adapter loaded (200) and served NaN, and its requests' NaN activations reached the next requests of
    other adapters and of the base model (issue 52, finding 11). The check now reads the adapter's data: a NaN or an
    infinity anywhere is a 422 naming the tensor (clipped), never a value; finite values, however large, pass (what
    they do to activations is the engine guard's, `finite_kv`)."""
    root = tmp_path / "run"
    a_name, b_name = "base_model.model.layers.0.q_proj.lora_A.weight", "base_model.model.layers.0.q_proj.lora_B.weight"
    for bad in (float("nan"), float("inf"), float("-inf")):
        tensors = {k: v.to(dtype) for k, v in lora_tensors().items()}
        tensors[b_name][3, 1] = bad
        e = refusal(write_adapter(root / f"{bad}-{dtype}", tensors), [root])
        assert e.status == 422 and f"non-finite values (NaN or inf) in tensor {b_name}" in e.message, e.message
        assert a_name not in e.message
    huge = {k: v.to(dtype) * torch.finfo(dtype).max for k, v in lora_tensors(fill=1.0).items()}
    path = write_adapter(root / f"huge-{dtype}", huge)
    assert check_adapter_dir(str(path), [root], BASE, 8, MODULES) == path.resolve()


def test_a_non_finite_tensor_s_long_name_is_clipped(tmp_path):
    """The name comes from the caller's file: it is clipped like any echoed name (an extra tensor is refused by its
    name first, so the long name is the LoRA layer's own)."""
    root = tmp_path / "run"
    layer = "layers.0." + "x" * 400 + ".q_proj"
    base = {**BASE, f"{layer}.weight": TensorSpec("BF16", (6, 4))}
    tensors = lora_tensors(layer)
    tensors[f"base_model.model.{layer}.lora_A.weight"][0, 0] = float("nan")
    with pytest.raises(WeightDirError) as e:
        check_adapter_dir(str(write_adapter(root / "long", tensors)), [root], base, 8, None)
    assert e.value.status == 422 and "non-finite values" in e.value.message and "x" * 200 not in e.value.message


def test_hard_linked_adapter_files_are_refused_unread(tmp_path):
    """A hard link inside the roots to a file outside them passed the roots check (it resolves to itself), and its
    config's values were echoed in the 422 (up to 80 characters of a file outside the roots). Any adapter file with
    more than one name is now refused (403, as a file outside the roots) without being read."""
    root = tmp_path / "run"
    good = write_adapter(root / "good", lora_tensors())
    foreign = outside_adapter(tmp_path)
    for linked in ("adapter_config.json", "adapter_model.safetensors"):
        directory = root / f"hard_{linked.split('.')[0]}"
        directory.mkdir(parents=True)
        for file in ("adapter_config.json", "adapter_model.safetensors"):
            if file == linked:
                os.link(foreign / file, directory / file)
            else:
                (directory / file).write_bytes((good / file).read_bytes())
        e = refusal(directory, [root])
        assert e.status == 403 and f"{linked} is a hard link (2 names)" in e.message, e.message
        assert SECRET not in e.message and "elsewhere" not in e.message and "peft_type" not in e.message
    # Both names inside the roots: still refused (which name is the real one cannot be told), and a copy passes.
    inside = root / "hard_inside"
    inside.mkdir()
    os.link(good / "adapter_config.json", inside / "adapter_config.json")
    (inside / "adapter_model.safetensors").write_bytes((good / "adapter_model.safetensors").read_bytes())
    assert refusal(inside, [root]).status == 403
    (inside / "adapter_config.json").unlink()
    (inside / "adapter_config.json").write_bytes((good / "adapter_config.json").read_bytes())
    assert check_adapter_dir(str(inside), [root], BASE, 8, MODULES) == inside.resolve()


def test_the_pattern_child_inherits_none_of_the_server_s_environment(tmp_path, monkeypatch):
    """The child that compiles and matches the rank/alpha patterns inherited the server's environment, API keys and
    a run secret given by hand included. Its environment, read from /proc while it runs (a pattern that backtracks
    for its full second), now holds at most PYTHONPATH; and it still works."""
    import threading

    import psutil

    monkeypatch.setenv("PRIME_RL_SECRET", "ab" * 32)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-must-not-reach-the-child")
    root = tmp_path / "run"
    slow = with_config(root, "slow", {"alpha_pattern": {"(.|.|.|.)*(?=X)": 2}})
    errors = []
    thread = threading.Thread(target=lambda: errors.append(refusal(slow, [root])))
    thread.start()
    environ = None
    while thread.is_alive() and environ is None:
        for child in psutil.Process().children():
            try:
                if "pattern_check" in " ".join(child.cmdline()):
                    environ = child.environ()
            except psutil.Error:  # gone before it was read: the next one is
                pass
    thread.join()
    assert environ is not None, "the pattern child was never seen running"
    assert set(environ) <= {"PYTHONPATH"}, sorted(environ)
    assert errors[0].status == 422 and "takes over 1.0s to match" in errors[0].message
