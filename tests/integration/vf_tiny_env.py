"""A minimal verifiers v1 environment for tests: reverse a short string, one chat turn, in-process harness."""

import random

import verifiers.v1 as vf
from openai import AsyncOpenAI
from verifiers.v1.runtimes import ProgramResult


class TinyData(vf.TaskData):
    answer: str


class TinyTask(vf.Task[TinyData]):
    @vf.reward
    async def exact(self, trace: vf.Trace) -> float:
        return float((trace.last_reply or "").strip() == self.data.answer)


class TinyConfig(vf.TasksetConfig):
    num_tasks: int = 4


class TinyTaskset(vf.Taskset[TinyTask, TinyConfig]):
    def load(self):
        rng = random.Random(0)
        for _ in range(self.config.num_tasks):
            text = "".join(rng.choice("abcdefgh") for _ in range(5))
            yield TinyTask(TinyData(prompt=f"Reverse: {text}", answer=text[::-1]), self.config.task)


class TinyChatHarness(vf.Harness[vf.HarnessConfig]):
    """One chat call, in this process (no uv, no subprocess)."""

    APPENDS_SYSTEM_PROMPT = SUPPORTS_RESUME = True
    EXECUTES_CODE = NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, *args, **kwargs):
        system, prompt = self.resolve_prompt(data)
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        async with AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            await client.chat.completions.create(model=ctx.model, messages=messages)
        return ProgramResult(0, "", "")


__all__ = ["TinyTaskset", "TinyChatHarness"]
