"""The llm-judge environment with our own inference server as the judge (and as the policy), through the real
rollout worker: rollouts complete, every judge call reaches the server, and the judge's failures arrive in the
rollouts' metrics, where the orchestrator averages them per step (`metrics/judge_failed`, ...)."""

import json
import re

import httpx
import pytest
from conftest import API_KEY
from llm_judge.judge import FAILURE_KINDS, VerdictJudge

pytestmark = pytest.mark.slow

KEY_VAR = "PRIME_TEST_API_KEY"
RENDERER = '{"name": "qwen3", "enable_thinking": false}'


def requests_finished(url: str) -> float:
    """vLLM's own count of finished requests, over every finish reason (`/metrics` needs the key like every route)."""
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10).text
    return sum(float(m) for m in re.findall(r"^vllm:request_success_total\{[^}]*\} ([\d.e+]+)$", text, re.M))


def test_our_server_as_the_judge(tied_server, verifiers_loop, monkeypatch):
    from prime_rl.orchestrator.config import OrchestratorConfig
    from prime_rl.orchestrator.envs import load_tasks
    from prime_rl.orchestrator.messages import RunGroup
    from prime_rl.orchestrator.worker import Worker

    srv = tied_server
    monkeypatch.setenv(KEY_VAR, API_KEY)
    judge = {
        "base_url": f"{srv.url}/v1",
        "model": str(srv.base),
        "api_key_var": KEY_VAR,
        "sampling": {"temperature": 0.0, "max_tokens": 16},
        "retries": 0,  # so that the server's request count is exactly one per judge call
    }
    config = OrchestratorConfig(
        model={"name": str(srv.base), "renderer": json.loads(RENDERER)},
        client={"base_url": [f"{srv.url}/v1"], "api_key_var": KEY_VAR},
        env=[{"id": "llm-judge", "args": {"num_tasks": 2, "task": {"judge": judge}}}],
        sampling={"max_tokens": 8},
        seq_len=512,
    )
    verdicts: list[str | None] = []  # what the judge's replies parsed to, one per judge call that came back
    parse = VerdictJudge.parse

    def spy_parse(self, response):
        verdicts.append(parse(self, response))
        return verdicts[-1]

    monkeypatch.setattr(VerdictJudge, "parse", spy_parse)
    tasks = load_tasks(config.env, config.seq_len)
    worker = Worker(config, 0)
    before = requests_finished(srv.url)

    async def run():
        rollouts = []
        async with worker.envs["llm-judge"].serving():
            for i in range(2):
                request = RunGroup(id=i, env="llm-judge", task=tasks["llm-judge"][i], n=3, base_url=f"{srv.url}/v1")
                rollouts += (await worker.run_group(request)).rollouts
        return rollouts

    rollouts = verifiers_loop.run_until_complete(run())
    assert len(rollouts) == 6
    for rollout in rollouts:
        assert rollout.error is None, rollout.error
        assert rollout.samples  # the policy's tokens came from the server, trainable
        metrics = rollout.metrics
        # The random model's verdicts are noise: only the bookkeeping is asserted. Every kind is reported, as 0/1.
        assert {metrics["judge_failed"], *(metrics[f"judge_failed/{k}"] for k in FAILURE_KINDS)} <= {0.0, 1.0}
        assert metrics["judge_failed/connection"] == metrics["judge_failed/timeout"] == 0.0
        assert metrics["judge_failed/http"] == 0.0
        # The only failure a reachable judge can have here is an unparsable verdict, and it is counted.
        assert metrics["judge_failed"] == metrics["judge_failed/unparsable"]
        assert rollout.reward in (0.0, 1.0) and metrics["reward/judge"] == rollout.reward
        assert not (rollout.reward == 1.0 and metrics["judge_failed"])  # a failed judgement never pays
    judged = sum(1 for r in rollouts if r.completion.strip())  # an empty reply is scored 0 without a judge call
    # One policy request per rollout plus one judge request per judged rollout: each judge call reached the server.
    assert requests_finished(srv.url) - before == len(rollouts) + judged
    # ... and came back with a reply; the counts match what those replies parsed to, exactly.
    assert len(verdicts) == judged
    assert sum(r.metrics["judge_failed/unparsable"] for r in rollouts) == verdicts.count(None)
    assert sum(r.reward for r in rollouts) == verdicts.count("CORRECT")
