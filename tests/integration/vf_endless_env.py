"""A procedural (infinite) taskset that counts the tasks it generated: runs must take tasks lazily."""

import verifiers.v1 as vf

GENERATED = []
"""Indices generated in this process, in order."""


class EndlessData(vf.TaskData):
    answer: str


class EndlessTask(vf.Task[EndlessData]):
    @vf.reward
    async def exact(self, trace: vf.Trace) -> float:
        return float((trace.last_reply or "").strip() == self.data.answer)


class EndlessTaskset(vf.Taskset[EndlessTask, vf.TasksetConfig]):
    INFINITE = True

    def load(self):
        i = 0
        while True:
            GENERATED.append(i)
            text = "abcdefgh"[i % 8] * (1 + i % 3)
            yield EndlessTask(EndlessData(prompt=f"Reverse: {text}", answer=text[::-1]), self.config.task)
            i += 1


__all__ = ["EndlessTaskset"]
