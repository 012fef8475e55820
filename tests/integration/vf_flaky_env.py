"""A test environment whose reward raises (the orchestrator must count and skip those rollouts).

By default the reward raises on every rollout of every other task; with `per_rollout = true` it raises on the
rollouts whose reply has an odd length, about half of every group, so groups arrive short of rollouts."""

import random

import verifiers.v1 as vf


class FlakyData(vf.TaskData):
    answer: str
    explode: bool
    per_rollout: bool


class FlakyTask(vf.Task[FlakyData]):
    @vf.reward
    async def exact(self, trace: vf.Trace) -> float:
        reply = (trace.last_reply or "").strip()
        if self.data.explode or (self.data.per_rollout and len(reply) % 2 == 1):
            raise RuntimeError("reward function exploded")
        return float(reply == self.data.answer)


class FlakyConfig(vf.TasksetConfig):
    per_rollout: bool = False
    """Raise on about half the rollouts of every task instead of on all rollouts of half the tasks."""


class FlakyTaskset(vf.Taskset[FlakyTask, FlakyConfig]):
    def load(self):
        rng = random.Random(0)
        for i in range(64):
            text = "".join(rng.choice("abcdefgh") for _ in range(5))
            explode = i % 2 == 1 and not self.config.per_rollout
            data = FlakyData(
                prompt=f"Reverse: {text}", answer=text[::-1], explode=explode, per_rollout=self.config.per_rollout
            )
            yield FlakyTask(data, self.config.task)


__all__ = ["FlakyTaskset"]
