"""`echo`: the environment's tokens of later turns named by role in each sample (`samples.env_spans`), their ce
weights per role (`echo.echo_weights`), and their place in the batch (`batch_samples`, `echo_metrics`)."""

from types import SimpleNamespace

import msgspec
import pytest

from prime_rl.orchestrator.config import OrchestratorConfig
from prime_rl.orchestrator.echo import echo_metrics, echo_weights
from prime_rl.orchestrator.messages import RolloutResult
from prime_rl.orchestrator.orchestrator import batch_samples
from prime_rl.orchestrator.samples import EnvSpan, SampleTokens, cut_to_seq_len, trace_samples
from prime_rl.orchestrator.scheduler import Group

F, T = False, True


def node(role, token_ids, mask=None, logprobs=(), is_content=(), sampled=None):
    mask = [F] * len(token_ids) if mask is None else mask
    return SimpleNamespace(
        message=SimpleNamespace(role=role),
        token_ids=list(token_ids),
        mask=list(mask),
        logprobs=list(logprobs),
        is_content=list(is_content),
        sampled=any(mask) if sampled is None else sampled,
    )


def branch(*nodes):
    return SimpleNamespace(nodes=list(nodes), trainable=True)


def two_turns():
    """system 0-2 | user 3-5 (the task) | reply 6-8 (scaffold 6, sampled 7 8) | tool 9-12 (body 10 11 between its
    template tokens) | user 13-15 (no content attribution: all three) | reply 16-17 (scaffold 16, sampled 17)."""
    return branch(
        node("system", [1, 2, 3], is_content=[F, T, F]),
        node("user", [4, 5, 6], is_content=[F, T, T]),
        node("assistant", [7, 8, 9], [F, T, T], [-0.1, -0.2]),
        node("tool", [10, 11, 12, 13], is_content=[F, T, T, F]),
        node("user", [14, 15, 16]),
        node("assistant", [17, 18], [F, T], [-0.3]),
    )


def echo(**roles) -> OrchestratorConfig:
    return OrchestratorConfig(algo={"type": "echo", "roles": {r: {"alpha": a} for r, a in roles.items()}})


def test_env_spans_are_the_later_turns_bodies_by_role():
    (s,) = trace_samples([two_turns()])
    # The task (system, first user) comes before the policy's first turn: not named. The tool message's body only;
    # the user message without attribution whole.
    assert s.env_spans == [EnvSpan(10, 12, "tool"), EnvSpan(13, 16, "user")]
    assert s.loss_mask == [F] * 7 + [T, T] + [F] * 8 + [T]


def test_ce_weights_per_role_by_hand():
    (s,) = trace_samples([two_turns()])
    default = OrchestratorConfig(algo={"type": "echo"}).algo  # tool at 0.1
    assert echo_weights(s, default) == [0.0] * 10 + [0.1, 0.1] + [0.0] * 6
    weights = echo_weights(s, echo(tool=0.5, user=0.25).algo)
    assert weights == [0.0] * 10 + [0.5, 0.5, 0.0, 0.25, 0.25, 0.25, 0.0, 0.0]
    assert [weights[t] for t in (7, 8, 17)] == [0.0, 0.0, 0.0]  # the sampled tokens: rl only
    assert echo_weights(s, echo(user=2.0).algo) == [0.0] * 13 + [2.0] * 3 + [0.0] * 2  # tool off
    # system and the task's user message come before the first turn, the replies are the policy's: nothing to train.
    assert echo_weights(s, echo(system=1.0, assistant=1.0).algo) == []
    assert echo_weights(s, OrchestratorConfig().algo) == []  # grpo


def test_an_assistant_message_the_policy_did_not_write_counts_as_the_environments():
    fabricated = node("assistant", [20, 21], is_content=[F, T], sampled=False)  # e.g. a harness's canned reply
    (s,) = trace_samples([branch(node("user", [1]), node("assistant", [2], [T], [-0.5]), fabricated,
                                 node("assistant", [3], [T], [-0.6]))])  # fmt: skip
    assert s.env_spans == [EnvSpan(3, 4, "assistant")]
    assert echo_weights(s, echo(assistant=0.3).algo) == [0.0, 0.0, 0.0, 0.3, 0.0]


def test_a_forked_trace_names_each_environment_message_once():
    """Both branches hold the tool result after the shared first reply; it trains in the first one only, as the
    shared reply does. The second branch's own user message is named there."""
    prompt, reply = node("user", [1, 2]), node("assistant", [3], [T], [-1.0])
    tool = node("tool", [4, 5], is_content=[T, T])
    a = branch(prompt, reply, tool, node("assistant", [6], [T], [-2.0]))
    b = branch(prompt, reply, tool, node("user", [7], is_content=[T]), node("assistant", [8], [T], [-3.0]))
    s1, s2 = trace_samples([a, b])
    assert s1.env_spans == [EnvSpan(3, 5, "tool")]
    assert s2.env_spans == [EnvSpan(5, 6, "user")]


def test_a_branch_without_trainable_tokens_leaves_its_messages_to_the_next():
    """Branch 1 only repeats the trained reply and adds a tool result: no sample, so the tool result is named in the
    branch that trains, branch 2."""
    prompt, reply = node("user", [1]), node("assistant", [2], [T], [-1.0])
    tool = node("tool", [3], is_content=[T])
    first = branch(prompt, reply)
    only_repeats = branch(prompt, reply, tool)
    trains = branch(prompt, reply, tool, node("assistant", [4], [T], [-2.0]))
    s1, s2 = trace_samples([first, only_repeats, trains])
    assert (s1.env_spans, s2.env_spans) == ([], [EnvSpan(2, 3, "tool")])


def test_cut_to_seq_len_cuts_the_spans_with_the_tokens():
    (s,) = trace_samples([two_turns()])
    (cut,) = cut_to_seq_len([s], 11)  # ends inside the tool's body
    assert cut.env_spans == [EnvSpan(10, 11, "tool")]
    assert echo_weights(cut, echo(tool=0.5, user=0.25).algo) == [0.0] * 10 + [0.5]


def test_results_encoded_before_env_spans_still_decode():
    old = msgspec.msgpack.encode([[1, 2], [F, T], [0.0, -0.5], [-1, 3]])  # SampleTokens of four fields
    assert msgspec.msgpack.decode(old, type=SampleTokens) == SampleTokens([1, 2], [F, T], [0.0, -0.5], [-1, 3], [])
    (s,) = trace_samples([two_turns()])
    result = RolloutResult(reward=1.0, samples=[s])
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(result), type=RolloutResult) == result


def group(env, first, second, truncated=False):
    """Two rollouts of rewards [1, 0], one sample each."""
    rollouts = [RolloutResult(reward=r, samples=[s], truncated=truncated) for r, s in ((1.0, first), (0.0, second))]
    return Group(0, env, 0, {}, 0, "u", rollouts=rollouts)


def test_batch_ships_ce_for_echo_environments_only_and_leaves_rl_as_grpo():
    """Environment `e` runs echo (tool 0.5, user 0.25), `g` grpo; both groups hold the same two samples, rewards
    [1, 0]: grpo's advantages [0.5, -0.5] everywhere, ce weights only in e's samples, on 2 + 3 tokens each."""
    (s,) = trace_samples([two_turns()])
    config = OrchestratorConfig(
        env=[
            {"id": "reverse-text", "name": "e", "algo": {"type": "echo", "roles": {"tool": {"alpha": 0.5},
                                                                                 "user": {"alpha": 0.25}}}},
            {"id": "reverse-text", "name": "g"},
        ],
        rollouts_per_example=2, batch_size=4,
    )  # fmt: skip
    groups = [group("e", s, s), group("g", s, s)]
    samples, advantages, _ = batch_samples(groups, config)
    assert advantages == [0.5, -0.5, 0.5, -0.5]
    assert all(t.loss_mask == s.loss_mask and t.inference_logprobs == s.logprobs for t in samples)
    expected = echo_weights(s, config.env_algo("e"))
    assert [t.ce_weights for t in samples] == [expected, expected, [], []]
    assert echo_metrics(groups, samples, config) == {"echo_tokens": 10}
    assert echo_metrics(groups[1:], samples[2:], config) == {"echo_tokens": 0}  # a step without echo's groups
    assert echo_metrics(groups, samples, OrchestratorConfig()) == {}
    # mask_truncated_completions: a truncated rollout trains nothing, its environment's tokens included.
    masked = config.model_copy(update={"mask_truncated_completions": True})
    assert [t.ce_weights for t in batch_samples([group("e", s, s, truncated=True)], masked)[0]] == [[], []]


def test_echo_config_errors_name_the_key():
    with pytest.raises(ValueError, match=r"algo\.echo\.roles\.observer"):
        echo(observer=0.1)
    with pytest.raises(ValueError, match=r"algo\.echo\.roles\.tool\.alpha\n.*greater than 0"):
        echo(tool=0.0)
    with pytest.raises(ValueError, match=r"algo\.echo\.roles\n.*at least 1 item"):
        OrchestratorConfig(algo={"type": "echo", "roles": {}})
