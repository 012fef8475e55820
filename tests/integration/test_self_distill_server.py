"""opsd's prefill against the session's real server: the hint goes where it should and comes out again.

The check of the offsets: the server samples a completion from the *hinted* prompt (hint block + prompt), recording
its sampling log-probs; the orchestrator's scorer is then given the plain sample (prompt + completion, as a rollout
holds it) and must give back, on the completion's positions, the same log-probs (a token off in either direction
would score other tokens in other contexts). The plain prefill of the same sample must differ: the hint changes the
distribution, so a scorer that lost the hint could not pass."""

import asyncio

import httpx
import pytest
from conftest import API_KEY

from prime_rl.config.orchestrator import OrchestratorConfig
from prime_rl.orchestrator.messages import RolloutResult
from prime_rl.orchestrator.samples import SampleTokens
from prime_rl.orchestrator.scheduler import Group
from prime_rl.orchestrator.self_distill import SelfDistiller, hint_ids
from prime_rl.orchestrator.servers import InferenceServers

KEY_VAR = "PRIME_TEST_SELF_DISTILL_KEY"
TOLERANCE = 1e-4
"""The server's sampling log-probs (decode) against its prefill's of the same tokens in the same context: measured
equal to the bit (2026-12-07, 8 tokens), the margin for kernels that batch otherwise; a token off moves a log-prob
by whole units. The hint itself moved the plain prefill's by up to 0.19 on the same tokens."""


def sample_from(srv, token_ids: list[int], max_tokens: int = 8) -> tuple[list[int], list[float]]:
    """A temperature-1 completion of `token_ids` on the token route: its ids and their sampling log-probs."""
    params = {"temperature": 1.0, "top_k": -1, "top_p": 1.0, "max_tokens": max_tokens, "logprobs": 1, "seed": 3}
    body = {"model": str(srv.base), "token_ids": token_ids, "sampling_params": params}
    r = httpx.post(f"{srv.url}/inference/v1/generate", json=body, headers=srv.headers, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["token_ids"], [e["logprob"] for e in choice["logprobs"]["content"]]


def test_the_scorer_gives_the_hinted_policys_sampling_logprobs_back(tied_server, tmp_path, monkeypatch):
    srv = tied_server
    # The base weights, whatever an earlier test left served: the hint's effect below was measured on them.
    reset = httpx.post(f"{srv.url}/reload_weights", json={}, headers=srv.headers, timeout=120)
    assert reset.status_code == 200, reset.text
    monkeypatch.setenv(KEY_VAR, API_KEY)
    tokenizer = srv.tokenizer
    task = {"idx": 0, "prompt": "Reverse this text: abcdef", "answer": "fedcba"}
    conversation = [{"role": "system", "content": "Reverse the text."}, {"role": "user", "content": task["prompt"]}]
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    prompt = tokenizer.encode(text, add_special_tokens=False)
    algo = {"type": "opsd", "demo_key": "answer"}
    config = OrchestratorConfig(
        model={"name": str(srv.base)},
        client={"base_url": [f"{srv.url}/v1"], "api_key_var": KEY_VAR},
        env=[{"id": "reverse-text", "algo": algo}],
    )
    distiller = SelfDistiller(config, {"reverse-text": config.env_algo("reverse-text")}, tokenizer)
    hint = distiller.hint("reverse-text", task)
    assert hint == hint_ids(tokenizer, f"An expert's response to the task that follows:\n{task['answer']}")
    assert tokenizer.bos_token_id is None  # qwen3: the hint block simply goes first (independently of `splice`)
    completion, sampled = sample_from(srv, hint + prompt)
    assert completion
    sample = prompt + completion
    tokens = SampleTokens(
        token_ids=sample,
        loss_mask=[False] * len(prompt) + [True] * len(completion),
        logprobs=[0.0] * len(prompt) + sampled,
        versions=[-1] * len(sample),
    )
    group = Group(0, "reverse-text", 0, task, 0, srv.url, rollouts=[RolloutResult(reward=0.0, samples=[tokens])])
    servers = InferenceServers(config.client.base_url, KEY_VAR, 60.0, tmp_path)

    async def score():
        try:
            refs = await distiller.score([group], servers)
            plain = await next(iter(distiller.clients.values())).logprobs(sample)
            return refs, plain
        finally:
            await distiller.close()
            await servers.close()

    refs, plain = asyncio.run(score())
    assert list(refs) == [(0, 0, 0)]
    ref = refs[(0, 0, 0)]
    assert len(ref) == len(sample)
    assert ref[len(prompt) :] == pytest.approx(sampled, abs=TOLERANCE)
    assert ref[0] < 0.0  # the first sample token follows the hint block: a real log-prob, not the unscored 0.0
    assert plain[0] == 0.0
    assert max(abs(a - b) for a, b in zip(plain[len(prompt) :], sampled, strict=True)) > 0.05  # measured 0.19
