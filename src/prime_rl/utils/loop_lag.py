"""Event-loop lag: how late `asyncio.sleep` wakes up, i.e. how long the loop was busy with something else.

The orchestrator's loop schedules rollouts and swaps weights; a rollout worker's loop runs hundreds of rollouts.
Either one starved (CPU-bound work on the loop, or a machine without spare cores) shows up here first.
"""

import asyncio
import statistics
import time


class LoopLagMonitor:
    def __init__(self, interval: float = 0.1):
        self.interval = interval
        self.samples: list[float] = []

    async def run(self) -> None:
        """Sample forever (run it as a task and cancel it when done)."""
        while True:
            start = time.perf_counter()
            await asyncio.sleep(self.interval)
            self.samples.append(time.perf_counter() - start - self.interval)

    def pop(self) -> tuple[float, float]:
        """(max, mean) lag in seconds since the last call; (0, 0) without samples."""
        samples, self.samples = self.samples or [0.0], []
        return max(samples), statistics.fmean(samples)
