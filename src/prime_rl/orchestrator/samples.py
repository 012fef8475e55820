"""verifiers traces -> token-exact training samples.

A trace is a graph of message nodes. Each root-to-leaf path (a branch) is one sequence the model saw, and
becomes one sample: the branch's token ids, with the loss mask on the tokens the policy sampled and the
logprobs vLLM returned for them. Environment tokens (user turns, tool results, template scaffolding) stay
in the sequence with the mask off. When a trace forks (a turn whose prompt does not extend the previous
one), the shared prefix appears in several branches; a sampled node is trained only in the first branch
that contains it, so every sampled span is trained exactly once however the trace branches.

Each sample also names, by role, the environment's tokens of later turns (`EnvSpan`: tool results, user replies
after the policy's first turn), which `echo` trains with cross-entropy; like a sampled node, an environment message
is named only in the first sample that contains it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import msgspec

UNKNOWN_VERSION = -1


class EnvSpan(msgspec.Struct, array_like=True):
    """Tokens [start, end) of one sample that the environment wrote in a message of role `role`."""

    start: int
    end: int
    role: str
    """The message's role: `system`, `user`, `assistant` (one the policy did not sample) or `tool`."""


class SampleTokens(msgspec.Struct, array_like=True):
    """One branch of a trace, token-aligned."""

    token_ids: list[int]
    loss_mask: list[bool]
    logprobs: list[float]
    """vLLM's logprob on sampled tokens, 0.0 elsewhere."""
    versions: list[int]
    """Policy step that sampled each token (-1 on tokens the policy did not sample or where vLLM gave none)."""
    env_spans: list[EnvSpan] = []
    """The environment's messages after the policy's first turn, by role (`env_message_spans`), in order; absent
    (results encoded before it existed) reads as none."""


def parse_version(label: str | None) -> int:
    """Our server labels weights `base` (step 0) or by directory name `step_<n>`; anything else is unknown."""
    if label is None:
        return UNKNOWN_VERSION
    if label == "base":
        return 0
    digits = label.removeprefix("step_")
    return int(digits) if digits.isdigit() else UNKNOWN_VERSION


def expand_version_spans(spans: list[dict] | None, num_tokens: int) -> list[int]:
    """vLLM's `weight_versions` ([{version, start, end}], end exclusive) -> one version per completion token."""
    versions = [UNKNOWN_VERSION] * num_tokens
    for span in spans or []:
        version = parse_version(span.get("version"))
        for i in range(max(0, span["start"]), min(num_tokens, span["end"])):
            versions[i] = version
    return versions


def env_message_spans(node, start: int) -> list[EnvSpan]:
    """Where environment message `node` lies once its tokens start at `start`: the runs of its body tokens where the
    renderer attributes content (`is_content`: the message without the chat template around it), else all of its
    tokens (the template's scaffold before and around it included)."""
    role = getattr(getattr(node, "message", None), "role", None)
    n = len(node.token_ids)
    if role is None or n == 0:
        return []
    content = getattr(node, "is_content", None) or []
    if len(content) != n:
        return [EnvSpan(start, start + n, role)]
    bounds, spans, end = [*content, False], [], 0  # list.index scans in C: a long tool result costs microseconds
    while True:
        try:
            begin = bounds.index(True, end)
        except ValueError:
            return spans
        end = bounds.index(False, begin)
        spans.append(EnvSpan(start + begin, start + end, role))


def trace_samples(
    branches: Iterable,
    versions_by_completion: Mapping[tuple[int, ...], list[int]] | None = None,
    fallback_version: int = UNKNOWN_VERSION,
) -> list[SampleTokens]:
    """Samples of one trace: one per trainable branch that still has a token to train.

    `branches` are verifiers `Branch` objects (or anything with `.nodes` and `.trainable`, whose nodes have
    `token_ids`, `mask`, `logprobs` with one entry per masked token, and `sampled`; `message.role` and
    `is_content` where present). `versions_by_completion` maps a model call's completion ids to vLLM's per-token
    policy versions; nodes without an entry get `fallback_version` on their sampled tokens. The environment's
    messages after a branch's first sampled node (the policy's first turn) become its `env_spans`.
    """
    versions_by_completion = versions_by_completion or {}
    trained: set[int] = set()  # id() of sampled nodes already trained in an earlier branch
    named: set[int] = set()  # id() of environment messages already in an earlier sample's env_spans
    samples = []
    for branch in branches:
        if not getattr(branch, "trainable", True):
            continue
        token_ids: list[int] = []
        loss_mask: list[bool] = []
        logprobs: list[float] = []
        versions: list[int] = []
        env_spans: list[EnvSpan] = []
        env_nodes: list[int] = []
        acted = False  # a sampled node came earlier in the branch: what the environment writes now is a later turn
        for node in branch.nodes:
            masked = [tok for tok, m in zip(node.token_ids, node.mask, strict=True) if m]
            if len(node.logprobs or []) != len(masked):
                raise ValueError(f"node has {len(masked)} sampled tokens but {len(node.logprobs or [])} logprobs")
            if node.sampled:
                acted = True
            elif acted and id(node) not in named:
                env_spans += env_message_spans(node, len(token_ids))
                env_nodes.append(id(node))
            train = bool(node.sampled and masked) and id(node) not in trained
            node_versions = iter(versions_by_completion.get(tuple(masked), [fallback_version] * len(masked)))
            node_logprobs = iter(node.logprobs or [])
            for tok, m in zip(node.token_ids, node.mask, strict=True):
                token_ids.append(tok)
                if m:
                    logprob, version = next(node_logprobs), next(node_versions, fallback_version)
                    loss_mask.append(train)
                    logprobs.append(logprob if train else 0.0)
                    versions.append(version if train else UNKNOWN_VERSION)
                else:
                    loss_mask.append(False)
                    logprobs.append(0.0)
                    versions.append(UNKNOWN_VERSION)
            if train:
                trained.add(id(node))
        if any(loss_mask):
            samples.append(SampleTokens(token_ids, loss_mask, logprobs, versions, env_spans))
            named.update(env_nodes)
    return samples


def cut_to_seq_len(samples: list[SampleTokens], seq_len: int) -> list[SampleTokens]:
    """Each sample's first `seq_len` tokens (its env spans cut with them), as upstream prime-rl trains an over-long
    rollout; a sample left with no sampled token (its context alone fills `seq_len`) is dropped."""
    cut = []
    for s in samples:
        if len(s.token_ids) > seq_len:
            spans = [EnvSpan(x.start, min(x.end, seq_len), x.role) for x in s.env_spans if x.start < seq_len]
            s = SampleTokens(
                s.token_ids[:seq_len], s.loss_mask[:seq_len], s.logprobs[:seq_len], s.versions[:seq_len], spans
            )
        if any(s.loss_mask):
            cut.append(s)
    return cut
