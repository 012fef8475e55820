"""The judge call: one chat completion to any OpenAI-compatible endpoint through verifiers' `vf.Judge`, with
retries for transient faults, and every failure returned as a named kind instead of raised.

A judge that is down, slow, broken or babbling must not take the policy's rollout with it: the rollout scores 0
and the failure is counted (`JudgeOutcome.metrics`), so a flaky judge shows up in the step metrics rather than as
crashed rollouts. (verifiers' built-in `reference` judge raises instead; that is why this package has its own.)
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import openai
import verifiers.v1 as vf
from pydantic import Field
from verifiers.v1.configs.client import ClientTimeoutConfig

logger = logging.getLogger(__name__)

VERDICTS = ("CORRECT", "INCORRECT")
"""The judge's verdict labels; the first scores 1.0, the second 0.0."""
FAILURE_KINDS = ("connection", "timeout", "http", "unparsable")
"""connection: no connection (refused, reset, DNS); timeout: a connect or read timeout; http: the server answered
but not with a completion (a non-2xx status or a malformed body); unparsable: a completion without a verdict."""
RETRY_STATUSES = frozenset({408, 409, 429})
"""HTTP statuses retried besides 5xx (the OpenAI SDK's own choice of transient statuses)."""

JUDGE_PROMPT = """You are grading an answer to a question against a reference answer.

Question:
{question}

Reference answer:
{reference}

Answer to grade:
{answer}

The answer is correct when it agrees with the reference answer in substance; wording, formatting and extra \
explanation do not matter. End your reply with exactly one of these two lines:
VERDICT: CORRECT
VERDICT: INCORRECT"""


class JudgeEndpointConfig(vf.JudgeConfig):
    """The judge: an OpenAI-compatible endpoint and model, how to sample it, and how hard to try.

    Inherited from verifiers and used as documented there: `headers`, `headers_from_env`, `prompt` (a file whose
    text replaces `JUDGE_PROMPT`, with the same `{question}`, `{reference}`, `{answer}` placeholders). `weight`,
    `id` and `name` only matter for verifiers' plugged judges and are not read here (weight the reward with
    verifiers' `task.rewards.judge.weight`)."""

    base_url: str = "http://127.0.0.1:8000/v1"
    """The judge's OpenAI-compatible base URL (ending in `/v1`); default: a local `inference` server."""
    api_key_var: str = "JUDGE_API_KEY"
    """Environment variable holding the judge's API key (unset: the key `EMPTY`)."""
    model: str = ""
    """The judge's model name on its endpoint; required (the taskset config refuses an empty one)."""
    sampling: vf.SamplingConfig = vf.SamplingConfig(temperature=0.0, max_tokens=256)
    """Sampling of the judge's reply: greedy by default, so a verdict is reproducible."""
    timeout: ClientTimeoutConfig = ClientTimeoutConfig(connect=10.0, read=120.0)
    """Per-request timeouts in seconds (connect; read = the longest wait between bytes of the reply)."""
    retries: int = Field(2, ge=0)
    """Extra attempts after a connection error, a timeout, or HTTP 408/409/429/5xx (other failures are final)."""
    retry_delay: float = Field(1.0, ge=0)
    """Seconds before the first retry; doubled before each further one."""


class VerdictJudge(vf.Judge[str | None, JudgeEndpointConfig]):
    """`JUDGE_PROMPT` -> the verdict label by verifiers' `parse_judge_choice` (None: no verdict in the reply)."""

    prompt = JUDGE_PROMPT

    def parse(self, response: vf.JudgeResponse[str | None]) -> str | None:
        return vf.parse_judge_choice(response.text, VERDICTS)


@dataclass(frozen=True)
class JudgeOutcome:
    verdict: str | None = None
    """A label of `VERDICTS`, or None when the judge failed or was not asked."""
    failure: str | None = None
    """A kind of `FAILURE_KINDS`, or None."""

    @property
    def score(self) -> float:
        return 1.0 if self.verdict == VERDICTS[0] else 0.0

    def metrics(self) -> dict[str, float]:
        """`judge_failed` and one `judge_failed/<kind>` per kind, each 0 or 1, all always present so that their
        per-step mean is the failure rate over every rollout."""
        per_kind = {f"judge_failed/{kind}": float(self.failure == kind) for kind in FAILURE_KINDS}
        return {"judge_failed": float(self.failure is not None), **per_kind}


def failure_kind(error: openai.APIError) -> str:
    if isinstance(error, openai.APITimeoutError):  # a subclass of APIConnectionError: test it first
        return "timeout"
    if isinstance(error, openai.APIConnectionError):
        return "connection"
    return "http"


def is_transient(error: openai.APIError) -> bool:
    if isinstance(error, openai.APIConnectionError):
        return True
    return isinstance(error, openai.APIStatusError) and (
        error.status_code >= 500 or error.status_code in RETRY_STATUSES
    )


async def ask_judge(
    config: JudgeEndpointConfig, *, question: str, reference: str, answer: str, trace: vf.Trace | None = None
) -> JudgeOutcome:
    """The judge's verdict on `answer`; never raises for a judge fault. Every completion that came back is recorded
    on `trace.info["judge_calls"]` by verifiers; the last failure's message goes to `trace.info["judge_error"]`."""
    judge = VerdictJudge(config)
    attempt = 0
    while True:
        try:
            response = await judge.evaluate(trace=trace, question=question, reference=reference, answer=answer)
        except openai.APIError as error:
            if attempt < config.retries and is_transient(error):
                await asyncio.sleep(config.retry_delay * 2**attempt)
                attempt += 1
                continue
            return failed(trace, failure_kind(error), f"{type(error).__name__}: {error}")
        if response.parsed is None:
            return failed(trace, "unparsable", f"no {'/'.join(VERDICTS)} verdict in {response.text[:200]!r}")
        return JudgeOutcome(verdict=response.parsed)


def failed(trace: vf.Trace | None, kind: str, message: str) -> JudgeOutcome:
    logger.warning("llm-judge: judge failed (%s): %s", kind, message)
    if trace is not None:
        trace.info["judge_error"] = f"{kind}: {message}"
    return JudgeOutcome(failure=kind)
