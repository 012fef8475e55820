"""Trace -> sample conversion: masks, logprobs, fork de-duplication, per-token policy versions."""

from types import SimpleNamespace

import pytest

from prime_rl.orchestrator.samples import expand_version_spans, parse_version, trace_samples


def node(token_ids, mask, logprobs=(), sampled=None):
    return SimpleNamespace(
        token_ids=list(token_ids),
        mask=list(mask),
        logprobs=list(logprobs),
        sampled=any(mask) if sampled is None else sampled,
    )


def branch(*nodes, trainable=True):
    return SimpleNamespace(nodes=list(nodes), trainable=trainable)


F, T = False, True


def test_single_turn_sample_keeps_prompt_unmasked_and_logprobs_on_sampled_tokens():
    prompt = node([1, 2, 3], [F, F, F])
    reply = node([4, 5, 6, 7], [F, T, T, T], [-0.5, -1.0, -2.0])  # scaffold token 4, then sampled 5 6 7
    (s,) = trace_samples([branch(prompt, reply)], {(5, 6, 7): [3, 3, 4]})
    assert s.token_ids == [1, 2, 3, 4, 5, 6, 7]
    assert s.loss_mask == [F, F, F, F, T, T, T]
    assert s.logprobs == [0.0, 0.0, 0.0, 0.0, -0.5, -1.0, -2.0]
    assert s.versions == [-1, -1, -1, -1, 3, 3, 4]


def test_multi_turn_keeps_environment_tokens_unmasked():
    turn1 = node([9, 10], [T, T], [-0.1, -0.2])
    feedback = node([11, 12, 13], [F, F, F])
    turn2 = node([14, 15], [F, T], [-0.3])
    (s,) = trace_samples([branch(node([1], [F]), turn1, feedback, turn2)], fallback_version=7)
    assert s.token_ids == [1, 9, 10, 11, 12, 13, 14, 15]
    assert s.loss_mask == [F, T, T, F, F, F, F, T]
    assert s.logprobs == [0.0, -0.1, -0.2, 0.0, 0.0, 0.0, 0.0, -0.3]
    assert s.versions == [-1, 7, 7, -1, -1, -1, -1, 7]  # no vLLM report: the fallback version


def test_forked_trace_trains_each_sampled_node_once():
    """Two branches share the prompt and the first reply; the shared reply is trained only in branch 1."""
    prompt = node([1, 2], [F, F])
    reply1 = node([3, 4], [T, T], [-1.0, -2.0])
    user_a = node([5], [F])
    reply_a = node([6], [T], [-3.0])
    rerendered = node([7, 8], [F, F])  # turn 2 re-rendered from text: a fork off the prompt
    reply_b = node([9], [T], [-4.0])
    s1, s2 = trace_samples([branch(prompt, reply1, user_a, reply_a), branch(prompt, reply1, rerendered, reply_b)])
    assert s1.loss_mask == [F, F, T, T, F, T]
    assert s2.token_ids == [1, 2, 3, 4, 7, 8, 9]
    assert s2.loss_mask == [F, F, F, F, F, F, T]  # reply1 stays in the context but is not trained again
    assert s2.logprobs == [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -4.0]
    trained = sum(sum(s.loss_mask) for s in (s1, s2))
    assert trained == 4  # 2 + 1 + 1 sampled tokens in the whole trace, each exactly once


def test_branch_with_nothing_left_to_train_and_untrainable_branches_are_skipped():
    prompt = node([1], [F])
    reply = node([2], [T], [-1.0])
    leaf = node([3], [F])
    samples = trace_samples(
        [branch(prompt, reply), branch(prompt, reply, leaf), branch(prompt, node([4], [T], [-2.0]), trainable=False)]
    )
    assert len(samples) == 1


def test_logprob_count_mismatch_is_an_error():
    with pytest.raises(ValueError, match="2 sampled tokens but 1 logprobs"):
        trace_samples([branch(node([1, 2], [T, T], [-1.0]))])


def test_version_labels_and_spans():
    assert parse_version("base") == 0 and parse_version("step_12") == 12
    assert parse_version("default") == -1 and parse_version(None) == -1
    spans = [{"version": "step_1", "start": 0, "end": 2}, {"version": "step_2", "start": 2, "end": 5}]
    assert expand_version_spans(spans, 5) == [1, 1, 2, 2, 2]
    assert expand_version_spans(None, 3) == [-1, -1, -1]
    assert expand_version_spans([{"version": "base", "start": 0, "end": 2}], 3) == [0, 0, -1]


def test_cut_to_seq_len_keeps_each_samples_first_tokens_and_drops_one_left_without_a_sampled_token():
    from prime_rl.orchestrator.samples import SampleTokens, cut_to_seq_len

    # prompt 1 2 3, sampled 4 5 6 7 (policy 2, 2, 3, 3): cut at 5 keeps two sampled tokens, all fields aligned.
    long = SampleTokens(
        [1, 2, 3, 4, 5, 6, 7], [F, F, F, T, T, T, T], [0, 0, 0, -0.1, -0.2, -0.3, -0.4], [-1] * 3 + [2, 2, 3, 3]
    )
    fits = SampleTokens([1, 2, 3, 4], [F, F, T, T], [0, 0, -0.5, -0.6], [-1, -1, 2, 2])
    late = SampleTokens([1, 2, 3, 4, 5, 6], [F] * 5 + [T], [0.0] * 5 + [-0.7], [-1] * 5 + [3])  # sampled token past 5
    kept = cut_to_seq_len([long, fits, late], 5)
    assert kept == [
        SampleTokens([1, 2, 3, 4, 5], [F, F, F, T, T], [0, 0, 0, -0.1, -0.2], [-1, -1, -1, 2, 2]),
        fits,
    ]
    assert cut_to_seq_len([fits], 4) == [fits]  # exactly seq_len long: unchanged
