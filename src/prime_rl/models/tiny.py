"""Build a tiny, randomly initialised Hugging Face causal LM directory on local disk.

Tests and demos of prime-rl need a real model directory that vLLM can serve and the FSDP2
trainer can load, but no model hub is reachable at run time. This module produces one from
nothing: a byte-level BPE tokenizer trained on a procedurally generated corpus, the family's
special tokens and chat template (written here, matching the Qwen3 / Llama-3 wire formats),
a `Qwen3Config` or `LlamaConfig`, a `generation_config.json` and seeded random weights in
`model.safetensors`. The same config always yields byte-identical files.

`perturb_weights` copies such a directory and adds seeded noise to its weights, which gives
tests a "new policy" checkpoint with the same tensor names, shapes and dtypes.
"""

import random
import shutil
import string
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from prime_rl.config import BaseConfig
from prime_rl.utils.fs import atomic_dir

DEFAULT_ALPHABET = string.ascii_lowercase + string.ascii_uppercase + string.digits + " .,!?;:'\"-()\n"

# Added tokens in id order, as (content, special). They take the last ids of the vocabulary, the
# way Qwen lays out its vocab. `special=False` tokens (tool / think / fim markers in Qwen3) are kept
# by `decode(..., skip_special_tokens=True)`, exactly like in the real Qwen3 tokenizer.
QWEN3_ADDED_TOKENS: list[tuple[str, bool]] = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
]

LLAMA_ADDED_TOKENS: list[tuple[str, bool]] = [
    ("<|begin_of_text|>", True),
    ("<|end_of_text|>", True),
    ("<|start_header_id|>", True),
    ("<|end_header_id|>", True),
    ("<|eot_id|>", True),
    ("<|finetune_right_pad_id|>", True),
    ("<|eom_id|>", True),
    ("<|python_tag|>", True),
]

# Both templates accept message content as a string or a list of text parts.
_TEXT_OF = r"""
{%- macro text_of(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content -%}
            {%- if part is string -%}
                {{- part -}}
            {%- elif part is mapping and part.text is string -%}
                {{- part.text -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
"""

# Qwen3 ChatML. Same output as Qwen3's own template: system block (with the tool list when `tools`
# is given), reasoning shown only on assistant turns after the last real user query, tool calls as
# JSON inside <tool_call>, tool results grouped into one user turn, `enable_thinking=false` prefilling
# an empty think block. Content may be a string or a list of text parts.
QWEN3_CHAT_TEMPLATE = (
    _TEXT_OF
    + r"""
{%- set starts_with_system = messages | length > 0 and messages[0].role == 'system' -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if starts_with_system -%}
        {{- text_of(messages[0].content) + '\n\n' -}}
    {%- endif -%}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' -}}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}
    {%- for tool in tools -%}
        {{- '\n' + (tool | tojson) -}}
    {%- endfor -%}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments ' -}}
    {{- 'within <tool_call></tool_call> XML tags:\n<tool_call>\n' -}}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- elif starts_with_system -%}
    {{- '<|im_start|>system\n' + text_of(messages[0].content) + '<|im_end|>\n' -}}
{%- endif -%}
{#- The last user message that is a real query (not a wrapped tool result). -#}
{%- set state = namespace(last_query=messages | length - 1, found=false) -%}
{%- for message in messages | reverse -%}
    {%- if not state.found and message.role == 'user' -%}
        {%- set body = text_of(message.content) | trim -%}
        {%- if not (body.startswith('<tool_response>') and body.endswith('</tool_response>')) -%}
            {%- set state.last_query = messages | length - 1 - loop.index0 -%}
            {%- set state.found = true -%}
        {%- endif -%}
    {%- endif -%}
{%- endfor -%}
{%- for message in messages -%}
    {%- set content = text_of(message.content) -%}
    {%- if message.role == 'system' -%}
        {%- if not loop.first -%}
            {{- '<|im_start|>system\n' + content + '<|im_end|>\n' -}}
        {%- endif -%}
    {%- elif message.role == 'user' -%}
        {{- '<|im_start|>user\n' + content + '<|im_end|>\n' -}}
    {%- elif message.role == 'assistant' -%}
        {%- set reasoning = '' -%}
        {%- if message.reasoning_content is string -%}
            {%- set reasoning = message.reasoning_content -%}
        {%- elif '</think>' in content -%}
            {%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') -%}
            {%- set content = content.split('</think>')[-1].lstrip('\n') -%}
        {%- endif -%}
        {%- if loop.index0 > state.last_query and (loop.last or reasoning) -%}
            {{- '<|im_start|>assistant\n<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') -}}
        {%- else -%}
            {{- '<|im_start|>assistant\n' + content -}}
        {%- endif -%}
        {%- if message.tool_calls -%}
            {%- for call in message.tool_calls -%}
                {%- if content or not loop.first -%}
                    {{- '\n' -}}
                {%- endif -%}
                {%- set fn = call.function if call.function is defined and call.function else call -%}
                {{- '<tool_call>\n{"name": "' + fn.name + '", "arguments": ' -}}
                {%- if fn.arguments is string -%}
                    {{- fn.arguments -}}
                {%- else -%}
                    {{- fn.arguments | tojson -}}
                {%- endif -%}
                {{- '}\n</tool_call>' -}}
            {%- endfor -%}
        {%- endif -%}
        {{- '<|im_end|>\n' -}}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' -}}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}
            {{- '<|im_end|>\n' -}}
        {%- endif -%}
    {%- else -%}
        {{- raise_exception('Unsupported message role: ' + message.role) -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}
        {{- '<think>\n\n</think>\n\n' -}}
    {%- endif -%}
{%- endif -%}
""".strip()
)

# Llama-3 (3.0-style: no date preamble, no tool prompt). Content is trimmed as in Meta's template.
LLAMA_CHAT_TEMPLATE = (
    _TEXT_OF
    + r"""
{{- '<|begin_of_text|>' -}}
{%- for message in messages -%}
    {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' + (text_of(message.content) | trim) -}}
    {{- '<|eot_id|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
{%- endif -%}
""".strip()
)


class TinyModelConfig(BaseConfig):
    """A tiny random-init causal LM to build locally (tokenizer, chat template, config, weights)."""

    output: Path
    """Directory to write the model into; replaced as a whole if it already exists."""

    family: Literal["qwen3", "llama"] = "qwen3"
    """Architecture, special tokens and chat template to imitate: Qwen3 (ChatML) or Llama-3."""

    alphabet: str = DEFAULT_ALPHABET
    """Characters the training corpus is drawn from; byte-level BPE still encodes any other text."""

    hidden_size: int = 128
    """Width of the residual stream."""

    num_layers: int = 2
    """Number of decoder layers."""

    num_heads: int = 2
    """Number of query attention heads."""

    num_kv_heads: int = 1
    """Number of key/value heads (grouped-query attention); must divide `num_heads`."""

    head_dim: int = 64
    """Per-head dimension; vLLM's CPU attention backend rejects 16, 64 works."""

    intermediate_size: int = 256
    """Hidden width of the SwiGLU MLP."""

    vocab_size: int = 512
    """Target vocabulary size including the special tokens (the BPE may stop short on a tiny corpus)."""

    max_position_embeddings: int = 4096
    """Longest sequence the model config (and the tokenizer's `model_max_length`) allows."""

    tie_word_embeddings: bool = True
    """Share the input embedding with the LM head (then no `lm_head.weight` is stored)."""

    seed: int = 0
    """Seed of the tokenizer corpus and of the weight initialisation."""

    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Dtype of the stored weights and of the config's `dtype`."""


def _added_tokens(family: str) -> list[tuple[str, bool]]:
    return QWEN3_ADDED_TOKENS if family == "qwen3" else LLAMA_ADDED_TOKENS


def _corpus(alphabet: str, seed: int, num_lines: int = 3000) -> Iterator[str]:
    """Deterministic pseudo-text over `alphabet`: Zipf-distributed random words in sentences."""
    rng = random.Random(seed)
    chars = sorted(set(alphabet))
    word_chars = [c for c in chars if c.isalnum()] or [c for c in chars if not c.isspace()] or chars
    punct = [c for c in chars if not c.isalnum() and not c.isspace()]
    space = " " if " " in chars else ""
    lexicon = ["".join(rng.choices(word_chars, k=rng.randint(1, 8))) for _ in range(600)]
    weights = [1.0 / (rank + 1) for rank in range(len(lexicon))]
    yield "".join(chars)  # every character of the alphabet appears at least once
    for _ in range(num_lines):
        words = rng.choices(lexicon, weights=weights, k=rng.randint(3, 14))
        if rng.random() < 0.3:
            words[0] = words[0].capitalize()
        if punct and rng.random() < 0.3:
            i = rng.randrange(len(words))
            words[i] += rng.choice(punct)
        line = space.join(words)
        if punct:
            line += rng.choice(punct)
        if "\n" in chars and rng.random() < 0.5:
            line += "\n"
        yield line


def _build_tokenizer(config: TinyModelConfig):
    """Train the byte-level BPE and wrap it as a `PreTrainedTokenizerFast` with the family's specials."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    added = _added_tokens(config.family)
    byte_alphabet = pre_tokenizers.ByteLevel.alphabet()
    base_size = config.vocab_size - len(added)
    if base_size < len(byte_alphabet):
        raise ValueError(
            f"vocab_size={config.vocab_size} is too small: the byte-level alphabet needs {len(byte_alphabet)} ids "
            f"plus {len(added)} special tokens for family {config.family!r}"
        )

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=base_size,
        initial_alphabet=byte_alphabet,
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(config.alphabet, config.seed), trainer=trainer)
    # One at a time, so ids follow the list order right after the BPE vocabulary.
    for content, special in added:
        tok.add_tokens([AddedToken(content, special=special, normalized=False)])

    if config.family == "qwen3":
        # No BOS: plain `encode` returns just the text's tokens, like Qwen3.
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        specials = dict(eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None)
        extra = [content for content, special in added if special and content not in ("<|im_end|>", "<|endoftext|>")]
        chat_template = QWEN3_CHAT_TEMPLATE
    else:
        # Like Meta's Llama-3 tokenizer: plain `encode` (add_special_tokens=True) prepends <|begin_of_text|>.
        # Chat templating tokenizes with add_special_tokens=False, so the template's own BOS is not doubled.
        bos = "<|begin_of_text|>"
        tok.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(
                    single=f"{bos}:0 $A:0",
                    pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                    special_tokens=[(bos, tok.token_to_id(bos))],
                ),
            ]
        )
        specials = dict(bos_token=bos, eos_token="<|eot_id|>", pad_token="<|finetune_right_pad_id|>")
        extra = [content for content, _ in added if content not in specials.values()]
        chat_template = LLAMA_CHAT_TEMPLATE

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        model_max_length=config.max_position_embeddings,
        clean_up_tokenization_spaces=False,
        extra_special_tokens=extra,
        **specials,
    )
    hf_tok.chat_template = chat_template
    return hf_tok


def _build_model_config(config: TinyModelConfig, tokenizer):
    from transformers import LlamaConfig, Qwen3Config

    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype=config.dtype,
    )
    if config.family == "qwen3":
        return Qwen3Config(**common)
    return LlamaConfig(**common)


def _build_generation_config(config: TinyModelConfig, tokenizer):
    """Stop tokens only: no temperature/top_p/top_k, so servers use each request's sampling."""
    from transformers import GenerationConfig

    if config.family == "qwen3":
        stops = ["<|im_end|>", "<|endoftext|>"]
    else:
        stops = ["<|eot_id|>", "<|end_of_text|>"]
    return GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.convert_tokens_to_ids(t) for t in stops],
        pad_token_id=tokenizer.pad_token_id,
    )


def build_tiny_model(config: TinyModelConfig) -> Path:
    """Write tokenizer, chat template, config, generation config and random weights to `config.output`.

    Everything is written into a temporary sibling directory that is renamed into place at the
    end, so a crash never leaves a half-written model directory. Returns `config.output`.
    """
    import torch
    from transformers import AutoModelForCausalLM

    output = Path(config.output)
    with atomic_dir(output) as tmp:
        tokenizer = _build_tokenizer(config)
        tokenizer.save_pretrained(tmp)

        model_config = _build_model_config(config, tokenizer)
        torch.manual_seed(config.seed)
        # Initialise in float32 (same numbers whatever the target dtype), then cast.
        model = AutoModelForCausalLM.from_config(model_config, dtype=torch.float32)
        model = model.to(getattr(torch, config.dtype))
        model.generation_config = _build_generation_config(config, tokenizer)
        model.save_pretrained(tmp, safe_serialization=True)
    return output


def perturb_weights(src: Path, dst: Path, scale: float = 0.5, seed: int = 1) -> Path:
    """Copy the model directory `src` to `dst`, adding seeded Gaussian noise to every float tensor.

    The noise of a tensor has standard deviation `scale * tensor.std()` (`scale * 0.02` when the
    tensor is constant, e.g. norm weights). Names, shapes, dtypes and all non-weight files are kept.
    `dst` is replaced as a whole if it exists. Returns `dst`.
    """
    import torch
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    with atomic_dir(dst) as work:
        shutil.copytree(src, work, dirs_exist_ok=True)
        generator = torch.Generator().manual_seed(seed)
        for file in sorted(work.glob("*.safetensors")):
            tensors = load_file(str(file))
            for name in sorted(tensors):
                tensor = tensors[name]
                if not tensor.is_floating_point():
                    continue
                values = tensor.float()
                std = values.std().item() if values.numel() > 1 else 0.0
                noise = torch.randn(values.shape, generator=generator) * (scale * (std if std > 0 else 0.02))
                tensors[name] = (values + noise).to(tensor.dtype).contiguous()
            save_file(tensors, str(file), metadata={"format": "pt"})
    return dst


__all__ = ["TinyModelConfig", "build_tiny_model", "perturb_weights"]


def main(argv: list[str] | None = None) -> None:
    """`uv run tiny-model --output DIR [--family llama] [--no-tie-word-embeddings] [--hidden-size 256] ...`"""
    from prime_rl.config.loader import load_config

    config, _ = load_config(TinyModelConfig, "tiny-model", argv)
    path = build_tiny_model(config)
    print(f"wrote {config.family} model ({'tied' if config.tie_word_embeddings else 'untied'} embeddings) to {path}")
