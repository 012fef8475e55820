"""Traces -> results: what the orchestrator needs of a finished verifiers trace (reward, token-exact samples, error
state, a little text), as the `RolloutResult` that crosses the process boundary.

Its own module because this is where a trace is judged, apart from how groups are run and carried: which errors
make it retryable, which seats' tokens cannot be trained on, what text and token counts the metrics keep. The same
judgment serves the orchestrator's worker processes and eval's and synthesize's in-process `Worker`.
"""

from __future__ import annotations

from prime_rl.orchestrator.messages import RolloutResult
from prime_rl.orchestrator.patches import take_versions
from prime_rl.orchestrator.samples import SampleTokens, trace_samples


def _error_of(trace) -> tuple[str | None, bool]:
    errors = list(trace.errors or [])
    if not errors and not trace.has_error:
        return None, False
    if not errors:
        return f"stop condition {trace.stop_condition}", False
    first = errors[0]
    retryable = first.type == "ProviderError" and (first.status_code is None or first.status_code >= 500)
    return f"{first.type}: {first.message}"[:500], retryable


def _text(message) -> str:
    content = getattr(message, "content", None)
    return content if isinstance(content, str) else ""


def chat_message(message) -> dict:
    return message.model_dump(mode="json", exclude_none=True) if hasattr(message, "model_dump") else dict(message)


def tool_schema(tool) -> dict:
    function = {"name": tool.name, "description": tool.description, "parameters": tool.parameters}
    return {"type": "function", "function": function}


def _token_counts(trace, samples: list[SampleTokens]) -> tuple[int, int]:
    """(first prompt, generated) token counts: exact from the samples, else as the server's usage reports them."""
    if samples:
        first = samples[0].loss_mask
        return (first.index(True) if any(first) else 0), sum(sum(s.loss_mask) for s in samples)
    first_call = next((c for c in trace.calls if c.usage is not None), None)
    total = trace.usage
    return (first_call.usage.prompt_tokens if first_call else 0), (total.completion_tokens if total else 0)


def untrainable_sampling(sampling) -> str | None:
    """Why tokens sampled with `sampling` cannot be trained on, or None.

    The trainer scores tokens with the full softmax at the sampling temperature; a seat that sets its own top_p,
    top_k or min_p, or samples greedily, produced tokens from another distribution than the one it is scored on."""
    if sampling is None:
        return None
    extra = sampling.model_extra or {}
    top_k, min_p = extra.get("top_k", -1), extra.get("min_p", 0.0)
    if (sampling.top_p or 1.0) < 1.0 or top_k not in (-1, 0, None) or (min_p or 0.0) > 0.0:
        return f"the seat samples with top_p={sampling.top_p}, top_k={top_k}, min_p={min_p}: not the full softmax"
    if not sampling.temperature:
        return f"the seat samples with temperature={sampling.temperature}: greedy tokens cannot be trained on"
    return None


def rollout_result(
    trace,
    seconds: float,
    keep_messages: bool = False,
    chat_api: bool = False,
    training: bool = False,
    token_versions: bool = True,
) -> RolloutResult:
    """One trace of the policy -> what the orchestrator needs: reward, samples, error state, a little text.

    A trace that sampled no tokens (a seat that never had to act, or any trace on a chat-completions endpoint,
    which returns no token ids) has no samples; that is no error. `training`: refuse traces whose seat sampled
    from another distribution than the trainer scores. `token_versions`: take vLLM's per-token versions (False:
    every sampled token's version is unknown, and the group counts at its start version)."""
    error, retryable = _error_of(trace)
    versions = take_versions(trace.id)
    if not token_versions:
        versions = {}
    sampling = getattr(trace.agent.config, "sampling", None)
    if error is None and training:
        error = untrainable_sampling(sampling)
    samples = [] if error or chat_api else trace_samples(trace.branches, versions)
    prompt_tokens, completion_tokens = _token_counts(trace, samples)
    metrics = {k: float(v) for k, v in (trace.metrics or {}).items() if isinstance(v, int | float)}
    for name, reward in (trace.rewards or {}).items():
        if reward is not None:
            metrics[f"reward/{name}"] = float(reward.score)
    messages = trace.messages or []
    prompt = next((_text(m) for m in messages if getattr(m, "role", None) == "user"), "")
    return RolloutResult(
        reward=float(trace.reward or 0.0) if not error else 0.0,
        samples=samples,
        error=error,
        retryable=retryable,
        truncated=bool(trace.is_truncated),
        metrics=metrics,
        num_turns=int(trace.num_turns or 0),
        prompt=prompt[:2000],
        completion=(trace.last_reply or "")[:2000],
        seconds=seconds,
        messages=[chat_message(m) for m in messages] if keep_messages else None,
        tools=[tool_schema(t) for t in trace.tools] or None if keep_messages else None,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        seat=trace.agent.name,
        temperature=getattr(sampling, "temperature", None),
    )


def episode_results(episode, seconds: float, **options) -> list[RolloutResult]:
    """The policy's traces of one episode (seats the env made untrainable, e.g. a simulated user, are not the
    policy); `options` go to `rollout_result`."""
    traces = [t for t in episode.traces if getattr(t.agent, "trainable", True)]
    if not traces:
        errors = "; ".join(f"{e.type}: {e.message}" for e in episode.errors) or "episode produced no trace"
        return [RolloutResult(reward=0.0, samples=[], error=errors[:500], seconds=seconds)]
    results = [rollout_result(t, seconds, **options) for t in traces]
    if not episode.ok and episode.errors:
        # An env hook failed after the agents ran (setup/run/finalize): the rewards are not trustworthy.
        message = "; ".join(f"{e.type}: {e.message}" for e in episode.errors)[:500]
        for r in results:
            r.error, r.samples = r.error or message, []
    return results
