import asyncio
import random
import re
import socket

import env_testkit as kit
import pytest
import verifiers.v1 as vf
from aiohttp import web
from llm_judge import LLMJudgeConfig, LLMJudgeTaskset
from llm_judge.judge import FAILURE_KINDS, JudgeOutcome, VerdictJudge
from llm_judge.questions import KINDS, WEEKDAYS, generate, question, read_jsonl

# verifiers keeps some asyncio state bound to the loop that first used it: one loop for this module.
LOOP = asyncio.new_event_loop()
API_KEY_VAR = "LLM_JUDGE_TEST_API_KEY"
JUDGE_KEY_VAR = "LLM_JUDGE_TEST_JUDGE_KEY"
POLICY_REPLY = "It is 42."


# --- questions ---------------------------------------------------------------------------------------------------


def test_each_kind_has_the_right_reference_answer():
    rng = random.Random(7)
    for _ in range(50):
        q, a = question("add", rng)
        x, y = map(int, re.fullmatch(r"What is (\d+) plus (\d+)\?", q).groups())
        assert a == str(x + y)
        q, a = question("reverse", rng)
        (word,) = re.fullmatch(r"Write the string '([a-z]+)' backwards\.", q).groups()
        assert a == word[::-1]
        q, a = question("count", rng)
        (word,) = re.fullmatch(r"How many letters does the string '([a-z]+)' have\?", q).groups()
        assert a == str(len(word)) and 4 <= len(word) <= 8
        q, a = question("weekday", rng)
        days, start = re.fullmatch(r"Which day of the week is (\d+) days after a (\w+)\?", q).groups()
        assert a == WEEKDAYS[(WEEKDAYS.index(start) + int(days)) % 7]
        q, a = question("binary", rng)
        (n,) = re.fullmatch(r"What is the number (\d+) written in binary\?", q).groups()
        assert int(a, 2) == int(n) and set(a) <= {"0", "1"}
    # Hand-checked: 10 days after a Wednesday is a Saturday (7 days -> Wednesday, +3).
    assert WEEKDAYS[(WEEKDAYS.index("Wednesday") + 10) % 7] == "Saturday"


def test_generation_is_deterministic_and_honours_kinds():
    first = generate(40, seed=3, kinds=list(KINDS))
    assert first == generate(40, seed=3, kinds=list(KINDS))
    assert first != generate(40, seed=4, kinds=list(KINDS))
    assert all(q.startswith("What is") and "plus" in q for q, _ in generate(10, seed=0, kinds=["add"]))
    config = LLMJudgeConfig(num_tasks=6, seed=3, kinds=["binary", "add"], task={"judge": {"model": "judge"}})
    tasks = list(LLMJudgeTaskset(config))
    assert [(t.data.question, t.data.answer) for t in tasks] == generate(6, seed=3, kinds=["binary", "add"])
    for i, task in enumerate(tasks):
        assert task.data.idx == i and task.data.prompt == task.data.question
        assert task.config.judge.model == "judge"


def test_jsonl_rows_and_their_errors(tmp_path):
    good = tmp_path / "qa.jsonl"
    good.write_text(
        '{"question": "Capital of France?", "answer": "Paris", "extra": 1}\n\n{"question": "2+2?", "answer": "4"}\n'
    )
    assert read_jsonl(good) == [("Capital of France?", "Paris"), ("2+2?", "4")]
    tasks = list(LLMJudgeTaskset(LLMJudgeConfig(data_file=good, num_tasks=1, task={"judge": {"model": "j"}})))
    assert [(t.data.question, t.data.answer) for t in tasks] == [("Capital of France?", "Paris"), ("2+2?", "4")]
    cases = {
        '{"question": "q"}\n': r"bad\.jsonl:1: key 'answer' must be a non-empty string",
        '{"question": "q", "answer": "a"}\n{"question": "q", "answer": 3}\n': r"bad\.jsonl:2: key 'answer'",
        '{"question": "", "answer": "a"}\n': r"bad\.jsonl:1: key 'question'",
        "not json\n": r"bad\.jsonl:1: not a JSON object",
        "[1, 2]\n": r"bad\.jsonl:1: expected a JSON object, got list",
        "\n": r"bad\.jsonl has no rows",
    }
    bad = tmp_path / "bad.jsonl"
    for text, message in cases.items():
        bad.write_text(text)
        with pytest.raises(ValueError, match=message):
            read_jsonl(bad)
    with pytest.raises(FileNotFoundError, match="missing.jsonl does not exist"):
        read_jsonl(tmp_path / "missing.jsonl")


def test_config_requires_a_judge_model():
    with pytest.raises(ValueError, match=r"set taskset\.task\.judge\.model"):
        LLMJudgeConfig()


# --- verdicts ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "verdict"),
    [
        ("VERDICT: CORRECT", "CORRECT"),
        ("The answer matches.\nVERDICT: CORRECT\n", "CORRECT"),
        ("It says 41, the reference says 42.\nVERDICT: INCORRECT", "INCORRECT"),
        ("verdict: incorrect", "INCORRECT"),
        ("<think>hmm, correct?</think>\nVERDICT: INCORRECT", "INCORRECT"),
        ("<think>still thinking, it looks correct", None),  # unclosed reasoning: no verdict
        ("I cannot decide.", None),
        ("", None),
    ],
)
def test_verdict_parsing(text, verdict):
    assert VerdictJudge().parse(vf.JudgeResponse(text=text)) == verdict


def test_outcome_score_and_metrics():
    assert JudgeOutcome(verdict="CORRECT").score == 1.0
    assert JudgeOutcome(verdict="INCORRECT").score == 0.0
    assert JudgeOutcome().score == 0.0
    assert JudgeOutcome(failure="timeout").score == 0.0
    ok = JudgeOutcome(verdict="CORRECT").metrics()
    assert ok == {"judge_failed": 0.0, **{f"judge_failed/{k}": 0.0 for k in FAILURE_KINDS}}
    timeout = JudgeOutcome(failure="timeout").metrics()
    assert timeout["judge_failed"] == 1.0 and timeout["judge_failed/timeout"] == 1.0
    assert sum(timeout.values()) == 2.0  # the total and exactly one kind


# --- episodes: a scripted policy and a scripted (or broken) judge ------------------------------------------------


class StatusJudge(kit.ScriptedChatServer):
    """Answers the first `failures` requests with HTTP `status`, then follows its script."""

    def __init__(self, status: int, failures: int, script=lambda body: {"content": "VERDICT: CORRECT"}) -> None:
        super().__init__(script)
        self.status, self.failures = status, failures

    async def _chat(self, request: web.Request) -> web.Response:
        if len(self.requests) >= self.failures:
            return await super()._chat(request)
        self.requests.append(await request.json())
        return web.json_response({"error": {"message": "judge is down"}}, status=self.status)


class SilentJudge(kit.ScriptedChatServer):
    """Accepts every request and never answers (until it is closed)."""

    def __init__(self) -> None:
        super().__init__(lambda body: {})
        self.closing = asyncio.Event()

    async def _chat(self, request: web.Request) -> web.Response:
        self.requests.append(await request.json())
        await asyncio.wait_for(self.closing.wait(), timeout=30)
        return web.json_response({}, status=503)

    async def __aexit__(self, *exc) -> None:
        self.closing.set()
        await super().__aexit__(*exc)


def closed_port_url() -> str:
    """A base URL on a port that was just free: nothing listens there, so connecting is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


def verdict_script(text: str):
    return lambda body: {"content": text}


async def run(judge: kit.ScriptedChatServer | None, n: int = 2, base_url: str | None = None, **judge_args):
    """`n` generated tasks played by a policy that always replies `POLICY_REPLY`, judged by `judge` (or by whatever
    is at `base_url`). Returns (episodes, policy requests)."""
    judge_config = {
        "base_url": base_url or judge.base_url,
        "model": "judge-model",
        "api_key_var": JUDGE_KEY_VAR,
        "retries": 0,
        "retry_delay": 0.0,
        **judge_args,
    }
    config = {
        "taskset": {"id": "llm-judge", "num_tasks": n, "seed": 1, "task": {"judge": judge_config}},
        "agent": {"harness": {"id": "env_testkit"}, "runtime": {"type": "subprocess"}},
    }
    script = verdict_script(POLICY_REPLY)
    return await kit.run_episodes(config, script, lambda env: list(env.taskset.take(n)), api_key_var=API_KEY_VAR)


def judged(judge: kit.ScriptedChatServer, **kwargs):
    async def main():
        async with judge:
            return await run(judge, **kwargs)

    return LOOP.run_until_complete(main())


def only_trace(episode: vf.Episode) -> vf.Trace:
    assert episode.ok, episode.errors
    (trace,) = episode.traces
    assert not trace.has_error, trace.errors
    return trace


def failures(trace: vf.Trace) -> dict[str, float]:
    return {k: v for k, v in trace.metrics.items() if k.startswith("judge_failed")}


@pytest.fixture(autouse=True)
def keys(monkeypatch):
    monkeypatch.setenv(API_KEY_VAR, "sk-policy")
    monkeypatch.setenv(JUDGE_KEY_VAR, "sk-judge")


def test_correct_verdict_scores_one_and_the_judge_sees_question_reference_and_answer():
    judge = kit.ScriptedChatServer(verdict_script("The reply matches the reference.\nVERDICT: CORRECT"))
    episodes, policy_requests = judged(judge, n=3)
    tasks = generate(3, seed=1, kinds=list(KINDS))
    assert len(policy_requests) == 3 and len(judge.requests) == 3
    for episode, (question_text, answer), request in zip(episodes, tasks, judge.requests, strict=True):
        trace = only_trace(episode)
        assert trace.reward == 1.0 and trace.rewards["judge"].score == 1.0
        assert failures(trace) == {"judge_failed": 0.0, **{f"judge_failed/{k}": 0.0 for k in FAILURE_KINDS}}
        assert request["model"] == "judge-model" and request["temperature"] == 0.0 and request["max_tokens"] == 256
        (message,) = request["messages"]
        prompt = message["content"]
        assert message["role"] == "user"
        assert f"Question:\n{question_text}\n" in prompt
        assert f"Reference answer:\n{answer}\n" in prompt
        assert f"Answer to grade:\n{POLICY_REPLY}\n" in prompt
        assert prompt.endswith("VERDICT: CORRECT\nVERDICT: INCORRECT")
        (call,) = trace.info["judge_calls"]  # verifiers recorded the exchange on the trace
        assert call["response"]["message"]["content"].endswith("VERDICT: CORRECT")


def test_incorrect_verdict_scores_zero_and_is_no_failure():
    judge = kit.ScriptedChatServer(verdict_script("VERDICT: INCORRECT"))
    episodes, _ = judged(judge)
    for episode in episodes:
        trace = only_trace(episode)
        assert trace.reward == 0.0 and trace.metrics["judge_failed"] == 0.0
        assert "judge_error" not in trace.info
    assert len(judge.requests) == 2


def test_unparsable_verdict_scores_zero_is_counted_and_not_retried():
    judge = kit.ScriptedChatServer(verdict_script("Hard to say, maybe."))
    episodes, _ = judged(judge, retries=3)
    for episode in episodes:
        trace = only_trace(episode)
        assert trace.reward == 0.0
        assert trace.metrics["judge_failed"] == 1.0 and trace.metrics["judge_failed/unparsable"] == 1.0
        assert sum(failures(trace).values()) == 2.0
        assert trace.info["judge_error"].startswith("unparsable: no CORRECT/INCORRECT verdict in 'Hard to say")
        assert len(trace.info["judge_calls"]) == 1
    assert len(judge.requests) == 2  # one per rollout: a judge that answered is not asked again


def test_http_500_scores_zero_is_counted_after_the_retries():
    judge = StatusJudge(500, failures=100)
    episodes, policy_requests = judged(judge, retries=2)
    assert len(policy_requests) == 2
    assert len(judge.requests) == 2 * 3  # 1 attempt + 2 retries per rollout
    for episode in episodes:
        trace = only_trace(episode)
        assert trace.reward == 0.0
        assert trace.metrics["judge_failed"] == 1.0 and trace.metrics["judge_failed/http"] == 1.0
        assert sum(failures(trace).values()) == 2.0
        assert trace.info["judge_error"].startswith("http: InternalServerError")


def test_client_error_is_not_retried():
    judge = StatusJudge(401, failures=100)
    episodes, _ = judged(judge, retries=2)
    assert len(judge.requests) == 2  # a wrong key or model stays wrong: one attempt per rollout
    assert all(only_trace(e).metrics["judge_failed/http"] == 1.0 for e in episodes)


def test_transient_failure_is_retried_into_a_verdict():
    judge = StatusJudge(503, failures=1)  # the first request fails, the rest get CORRECT
    episodes, _ = judged(judge, retries=1)
    assert len(judge.requests) == 3  # rollout 1: 503 then CORRECT; rollout 2: CORRECT
    for episode in episodes:
        trace = only_trace(episode)
        assert trace.reward == 1.0 and trace.metrics["judge_failed"] == 0.0


def test_unreachable_judge_scores_zero_and_is_counted():
    episodes, policy_requests = LOOP.run_until_complete(run(None, base_url=closed_port_url(), retries=1))
    assert len(policy_requests) == 2
    for episode in episodes:
        trace = only_trace(episode)
        assert trace.reward == 0.0 and trace.last_reply == POLICY_REPLY
        assert trace.metrics["judge_failed"] == 1.0 and trace.metrics["judge_failed/connection"] == 1.0
        assert trace.info["judge_error"].startswith("connection: APIConnectionError")
        assert "judge_calls" not in trace.info


def test_silent_judge_times_out_scores_zero_and_is_counted():
    judge = SilentJudge()
    # read timeout 0.3 s: the judge never answers, so each attempt ends on it (2 attempts x 2 rollouts ~ 1.2 s).
    episodes, _ = judged(judge, retries=1, timeout={"connect": 5.0, "read": 0.3})
    assert len(judge.requests) == 4
    for episode in episodes:
        trace = only_trace(episode)
        assert trace.reward == 0.0
        assert trace.metrics["judge_failed"] == 1.0 and trace.metrics["judge_failed/timeout"] == 1.0
        assert trace.info["judge_error"].startswith("timeout: APITimeoutError")


def test_empty_reply_is_not_judged():
    judge = kit.ScriptedChatServer(verdict_script("VERDICT: CORRECT"))

    async def main():
        async with judge:
            config = {
                "taskset": {
                    "id": "llm-judge",
                    "num_tasks": 1,
                    "task": {"judge": {"base_url": judge.base_url, "model": "j"}},
                },
                "agent": {"harness": {"id": "env_testkit"}, "runtime": {"type": "subprocess"}},
            }
            return await kit.run_episodes(
                config, lambda body: {"content": "  \n"}, lambda env: list(env.taskset.take(1)), api_key_var=API_KEY_VAR
            )

    (episode,), _ = LOOP.run_until_complete(main())
    trace = only_trace(episode)
    assert trace.reward == 0.0 and trace.metrics["judge_failed"] == 0.0
    assert judge.requests == []
