"""SFT data: loss masks from real chat templates, JSONL/Parquet loading, and the resumable epoch order."""

import copy
import importlib.util
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from prime_rl.models.tiny import TinyModelConfig, build_tiny_model
from prime_rl.trainer.sft.config import ChatDataConfig, LossMaskConfig
from prime_rl.trainer.sft.data import (
    ChatStream,
    DataError,
    DataState,
    chat_example,
    epoch_order,
    fake_samples,
    load_examples,
    tokenize_example,
    write_examples,
)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    return {
        family: AutoTokenizer.from_pretrained(build_tiny_model(TinyModelConfig(output=root / family, family=family)))
        for family in ("qwen3", "llama")
    }


def chat(*turns: tuple[str, str], system: str | None = None) -> dict:
    """prompt = system + all but the last assistant reply; completion = the last reply."""
    messages = [{"role": "system", "content": system}] if system else []
    for user, assistant in turns:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return {"prompt": messages[:-1], "completion": messages[-1:]}


def trained_spans(tokenizer, ids: list[int], mask: list[bool]) -> list[str]:
    """The decoded text of each run of consecutive trained tokens."""
    spans, run = [], []
    for token, trained in zip(ids, mask, strict=True):
        if trained:
            run.append(token)
        elif run:
            spans.append(tokenizer.decode(run))
            run = []
    return spans + ([tokenizer.decode(run)] if run else [])


TWO_TURNS = chat(("Reverse: abcde", "edcba"), ("Reverse: xyz", "zyx"))


def test_two_turn_mask_is_exactly_the_assistant_replies_and_their_end_tokens(tokenizers):
    tok = tokenizers["llama"]
    [(ids, mask)] = tokenize_example(tok, TWO_TURNS, LossMaskConfig(), "two turns")
    assert ids == tok.apply_chat_template(TWO_TURNS["prompt"] + TWO_TURNS["completion"])["input_ids"]
    # From the ids alone: a turn is <|start_header_id|> role <|end_header_id|> "\n\n" body <|eot_id|>; the body
    # of an assistant turn and its <|eot_id|> are trained, nothing else (not the header that opens the turn).
    header, end_header, eot = tok.convert_tokens_to_ids(["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"])
    newline = tok.encode("\n", add_special_tokens=False)
    expected = [False] * len(ids)
    for start in [i for i, token in enumerate(ids) if token == header]:
        close = ids.index(end_header, start)
        assert ids[close + 1 : close + 3] == newline * 2
        stop = ids.index(eot, close)
        if tok.decode(ids[start + 1 : close]) == "assistant":
            expected[close + 3 : stop + 1] = [True] * (stop - close - 2)
    assert mask == expected
    assert trained_spans(tok, ids, mask) == ["edcba<|eot_id|>", "zyx<|eot_id|>"]


def test_chatml_mask_skips_the_generation_scaffold_and_the_newline_after_the_end_token(tokenizers):
    tok = tokenizers["qwen3"]
    example = chat(("Reverse: abcde", "edcba"), system="Be brief.")
    [(ids, mask)] = tokenize_example(tok, example, LossMaskConfig(), "one turn")
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    last_turn = max(i for i, token in enumerate(ids) if token == im_start)
    think = ids.index(tok.convert_tokens_to_ids("<think>"), last_turn)  # Qwen3 opens the reply with a think block
    assert tok.decode(ids[last_turn:think]) == "<|im_start|>assistant\n"  # the scaffold: prompt, not trained
    assert ids[-2:] == [im_end, *tok.encode("\n", add_special_tokens=False)]
    assert mask == [False] * think + [True] * (len(ids) - 1 - think) + [False]
    assert trained_spans(tok, ids, mask) == ["<think>\n\n</think>\n\nedcba<|im_end|>"]


def test_roles_to_train_are_configurable(tokenizers):
    tok = tokenizers["llama"]
    example = chat(("Reverse: ab", "ba"), system="Be brief.")
    [(ids, mask)] = tokenize_example(tok, example, LossMaskConfig(user=True, assistant=False), "roles")
    assert trained_spans(tok, ids, mask) == ["<|start_header_id|>user<|end_header_id|>\n\nReverse: ab<|eot_id|>"]
    [(ids, mask)] = tokenize_example(tok, example, LossMaskConfig(system=True), "roles")
    # The first token (<|begin_of_text|>) is never trained: nothing predicts it.
    assert trained_spans(tok, ids, mask) == [
        "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>",
        "ba<|eot_id|>",
    ]
    tools = {
        "prompt": [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "Calling."},
            {"role": "tool", "content": "4"},
            {"role": "tool", "content": "ok"},
        ],
        "completion": [{"role": "assistant", "content": "It is 4."}],
    }
    [(ids, mask)] = tokenize_example(tok, tools, LossMaskConfig(assistant=False, tool=True), "tools")
    assert trained_spans(tok, ids, mask) == [
        "<|start_header_id|>tool<|end_header_id|>\n\n4<|eot_id|><|start_header_id|>tool<|end_header_id|>\n\nok<|eot_id|>"
    ]


def test_template_that_rewrites_history_gives_a_sample_per_assistant_turn(tokenizers):
    # Qwen3's template gives only the assistant turns after the last user message a think block, so turn 1
    # renders differently once turn 2 exists: each reply is trained in the context the model had when writing it.
    tok = tokenizers["qwen3"]
    messages = TWO_TURNS["prompt"] + TWO_TURNS["completion"]
    (ids_1, mask_1), (ids_2, mask_2) = tokenize_example(tok, TWO_TURNS, LossMaskConfig(), "two turns")
    assert ids_1 == tok.apply_chat_template(messages[:2])["input_ids"]
    assert ids_2 == tok.apply_chat_template(messages)["input_ids"]
    assert "<|im_start|>assistant\nedcba<|im_end|>" in tok.decode(ids_2)  # turn 1 without its think block
    assert trained_spans(tok, ids_1, mask_1) == ["<think>\n\n</think>\n\nedcba<|im_end|>"]
    assert trained_spans(tok, ids_2, mask_2) == ["<think>\n\n</think>\n\nzyx<|im_end|>"]
    # The stream counts examples, not samples: two examples, three samples.
    one_turn = chat(("Reverse: ab", "ba"))
    [(ids_3, _)] = tokenize_example(tok, one_turn, LossMaskConfig(), "one turn")
    stream = ChatStream([TWO_TURNS, one_turn], tok, ChatDataConfig(name="mem", shuffle=False), seq_len=256, seed=0)
    samples, example_ids = stream.take(2)
    assert example_ids == [0, 1]
    assert [sample.token_ids for sample in samples] == [ids_1, ids_2, ids_3]


def test_template_that_changes_earlier_text_even_per_turn_is_an_error_naming_the_sample(tokenizers):
    tok = copy.deepcopy(tokenizers["llama"])
    # Marks the last message, so no rendering is ever a prefix of a longer one.
    tok.chat_template = (
        "{% for m in messages %}{{ m.role }}: {{ m.content }}{% if loop.last %} (last){% endif %}\n{% endfor %}"
    )
    with pytest.raises(DataError, match="example 7 of data.jsonl: the chat template renders the first 1 messages"):
        tokenize_example(tok, chat(("Reverse: ab", "ba")), LossMaskConfig(), "example 7 of data.jsonl")


def test_malformed_example_names_the_sample(tokenizers):
    bad = {"prompt": [{"role": "narrator", "content": "x"}], "completion": []}
    with pytest.raises(DataError, match="example 3: message 0 needs a role"):
        tokenize_example(tokenizers["llama"], bad, LossMaskConfig(), "example 3")
    with pytest.raises(DataError, match="`completion` must be a list"):
        tokenize_example(tokenizers["llama"], {"prompt": []}, LossMaskConfig(), "example 4")


ROWS = [
    chat(("Reverse: abc", "cba"), system="Be brief."),
    {
        "prompt": [{"role": "user", "content": "2+2?"}],
        "completion": [
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"type": "function", "function": {"name": "calc", "arguments": '{"x": "2+2"}'}}],
            }
        ],
        "tools": json.dumps([{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]),
    },
    chat(("Reverse: xy", "yx")),
]


def test_jsonl_and_parquet_give_the_same_samples(tokenizers, tmp_path):
    jsonl = tmp_path / "data.jsonl"
    jsonl.write_text("".join(json.dumps(row) + "\n" for row in ROWS) + "\n")
    parquet_dir = tmp_path / "parquet"
    parquet_dir.mkdir()
    # Two files, read in name order. Parquet gives every row every key of its column (tool_calls, tools): None
    # where a row had none. (Columns, not `from_pylist`, which would take the columns of the first row only.)
    for name, rows in (("part-0", ROWS[:2]), ("part-1", ROWS[2:])):
        columns = {key: [row.get(key) for row in rows] for key in ("prompt", "completion", "tools")}
        pq.write_table(pa.table(columns), parquet_dir / f"{name}.parquet")
    from_jsonl = load_examples(ChatDataConfig(name=str(jsonl)))
    from_parquet = load_examples(ChatDataConfig(name=str(parquet_dir)))
    assert len(from_jsonl) == len(from_parquet) == 3
    assert from_parquet[0]["completion"][0].get("tool_calls", "missing") is None  # the files do differ
    tok = tokenizers["qwen3"]
    for i, (a, b) in enumerate(zip(from_jsonl, from_parquet, strict=True)):
        [sample] = tokenize_example(tok, a, LossMaskConfig(), f"example {i}")
        assert [sample] == tokenize_example(tok, b, LossMaskConfig(), f"example {i}")
        assert any(sample[1])
    [(ids, _)] = tokenize_example(tok, from_parquet[1], LossMaskConfig(), "tools")
    assert '"name": "calc"' in tok.decode(ids)  # tools and tool calls survived the round trip


def test_written_examples_read_back_and_train_only_the_answer(tokenizers, tmp_path):
    rows = [chat_example("Reverse the text.", "Reverse: ab", "ba"), chat_example(None, "Reverse: xyz", "zyx")]
    write_examples(tmp_path / "sft.jsonl", rows)
    assert [p.name for p in tmp_path.iterdir()] == ["sft.jsonl"]  # no temp file left beside it
    examples = load_examples(ChatDataConfig(name=str(tmp_path / "sft.jsonl")))
    assert list(examples) == rows
    assert [m["role"] for m in examples[0]["prompt"]] == ["system", "user"]
    assert [m["role"] for m in examples[1]["prompt"]] == ["user"]  # no empty system message
    tok = tokenizers["qwen3"]
    [(ids, mask)] = tokenize_example(tok, examples[0], LossMaskConfig(), "example 0")
    # Qwen3's template opens the answer with an empty think block; the prompt is never trained.
    assert tok.decode([t for t, m in zip(ids, mask, strict=True) if m]) == "<think>\n\n</think>\n\nba<|im_end|>"


def test_missing_files_and_hub_names_fail_clearly(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_examples(ChatDataConfig(name=str(tmp_path / "nope.jsonl")))
    (tmp_path / "bad.jsonl").write_text('{"prompt": []}\nnot json\n')
    with pytest.raises(DataError, match="bad.jsonl:2: not valid JSON"):
        load_examples(ChatDataConfig(name=str(tmp_path / "bad.jsonl")))
    if importlib.util.find_spec("datasets") is None:
        with pytest.raises(DataError, match="needs the `datasets` package"):
            load_examples(ChatDataConfig(name="some-org/some-dataset"))


def test_epoch_order_is_a_seeded_permutation_per_epoch():
    orders = [epoch_order(50, epoch, seed=3, shuffle=True) for epoch in range(3)]
    assert all(sorted(order) == list(range(50)) for order in orders)
    assert orders[0] != orders[1] != orders[2]
    assert orders[1] == epoch_order(50, 1, seed=3, shuffle=True)
    assert orders[0] != epoch_order(50, 0, seed=4, shuffle=True)
    assert epoch_order(5, 2, seed=3, shuffle=False) == [0, 1, 2, 3, 4]


def test_stream_resumes_exactly_skips_unusable_examples_and_cuts_long_ones(tokenizers):
    tok = tokenizers["llama"]
    examples = [chat((f"Reverse: {'ab' * (i % 4 + 1)}", "x" * (i % 4 + 1))) for i in range(10)]
    examples[2] = chat(("Reverse: " + "a b " * 40, "b a " * 40))  # the prompt alone fills seq_len: skipped
    examples[7] = chat(("Reverse: ab", "b a " * 40))  # longer than seq_len: trained on its first 64 tokens
    examples[5] = {"prompt": [{"role": "user", "content": "hi"}], "completion": []}  # nothing to train
    config = ChatDataConfig(name="mem")

    def stream() -> ChatStream:
        return ChatStream(examples, tok, config, seq_len=64, seed=1)

    straight = stream()
    ids = [straight.take(3)[1] for _ in range(7)]  # 21 usable samples: into the third epoch of 8 usable ones
    epochs = [epoch_order(10, e, seed=1, shuffle=True) for e in range(3)]
    assert [i for step in ids for i in step] == [i for e in epochs for i in e if i not in (2, 5)][:21]
    assert straight.state.epoch == 2
    consumed = epochs[0] + epochs[1] + epochs[2][: straight.state.index]  # the last one read was used
    assert consumed[-1] == ids[-1][-1]
    assert (straight.state.skipped_too_long, straight.state.skipped_no_loss) == (consumed.count(2), consumed.count(5))
    assert straight.state.truncated == consumed.count(7)
    (cut,), _ = ChatStream([examples[7]], tok, config, seq_len=64, seed=1).take(1)
    full = tokenize_example(tok, examples[7], config.loss_mask, "x")[0]
    assert len(full[0]) > 64 and cut.token_ids == full[0][:64] and cut.loss_mask == full[1][:64]

    first = stream()
    for _ in range(4):
        first.take(3)
    saved = DataState(**vars(first.state))  # what a checkpoint after step 4 holds
    resumed = stream()
    resumed.state = saved
    assert [resumed.take(3)[1] for _ in range(3)] == ids[4:]
    assert resumed.state == straight.state


def test_stream_with_nothing_usable_is_an_error(tokenizers):
    examples = [{"prompt": [{"role": "user", "content": "hi"}], "completion": []}] * 3
    with pytest.raises(DataError, match="no usable example"):
        ChatStream(examples, tokenizers["llama"], ChatDataConfig(name="mem"), seq_len=64, seed=0).take(1)


def test_fake_samples_are_a_function_of_seed_and_step():
    fixed = fake_samples(seed=3, step=2, count=4, seq_len=64, vocab_size=100)
    assert [len(s.token_ids) for s in fixed] == [64] * 4
    assert all(s.loss_mask == [False] + [True] * 63 for s in fixed)
    assert [s.token_ids for s in fake_samples(3, 2, 4, 64, 100)] == [s.token_ids for s in fixed]
    assert [s.token_ids for s in fake_samples(3, 3, 4, 64, 100)] != [s.token_ids for s in fixed]
    variable = fake_samples(seed=3, step=2, count=32, seq_len=64, vocab_size=100, variable_length=True)
    lengths = [len(s.token_ids) for s in variable]
    assert min(lengths) >= 8 and max(lengths) <= 64 and len(set(lengths)) > 4  # uniform in [seq_len / 8, seq_len]
    assert all(s.loss_mask == [False] + [True] * (len(s.token_ids) - 1) for s in variable)


# --- rendering with the renderer RL samples with -------------------------------------------------------------------

COMPACT = {"name": "custom", "import_path": "prime_rl.models.renderers.CompactToolsQwen3Renderer"}
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"properties": {"key": {}}}}}]
TOOL_CALL = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": {"key": "PZBH"}}}
TOOL_CHAT = {
    "prompt": [{"role": "system", "content": "find the code."}, {"role": "user", "content": "code of PZBH?"}],
    "completion": [
        {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": "1942"},
        {"role": "assistant", "content": "1942"},
    ],
    "tools": TOOLS,
}


def renderer_for(tokenizer, config: dict):
    from renderers import create_renderer

    from prime_rl.config.orchestrator import renderer_config

    return create_renderer(tokenizer, renderer_config(config, "data.renderer"))


@pytest.mark.parametrize("config", [{"name": "qwen3"}, COMPACT])
def test_rendered_tool_chat_is_one_sample_that_trains_what_the_model_samples(tokenizers, config):
    from prime_rl.trainer.sft.data import tokenize_rendered

    tok = tokenizers["qwen3"]
    renderer = renderer_for(tok, {**config, "enable_thinking": False})
    ids, mask = tokenize_rendered(renderer, TOOL_CHAT, LossMaskConfig(), "ex")
    assert ids == list(renderer.render(TOOL_CHAT["prompt"] + TOOL_CHAT["completion"], tools=TOOLS).token_ids)
    think = "<think>\n\n</think>\n\n"  # Qwen3's renderer counts the empty think block as the model's own
    call = '<tool_call>\n{"name": "lookup", "arguments": {"key": "PZBH"}}\n</tool_call><|im_end|>'
    assert trained_spans(tok, ids, mask) == [think + call, think + "1942<|im_end|>"]
    text = tok.decode(ids)
    assert ("Tools: lookup(key)" in text) == (config == COMPACT) and ("# Tools" in text) != (config == COMPACT)
    # Qwen3's chat template drops the first turn's think block once the answer follows, and so needs a sample per
    # turn; the renderer keeps it, as RL's bridging keeps the sampled tokens: one sample holds both turns.
    assert len(tokenize_example(tok, TOOL_CHAT, LossMaskConfig(), "ex")) == 2

    # Tool results train when asked for, whole (the renderer never marks them as sampled).
    _, with_tool = tokenize_rendered(renderer, TOOL_CHAT, LossMaskConfig(tool=True), "ex")
    assert any("<tool_response>\n1942\n</tool_response>" in span for span in trained_spans(tok, ids, with_tool))


def test_rendered_sample_is_the_token_sequence_rl_samples_and_bridges(tokenizers):
    """Each turn's context in the SFT sample is exactly what RL's renderer gives the model at that turn: the prompt
    with its generation prompt, the tokens sampled before, and the bridge to the next turn."""
    from prime_rl.trainer.sft.data import tokenize_rendered

    tok = tokenizers["qwen3"]
    renderer = renderer_for(tok, {**COMPACT, "enable_thinking": False})
    ids, mask = tokenize_rendered(renderer, TOOL_CHAT, LossMaskConfig(), "ex")
    prompt = list(renderer.render(TOOL_CHAT["prompt"], tools=TOOLS, add_generation_prompt=True).token_ids)
    first = tok.encode('<tool_call>\n{"name": "lookup", "arguments": {"key": "PZBH"}}\n</tool_call><|im_end|>')
    assert ids[: len(prompt) + len(first)] == prompt + first
    bridged = renderer.bridge_to_next_turn(prompt, first, [TOOL_CHAT["completion"][1]], tools=TOOLS)
    second = tok.encode("1942<|im_end|>")
    assert ids[: len(bridged.token_ids) + len(second)] == list(bridged.token_ids) + second
    assert mask[len(bridged.token_ids) : len(bridged.token_ids) + len(second)] == [True] * len(second)


def test_stream_renders_with_the_configured_renderer_and_bad_configs_fail_clearly(tokenizers):
    tok = tokenizers["qwen3"]
    config = ChatDataConfig(name="x", renderer={**COMPACT, "enable_thinking": False})
    stream = ChatStream([TOOL_CHAT, TOOL_CHAT], tok, config, seq_len=512, seed=0)
    samples, ids = stream.take(2)
    assert ids in ([0, 1], [1, 0]) and len(samples) == 2  # one sample per conversation
    assert "Tools: lookup(key)" in tok.decode(samples[0].token_ids)
    with pytest.raises(ValueError, match="data.renderer .* is not a valid renderers config"):
        ChatStream([TOOL_CHAT], tok, ChatDataConfig(name="x", renderer={"name": "no-such"}), seq_len=512, seed=0)
