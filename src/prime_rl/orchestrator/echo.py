"""`echo`'s cross-entropy weights: which environment tokens of a sample the policy learns to predict, and how much.

ECHO trains the policy's own tokens with the grpo family's advantages (`rl`) and, beside them, the tokens the
environment wrote in answer to it (tool results, user replies) with cross-entropy (`ce`), so the policy also learns
what its actions cause. Which tokens: the sample's `env_spans` (`samples.py`), the environment's messages after the
policy's first turn (the task's own prompt is not trained), each message's body where the renderer tells body from
chat template, else the whole message; a message counts under its role when `EchoAlgo.roles` names the role, at that
role's `alpha`. Sampled tokens are never in a span, so the rl loss mask and its token count stay as grpo's.
"""

from __future__ import annotations

from collections.abc import Sequence

from prime_rl.batch import TrainingSample
from prime_rl.config.algorithm import AlgoConfig, EchoAlgo
from prime_rl.orchestrator.samples import SampleTokens


def echo_weights(sample: SampleTokens, algo: AlgoConfig) -> list[float]:
    """One ce weight per token of `sample`: its role's alpha on the env-span tokens of the roles `algo` trains, 0
    elsewhere; `[]` (no ce tokens) where nothing is chosen or `algo` is not echo."""
    if not isinstance(algo, EchoAlgo):
        return []
    weights = [0.0] * len(sample.token_ids)
    chosen = False
    for span in sample.env_spans:
        role = algo.roles.get(span.role)
        if role is not None:
            weights[span.start : span.end] = [role.alpha] * (span.end - span.start)
            chosen = True
    return weights if chosen else []


def echo_metrics(groups: Sequence, samples: Sequence[TrainingSample], config) -> dict:
    """`echo_tokens`: the tokens of the batch (`samples`, as `batch_samples` built them from `groups`: one per
    rollout sample, in order) that echo trains with ce; where no other algorithm ships ce, the trainer's `ce_tokens`
    of the step. `{}` when no environment runs echo."""
    echo = {e.display_name for e in config.env if isinstance(config.env_algo(e.display_name), EchoAlgo)}
    if not echo:
        return {}
    envs = [g.env for g in groups for r in g.rollouts for _ in r.samples]
    return {
        "echo_tokens": sum(
            sum(w > 0 for w in s.ce_weights) for env, s in zip(envs, samples, strict=True) if env in echo
        )
    }
