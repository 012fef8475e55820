"""Shared integration fixtures: one real vLLM server on the tiny tied model for the whole session.

vLLM takes ~100 s to start on CPU, so every module that needs "a server" (inference tests, orchestrator tests)
shares this one. Tests must not assume which weights it serves: the orchestrator resets it on start. Its model
carries Qwen3's sampling defaults in generation_config.json, as real checkpoints do.
"""

import asyncio
import json
import re

import httpx
import pytest
from transformers import AutoTokenizer

from prime_rl.inference.process import InferenceServer
from prime_rl.models.tiny import TinyModelConfig, build_tiny_model, perturb_weights

API_KEY = "test-key"
QWEN3_SAMPLING_DEFAULTS = {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
PROMPT = "<|im_start|>user\nReverse: hello world<|im_end|>\n<|im_start|>assistant\n"


def start_server(root, tied: bool) -> InferenceServer:
    """A server on a fresh tiny model under `root`, which is also its allowed weight root."""
    base = build_tiny_model(TinyModelConfig(output=root / "base", tie_word_embeddings=tied))
    # Qwen3's own sampling defaults, which vLLM's chat route applies to request fields left unset: clients that
    # need the plain distribution (the orchestrator, for the trainer's logprobs) say so in each request.
    generation_config = json.loads((base / "generation_config.json").read_text())
    generation_config.update(QWEN3_SAMPLING_DEFAULTS)
    (base / "generation_config.json").write_text(json.dumps(generation_config))
    perturb_weights(base, root / "step_1", scale=8.0)
    extra = ["--model.enforce-eager", "--model.max-model-len", "512", "--allowed-weight-roots", str(root)]
    srv = InferenceServer(base, root / "out", extra=extra + ["--max-num-seqs", "48"], api_key=API_KEY)
    try:
        srv.wait_healthy()
    except BaseException:
        srv.stop()
        raise
    srv.root, srv.base, srv.step_1 = root, base, root / "step_1"
    srv.tokenizer = AutoTokenizer.from_pretrained(base)
    srv.prompt_ids = srv.tokenizer.encode(PROMPT)
    return srv


@pytest.fixture(scope="session")
def tied_server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("inference-tied"), tied=True)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def verifiers_loop():
    """renderers' train client keeps a module-level asyncio.Lock that binds to the first loop that waits on it,
    so every in-process verifiers call of the session runs on this one loop."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def requests_running(url: str) -> float:
    """vLLM's own gauge of requests being generated (`/metrics` needs no API key); 0 when the server does not answer."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=5).text
    except httpx.TransportError:
        return 0.0
    return sum(float(m) for m in re.findall(r"^vllm:num_requests_running\{[^}]*\} ([\d.e+]+)$", text, re.M))
