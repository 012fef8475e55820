"""opsd's self-distillation parts (`orchestrator/self_distill.py`): where a task's demonstration is found, the error
without one, the hint block and the token arithmetic that puts it in front of a sample and takes it out again. The
prefill itself against a real server: tests/integration/test_self_distill_server.py; through `rl`:
test_rl.py::test_rl_trains_a_proposer_solver_env_under_hierarchical_grpo."""

import pytest

from prime_rl.config.orchestrator import OrchestratorConfig
from prime_rl.models.tiny import TinyModelConfig
from prime_rl.models.tiny_tokenizer import build_tokenizer
from prime_rl.orchestrator.envs import load_tasks
from prime_rl.orchestrator.self_distill import (
    DemonstrationError,
    SelfDistiller,
    demonstration,
    hint_ids,
    hint_text,
    sample_logprobs,
    splice,
)


def tiny_tokenizer(family: str):
    c = TinyModelConfig(output="unused", family=family)
    return build_tokenizer(
        family=family, vocab_size=c.vocab_size, alphabet=c.alphabet, seed=c.seed, max_length=c.max_position_embeddings
    )


def test_the_demonstration_is_looked_up_in_info_first_then_at_the_top_level():
    both = {"idx": 3, "info": {"demonstration": "from info"}, "demonstration": "top"}
    assert demonstration(both, "demonstration", "e") == "from info"
    assert demonstration({"info": {"other": 1}, "answer": "olleh"}, "answer", "e") == "olleh"
    assert demonstration({"info": {"answer": None}, "answer": "top"}, "answer", "e") == "top"  # null: not there
    assert demonstration({"info": "not a dict", "answer": "top"}, "answer", "e") == "top"
    assert demonstration({"answer": 42}, "answer", "e") == "42"  # non-strings as JSON
    assert demonstration({"info": {"d": [{"role": "assistant", "content": "x"}]}}, "d", "e") == (
        '[{"role": "assistant", "content": "x"}]'
    )


def test_a_task_without_a_demonstration_names_the_env_the_key_and_the_task_fields():
    with pytest.raises(DemonstrationError) as e:
        demonstration({"idx": 7, "prompt": "p", "info": {"hint": "h"}, "answer": None}, "demonstration", "my-env")
    message = str(e.value)
    assert message.startswith("my-env: algo opsd needs a demonstration at the task's info['demonstration']")
    assert "task 7 has neither" in message
    assert "its fields: ['answer', 'idx', 'info', 'prompt'], info's: ['hint']" in message
    assert "algo.demo_key" in message


def test_the_template_is_filled_and_a_bad_one_is_named():
    assert hint_text("Expert: {demonstration} {{ok}}", "olleh", "e") == "Expert: olleh {ok}"
    assert hint_text("no placeholder", "olleh", "e") == "no placeholder"
    with pytest.raises(DemonstrationError, match=r"^e: algo.template 'see {answer}' cannot be filled \(KeyError"):
        hint_text("see {answer}", "olleh", "e")


def test_splice_puts_the_hint_in_front_and_says_where_each_sample_token_went():
    # No BOS: hint of 2 tokens, sample of 3 -> sample token j at j + 2; the first one now has context (position 2).
    assert splice([7, 8], [1, 2, 3], bos=None) == ([7, 8, 1, 2, 3], [2, 3, 4])
    # Both start with BOS 0: it stays once, first; the rest of the hint follows it: [0 | 7 8 | 2 3].
    assert splice([0, 7, 8], [0, 2, 3], bos=0) == ([0, 7, 8, 2, 3], [0, 3, 4])
    # Only the hint starts with BOS (a sample rendered without one): the whole hint block goes in front.
    assert splice([0, 7], [2, 3], bos=0) == ([0, 7, 2, 3], [2, 3])
    # A tokenizer with a BOS its template does not write: nothing is kept back.
    assert splice([7], [0, 2], bos=0) == ([7, 0, 2], [1, 2])
    assert splice([], [5, 6], bos=None) == ([5, 6], [0, 1])


def test_sample_logprobs_drop_the_hint_positions():
    # Prefill of [7, 8, 1, 2, 3]: vLLM's 0.0 for the first token, then one value per position.
    prefill = [0.0, -0.1, -0.2, -0.3, -0.4]
    assert sample_logprobs(prefill, splice([7, 8], [1, 2, 3], None)[1]) == [-0.2, -0.3, -0.4]
    assert sample_logprobs(prefill, splice([0, 7, 8], [0, 2, 3], 0)[1]) == [0.0, -0.3, -0.4]  # the BOS: no context


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_the_spliced_prefill_is_what_the_template_renders_with_the_hint_as_a_leading_system_message(family):
    """The tiny qwen3 tokenizer has no BOS (its hint block is `<|im_start|>system\\n...<|im_end|>\\n`); the llama one
    starts every rendering with `<|begin_of_text|>`. Either way the prefill equals the template's own rendering of the
    conversation with one more system message in front: the sample's tokens are not touched, only moved."""
    tokenizer = tiny_tokenizer(family)
    hint = "An expert's response to the task that follows:\nolleh"
    conversation = [{"role": "system", "content": "Reverse the text."}, {"role": "user", "content": "hello"}]

    def ids(messages):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)

    sample = ids(conversation) + tokenizer.encode("olleh<|im_end|>" if family == "qwen3" else "olleh<|eot_id|>")
    block = hint_ids(tokenizer, hint)
    prompt, positions = splice(block, sample, tokenizer.bos_token_id)
    expected = ids([{"role": "system", "content": hint}, *conversation])
    assert prompt[: len(expected)] == expected
    assert [prompt[p] for p in positions] == sample
    if family == "qwen3":
        assert tokenizer.bos_token_id is None and tokenizer.decode(block) == f"<|im_start|>system\n{hint}<|im_end|>\n"
        assert positions[0] == len(block)
    else:
        assert prompt[0] == sample[0] == tokenizer.bos_token_id and positions[:2] == [0, len(block)]


def test_a_run_whose_tasks_lack_the_demonstration_fails_at_start_and_one_that_has_it_builds_hints(tmp_path):
    """reverse-text's tasks carry `answer` (the reversed text) and no `demonstration` or `info`."""
    missing = OrchestratorConfig(env=[{"id": "reverse-text", "algo": {"type": "opsd"}}])
    tasks = load_tasks(missing.env, missing.seq_len)
    with pytest.raises(DemonstrationError, match=r"^reverse-text: .*info\['demonstration'\].* 'answer'"):
        SelfDistiller.for_run(missing, tasks)
    assert SelfDistiller.for_run(OrchestratorConfig(env=[{"id": "reverse-text"}]), tasks) is None  # no opsd env
    opsd = {"id": "reverse-text", "algo": {"type": "opsd", "demo_key": "answer"}}
    with pytest.raises(
        ValueError, match=r"^reverse-text: algo opsd cannot train a LoRA adapter \(orchestrator.adapter"
    ):
        SelfDistiller.for_run(OrchestratorConfig(adapter={"name": "lora"}, env=[opsd]), tasks)

    model = tmp_path / "model"
    tiny_tokenizer("qwen3").save_pretrained(model)
    algo = {"type": "opsd", "demo_key": "answer", "template": "Answer: {demonstration}"}
    config = OrchestratorConfig(model={"name": str(model)}, env=[{"id": "reverse-text", "algo": algo}])
    distiller = SelfDistiller.for_run(config, tasks)
    task = tasks["reverse-text"].first(1)[0]
    block = distiller.hint("reverse-text", task)
    assert distiller.tokenizer.decode(block) == f"<|im_start|>system\nAnswer: {task['answer']}<|im_end|>\n"
