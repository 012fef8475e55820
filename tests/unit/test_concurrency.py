"""Adaptive in-flight control: the controller's steps worked by hand, the servers' gauges read from vLLM's
Prometheus text, and the bounds in groups."""

import pytest

from prime_rl.orchestrator.concurrency import InflightControl, ServerLoad, parse_load
from prime_rl.orchestrator.config import OrchestratorConfig

IDLE, QUEUED, FULL = ServerLoad(0, 0.5), ServerLoad(2, 0.5), ServerLoad(0, 0.95)


def test_additive_increase_multiplicative_decrease():
    """Start 8 in [2, 10]: two steps that kept up -> 9, 10; at the ceiling it stays; one server queued -> 7
    (int(10 x 0.75)); a full KV cache -> 5 (int(7 x 0.75)); then 3, 2, and the floor holds."""
    control = InflightControl(2, 10, 8)
    assert [control.update([IDLE, IDLE], peak=p) for p in (8, 9, 10)] == [9, 10, 10]
    assert control.update([IDLE, QUEUED], peak=10) == 7
    assert control.update([FULL], peak=7) == 5
    assert [control.update([QUEUED], peak=5) for _ in range(3)] == [3, 2, 2]


def test_no_growth_without_evidence():
    """A target the scheduler never filled says nothing about capacity; no answer from any server neither."""
    control = InflightControl(1, 10, 4)
    assert control.update([IDLE], peak=3) == 4
    assert control.update([], peak=4) == 4


def test_pinned_when_the_bounds_are_equal_and_the_start_is_clamped():
    control = InflightControl(6, 6, 2)
    assert control.target == 6
    assert control.update([IDLE], peak=6) == 6 and control.update([QUEUED], peak=6) == 6
    with pytest.raises(ValueError):
        InflightControl(5, 4, 4)


def test_loads_read_from_vllm_metrics_text():
    text = (
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0\n'
        'vllm:num_requests_waiting{engine="1",model_name="m"} 1.0\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
        'vllm:num_requests_running{engine="0",model_name="m"} 7.0\n'
    )
    assert parse_load(text) == ServerLoad(waiting=4.0, kv_usage=0.25) and parse_load(text).behind
    assert parse_load("") == ServerLoad(0.0, 0.0) and not parse_load("").behind


def test_bounds_are_rollouts_rounded_up_to_groups():
    config = OrchestratorConfig(
        batch_size=32,
        rollouts_per_example=4,
        concurrency={"min_inflight": 5, "max_inflight": 30, "initial_inflight": 9},
    )
    assert config.inflight_bounds() == (2, 8) and config.groups_in_flight == 3
    config = OrchestratorConfig(batch_size=32, rollouts_per_example=4, concurrency={})
    assert config.inflight_bounds() == (1, 32) and config.groups_in_flight == 8  # four batches; batch x oversampling
    with pytest.raises(ValueError, match=r"min_inflight \(9\) > max_inflight \(8\)"):
        OrchestratorConfig(batch_size=32, rollouts_per_example=4, concurrency={"min_inflight": 9, "max_inflight": 8})
