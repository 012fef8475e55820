"""A test environment whose reward raises on every other task (the orchestrator must count and skip those)."""

import random

import verifiers.v1 as vf


class FlakyData(vf.TaskData):
    answer: str
    explode: bool


class FlakyTask(vf.Task[FlakyData]):
    @vf.reward
    async def exact(self, trace: vf.Trace) -> float:
        if self.data.explode:
            raise RuntimeError("reward function exploded")
        return float((trace.last_reply or "").strip() == self.data.answer)


class FlakyTaskset(vf.Taskset[FlakyTask, vf.TasksetConfig]):
    def load(self):
        rng = random.Random(0)
        for i in range(64):
            text = "".join(rng.choice("abcdefgh") for _ in range(5))
            data = FlakyData(prompt=f"Reverse: {text}", answer=text[::-1], explode=i % 2 == 1)
            yield FlakyTask(data, self.config.task)


__all__ = ["FlakyTaskset"]
