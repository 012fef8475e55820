"""Messages between the orchestrator and its rollout workers (msgpack, tagged unions).

Their own module because both sides of the ZeroMQ socket use them, and so do the callers that never start a
worker process (eval, synthesize, the scheduler's tests): `RolloutResult` is what every consumer of rollouts reads.
The orchestrator sends `ToWorker` (a group to run, the policy step the servers now serve, or shut down); a worker
answers with `FromWorker` (a finished group, ready after loading its environments, or the error that kept it from
loading them).
"""

from __future__ import annotations

from typing import Any

import msgspec

from prime_rl.orchestrator.samples import SampleTokens


class RunGroup(msgspec.Struct, tag=True):
    id: int
    env: str
    task: dict[str, Any]
    """The task's `TaskData`, JSON-dumped; the worker rebuilds the task from it (the orchestrator owns the taskset)."""
    n: int
    base_url: str
    model: str | None = None
    """The `model` the group's requests name: the policy it was started on (in adapter mode, the adapter from step 1
    on); None: the config's `model.api_name`."""
    temperature: float | None = None
    """The temperature the group samples at (the orchestrator's temperature scaling); None: `sampling.temperature`.
    A seat that sets its own temperature keeps it."""
    policy_gate: int | None = None
    """A group started before the policy its batch needs: its model calls wait until the servers serve this step
    (`PolicyServed`); None: they go out at once."""


class PolicyServed(msgspec.Struct, tag=True):
    """The servers serve policy `step` now: model calls gated on it (or older) may go."""

    step: int


class Shutdown(msgspec.Struct, tag=True):
    pass


class RolloutResult(msgspec.Struct):
    """One trace of the policy (a seat's part of an episode): its reward, and its samples if it sampled tokens.

    A trace without samples and without an error (a seat that never had to act) is a rollout like any other for
    rewards and metrics; it is simply not trained on."""

    reward: float
    samples: list[SampleTokens]
    error: str | None = None
    """Why the rollout is excluded from rewards and training (None: fine)."""
    retryable: bool = False
    """The error came from the inference server (connection, 5xx): running the group again may succeed."""
    truncated: bool = False
    metrics: dict[str, float] = {}
    num_turns: int = 0
    prompt: str = ""
    completion: str = ""
    seconds: float = 0.0
    messages: list[dict] | None = None
    """The final branch's conversation as OpenAI chat messages (only when the worker keeps them: `synthesize`)."""
    tools: list[dict] | None = None
    """The tools offered to the model, OpenAI function schemas (with `messages`)."""
    prompt_tokens: int = 0
    """Tokens of the first prompt."""
    completion_tokens: int = 0
    """Tokens the model generated, all turns."""
    seat: str = "agent"
    """The env seat that produced the trace (`agent` for single-agent envs); advantages are computed per seat."""
    episode: int = 0
    """Which episode of its group the trace belongs to (an episode of a multi-agent env has a trace per seat)."""
    temperature: float | None = None
    """The temperature the seat sampled with (a seat may set its own), None where the trace does not say."""


class GroupDone(msgspec.Struct, tag=True):
    id: int
    rollouts: list[RolloutResult]
    loop_lag: float = 0.0
    """Worst event-loop lag (s) this worker saw since its previous message."""


class Ready(msgspec.Struct, tag=True):
    worker: int
    proof: bytes
    """The orchestrator's random channel token, given to its workers at spawn: the socket listens on loopback, where
    any local process (the code a model writes, among them) can connect; only a worker knows it."""


class Failed(msgspec.Struct, tag=True):
    worker: int
    message: str
    proof: bytes


ToWorker = RunGroup | PolicyServed | Shutdown
FromWorker = GroupDone | Ready | Failed
