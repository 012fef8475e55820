"""llm-judge: short questions with a reference answer, answered in one chat turn and graded by an LLM judge.

Reward `judge`: 1.0 when the judge (any OpenAI-compatible endpoint, `taskset.task.judge`) ends its reply with
`VERDICT: CORRECT`, 0.0 for `VERDICT: INCORRECT`, for an empty reply (the judge is not asked), and for any judge
failure. Failures never raise out of the rollout; metrics `judge_failed` and `judge_failed/<kind>` (0 or 1 per
rollout, see `judge.FAILURE_KINDS`) count them. No harness is exported: any single-call chat harness plays it.
"""

from __future__ import annotations

from pathlib import Path

import verifiers.v1 as vf
from pydantic import Field, model_validator

from llm_judge.judge import JudgeEndpointConfig, JudgeOutcome, ask_judge
from llm_judge.questions import KINDS, Kind, generate, read_jsonl

SYSTEM_PROMPT = "Answer the question briefly."


class LLMJudgeData(vf.TaskData):
    question: str
    """The question, also the user prompt."""
    answer: str
    """The reference answer shown to the judge."""


class LLMJudgeTaskConfig(vf.TaskConfig):
    judge: JudgeEndpointConfig = JudgeEndpointConfig()
    """The judge endpoint, model, sampling, timeouts and retries."""


class LLMJudgeTask(vf.Task[LLMJudgeData, vf.State, LLMJudgeTaskConfig]):
    @vf.reward
    async def judge(self, trace: vf.Trace) -> float:
        reply = trace.last_reply.strip()
        outcome = JudgeOutcome()  # an empty reply is wrong whatever a judge would say: no call
        if reply:
            outcome = await ask_judge(
                self.config.judge, question=self.data.question, reference=self.data.answer, answer=reply, trace=trace
            )
        trace.record_metrics(outcome.metrics())
        return outcome.score


class LLMJudgeConfig(vf.TasksetConfig):
    num_tasks: int = Field(1000, ge=1)
    """Number of generated tasks (ignored with `data_file`)."""
    seed: int = 0
    """Generator seed: the same seed always yields the same tasks (ignored with `data_file`)."""
    kinds: list[Kind] = Field(default_factory=lambda: list(KINDS), min_length=1)
    """Question kinds drawn from, uniformly (ignored with `data_file`)."""
    data_file: Path | None = None
    """A local JSONL file of `{"question": str, "answer": str}` rows used instead of generated questions."""
    task: LLMJudgeTaskConfig = LLMJudgeTaskConfig()
    """Per-task settings; `task.judge` configures the judge."""

    @model_validator(mode="after")
    def _check_judge_model(self) -> LLMJudgeConfig:
        if not self.task.judge.model:
            raise ValueError("llm-judge: set taskset.task.judge.model (the judge's model name on its endpoint)")
        return self


class LLMJudgeTaskset(vf.Taskset[LLMJudgeTask, LLMJudgeConfig]):
    def load(self):
        config = self.config
        pairs = (
            read_jsonl(config.data_file)
            if config.data_file is not None
            else generate(config.num_tasks, config.seed, config.kinds)
        )
        for question, answer in pairs:
            data = LLMJudgeData(prompt=question, system_prompt=SYSTEM_PROMPT, question=question, answer=answer)
            yield LLMJudgeTask(data, config.task)


__all__ = ["LLMJudgeTaskset"]
