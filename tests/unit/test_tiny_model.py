"""The locally built tiny model: loadable, tied/untied as asked, tokenizer, chat templates, determinism."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from prime_rl.models.tiny import TinyModelConfig, build_tiny_model, perturb_weights
from prime_rl.models.tiny_tokenizer import LLAMA_ADDED_TOKENS, QWEN3_ADDED_TOKENS

VOCAB = 300  # small target vocab: few BPE merges, fast to train
QWEN3_TOKENS = [content for content, _ in QWEN3_ADDED_TOKENS]


def _build(path: Path, **overrides) -> Path:
    return build_tiny_model(TinyModelConfig(output=path, **{"vocab_size": VOCAB, **overrides}))


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    return _build(tmp_path_factory.mktemp("qwen3") / "model")


@pytest.fixture(scope="module")
def qwen3_untied_dir(tmp_path_factory) -> Path:
    return _build(tmp_path_factory.mktemp("qwen3_untied") / "model", tie_word_embeddings=False)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return _build(tmp_path_factory.mktemp("llama") / "model", family="llama")


@pytest.fixture(scope="module")
def qwen3_tok(qwen3_dir):
    return AutoTokenizer.from_pretrained(qwen3_dir)


def _safetensors_keys(model_dir: Path) -> set[str]:
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def _expected_params(vocab: int, *, qk_norm: bool, tied: bool) -> int:
    hidden, heads, kv_heads, head_dim, inter, layers = 128, 2, 1, 64, 256, 2
    attn = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q, o and k, v
    per_layer = attn + 3 * hidden * inter + 2 * hidden + (2 * head_dim if qk_norm else 0)
    return vocab * hidden * (1 if tied else 2) + layers * per_layer + hidden


def test_qwen3_loads_and_matches_request(qwen3_dir, qwen3_tok):
    model = AutoModelForCausalLM.from_pretrained(qwen3_dir)
    cfg = model.config
    vocab = len(qwen3_tok)
    assert vocab == VOCAB  # the BPE reaches the target on the generated corpus
    assert cfg.model_type == "qwen3"
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (vocab, 128, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size) == (2, 1, 64, 256)
    assert cfg.max_position_embeddings == 4096
    assert model.dtype == torch.bfloat16
    assert sum(p.numel() for p in model.parameters()) == _expected_params(vocab, qk_norm=True, tied=True)
    assert cfg.eos_token_id == qwen3_tok.convert_tokens_to_ids("<|im_end|>")
    assert cfg.pad_token_id == qwen3_tok.convert_tokens_to_ids("<|endoftext|>")
    assert cfg.bos_token_id is None

    ids = torch.tensor([qwen3_tok.encode("hello there")])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], vocab)
    assert torch.isfinite(logits).all()


def test_generation_config_has_stops_but_no_sampling(qwen3_dir, qwen3_tok):
    gen = json.loads((qwen3_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [qwen3_tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    assert not {"temperature", "top_p", "top_k", "do_sample"} & gen.keys()


def test_tied_model_stores_no_lm_head(qwen3_dir):
    assert "lm_head.weight" not in _safetensors_keys(qwen3_dir)
    model = AutoModelForCausalLM.from_pretrained(qwen3_dir)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_untied_model_stores_separate_lm_head(qwen3_untied_dir):
    assert "lm_head.weight" in _safetensors_keys(qwen3_untied_dir)
    model = AutoModelForCausalLM.from_pretrained(qwen3_untied_dir)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    vocab = model.config.vocab_size
    assert sum(p.numel() for p in model.parameters()) == _expected_params(vocab, qk_norm=True, tied=False)


def test_qwen3_special_tokens(qwen3_tok):
    ids = []
    for token in QWEN3_TOKENS:
        encoded = qwen3_tok.encode(token, add_special_tokens=False)
        assert len(encoded) == 1, token
        ids.append(encoded[0])
    # Layout: the added tokens take the last ids, in Qwen3's order.
    assert ids == list(range(len(qwen3_tok) - len(QWEN3_TOKENS), len(qwen3_tok)))
    assert qwen3_tok.eos_token == "<|im_end|>"
    assert qwen3_tok.pad_token == "<|endoftext|>"
    assert qwen3_tok.bos_token is None
    assert qwen3_tok.model_max_length == 4096
    # No BOS is prepended to plain text.
    assert qwen3_tok.encode("hi", add_special_tokens=True) == qwen3_tok.encode("hi", add_special_tokens=False)
    # Tool / think markers are not "special": skip_special_tokens keeps them, as in Qwen3.
    ids = qwen3_tok.encode("<|im_start|>a<think>b</think><tool_call>c</tool_call><|im_end|><|endoftext|>")
    assert qwen3_tok.decode(ids, skip_special_tokens=True) == "a<think>b</think><tool_call>c</tool_call>"


@pytest.mark.parametrize(
    "text",
    [
        "Hello, World! 123 (a-b); 'quoted' \"double\"?\nnew line: x.",
        "  leading and trailing spaces  ",
        "é漢 ünïcödé ✓ emoji 🙂 tab\tend",
    ],
)
def test_text_round_trips(qwen3_tok, text):
    ids = qwen3_tok.encode(text, add_special_tokens=False)
    assert qwen3_tok.decode(ids) == text


def test_qwen3_chat_template_reasoning_history(qwen3_tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
        {"role": "user", "content": "Bye"},
    ]
    # The assistant turn precedes the last user query, so its reasoning is dropped.
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert qwen3_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == expected
    no_think = qwen3_tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert no_think == expected + "<think>\n\n</think>\n\n"
    # enable_thinking=True behaves like the default.
    assert qwen3_tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=True
    ) == (expected)


def test_qwen3_chat_template_reasoning_after_last_query(qwen3_tok):
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "\nGreet back.\n"},
    ]
    assert qwen3_tok.apply_chat_template(messages, tokenize=False) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\nGreet back.\n</think>\n\nHello!<|im_end|>\n"
    )
    # Reasoning given inline in the content is split out the same way.
    inline = [messages[0], {"role": "assistant", "content": "<think>\nGreet back.\n</think>\n\nHello!"}]
    assert qwen3_tok.apply_chat_template(inline, tokenize=False) == qwen3_tok.apply_chat_template(
        messages, tokenize=False
    )
    # The last assistant turn always gets a (possibly empty) think block.
    plain = [messages[0], {"role": "assistant", "content": "Hello!"}]
    assert qwen3_tok.apply_chat_template(plain, tokenize=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\nHello!<|im_end|>\n"
    )


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
        },
    }
]

TOOL_CONVERSATION = [
    {"role": "system", "content": "Use tools."},
    {"role": "user", "content": "2+3? And 1+1?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Call add twice.",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}},
            {"id": "c2", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 1}'}},
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "5"},
    {"role": "tool", "tool_call_id": "c2", "content": "2"},
    {"role": "assistant", "content": "5 and 2."},
]


def test_qwen3_chat_template_tools(qwen3_tok):
    expected = (
        "<|im_start|>system\nUse tools.\n\n"
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": '
        '{"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}\n'
        "</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n2+3? And 1+1?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nCall add twice.\n</think>\n\n"
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 1}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n2\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n5 and 2.<|im_end|>\n"
    )
    assert qwen3_tok.apply_chat_template(TOOL_CONVERSATION, tools=TOOLS, tokenize=False) == expected


def test_llama_builds_loads_and_renders(llama_dir):
    tok = AutoTokenizer.from_pretrained(llama_dir)
    model = AutoModelForCausalLM.from_pretrained(llama_dir)
    assert model.config.model_type == "llama"
    assert model.config.head_dim == 64 and model.config.num_key_value_heads == 1
    assert sum(p.numel() for p in model.parameters()) == _expected_params(len(tok), qk_norm=False, tied=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight

    names = [content for content, _ in LLAMA_ADDED_TOKENS]
    ids = [tok.convert_tokens_to_ids(t) for t in names]
    assert ids == list(range(len(tok) - len(names), len(tok)))
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (
        "<|begin_of_text|>",
        "<|eot_id|>",
        "<|finetune_right_pad_id|>",
    )
    assert model.config.eos_token_id == tok.convert_tokens_to_ids("<|eot_id|>")
    gen = json.loads((llama_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [
        tok.convert_tokens_to_ids("<|eot_id|>"),
        tok.convert_tokens_to_ids("<|end_of_text|>"),
    ]
    # Plain encode prepends BOS, like Meta's Llama-3 tokenizer.
    assert tok.encode("hi")[0] == tok.bos_token_id
    assert tok.decode(tok.encode("é漢 ok"), skip_special_tokens=True) == "é漢 ok"

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi \n"}]
    expected = (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == expected
    # Chat templating does not double the BOS.
    chat_ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert chat_ids.count(tok.bos_token_id) == 1 and chat_ids[0] == tok.bos_token_id


def test_same_seed_is_byte_identical_other_seed_differs(tmp_path, qwen3_dir):
    again = _build(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "config.json", "chat_template.jinja"):
        assert (again / name).read_bytes() == (qwen3_dir / name).read_bytes(), name
    other = _build(tmp_path / "other", seed=1)
    assert (other / "model.safetensors").read_bytes() != (qwen3_dir / "model.safetensors").read_bytes()


def test_rebuild_replaces_existing_dir_and_leaves_no_temp(tmp_path):
    target = tmp_path / "model"
    target.mkdir()
    (target / "stale.txt").write_text("old")
    _build(target, num_layers=1)
    assert not (target / "stale.txt").exists()
    assert (target / "model.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_vocab_too_small_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="too small"):
        _build(tmp_path / "model", vocab_size=270)
    assert list(tmp_path.iterdir()) == []


def test_perturb_weights(tmp_path, qwen3_dir):
    dst = perturb_weights(qwen3_dir, tmp_path / "perturbed")
    assert sorted(p.name for p in dst.iterdir()) == sorted(p.name for p in qwen3_dir.iterdir())
    assert (dst / "tokenizer.json").read_bytes() == (qwen3_dir / "tokenizer.json").read_bytes()
    before = load_file(str(qwen3_dir / "model.safetensors"))
    after = load_file(str(dst / "model.safetensors"))
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        assert after[name].shape == tensor.shape and after[name].dtype == tensor.dtype, name
        assert not torch.equal(after[name], tensor), name  # norm weights (all ones) change too
    with safe_open(str(dst / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    # Seeded: the same call gives the same weights.
    again = perturb_weights(qwen3_dir, tmp_path / "again")
    assert (again / "model.safetensors").read_bytes() == (dst / "model.safetensors").read_bytes()

    model = AutoModelForCausalLM.from_pretrained(dst)
    assert torch.equal(model.model.embed_tokens.weight, after["model.embed_tokens.weight"])


def test_renderers_qwen3_matches_template(qwen3_dir):
    from renderers import Qwen3RendererConfig, create_renderer
    from renderers.base import load_tokenizer

    # As verifiers builds it: load_tokenizer(path) + create_renderer(tokenizer, config). The config must be
    # explicit: auto-resolution goes by tokenizer.name_or_path, which for a local dir matches no known model.
    tok = load_tokenizer(str(qwen3_dir))
    renderer = create_renderer(tok, Qwen3RendererConfig())  # __init__ asserts every marker token exists

    simple = [{"role": "user", "content": "Hi there."}]
    expected = tok.apply_chat_template(simple, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert renderer.render_ids(simple, add_generation_prompt=True) == expected
    assert tok.decode(expected) == "<|im_start|>user\nHi there.<|im_end|>\n<|im_start|>assistant\n"

    # The renderer and our template agree on a tool conversation too (full render, no generation prompt).
    tool_ids = tok.apply_chat_template(TOOL_CONVERSATION, tools=TOOLS, tokenize=True, return_dict=False)
    assert renderer.render_ids(TOOL_CONVERSATION, tools=TOOLS) == tool_ids

    # With thinking disabled both prefill the empty think block.
    no_think = create_renderer(tok, Qwen3RendererConfig(enable_thinking=False))
    expected = tok.apply_chat_template(
        simple, tokenize=True, add_generation_prompt=True, enable_thinking=False, return_dict=False
    )
    assert no_think.render_ids(simple, add_generation_prompt=True) == expected
    assert renderer.get_stop_token_ids() == [tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
