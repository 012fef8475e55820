"""The orchestrator against the real vLLM server on the tiny model: token exactness (in-process worker),
the async bound with a stand-in trainer, the environment mix, `--bench`, and robustness to failures."""

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from conftest import API_KEY, make_adapter
from token_spans import masked_runs, responses_by_prompt, spy_generations
from transformers import AutoModelForCausalLM

from prime_rl.batch import batch_path, read_batch

pytestmark = pytest.mark.slow

ORCHESTRATOR = str(Path(sys.executable).parent / "orchestrator")
KEY_VAR = "PRIME_TEST_API_KEY"
RENDERER = '{"name": "qwen3", "enable_thinking": false}'
# Same bound as the inference tests: vLLM computes in bf16, transformers here in fp32 from the same bf16
# weights; measured maxima are ~0.01-0.02, a wrong-weights bug moves logprobs by > 0.5.
LOGPROB_ATOL = 0.05
# Adapters move each weight by about 5x its spread, as the perturbed weights of the inference tests do: their bound.
ADAPTER_ATOL = 0.08


def orchestrator_args(srv, out: Path, *extra: str) -> list[str]:
    return [
        ORCHESTRATOR,
        "--output-dir", str(out),
        "--model.name", str(srv.base),
        "--model.renderer", RENDERER,
        "--client.base-url", f'["{srv.url}/v1"]',
        "--client.api-key-var", KEY_VAR,
        "--workers", "1",
        "--seq-len", "512",
        "--sampling.max-tokens", "12",
        "--batch-size", "8",
        "--rollouts-per-example", "4",
        "--weights-poll-interval", "0.2",
        *extra,
    ]  # fmt: skip


def start_orchestrator(srv, out: Path, *extra: str, home: Path | None = None) -> subprocess.Popen:
    """`home`: the process's HOME (where verifiers keeps each rollout's working directory), else the test's own."""
    # tests/integration on the path: the workers import test environments (vf_flaky_env) from there
    path = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, KEY_VAR: API_KEY, "PYTHONPATH": path} | ({"HOME": str(home)} if home else {})
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "console.out", "w")
    return subprocess.Popen(
        orchestrator_args(srv, out, *extra), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )


def run_orchestrator(srv, out: Path, *extra: str, timeout: float = 300) -> str:
    proc = start_orchestrator(srv, out, *extra)
    try:
        proc.wait(timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log = (out / "console.out").read_text()
    assert proc.returncode == 0, log[-4000:]
    return log


def metrics(out: Path) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [m for m in map(json.loads, lines) if m["process"] == "orchestrator"]


def publish(srv, out: Path, step: int, source: Path) -> None:
    """What the trainer does after step n: a complete weight (or adapter) directory, then its STABLE marker."""
    target = out / "broadcasts" / f"step_{step}"
    tmp = target.with_name(target.name + ".tmp")
    shutil.copytree(source, tmp)
    tmp.rename(target)
    (target / "STABLE").touch()


@functools.lru_cache(maxsize=8)
def hf_model(model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def full_logprobs(model_dir: Path, token_ids: list[int]) -> torch.Tensor:
    """fp32 transformers logprob of every token given its prefix (position 0 gets 0)."""
    model = hf_model(model_dir)
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0, :-1]
    logp = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(token_ids[1:])[:, None])[:, 0]
    return torch.cat([torch.zeros(1), logp])


# ---------------------------------------------------------------------------------------------------------


def test_worker_samples_are_token_exact(tied_server, verifiers_loop, monkeypatch):
    """Single- and multi-turn rollouts through the real worker code: every sampled span of every sample is
    exactly a vLLM response (ids and logprobs, bit for bit) at exactly the position of its prompt, and the
    logprobs match a transformers forward pass."""
    from prime_chat import close_shared_client
    from prime_rl.orchestrator.config import OrchestratorConfig
    from prime_rl.orchestrator.envs import load_tasks
    from prime_rl.orchestrator.messages import RunGroup
    from prime_rl.orchestrator.patches import install_version_capture
    from prime_rl.orchestrator.worker import Worker

    srv = tied_server
    monkeypatch.setenv(KEY_VAR, API_KEY)
    assert httpx.post(f"{srv.url}/reload_weights", json={}, headers=srv.headers, timeout=60).status_code == 200
    config = OrchestratorConfig(
        model={"name": str(srv.base), "renderer": json.loads(RENDERER)},
        client={"base_url": [f"{srv.url}/v1"], "api_key_var": KEY_VAR},
        env=[{"id": "reverse-text"}, {"id": "guess-number", "args": {"max_turns": 3}}],
        sampling={"max_tokens": 10},
        seq_len=512,
    )
    install_version_capture()
    calls = spy_generations(monkeypatch)
    tasks = load_tasks(config.env, config.seq_len)
    worker = Worker(config, 0)

    async def run():
        results = {}
        for name, env in worker.envs.items():
            async with env.serving():
                request = RunGroup(id=0, env=name, task=tasks[name][0], n=3, base_url=f"{srv.url}/v1")
                results[name] = (await worker.run_group(request)).rollouts
        await close_shared_client()  # prime-chat's pool on this loop (the worker's `serving` closes it in a run)
        return results

    results = verifiers_loop.run_until_complete(run())
    by_prompt = responses_by_prompt(calls)
    max_diff = 0.0
    for rollouts in results.values():
        assert len(rollouts) == 3
        for rollout in rollouts:
            assert rollout.error is None, rollout.error
            assert len(rollout.samples) == 1  # the Qwen3 renderer bridges turns: no forks
            sample = rollout.samples[0]
            runs = masked_runs(sample.loss_mask)
            assert len(runs) == rollout.num_turns >= 1
            for start, end in runs:
                # a group shares its prompt: the span must be one of the responses to exactly this prefix
                responses = by_prompt[tuple(sample.token_ids[:start])]
                assert (sample.token_ids[start:end], sample.logprobs[start:end]) in responses  # exact floats
                assert sample.versions[start:end] == [0] * (end - start)  # vLLM labelled them "base"
            off = [i for i, m in enumerate(sample.loss_mask) if not m]
            assert all(sample.logprobs[i] == 0.0 and sample.versions[i] == -1 for i in off)
            ref = full_logprobs(srv.base, sample.token_ids)
            got = torch.tensor(sample.logprobs)
            mask = torch.tensor(sample.loss_mask)
            max_diff = max(max_diff, (got - ref)[mask].abs().max().item())
    assert max(r.num_turns for r in results["guess-number"]) >= 2  # the multi-turn path was exercised
    print(f"max |vLLM - transformers fp32| logprob over sampled tokens: {max_diff:.4f}")
    assert max_diff < LOGPROB_ATOL


FLAKY_MIX = '[{"id": "reverse-text", "ratio": 1}, {"id": "vf-flaky-env", "ratio": 1, "args": {"per_rollout": true}}]'


def stand_in_trainer(
    srv, out: Path, proc: subprocess.Popen, steps: int, adapters: list[Path] | None = None
) -> threading.Thread:
    """What the trainer does, minus the training: publish pi_n one second after batch n appears (the perturbed
    weights, or `adapters[n - 1]`)."""

    def run():
        for n in range(1, steps + 1):
            while not batch_path(out, n).exists():
                if proc.poll() is not None:
                    return
                time.sleep(0.05)
            time.sleep(1.0)
            publish(srv, out, n, adapters[n - 1] if adapters else srv.step_1)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def wait_ok(proc: subprocess.Popen, out: Path, timeout: float) -> str:
    try:
        assert proc.wait(timeout) == 0, (out / "console.out").read_text()[-4000:]
    except subprocess.TimeoutExpired:
        raise AssertionError(f"no exit after {timeout}s:\n" + (out / "console.out").read_text()[-4000:]) from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return (out / "console.out").read_text()


@pytest.mark.parametrize(("k", "workers"), [(0, 0), (0, 1), (1, 1)])
def test_async_bound_with_stand_in_trainer(tied_server, tmp_path_factory, k, workers):
    """A stand-in trainer publishes pi_n one second after batch n appears. Batch n never contains a token from a
    policy older than n-1-k; with k=0 every token comes from exactly pi_{n-1}. 8 steps, so the bound is active on
    batches k+2..8 (n-1-k > 0), and the reward raises on about half the rollouts of the vf-flaky-env groups, so
    groups arrive short of rollouts: at k=0 that used to deadlock (a batch short of a rollout or two waited for a
    group that only a policy which could not exist yet would have allowed). At k=0 each batch's groups start
    gated on pi_{n-1} while the stand-in trains, so the exact versions say the gate held every model call, on the
    orchestrator's own loop (`workers = 0`) and in a worker process (told over the socket); k=1 in a worker process:
    the same guarantees either way."""
    srv = tied_server
    out = srv.root / "runs" / f"async_k{k}_w{workers}"
    steps = 8
    extra = ("--max-async-level", str(k), "--max-steps", str(steps), "--env", FLAKY_MIX, "--workers", str(workers))
    proc = start_orchestrator(srv, out, *extra)
    stand_in_trainer(srv, out, proc, steps)
    log = wait_ok(proc, out, 300)
    active = 0
    for n in range(1, steps + 1):
        batch = read_batch(batch_path(out, n))
        assert batch.step == n and len(batch.samples) >= 8
        oldest = min(v for s in batch.samples for v in s.policy_versions)
        assert oldest >= n - 1 - k, (n, oldest)
        active += n - 1 - k > 0
        if k == 0:
            assert {tuple(s.policy_versions) for s in batch.samples} == {(n - 1,)}
    assert active >= 8 - 1 - k - 1  # the bound constrained most batches
    rows = metrics(out)
    assert sum(m["errors"] for m in rows) > 0  # rollouts were excluded along the way
    assert max(m["async_lag/max"] for m in rows) <= k
    assert "policy step 0 -> " in log  # published weights were picked up
    if k == 0:  # every step after the first hits the barrier: wait for pi_{n-1}, then swap
        assert "batch 2 needs policy step 1" in log and "waiting for" in log
        assert all(m["time/wait_for_weights"] > 0 for m in rows[1:])
        assert sum(m["groups_started/gated"] for m in rows) >= steps - 1  # each later batch began during training
    assert (out / "logs" / "orchestrator_worker_0.log").exists() == (workers > 0)  # a worker process logs there


def test_multi_agent_and_infinite_environments(tied_server):
    """nim (two seats, self-play; an episode may end before the second seat acts) and an infinite procedural
    taskset, mixed: batches fill with the acting seats' samples, seats that never acted count in the rewards,
    per-seat rewards are logged, and the infinite taskset is drawn one task per group."""
    srv = tied_server
    out = srv.root / "runs" / "seats"
    envs = '[{"id": "nim", "ratio": 1, "args": {"max_sticks": 4}}, {"id": "vf-endless-env", "ratio": 1}]'
    run_orchestrator(srv, out, "--max-steps", "3", "--max-async-level", "8", "--env", envs)
    rows = metrics(out)
    assert len(rows) == 3
    for n in (1, 2, 3):
        assert len(read_batch(batch_path(out, n)).samples) >= 8
    nim = [m for m in rows if "rollouts/nim" in m]
    assert nim and all("reward/nim/first/mean" in m and "reward/nim/second/mean" in m for m in nim)
    drawn = rows[-1]["buffer/tasks_drawn/vf-endless-env"]
    assert 0 < drawn <= sum(m["groups_started/server_0"] for m in rows)  # one task per group started, no more


def test_environment_mix_follows_ratios(tied_server, tmp_path_factory):
    """reverse-text : arithmetic = 3 : 1 over 400 rollouts (100 groups of 4). Groups are the sampled unit:
    p = 0.75, n = 100, sd = sqrt(p(1-p)/n) = 0.043; we allow 3.5 sd (0.15). The server is given under two
    URLs, which the orchestrator treats as two servers: both get groups."""
    srv = tied_server
    out = srv.root / "runs" / "mix"
    run_orchestrator(
        srv, out,
        "--max-steps", "10", "--batch-size", "40", "--max-async-level", "100",
        "--env", '[{"id": "reverse-text", "ratio": 3}, {"id": "arithmetic", "ratio": 1}]',
        "--sampling.max-tokens", "4",
        "--client.base-url", f'["{srv.url}/v1", "http://localhost:{srv.port}/v1"]',
    )  # fmt: skip
    rows = metrics(out)
    counts = {env: sum(m.get(f"rollouts/{env}", 0) for m in rows) for env in ("reverse-text", "arithmetic")}
    assert sum(counts.values()) == 400
    share = counts["reverse-text"] / 400
    assert abs(share - 0.75) <= 0.15, counts
    assert all(f"reward/{env}/mean" in rows[-1] or counts[env] == 0 for env in counts)
    per_server = [sum(m[f"groups_started/server_{i}"] for m in rows) for i in (0, 1)]
    assert min(per_server) >= 30, per_server  # least-loaded balancing: roughly even


def test_failing_reward_is_counted_and_the_run_goes_on(tied_server):
    """An environment whose reward raises on half its tasks: those rollouts are errors, excluded; batches fill.

    Also runs `reinforce_pp` and temperature scaling: the tiny random model never writes the exact answer, so every
    reward is 0. Reinforce++'s batch normalisation of an all-equal batch gives exact zeros (not NaN), and every
    scored group (rewards all equal) raises the env's temperature by 1.1, capped at 1.5. Each step takes at least 2
    scored groups of 4, so after step 3 at least 6 were seen: 1.1^6 > 1.5, the cap."""
    srv = tied_server
    out = srv.root / "runs" / "flaky"
    run_orchestrator(
        srv, out, "--max-steps", "3", "--max-async-level", "4", "--env", '[{"id": "vf-flaky-env"}]',
        "--advantage.estimator", "reinforce_pp", "--sampling.temperature-scaling",
    )  # fmt: skip
    rows = metrics(out)
    assert len(rows) == 3 and sum(m["errors"] for m in rows) > 0
    assert all(m["reward/mean"] == 0 for m in rows)  # what the rest assumes
    allowed, t = {1.0}, 1.0  # the values 1.0 * 1.1 * 1.1 ... capped at 1.5 take, in the controller's arithmetic
    for _ in range(10):
        t = min(t * 1.1, 1.5)
        allowed.add(t)
    temperatures = [m["sampling/temperature/vf-flaky-env"] for m in rows]
    assert temperatures == sorted(temperatures) and temperatures[0] >= 1.1**2 and temperatures[-1] == 1.5
    sampled = set()
    for n in (1, 2, 3):
        batch = read_batch(batch_path(out, n))
        assert len(batch.samples) == 8
        assert all(a == 0.0 for s in batch.samples for a in s.advantages)
        sampled |= {s.temperature for s in batch.samples}
    assert sampled <= allowed and 1.0 in sampled and max(sampled) > 1.0, sampled  # groups started after a raise


def test_bench_measures_the_served_weights_and_writes_nothing_a_trainer_reads(tied_server):
    """`--bench`, no trainer: 3 steps on the weights the server serves (pi_1 here: not reset to base), a stale
    published policy in the output dir left alone (loading it would fail: it holds no weights), no batch and no
    checkpoint although `--ckpt` is on, and one table: a row per step, then a summary over steps 2 and 3."""
    srv = tied_server
    out = srv.root / "runs" / "bench"
    stale = out / "broadcasts" / "step_1"
    stale.mkdir(parents=True)
    (stale / "STABLE").touch()
    body = {"weight_dir": str(srv.step_1), "version": "step_1"}
    assert httpx.post(f"{srv.url}/update_weights", json=body, headers=srv.headers, timeout=60).status_code == 200
    try:
        log = run_orchestrator(srv, out, "--bench", "--bench.steps", "3", "--ckpt", "--ckpt.interval", "1")
        params = {"max_tokens": 2, "temperature": 1.0, "top_k": -1, "top_p": 1.0}
        request = {"model": str(srv.base), "token_ids": srv.prompt_ids, "sampling_params": params}
        r = httpx.post(f"{srv.url}/inference/v1/generate", json=request, headers=srv.headers, timeout=60)
        served = [span["version"] for span in r.json()["choices"][0]["weight_versions"]]
    finally:
        httpx.post(f"{srv.url}/reload_weights", json={}, headers=srv.headers, timeout=60)
    assert served == ["step_1"]
    assert not list(out.glob("rollouts/step_*")) and not (out / "checkpoints").exists()
    rows = metrics(out)
    assert [m["step"] for m in rows] == [1, 2, 3]
    assert all(m["weight_swaps"] == 0 and m["time/wait_for_weights"] == 0 for m in rows)
    for m in rows:  # the step's time is all accounted for: waiting for rollouts, then building the batch
        assert m["time/rollouts"] + m["time/batch"] == pytest.approx(m["time/step"], rel=1e-9)
    lines = log.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("step  seconds"))
    header, *table, summary = lines[start : start + 5]
    assert header.split() == [
        "step", "seconds", "rollouts", "rollouts/s", "sampled", "tok/s", "total", "tok/s", "rollouts", "s", "batch", "s"
    ]  # fmt: skip
    assert [row.split()[0] for row in table] == ["1", "2", "3"]
    assert [int(row.split()[2]) for row in table] == [m["rollouts"] for m in rows]
    assert all(m["rollouts"] >= 8 for m in rows)
    assert summary.startswith("summary over 2 steps after the first: seconds "), summary


def test_killed_orchestrator_leaves_only_complete_batches(tied_server):
    """kill -9 while batches are being written: every batch.bin on disk decodes, and the steps are 1..m."""
    srv = tied_server
    out = srv.root / "runs" / "killed"
    proc = start_orchestrator(srv, out, "--max-steps", "1000", "--max-async-level", "1000", "--batch-size", "4")
    try:
        while not batch_path(out, 4).exists():
            assert proc.poll() is None, (out / "console.out").read_text()[-3000:]
            time.sleep(0.01)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    steps = sorted(int(p.parent.name.removeprefix("step_")) for p in (out / "rollouts").glob("step_*/batch.bin"))
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 4
    for n in steps:
        assert len(read_batch(batch_path(out, n)).samples) == 4


@pytest.mark.parametrize("workers", [0, 1])
def test_sigterm_mid_run_cancels_the_rollouts_and_leaves_no_working_directory(tied_server, workers):
    """`rl` stops an orchestrator with SIGTERM (its process group: worker processes too). The rollouts in flight are
    cancelled and cleaned up as verifiers cleans up, each one's working directory under ~/.cache/verifiers removed,
    and it says it stopped. SIGTERM used to end it at once: every stopped run left up to a batch of directories."""
    srv = tied_server
    out = srv.root / "runs" / f"sigterm-{workers}"
    home = srv.root / f"home-sigterm-{workers}"
    runtimes = home / ".cache" / "verifiers" / "runtimes" / "subprocess"
    extra = ["--max-steps", "1000", "--max-async-level", "1000", "--workers", str(workers)]
    proc = start_orchestrator(srv, out, *extra, home=home)
    try:
        deadline = time.monotonic() + 120
        while not (batch_path(out, 2).exists() and runtimes.is_dir() and any(runtimes.iterdir())):  # rollouts running
            assert proc.poll() is None and time.monotonic() < deadline, (out / "console.out").read_text()[-3000:]
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGTERM)
        code = proc.wait(15)  # rl's stop_grace
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log = (out / "console.out").read_text()
    assert code == 128 + signal.SIGTERM and "stopped (SIGTERM)" in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    assert sorted(p.name for p in runtimes.iterdir()) == []


def test_a_server_dying_under_generation_fails_rollouts_as_retryable(tmp_path, verifiers_loop, monkeypatch):
    """What the scheduler retries on another server: generation whose connection fails (the server died; here the
    port is closed, no server needed) is a retryable error, from the real worker and verifiers client."""
    from prime_chat import close_shared_client
    from prime_rl.models.tiny import TinyModelConfig, build_tiny_model
    from prime_rl.orchestrator.config import OrchestratorConfig
    from prime_rl.orchestrator.envs import load_tasks
    from prime_rl.orchestrator.messages import RunGroup
    from prime_rl.orchestrator.worker import Worker
    from prime_rl.utils.net import free_port

    monkeypatch.setenv(KEY_VAR, API_KEY)
    model = build_tiny_model(TinyModelConfig(output=tmp_path / "tiny", tie_word_embeddings=True))
    url = f"http://127.0.0.1:{free_port()}/v1"
    config = OrchestratorConfig(
        model={"name": str(model), "renderer": json.loads(RENDERER)},
        client={"base_url": [url], "api_key_var": KEY_VAR},
        env=[{"id": "reverse-text"}],
        sampling={"max_tokens": 10},
        seq_len=512,
    )
    task = load_tasks(config.env, config.seq_len)["reverse-text"][0]
    worker = Worker(config, 0)

    async def run():
        async with worker.envs["reverse-text"].serving():
            request = RunGroup(id=0, env="reverse-text", task=task, n=2, base_url=url)
            rollouts = (await worker.run_group(request)).rollouts
        await close_shared_client()
        return rollouts

    rollouts = verifiers_loop.run_until_complete(run())
    assert len(rollouts) == 2
    for rollout in rollouts:
        assert rollout.retryable and "ProviderError" in rollout.error and not rollout.samples, rollout


def test_rollouts_longer_than_seq_len_are_trained_cut_to_it(tied_server):
    """seq_len leaves the prompts 3 tokens for the reply (the preflight only refuses prompts that fill it), replies
    may take 12: as upstream prime-rl does, an over-long rollout is trained on its first seq_len tokens and marked
    truncated, so the run goes on instead of dropping rollouts until its liveness check ends it."""
    from transformers import AutoTokenizer

    from prime_rl.orchestrator.config import EnvConfig
    from prime_rl.orchestrator.envs import load_tasks, prompt_messages

    srv = tied_server
    tokenizer = AutoTokenizer.from_pretrained(srv.base)
    tasks = load_tasks([EnvConfig(id="reverse-text")], 4096)["reverse-text"]
    longest = max(
        len(tokenizer.apply_chat_template(prompt_messages(t), add_generation_prompt=True)["input_ids"])
        for t in tasks.items
    )
    seq_len = longest + 3
    out = srv.root / "runs" / "too_long"
    proc = start_orchestrator(srv, out, "--max-steps", "2", "--max-async-level", "4", "--seq-len", str(seq_len))
    wait_ok(proc, out, 300)
    samples = [s for n in (1, 2) for s in read_batch(batch_path(out, n)).samples]
    assert all(len(s.token_ids) <= seq_len for s in samples)
    cut = [s for s in samples if len(s.token_ids) == seq_len]
    assert cut and all(any(s.loss_mask) for s in cut)  # cut rollouts keep their first sampled tokens to train on
    steps = metrics(out)
    assert sum(m["cut_to_seq_len"] for m in steps) >= 1 and sum(m["truncated_fraction"] for m in steps) > 0


def test_two_runs_train_adapters_on_one_server(tied_server):
    """Two orchestrators in adapter mode (runs a and b) share the server, fully on-policy (k=0), each with a stand-in
    trainer that publishes a different adapter as every step's policy. Batch n of each run is sampled from that run's
    own adapter of step n-1 (the base model for batch 1), checked token by token against transformers with the adapter
    merged, and counted at step n-1, though vLLM labels adapter tokens with the base's version ("base" = step 0, which
    k=0 would drop as stale). The base weights never change."""
    srv = tied_server
    assert httpx.post(f"{srv.url}/reload_weights", headers=srv.headers, json={}, timeout=120).status_code == 200
    steps = 3
    runs = {
        run: [
            make_adapter(srv.base, srv.root / "adapters" / run / str(n), seed=10 * i + n) for n in range(1, steps + 1)
        ]
        for i, run in enumerate(("run-a", "run-b"))
    }
    procs, outs = {}, {}
    for run, adapters in runs.items():
        outs[run] = srv.root / "runs" / f"adapter_{run}"
        procs[run] = start_orchestrator(
            srv, outs[run], "--adapter.name", run, "--max-async-level", "0", "--max-steps", str(steps)
        )
        stand_in_trainer(srv, outs[run], procs[run], steps, [a for a, _ in adapters])
    for run in runs:
        wait_ok(procs[run], outs[run], 400)
    max_diff = 0.0
    for run, adapters in runs.items():
        (other,) = set(runs) - {run}
        for n in range(1, steps + 1):
            batch = read_batch(batch_path(outs[run], n))
            assert {tuple(s.policy_versions) for s in batch.samples} == {(n - 1,)}, (run, n)
            right = srv.base if n == 1 else adapters[n - 2][1]
            # What a wrong policy would have given: an adapter for batch 1; the base or the other run's adapter after.
            wrongs = [adapters[0][1]] if n == 1 else [srv.base, runs[other][n - 2][1]]
            gaps = [0.0] * len(wrongs)
            for sample in batch.samples:
                mask = torch.tensor(sample.loss_mask)
                got = torch.tensor(sample.inference_logprobs)[mask]
                max_diff = max(max_diff, (got - full_logprobs(right, sample.token_ids)[mask]).abs().max().item())
                for i, wrong in enumerate(wrongs):
                    gaps[i] = max(gaps[i], (got - full_logprobs(wrong, sample.token_ids)[mask]).abs().max().item())
            assert min(gaps) > 0.5, (run, n, gaps)  # the check tells each wrong policy from the right one
    print(f"max |vLLM - transformers fp32 (adapter merged)| logprob over sampled tokens: {max_diff:.4f}")
    assert max_diff < ADAPTER_ATOL
    weights = httpx.get(f"{srv.url}/weights", headers=srv.headers, timeout=30).json()
    assert weights["version"] == "base"  # neither run touched the base weights
    assert {weights["adapters"][run] for run in runs} <= {f"step_{steps - 1}", f"step_{steps}"}
    for run in runs:
        assert (
            httpx.post(f"{srv.url}/unload_lora_adapter", json={"lora_name": run}, headers=srv.headers).status_code
            == 200
        )
