"""SFT data: chat examples -> token ids with a per-token loss mask, served in a seeded, resumable order.

An example is a row with `prompt` and `completion` (OpenAI message lists) and optionally `tools`. The
conversation is rendered with the model's chat template, then the loss mask is built message by message:
the template is rendered up to the end of each message, and the characters each rendering adds belong to
that message's role. Right before an assistant message the preceding turns are rendered with the generation
prompt, so the scaffold that opens the turn (`<|im_start|>assistant\n`) is its own, never trained, span; the
model only learns what it would have to generate itself, up to and including its end-of-turn token.
Working on characters and tokenizing the whole text once (with offsets) keeps the ids exactly those of
`apply_chat_template`, even where BPE merges tokens across a span boundary. Templates that re-render earlier
turns once later ones follow (Qwen3's) get one sample per trained message instead, see `tokenize_example`.
With `data.renderer` set, the renderer RL samples with renders the conversation instead (`tokenize_rendered`).
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from jinja2 import TemplateError
from loguru import logger

from prime_rl.batch import TrainingSample
from prime_rl.trainer.sft.config import ChatDataConfig, LossMaskConfig
from prime_rl.utils.fs import write_atomic

ROLES = ("system", "user", "assistant", "tool")


class DataError(ValueError):
    """A dataset or example that cannot be trained on; the message names the file or the example."""


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    with open(path) as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{line_number}: not valid JSON: {e}") from None
    return rows


def _read_parquet(path: Path) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


READERS = {".jsonl": _read_jsonl, ".parquet": _read_parquet}


def _load_hub(name: str, split: str):
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"data.name={name!r} is not a local file or directory; loading it from the Hugging Face hub "
            "needs the `datasets` package (`uv pip install datasets`), or point data.name at .jsonl/.parquet files"
        ) from None
    return datasets.load_dataset(name, split=split)  # a map-style dataset: len() and rows by index


def load_examples(config: ChatDataConfig) -> Sequence[dict]:
    """All rows of a local file or directory (files in name order), else of a hub dataset split."""
    path = Path(config.name).expanduser()
    looks_local = path.suffix in READERS or config.name.startswith(("/", ".", "~"))
    if not path.exists():
        if looks_local:
            raise DataError(f"data.name={config.name!r}: no such file or directory")
        examples = _load_hub(config.name, config.split)
    else:
        files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.suffix in READERS)
        if not files or any(file.suffix not in READERS for file in files):
            raise DataError(f"{path}: expected a .jsonl or .parquet file, or a directory holding some")
        examples = [row for file in files for row in READERS[file.suffix](file)]
    if len(examples) == 0:
        raise DataError(f"data.name={config.name!r} holds no examples")
    return examples


def _drop_nones(value):
    """Parquet (and hub datasets) give every message every key seen in the column, unset ones as None;
    dropping them makes a row read the same whatever file format it came from."""
    if isinstance(value, dict):
        return {k: _drop_nones(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nones(v) for v in value]
    return value


def chat_example(system_prompt: str | None, user: str, answer: str) -> dict:
    """One single-turn row in the form `load_examples` reads: how the SFT-data scripts turn a task into a
    demonstration with the same system prompt and user message that RL and eval later send."""
    prompt = [{"role": "system", "content": system_prompt}] if system_prompt else []
    prompt.append({"role": "user", "content": user})
    return {"prompt": prompt, "completion": [{"role": "assistant", "content": answer}]}


def write_examples(path: Path, rows: Sequence[dict]) -> None:
    """JSONL rows, written atomically: an interrupted script leaves no half file for SFT to read."""
    write_atomic(path, "".join(json.dumps(row) + "\n" for row in rows).encode())


# ---------------------------------------------------------------------------------------------
# Tokenisation and loss mask
# ---------------------------------------------------------------------------------------------


def _messages_and_tools(example: dict, name: str) -> tuple[list[dict], list[dict] | None]:
    example = _drop_nones(example)
    messages = []
    for column in ("prompt", "completion"):
        value = example.get(column)
        if not isinstance(value, list):
            raise DataError(f"{name}: `{column}` must be a list of messages, got {type(value).__name__}")
        messages.extend(value)
    if not messages:
        raise DataError(f"{name}: no messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise DataError(f"{name}: message {i} needs a role out of {ROLES}, got {message!r:.200}")
    tools = example.get("tools")
    if isinstance(tools, str):  # often stored as a JSON string: tool schemas do not fit one Parquet type
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise DataError(f"{name}: `tools` is not valid JSON: {e}") from None
    return messages, tools or None


@dataclass
class _Span:
    text: str
    """The conversation rendered up to the end of this span; the span is what it adds to the previous one."""
    trained: bool
    count: int
    """Messages rendered."""


def _message_spans(messages: list[dict], roles: LossMaskConfig, render) -> list[_Span]:
    """One span per message (a run of tool results is one), plus an untrained span for the scaffold that opens
    each assistant turn (rendered with the generation prompt)."""
    spans = []
    for i, message in enumerate(messages):
        role = message["role"]
        if role == "assistant":
            spans.append(_Span(render(i, generation_prompt=True), False, i))
        if role == "tool" and i + 1 < len(messages) and messages[i + 1]["role"] == "tool":
            continue
        spans.append(_Span(render(i + 1), getattr(roles, role), i + 1))
    return spans


def _tokenize_spans(tokenizer, spans: list[_Span]) -> tuple[list[int], list[bool]] | None:
    """Ids of the last span's rendering and the per-token mask; None if an earlier rendering is not a prefix of
    it (the template rewrote an earlier turn once later ones followed)."""
    text = spans[-1].text
    ends: list[int] = []
    for span in spans:
        if not text.startswith(span.text) or (ends and len(span.text) < ends[-1]):
            return None
        ends.append(len(span.text))
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids: list[int] = encoding["input_ids"]
    # A token belongs to the span its first character is in.
    span_of = [bisect.bisect_right(ends, start) for start, _ in encoding["offset_mapping"]]
    mask = [spans[k].trained for k in span_of]
    last_end_token = {
        k: t for t, (token, k) in enumerate(zip(ids, span_of, strict=True)) if token == tokenizer.eos_token_id
    }
    for t, k in enumerate(span_of):
        if k in last_end_token and t > last_end_token[k]:
            mask[t] = False
    if mask:
        mask[0] = False
    return ids, mask


def tokenize_example(tokenizer, example: dict, roles: LossMaskConfig, name: str) -> list[tuple[list[int], list[bool]]]:
    """Token ids of the rendered conversation and, per token, whether it is trained on.

    One sample when the template only appends. A template that rewrites earlier turns once later ones follow
    (Qwen3's drops the think block of every assistant turn before the last user message) gives one sample per
    trained message instead: the conversation up to that message, rendered as the model saw it when it wrote
    it, with only that message trained. More tokens, but no turn is trained on a context it was never given.

    A consecutive run of tool results is one span (templates such as Qwen3's wrap the run in one turn).
    The first token is never trained (nothing predicts it), nor are tokens of a trained message that come
    after its last end-of-turn token (ChatML's "\\n" after `<|im_end|>`: generation stops before it).
    """
    messages, tools = _messages_and_tools(example, name)

    def render(count: int, generation_prompt: bool = False) -> str:
        try:
            return tokenizer.apply_chat_template(
                messages[:count], tools=tools, tokenize=False, add_generation_prompt=generation_prompt
            )
        except TemplateError as e:
            raise DataError(f"{name}: the chat template failed on the first {count} messages: {e}") from None

    spans = _message_spans(messages, roles, render)
    if (whole := _tokenize_spans(tokenizer, spans)) is not None:
        return [whole]
    samples = []
    for k, span in enumerate(spans):
        if not span.trained:
            continue
        sample = _tokenize_spans(tokenizer, spans[max(k - 1, 0) : k + 1])
        if sample is None:
            raise DataError(
                f"{name}: the chat template renders the first {spans[k - 1].count} messages differently once "
                f"message {span.count - 1} follows, so its tokens cannot be told apart from theirs"
            )
        samples.append(sample)
    return samples


def tokenize_rendered(renderer, example: dict, roles: LossMaskConfig, name: str) -> tuple[list[int], list[bool]]:
    """Token ids of the conversation as `renderer` renders it and, per token, whether it is trained on.

    One sample for any number of turns: the renderer renders earlier turns exactly as RL's bridging leaves them
    (the sampled tokens), so every turn's context is the one it is sampled in. Per token the renderer says which
    message it belongs to and whether the model would sample it: an assistant message trains only its sampled
    tokens (not the `<|im_start|>assistant` that opens the turn); other trained roles train all their tokens.
    """
    messages, tools = _messages_and_tools(example, name)
    try:
        rendered = renderer.render(messages, tools=tools)
    except Exception as e:  # a renderer refuses what it cannot render with assorted exception types
        raise DataError(f"{name}: the renderer failed: {type(e).__name__}: {e}") from None
    if len(rendered.sampled_mask) != len(rendered.token_ids):
        raise DataError(
            f"{name}: renderer {type(renderer).__name__} does not say which tokens the model samples; "
            "leave data.renderer unset to render with the chat template"
        )
    mask = []
    for index, sampled in zip(rendered.message_indices, rendered.sampled_mask, strict=True):
        role = messages[index]["role"] if index >= 0 else None
        mask.append(bool(role and getattr(roles, role) and (sampled or role != "assistant")))
    if mask:
        mask[0] = False
    return list(rendered.token_ids), mask


def sft_sample(token_ids: list[int], loss_mask: list[bool]) -> TrainingSample:
    """A packable sample: the RL-only per-token fields are zeros."""
    n = len(token_ids)
    return TrainingSample(token_ids=token_ids, loss_mask=loss_mask, inference_logprobs=[0.0] * n, advantages=[0.0] * n)


# ---------------------------------------------------------------------------------------------
# Order
# ---------------------------------------------------------------------------------------------


def epoch_order(num_examples: int, epoch: int, seed: int, shuffle: bool) -> list[int]:
    """The example ids of one epoch, in visiting order: a permutation drawn from (seed, epoch) alone."""
    if not shuffle:
        return list(range(num_examples))
    return np.random.default_rng([seed, epoch]).permutation(num_examples).tolist()


@dataclass
class DataState:
    """Where the example stream stands; saved in checkpoints so a resumed run reads on from the same example."""

    epoch: int = 0
    """Epoch of the next example."""
    index: int = 0
    """Examples of that epoch's order already read (used or skipped)."""
    skipped_too_long: int = 0
    """Examples read so far whose trained tokens all lie beyond `seq_len`."""
    skipped_no_loss: int = 0
    """Examples read so far without a single trained token."""
    truncated: int = 0
    """Examples read so far that were longer than `seq_len` and trained on their first `seq_len` tokens."""


class ChatStream:
    """Tokenized samples epoch after epoch; each epoch visits every example once, in `epoch_order`.

    `state` says where the stream stands; set it from a checkpoint to continue a run's stream exactly.
    """

    def __init__(self, examples: Sequence[dict], tokenizer, config: ChatDataConfig, seq_len: int, seed: int):
        self.renderer = None
        if config.renderer is not None:
            from renderers import create_renderer

            from prime_rl.config.orchestrator import renderer_config

            self.renderer = create_renderer(tokenizer, renderer_config(config.renderer, "data.renderer"))
        elif not getattr(tokenizer, "is_fast", False):
            raise DataError("sft needs a fast tokenizer (character offsets of tokens build the loss mask)")
        elif not tokenizer.chat_template:
            raise DataError("the model's tokenizer has no chat template to render the conversations with")
        self.examples, self.tokenizer, self.config = examples, tokenizer, config
        self.seq_len, self.seed = seq_len, seed
        self.state = DataState()
        self._order: tuple[int, list[int]] | None = None  # (epoch, order), cached
        self._said_branched = False

    def _next_id(self) -> int:
        if self.state.index >= len(self.examples):
            self.state.epoch += 1
            self.state.index = 0
        if self._order is None or self._order[0] != self.state.epoch:
            order = epoch_order(len(self.examples), self.state.epoch, self.seed, self.config.shuffle)
            self._order = (self.state.epoch, order)
        self.state.index += 1
        return self._order[1][self.state.index - 1]

    def take(self, count: int) -> tuple[list[TrainingSample], list[int]]:
        """The samples of the next `count` usable examples and their example ids (an example gives several
        samples where the template rewrites history); unusable examples are skipped and counted."""
        samples, ids = [], []
        skipped_in_a_row = 0
        while len(ids) < count:
            example_id = self._next_id()
            name = f"example {example_id} of {self.config.name}"
            example, roles = self.examples[example_id], self.config.loss_mask
            if self.renderer is not None:
                pieces = [tokenize_rendered(self.renderer, example, roles, name)]
            else:
                pieces = tokenize_example(self.tokenizer, example, roles, name)
            # As upstream prime-rl: an over-long sample is trained on its first seq_len tokens.
            longest = max(len(token_ids) for token_ids, _ in pieces)
            has_loss = any(any(loss_mask) for _, loss_mask in pieces)
            pieces = [(ids[: self.seq_len], mask[: self.seq_len]) for ids, mask in pieces if any(mask[: self.seq_len])]
            if not pieces:
                too_long = has_loss
                if too_long:
                    self.state.skipped_too_long += 1
                else:
                    self.state.skipped_no_loss += 1
                reason = f"no trained token within seq_len={self.seq_len}" if too_long else "no trained token"
                if (self.state.skipped_too_long if too_long else self.state.skipped_no_loss) == 1:
                    logger.warning(f"skipping {name}: {reason} (further skips are counted in the step lines)")
                else:
                    logger.debug(f"skipping {name}: {reason}")
                skipped_in_a_row += 1
                if skipped_in_a_row >= len(self.examples):
                    raise DataError(
                        f"no usable example in {self.config.name}: none has a trained token within "
                        f"seq_len={self.seq_len} (loss_mask: {self.config.loss_mask.model_dump()})"
                    )
                continue
            if len(pieces) > 1 and not self._said_branched:
                self._said_branched = True
                logger.info(
                    f"{name}: the chat template rewrites earlier turns once later ones follow, so each trained "
                    f"message becomes its own sample with the conversation before it as context ({len(pieces)} "
                    "samples here); multi-turn examples cost more tokens with this template"
                )
            skipped_in_a_row = 0
            if longest > self.seq_len:
                self.state.truncated += 1
                if self.state.truncated == 1:
                    logger.warning(f"{name}: {longest} tokens, trained on its first seq_len={self.seq_len} (counted)")
            samples.extend(sft_sample(token_ids, loss_mask) for token_ids, loss_mask in pieces)
            ids.append(example_id)
        return samples, ids


def fake_samples(
    seed: int, step: int, count: int, seq_len: int, vocab_size: int, variable_length: bool = False
) -> list[TrainingSample]:
    """`count` samples of `seq_len` random tokens (lengths uniform in [seq_len/8, seq_len] when
    `variable_length`), all trained but the first; a function of (seed, step)."""
    rng = np.random.default_rng([seed, step])
    rows = rng.integers(0, vocab_size, size=(count, seq_len)).tolist()
    if variable_length:
        lengths = rng.integers(max(2, seq_len // 8), seq_len + 1, size=count).tolist()
        rows = [row[:n] for row, n in zip(rows, lengths, strict=True)]
    return [sft_sample(row, [False] + [True] * (len(row) - 1)) for row in rows]
