"""The tiny model's tokenizer: a byte-level BPE trained on a procedurally generated corpus, with the family's special
tokens and chat template (written here, matching the Qwen3 / Llama-3 wire formats). Deterministic: the same arguments
always yields the same tokenizer files."""

from __future__ import annotations

import random
import string
from collections.abc import Iterator

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


def build_tokenizer(*, family: str, vocab_size: int, alphabet: str, seed: int, max_length: int):
    """Train the byte-level BPE and wrap it as a `PreTrainedTokenizerFast` with the family's specials (the fields of
    the same names of `prime_rl.models.tiny.TinyModelConfig`; `max_length` is its `max_position_embeddings`)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    added = _added_tokens(family)
    byte_alphabet = pre_tokenizers.ByteLevel.alphabet()
    base_size = vocab_size - len(added)
    if base_size < len(byte_alphabet):
        raise ValueError(
            f"vocab_size={vocab_size} is too small: the byte-level alphabet needs {len(byte_alphabet)} ids "
            f"plus {len(added)} special tokens for family {family!r}"
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
    tok.train_from_iterator(_corpus(alphabet, seed), trainer=trainer)
    # One at a time, so ids follow the list order right after the BPE vocabulary.
    for content, special in added:
        tok.add_tokens([AddedToken(content, special=special, normalized=False)])

    if family == "qwen3":
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
        model_max_length=max_length,
        clean_up_tokenization_spaces=False,
        extra_special_tokens=extra,
        **specials,
    )
    hf_tok.chat_template = chat_template
    return hf_tok
