"""Adaptive in-flight control: how many groups the scheduler keeps running, adapted to what the servers absorb.

More groups in flight hide slow rollouts and keep every server batch full; past what the servers' KV caches hold,
vLLM queues (or preempts) requests and every rollout slows down. Once per step the controller reads each server's
own gauges (`/metrics`: requests waiting, KV-cache usage) and moves the target like TCP's congestion window
(additive increase, multiplicative decrease): up one group when no server queued and the target was reached, down
a quarter when any server queued or filled its cache past `KV_HIGH`. `min == max` pins it."""

from __future__ import annotations

import re
from dataclasses import dataclass

KV_HIGH = 0.9
"""KV-cache usage above which a server counts as full (vLLM preempts near 1.0)."""
SHRINK = 0.75
"""Factor the target is multiplied by after a step on which a server fell behind."""


@dataclass(frozen=True)
class ServerLoad:
    waiting: float
    """Requests the server has queued, not yet scheduled (`vllm:num_requests_waiting`)."""
    kv_usage: float
    """Share of its KV cache in use, 0 to 1 (`vllm:kv_cache_usage_perc`)."""

    @property
    def behind(self) -> bool:
        return self.waiting > 0 or self.kv_usage > KV_HIGH


def parse_load(metrics_text: str) -> ServerLoad:
    """A server's load from its Prometheus text (the sum over its engines); a missing gauge reads 0."""

    def gauge(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([-\d.e+]+)$", metrics_text, re.M))

    return ServerLoad(waiting=gauge("vllm:num_requests_waiting"), kv_usage=gauge("vllm:kv_cache_usage_perc"))


class InflightControl:
    """The target number of groups in flight, between `low` and `high` (groups)."""

    def __init__(self, low: int, high: int, start: int):
        if not 1 <= low <= high:
            raise ValueError(f"in-flight bounds must satisfy 1 <= low <= high, got {low}, {high}")
        self.low, self.high = low, high
        self.target = min(max(start, low), high)

    def update(self, loads: list[ServerLoad], peak: int) -> int:
        """The next step's target, from the servers' loads now and the most groups in flight during the step (no
        growth unless the target was reached: a target the scheduler never filled says nothing about capacity)."""
        if any(load.behind for load in loads):
            self.target = max(self.low, int(self.target * SHRINK))
        elif loads and peak >= self.target:
            self.target = min(self.high, self.target + 1)
        return self.target
