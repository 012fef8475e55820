"""A real pretrained model end to end: SmolLM2-135M-Instruct (BPE, vocabulary 49,152, tied embeddings, ChatML with a
default system prompt), built once per session from the wheel in uv's cache (conftest's `smollm2`), served by one
vLLM server for this module (fp32, the trainer's dtype), then: stop tokens, multi-turn rollouts token for token,
no drift from re-tokenising, the SFT data path, one `rl` run with a weight swap, and `eval`.

The orchestrator picks no model-specific renderer for this model (none is registered): renderers' DefaultRenderer
applies the chat template, as a user gets it. The rollouts run without a system message, so the template's default
one ("You are a helpful AI assistant named SmolLM, ...") opens every prompt."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from conftest import API_KEY, RUN_SECRET
from safetensors.torch import load_file
from token_spans import masked_runs, responses_by_prompt, spy_generations
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from prime_rl.inference.process import InferenceServer
from prime_rl.utils.net import free_port
from prime_rl.utils.secret import SECRET_VAR

pytestmark = pytest.mark.slow

KEY_VAR = "PRIME_TEST_API_KEY"
BIN = Path(sys.executable).parent
DEFAULT_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
# The tiny-model tests' bound (test_inference_server.py, test_orchestrator.py): vLLM in bf16 against transformers in
# fp32 from the same bf16 weights, measured ~0.01-0.02 there, while wrong weights move logprobs by > 0.5. This server
# computes in fp32 like transformers, so only kernel differences remain (measured 3e-5) and the same bound holds with
# room to spare. Served in bf16 (vLLM's "auto" for this bf16 checkpoint) the same comparison measured up to 0.22
# (mean 0.04, mismatch KL ~1.5e-3) over 8 sampled answers of 48 tokens (2026-11-26, 2-core CPU): 30 layers of bf16
# rounding are not 2, which is why this server (as benchmarks/configs/smollm2-135m) samples in the trainer's fp32.
LOGPROB_ATOL = 0.05
# The trainer's mismatch KL is the mean over loss tokens of k3 = exp(d) - 1 - d ~ d^2 / 2, d the trainer's logprob
# minus the sampler's: tokens within LOGPROB_ATOL of each other give at most LOGPROB_ATOL^2 / 2. A trainer that saw
# other tokens than the sampler (re-tokenised text, a shifted mask) or other weights is far above it.
MISMATCH_KL_MAX = LOGPROB_ATOL**2 / 2


@pytest.fixture(scope="module")
def smol(smollm2, tmp_path_factory):
    """The module's one server on SmolLM2 (short context, few sequences: this machine has 2 cores). It accepts the
    in-memory broadcast of the `rl` run's trainer on `broadcast_port`, and weights from under `root` (eval)."""
    root = tmp_path_factory.mktemp("smollm2-run")
    broadcast_port = free_port()
    extra = ["--model.enforce-eager", "--model.max-model-len", "512", "--model.dtype", "float32"]
    extra += ["--max-num-seqs", "16", "--allowed-weight-roots", str(root)]
    extra += ["--weight-broadcast.type", "gloo", "--weight-broadcast.port", str(broadcast_port)]
    extra += ["--weight-broadcast.timeout", "60"]
    srv = InferenceServer(smollm2.path, root / "server", extra=extra, api_key=API_KEY, env={SECRET_VAR: RUN_SECRET})
    srv.wait_healthy()
    print(f"SmolLM2 server started in {srv.startup_seconds:.0f}s")
    srv.root, srv.base, srv.broadcast_port = root, smollm2.path, broadcast_port
    srv.tokenizer = AutoTokenizer.from_pretrained(smollm2.path)
    srv.model_name = httpx.get(f"{srv.url}/v1/models", headers=srv.headers, timeout=30).json()["data"][0]["id"]
    # An empty system prompt file for the tasksets (verifiers reads `system_prompt` overrides from a file): the
    # harness then sends no system message and the template's default one applies.
    srv.no_system = root / "no-system-prompt.txt"
    srv.no_system.write_text("")
    yield srv
    srv.stop()


def default_renderer(tokenizer):
    from renderers import create_renderer

    renderer = create_renderer(tokenizer, None)  # what the orchestrator builds for a model without renderer config
    assert type(renderer).__name__ == "DefaultRenderer"
    return renderer


CONVERSATION = [
    {"role": "user", "content": "Guess my number from 1 to 32. You have 3 guesses."},
    {"role": "assistant", "content": "16"},
    {"role": "user", "content": "higher"},
    {"role": "assistant", "content": " I guess 24.\n"},
    {"role": "user", "content": "lower"},
    {"role": "assistant", "content": "My guess: 20"},
]


def test_sft_data_and_the_renderer_render_the_default_system_prompt_alike(smollm2):
    """SFT's sample of a multi-turn conversation without a system message is the sampler's view of it: before each
    assistant turn exactly the prompt the renderer sends (the default system prompt once, at the start), and trained
    exactly on each reply's tokens and its end-of-turn token, as RL trains what the sampler returned."""
    from prime_rl.trainer.sft.config import LossMaskConfig
    from prime_rl.trainer.sft.data import tokenize_example

    tokenizer = AutoTokenizer.from_pretrained(smollm2.path)
    renderer = default_renderer(tokenizer)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    example = {"prompt": CONVERSATION[:1], "completion": CONVERSATION[1:]}
    [(ids, mask)] = tokenize_example(tokenizer, example, LossMaskConfig(), "conversation")

    assert tokenizer.decode(ids).startswith(DEFAULT_SYSTEM) and tokenizer.decode(ids).count("SmolLM") == 1
    assert ids == renderer.render(CONVERSATION).token_ids
    trained = []
    for i, message in enumerate(CONVERSATION):
        if message["role"] != "assistant":
            continue
        prompt = renderer.render(CONVERSATION[:i], add_generation_prompt=True).token_ids
        reply = tokenizer.encode(message["content"], add_special_tokens=False) + [end]
        assert ids[: len(prompt)] == prompt  # the sampler's prompt for this turn, token for token
        assert ids[len(prompt) : len(prompt) + len(reply)] == reply
        trained += range(len(prompt), len(prompt) + len(reply))
    assert [i for i, m in enumerate(mask) if m] == trained
    assert ids[trained[-1] + 1 :] == tokenizer.encode("\n", add_special_tokens=False)  # after the last <|im_end|>


def generate(srv, verifiers_loop, messages, **sampling) -> dict:
    """One generation through renderers' own client (what verifiers' train client calls per model turn)."""
    import renderers.client as rc
    from openai import AsyncOpenAI

    async def call():
        async with AsyncOpenAI(base_url=f"{srv.url}/v1", api_key=API_KEY) as client:
            return await rc.generate(
                client=client,
                renderer=default_renderer(srv.tokenizer),
                messages=messages,
                model=srv.model_name,
                sampling_params=sampling,
            )

    return verifiers_loop.run_until_complete(call())


def test_stop_tokens_are_the_generation_configs(smol, verifiers_loop):
    """The renderer asks to stop at the tokenizer's EOS only (<|im_end|>); the model's generation config also names
    <|endoftext|>. Sampling is restricted to one of them: the server must stop right after it, not sample it again
    until max_tokens."""
    generation_config = GenerationConfig.from_pretrained(smol.base)
    stops = [smol.tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    assert generation_config.eos_token_id == stops
    assert default_renderer(smol.tokenizer).get_stop_token_ids() == stops[:1]
    messages = [{"role": "user", "content": "hi"}]
    for stop in stops:
        out = generate(smol, verifiers_loop, messages, max_tokens=8, temperature=1.0, allowed_token_ids=[stop])
        assert (out["completion_ids"], out["finish_reason"]) == ([stop], "stop"), out
        assert out["content"] == "", out  # neither stop token leaks into the reply's text
    # A greedy answer ends at the end-of-turn token by itself, and its text carries no special token.
    out = generate(smol, verifiers_loop, [{"role": "user", "content": "What is 2 + 2?"}], max_tokens=48, temperature=0)
    assert out["finish_reason"] == "stop" and out["completion_ids"][-1] in stops, out
    assert "<|" not in out["content"] and out["content"].strip(), out


def run_guess_number(smol, verifiers_loop, monkeypatch, n: int, max_tokens: int, **sampling_extra):
    """`n` guess-number rollouts (no system message) through the real worker code, and every generation call
    (prompt ids sent, vLLM's raw response)."""
    import verifiers.v1 as vf

    from prime_rl.orchestrator.config import OrchestratorConfig
    from prime_rl.orchestrator.envs import load_tasks
    from prime_rl.orchestrator.messages import RunGroup
    from prime_rl.orchestrator.patches import install_version_capture
    from prime_rl.orchestrator.worker import Worker, request_sampling

    monkeypatch.setenv(KEY_VAR, API_KEY)
    r = httpx.post(f"{smol.url}/reload_weights", json={}, headers=smol.headers, timeout=120)
    assert r.status_code == 200, r.text
    config = OrchestratorConfig(
        model={"name": str(smol.base)},
        client={"base_url": [f"{smol.url}/v1"], "api_key_var": KEY_VAR},
        env=[{"id": "guess-number", "args": {"max_turns": 3, "system_prompt": str(smol.no_system)}}],
        sampling={"max_tokens": max_tokens},
        seq_len=512,
    )
    install_version_capture()
    calls = spy_generations(monkeypatch)
    tasks = load_tasks(config.env, config.seq_len)
    worker = Worker(config, 0, keep_messages=True)
    worker.sampling["guess-number"] = vf.SamplingConfig(**request_sampling(config.sampling), **sampling_extra)

    async def run():
        async with worker.envs["guess-number"].serving():
            request = RunGroup(id=0, env="guess-number", task=tasks["guess-number"][0], n=n, base_url=f"{smol.url}/v1")
            return (await worker.run_group(request)).rollouts

    return verifiers_loop.run_until_complete(run()), calls


def check_sampled_spans(rollouts, calls) -> None:
    """Every sampled span of every sample is exactly a vLLM response (ids and logprobs, bit for bit) at exactly the
    position of the prompt it answered; every call is trained once."""
    by_prompt = responses_by_prompt(calls)
    spans = 0
    for rollout in rollouts:
        assert rollout.error is None, rollout.error
        for sample in rollout.samples:
            for start, end in masked_runs(sample.loss_mask):
                responses = by_prompt[tuple(sample.token_ids[:start])]
                assert (sample.token_ids[start:end], sample.logprobs[start:end]) in responses
                spans += 1
        assert sum(len(masked_runs(s.loss_mask)) for s in rollout.samples) == rollout.num_turns
    assert spans == len(calls)


def test_multi_turn_samples_are_the_samplers_tokens_and_logprobs(smol, verifiers_loop, monkeypatch):
    """Multi-turn rollouts under the default system prompt: each sample is the sampler's prompt and response ids,
    the prompt opens with the template's default system prompt, and vLLM's logprobs match transformers'."""
    rollouts, calls = run_guess_number(smol, verifiers_loop, monkeypatch, n=3, max_tokens=8)
    check_sampled_spans(rollouts, calls)
    assert max(r.num_turns for r in rollouts) >= 2  # the multi-turn path was exercised
    assert all(rollout.messages[0]["role"] == "user" for rollout in rollouts)  # no system message was sent
    first_prompt = smol.tokenizer.apply_chat_template(
        rollouts[0].messages[:1], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert smol.tokenizer.decode(first_prompt).startswith(DEFAULT_SYSTEM)

    model = AutoModelForCausalLM.from_pretrained(smol.base, dtype=torch.float32)
    max_diff = 0.0
    for rollout in rollouts:
        for sample in rollout.samples:
            assert sample.token_ids[: len(first_prompt)] == first_prompt
            with torch.no_grad():
                logits = model(torch.tensor([sample.token_ids])).logits[0, :-1]
            ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(sample.token_ids[1:])[:, None])[:, 0]
            mask = torch.tensor(sample.loss_mask[1:])
            diff = (torch.tensor(sample.logprobs[1:]) - ref)[mask].abs().max().item()
            max_diff = max(max_diff, diff)
    forks = sum(len(r.samples) - 1 for r in rollouts)
    print(f"max |vLLM fp32 - transformers fp32| logprob over sampled tokens: {max_diff:.2e}; {forks} forks")
    assert max_diff < LOGPROB_ATOL


def test_replies_that_re_tokenise_differently_are_trained_as_sampled(smol, verifiers_loop, monkeypatch):
    """Sampling only the single-letter tokens "a" and "n" gives replies whose text BPE would tokenise otherwise
    ("anna" is one token). The next turn's prompt (the template re-rendered from text) then does not extend the
    sampled ids; the trace forks instead, and every reply is still trained as the ids that were sampled."""
    letters = [smol.tokenizer.convert_tokens_to_ids(t) for t in ("a", "n")]
    rollouts, calls = run_guess_number(smol, verifiers_loop, monkeypatch, n=2, max_tokens=6, allowed_token_ids=letters)
    check_sampled_spans(rollouts, calls)
    for rollout in rollouts:
        assert rollout.num_turns == 3  # no digit, no valid guess: every guess is used
        replies = [list(s.token_ids[a:b]) for s in rollout.samples for a, b in masked_runs(s.loss_mask)]
        assert all(len(r) == 6 and set(r) <= set(letters) for r in replies)
        retokenised = [smol.tokenizer.encode(smol.tokenizer.decode(r), add_special_tokens=False) for r in replies]
        assert all(t != r for t, r in zip(retokenised, replies, strict=True))  # the drift is real
        assert len(rollout.samples) == 3  # a fork at each re-rendered turn, none trained on re-tokenised ids


def rl_config(smol, out: Path) -> Path:
    """Two synchronous steps of guess-number (no system message) on the module's server, full fine-tuning in fp32
    (as benchmarks/configs/smollm2-135m), the new policy sent to the server in memory before step 2's rollouts."""
    path = out.with_suffix(".toml")
    path.write_text(
        f"""
output_dir = "{out}"
max_steps = 2
max_async_level = 0
seq_len = 512
trainer_gpu_ids = [0]

[model]
name = "{smol.base}"

[weight_broadcast]
type = "gloo"
port = {smol.broadcast_port}

[orchestrator]
batch_size = 8
rollouts_per_example = 4
workers = 1
weights_poll_interval = 0.2
[orchestrator.sampling]
max_tokens = 8
[[orchestrator.env]]
id = "guess-number"
args = {{ max_turns = 2, system_prompt = "{smol.no_system}" }}
[orchestrator.client]
base_url = ["{smol.url}/v1"]
api_key_var = "{KEY_VAR}"

[trainer]
micro_batch_tokens = 4096
[trainer.model]
dtype = "float32"
[trainer.optim]
type = "adamw"
lr = 3e-6
weight_decay = 0.0
"""
    )
    return path


def test_rl_step_with_a_weight_swap_then_eval(smol):
    """`rl` (trainer + orchestrator against the module's server): step 2 samples on the policy of step 1, sent to
    the server in memory; the trainer's log-probs of the batches match the sampler's (the tokens it trains are
    the sampler's); the published policy keeps the tokenizer, template and stop tokens. Then `eval` scores the
    base model and that policy on the same server."""
    out = smol.root / "rl"
    env = {**os.environ, KEY_VAR: API_KEY, SECRET_VAR: RUN_SECRET}
    start = time.monotonic()
    log = smol.root / "rl.log"
    proc = subprocess.Popen(
        [BIN / "rl", "@", rl_config(smol, out)], stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env
    )
    try:
        code = proc.wait(480)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)
        code = None
    assert code == 0, log.read_text()[-4000:]
    print(f"rl, 2 steps: {time.monotonic() - start:.0f}s")

    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in lines if m["process"] == "trainer"]
    assert [m["step"] for m in trained] == [1, 2]
    assert [(m["policy_version/min"], m["policy_version/max"]) for m in trained] == [(0, 0), (1, 1)]
    for m in trained:
        print(f"step {m['step']}: mismatch_kl {m['mismatch_kl']:.2e}")
        assert 0 <= m["mismatch_kl"] < MISMATCH_KL_MAX, m
    assert "policy step 0 -> 1 on 1 server" in (out / "logs" / "orchestrator.log").read_text()
    orchestrated = [m for m in lines if m["process"] == "orchestrator"]
    assert max(m["turns/mean"] for m in orchestrated) > 1  # multi-turn samples were trained

    policy = out / "broadcasts" / "step_2"
    assert (policy / "STABLE").exists()
    # The policy leaves the fp32 trainer in fp32, not in this checkpoint's bf16, where steps of lr 3e-6 vanish (bf16
    # keeps 8 significant bits: a weight of 0.05 moves in steps of 2.4e-4) and the sampler serves the start policy.
    assert {t.dtype for t in load_file(policy / "model.safetensors").values()} == {torch.float32}
    saved = AutoTokenizer.from_pretrained(policy)
    assert saved.apply_chat_template(CONVERSATION) == smol.tokenizer.apply_chat_template(CONVERSATION)
    assert (
        GenerationConfig.from_pretrained(policy).eos_token_id
        == GenerationConfig.from_pretrained(smol.base).eos_token_id
    )

    start = time.monotonic()
    envs = json.dumps([{"id": "reverse-text", "num_examples": 4, "rollouts_per_example": 2}])
    args = [BIN / "eval", "--output-dir", smol.root / "eval", "--model.name", smol.base, "--env", envs]
    args += ["--client.base-url", f'["{smol.url}/v1"]', "--client.api-key-var", KEY_VAR, "--seq-len", "512"]
    args += ["--sampling.max-tokens", "24", "--weights-dir", out / "broadcasts"]
    done = subprocess.run(list(map(str, args)), env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    print(f"eval, 2 policies: {time.monotonic() - start:.0f}s")
    records = [json.loads(line) for line in (smol.root / "eval" / "results.jsonl").read_text().splitlines()]
    assert sorted({r["policy"] for r in records}) == ["base", "step_2"] and len(records) == 16
    assert all(r["error"] is None and r["completion_tokens"] >= 1 and 0 <= r["reward"] <= 1 for r in records)
    summary = json.loads((smol.root / "eval" / "summary.json").read_text())
    print("eval rewards:", {p["label"]: p["envs"]["reverse-text"]["reward_mean"] for p in summary["policies"]})
