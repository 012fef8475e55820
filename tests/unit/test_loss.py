"""RL loss family: hand-derived values and gradients, masks, KL shaping, normalisation, stats, config checks.

Notation: log r = π − μ, r = e^(log r), A the advantage, scale the step's normaliser (`step_loss_scale`: its
loss tokens, or its samples for gspo); loss = Σ over kept tokens of w_t·L_t / scale, w_t = 1 except for gspo,
where w_t = 1/n_i with n_i the kept tokens of the token's sample i.
"""

import math

import pytest
import torch
from pydantic import ValidationError

from prime_rl.trainer.rl.loss import LossConfig, compute_loss, ratio_masks, sequence_stats, step_loss_scale

F64 = torch.float64
OBJECTIVES = ["aipo", "grpo", "gspo", "cispo"]


def run(config, pi, mu, adv, mask, ids, num_samples, scale):
    """compute_loss on python lists; returns (loss, d loss / d π, stats)."""
    pi = torch.tensor(pi, dtype=F64, requires_grad=True)
    loss, stats = compute_loss(
        pi,
        torch.tensor(mu, dtype=F64),
        torch.tensor(adv, dtype=F64),
        torch.tensor(mask, dtype=torch.bool),
        torch.tensor(ids, dtype=torch.long),
        num_samples,
        scale,
        config,
    )
    (grad,) = torch.autograd.grad(loss, pi)
    return loss.item(), grad.tolist(), stats


def close(actual, expected, tol=1e-12):
    assert actual == pytest.approx(expected, abs=tol, rel=tol)


# Shared tiny batch: sample 0 = tokens 0..2 (token 0 is a prompt token, loss_mask False), sample 1 = tokens 3..4.
IDS = [0, 0, 0, 1, 1]
MASK = [False, True, True, True, True]
SCALE = 10.0


def test_aipo_value_and_grad():
    cfg = LossConfig(objective="aipo", delta=1.5)
    pi = [-1.0, -0.5, -1.0, -2.0, -0.3]
    mu = [-5.0, -1.0, -0.8, -2.0, -0.1]  # log r = [4 (not a loss token), 0.5, -0.2, 0, -0.2]
    adv = [7.0, 2.0, 2.0, -1.0, -1.0]
    # t1: r = e^0.5 = 1.6487 > delta=1.5 -> weight 1.5: L = -1.5*2*(-0.5) = 1.5, grad = -1.5*2 = -3   (truncated)
    # t2: r = e^-0.2 = 0.8187 -> weight 0.8187: L = -0.8187*2*(-1) = 1.6375, grad = -2*0.8187          (not)
    # t3: r = 1: L = -1*(-1)*(-2) = -2, grad = +1
    # t4: r = e^-0.2: L = -0.8187*(-1)*(-0.3) = -0.2456, grad = +0.8187
    # t0 is not a loss token: no loss, no gradient, despite r = e^4.
    w = math.exp(-0.2)
    loss, grad, stats = run(cfg, pi, mu, adv, MASK, IDS, 2, SCALE)
    close(loss, (1.5 + 2 * w - 2 - 0.3 * w) / SCALE)
    for g, e in zip(grad, [0.0, -3.0 / SCALE, -2 * w / SCALE, 1.0 / SCALE, w / SCALE], strict=True):
        close(g, e)
    assert stats["clipped_tokens"].item() == 1  # only t1 had r > delta
    assert stats["loss_tokens"].item() == 4 and stats["samples"].item() == 2


def test_grpo_value_and_grad():
    cfg = LossConfig(objective="grpo", eps_low=0.2, eps_high=0.28)  # ratio range [0.8, 1.28]
    ids = [0, 0, 0, 1, 1, 1]
    mask = [False, True, True, True, True, True]
    log_r = [0.0, 0.5, 0.5, -0.5, -0.5, 0.1]
    mu = [-1.0] * 6
    pi = [m + x for m, x in zip(mu, log_r, strict=True)]
    adv = [1.0, 1.0, -1.0, -1.0, 1.0, 2.0]
    hi, lo, mid = math.exp(0.5), math.exp(-0.5), math.exp(0.1)  # 1.6487, 0.6065, 1.1052
    # t1: r=1.6487, A=+1: min(1.6487, 1.28) = 1.28 -> clipped: L = -1.28, grad 0
    # t2: r=1.6487, A=-1: min(-1.6487, -1.28) = -1.6487 -> unclipped: L = 1.6487, grad = -A*r = +1.6487
    # t3: r=0.6065, A=-1: min(-0.6065, -0.8) = -0.8 -> clipped: L = 0.8, grad 0
    # t4: r=0.6065, A=+1: min(0.6065, 0.8) = 0.6065 -> unclipped: L = -0.6065, grad = -0.6065
    # t5: r=1.1052 in range, A=2: L = -2.2103, grad = -2*1.1052
    loss, grad, stats = run(cfg, pi, mu, adv, mask, ids, 2, SCALE)
    close(loss, (-1.28 + hi + 0.8 - lo - 2 * mid) / SCALE)
    for g, e in zip(grad, [0.0, 0.0, hi / SCALE, 0.0, -lo / SCALE, -2 * mid / SCALE], strict=True):
        close(g, e)
    assert stats["clipped_tokens"].item() == 2  # t1 and t3


@pytest.mark.parametrize("eps_high", [0.28, 0.2])
def test_grpo_clip_higher_asymmetry(eps_high):
    cfg = LossConfig(objective="grpo", eps_low=0.2, eps_high=eps_high)
    # One token per sample. Token 0: r = 1.25, A = +1. Token 1: r = 0.75, A = -1.
    # A>0 is capped at 1+eps_high: with 0.28, 1.25 < 1.28 -> unclipped, L = -1.25, grad = -1.25;
    #                             with 0.2,  1.25 > 1.2  -> clipped,   L = -1.2,  grad 0.
    # A<0 is capped at 1-eps_low = 0.8 either way: min(-0.75, -0.8) = -0.8 -> L = 0.8, grad 0.
    pi = [math.log(1.25), math.log(0.75)]
    loss, grad, stats = run(cfg, pi, [0.0, 0.0], [1.0, -1.0], [True, True], [0, 1], 2, SCALE)
    if eps_high == 0.28:
        close(loss, (-1.25 + 0.8) / SCALE)
        close(grad[0], -1.25 / SCALE)
        assert stats["clipped_tokens"].item() == 1
    else:
        close(loss, (-1.2 + 0.8) / SCALE)
        close(grad[0], 0.0)
        assert stats["clipped_tokens"].item() == 2
    close(grad[1], 0.0)


@pytest.mark.parametrize("adv1", [1.0, -1.0])
def test_gspo_value_and_grad(adv1):
    cfg = LossConfig(objective="gspo")  # sequence ratio range [1 - 3e-4, 1 + 4e-4]
    ids = [0, 0, 0, 0, 1, 1]
    mask = [True, True, False, True, True, True]
    log_r = [1e-4, -1e-4, 5.0, 2e-4, 0.01, 0.01]  # token 2 is not a loss token: excluded from the mean
    mu = [-2.0] * 6
    pi = [m + x for m, x in zip(mu, log_r, strict=True)]
    adv = [1.0, 2.0, 9.0, 3.0, adv1, adv1]
    # Sample 0: mean log r = (1e-4 - 1e-4 + 2e-4)/3, s0 = e^(2e-4/3) = 1.0000667, in range -> unclipped.
    #   L_u = -s0*A_u for u in its 3 loss tokens, each weighted 1/3: the sample's loss is -s0*(1+2+3)/3 = -2*s0.
    #   ds0/dπ_t = s0/3, so every loss token gets grad = -2*s0/3.
    # Sample 1 (2 tokens, weights 1/2): s1 = e^0.01 = 1.01005 > 1.0004.
    #   A=+1: min(1.01005, 1.0004) -> clipped: loss -1.0004, the whole sample's gradient is 0.
    #   A=-1: min(-1.01005, -1.0004) = -1.01005 -> unclipped: loss +s1, grad per token = s1/2.
    s0, s1 = math.exp(2e-4 / 3), math.exp(0.01)
    loss, grad, stats = run(cfg, pi, mu, adv, mask, ids, 2, SCALE)
    expected_grad0 = [-2 * s0 / 3 / SCALE, -2 * s0 / 3 / SCALE, 0.0, -2 * s0 / 3 / SCALE]
    for g, e in zip(grad[:4], expected_grad0, strict=True):
        close(g, e)
    if adv1 > 0:
        close(loss, (-2 * s0 - 1.0004) / SCALE)
        assert grad[4:] == [0.0, 0.0]
        assert stats["clipped_tokens"].item() == 2
    else:
        close(loss, (-2 * s0 + s1) / SCALE)
        close(grad[4], s1 / 2 / SCALE)
        close(grad[5], s1 / 2 / SCALE)
        assert stats["clipped_tokens"].item() == 0


@pytest.mark.parametrize("adv", [1.0, -1.0])
def test_gspo_sequence_ratio_is_over_kept_tokens_only(adv):
    cfg = LossConfig(objective="gspo")  # sequence ratio range [1 - 3e-4, 1 + 4e-4], token mask (0.125, 8)
    log_r = [2e-4, -4e-4, 3.0]  # one sample of 3 loss tokens; t2 has r = e^3 = 20.1 > 8: token-masked
    mu = [-1.0] * 3
    pi = [m + x for m, x in zip(mu, log_r, strict=True)]
    # Kept: t0, t1. s = e^((2e-4 - 4e-4)/2) = e^-1e-4 = 0.9999, inside the clip range -> unclipped either sign.
    # L = Σ over kept u of -s*A/2 = -s*A (weights 1/2: two kept tokens); ds/dπ_t = s/2 for t0 and t1 (the mean is
    # over the 2 kept tokens), so grad = -A*s/2 on t0 and t1, and exactly 0 on t2, which is not in the mean at all.
    # (Averaging over the loss mask instead gives s = e^((3 - 2e-4)/3) = 2.718: clipped for A = +1, and for
    # A = -1 unclipped with gradient -A*s/3 = +0.91 flowing into the masked token t2.)
    s = math.exp(-1e-4)
    loss, grad, stats = run(cfg, pi, mu, [adv] * 3, [True] * 3, [0, 0, 0], 1, SCALE)
    close(loss, -s * adv / SCALE)
    close(grad[0], -adv * s / 2 / SCALE)
    close(grad[1], -adv * s / 2 / SCALE)
    assert grad[2] == 0.0
    assert stats["masked_high"].item() == 1 and stats["clipped_tokens"].item() == 0


def issue_case(objective, pi, mu, ids, mask, calls):
    """float32 compute_loss over the two samples below, split into `calls` (lists of sample ids), like micro-batches
    or ranks; every call divides by the step's `step_loss_scale`. Returns (summed loss, d loss / d π)."""
    cfg = LossConfig(objective=objective)
    pi = torch.tensor(pi, dtype=torch.float32, requires_grad=True)
    mu, ids, mask = torch.tensor(mu, dtype=torch.float32), torch.tensor(ids), torch.tensor(mask)
    scale = step_loss_scale(cfg, loss_tokens=int(mask.sum()), samples=2)
    total = 0.0
    for call in calls:
        at = torch.isin(ids, torch.tensor(call))
        local_ids = torch.searchsorted(torch.tensor(call), ids[at])  # renumbered 0.. within the call, as packing does
        loss, _ = compute_loss(pi[at], mu[at], torch.ones(int(at.sum())), mask[at], local_ids, len(call), scale, cfg)
        loss.backward()
        total += loss.item()
    return total, pi.grad.tolist()


def test_gspo_weighs_each_sequence_equally_whatever_its_length():
    # The issue's case: sample 0 = a prompt token + 4 completion tokens, sample 1 = a prompt token + 1 completion
    # token; both have A = 1 and log r = x = 2^-14 on every completion token (prompt tokens: log r = 1, ignored).
    # GSPO (paper): J = 1/G Σ_i min(s_i A_i, clip(s_i) A_i), s_i = exp(mean log r over sample i's tokens), G = 2.
    #   s_0 = s_1 = s = e^x = 1.0000610370 (inside [1 - 3e-4, 1 + 4e-4]: unclipped), loss = -(s + s)/2 = -s.
    #   Sample 0: ds_0/dπ_t = s/4 for each of its 4 tokens -> grad = -(1/2)*s/4 = -s/8 = -0.1250076296 each,
    #             -s/2 = -0.5000305185 summed over the sequence.
    #   Sample 1: ds_1/dπ_t = s for its one token -> grad = -(1/2)*s = -s/2 = -0.5000305185.
    # Both sequences get the same total gradient, -s/2: equal weight 1/G. (Token weighting, divided by the 5 loss
    # tokens, gave sample 0 4 * -s/5 and sample 1 -s/5: 4x.)
    # float32: x = 2^-14, -1 + x (a multiple of 2^-24 in [0.5, 1)), π − μ, the mean of four x's, the weights 1/4 and
    # 1/1 and the scale 2 are all exact; e^x is the only rounded operation (to within half an ulp, 2^-24 ~ 6e-8
    # relative: it rounds to 1 + 2^-14, 1.9e-9 off), so rel = 5e-7 (4 ulps of 2^-23) is ample and still far below
    # any weighting error (the smallest wrong weight here is off by 25%).
    x = 2.0**-14
    s = math.exp(x)
    mu = [-1.0] * 7
    pi = [0.0, -1 + x, -1 + x, -1 + x, -1 + x, 0.0, -1 + x]
    ids = [0, 0, 0, 0, 0, 1, 1]
    mask = [False, True, True, True, True, False, True]
    tol = 5e-7
    for calls in ([[0, 1]], [[0], [1]]):  # one packed call, or each sample in its own micro-batch / rank
        loss, grad = issue_case("gspo", pi, mu, ids, mask, calls)
        assert loss == pytest.approx(-s, rel=tol)
        assert grad == pytest.approx([0.0, -s / 8, -s / 8, -s / 8, -s / 8, 0.0, -s / 2], rel=tol, abs=0)
        assert sum(grad[0:5]) == pytest.approx(sum(grad[5:7]), rel=tol) == pytest.approx(-s / 2, rel=tol)
    # The token-weighted objectives are unchanged: grpo (r = s for every token) divides by the 5 loss tokens and gives
    # each token -r/5, so the 4-token sample gets 4x the 1-token one's gradient.
    _, grad = issue_case("grpo", pi, mu, ids, mask, [[0, 1]])
    assert grad == pytest.approx([0.0] + [-s / 5] * 4 + [0.0, -s / 5], rel=tol, abs=0)


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_step_loss_scale_counts_samples_for_gspo_and_loss_tokens_otherwise(objective):
    cfg = LossConfig(objective=objective)
    assert step_loss_scale(cfg, loss_tokens=37, samples=6) == (6.0 if objective == "gspo" else 37.0)
    assert step_loss_scale(cfg, loss_tokens=0, samples=0) == 1.0  # an empty step divides by 1, not 0


def test_cispo_clipped_tokens_keep_gradient_unlike_grpo():
    ids = [0, 0, 1, 1]
    log_r = [0.5, 0.5, -0.5, 0.1]
    mu = [-1.0] * 4
    pi = [m + x for m, x in zip(mu, log_r, strict=True)]  # π = [-0.5, -0.5, -1.5, -0.9]
    adv = [1.0, -1.0, -1.0, 2.0]
    mask = [True] * 4
    mid = math.exp(0.1)
    # Weight clip(r, 0.8, 1.28): t0,t1: r=1.6487 -> 1.28; t2: r=0.6065 -> 0.8; t3: r=1.1052 unchanged.
    # cispo L = -w*A*π:  t0: -1.28*1*(-0.5) = 0.64     grad -1.28
    #                    t1: -1.28*(-1)*(-0.5) = -0.64 grad +1.28
    #                    t2: -0.8*(-1)*(-1.5) = -1.2   grad +0.8
    #                    t3: -1.1052*2*(-0.9)          grad -2*1.1052
    loss, grad, stats = run(LossConfig(objective="cispo"), pi, mu, adv, mask, ids, 2, SCALE)
    close(loss, (0.64 - 0.64 - 1.2 + 1.8 * mid) / SCALE)
    for g, e in zip(grad, [-1.28 / SCALE, 1.28 / SCALE, 0.8 / SCALE, -2 * mid / SCALE], strict=True):
        close(g, e)
    assert stats["clipped_tokens"].item() == 3  # every weight outside [0.8, 1.28] was clipped
    # grpo on the same tokens: t0 (r>1.28, A>0) and t2 (r<0.8, A<0) are clipped -> zero gradient;
    # t1 (r>1.28 but A<0) stays unclipped: grad = -A*r = +1.6487.
    _, grad, stats = run(LossConfig(objective="grpo"), pi, mu, adv, mask, ids, 2, SCALE)
    for g, e in zip(grad, [0.0, math.exp(0.5) / SCALE, 0.0, -2 * mid / SCALE], strict=True):
        close(g, e)
    assert stats["clipped_tokens"].item() == 2


def test_token_mask_bounds_are_strict():
    cfg = LossConfig(token_mask_low=0.5, token_mask_high=2.0, geo_mask_low=1e-3, geo_mask_high=1e3)
    # log r = log 0.5 and log 2 give r = 0.5 and 2.0 exactly in float64: at the bound -> kept.
    # Just beyond (x 0.999 / x 1.001) -> masked low / high.
    pi = [math.log(0.5), math.log(0.5 * 0.999), math.log(2.0), math.log(2.0 * 1.001)]
    ids, mask = [0, 0, 1, 1], [True] * 4
    masks = ratio_masks(
        torch.tensor(pi, dtype=F64), torch.tensor(mask), torch.tensor(ids), 2, cfg
    )  # μ = 0, so log r = π
    assert masks["token_low"].tolist() == [False, True, False, False]
    assert masks["token_high"].tolist() == [False, False, False, True]
    assert masks["keep"].tolist() == [True, False, True, False]
    loss, grad, stats = run(cfg, pi, [0.0] * 4, [1.0] * 4, mask, ids, 2, SCALE)
    # aipo, delta=2: kept t0 has weight 0.5, t2 weight min(2, 2) = 2 -> grads -0.5 and -2.
    for g, e in zip(grad, [-0.5 / SCALE, 0.0, -2.0 / SCALE, 0.0], strict=True):
        close(g, e)
    assert stats["masked_low"].item() == 1 and stats["masked_high"].item() == 1
    assert stats["masked_tokens"].item() == 2
    assert stats["geo_masked_samples"].item() == 0 and stats["sequence_masked_samples"].item() == 0


def test_geo_mask_drops_whole_sample():
    cfg = LossConfig(geo_mask_low=0.5, geo_mask_high=2.0)
    ids = [0, 0, 0, 1, 1, 2, 2]
    mask = [True] * 7
    log_r = [1.0, 1.0, 0.5, -1.0, -1.0, 0.2, -0.2]
    # Sample 0: mean = 2.5/3 = 0.8333, g = 2.30 > 2 -> masked high, including its in-range r = e^0.5 = 1.65 token
    #           (and every r = e = 2.72 is within the token bounds [0.125, 8]).
    # Sample 1: g = e^-1 = 0.368 < 0.5 -> masked low (r = 0.368 > 0.125, so no token mask).
    # Sample 2: g = e^0 = 1 -> kept; aipo grads -e^0.2 and -e^-0.2 with A = 1.
    loss, grad, stats = run(cfg, log_r, [0.0] * 7, [1.0] * 7, mask, ids, 3, SCALE)
    masks = ratio_masks(torch.tensor(log_r, dtype=F64), torch.tensor(mask), torch.tensor(ids), 3, cfg)
    assert masks["geo_high"].tolist() == [True] * 3 + [False] * 4
    assert masks["geo_low"].tolist() == [False] * 3 + [True] * 2 + [False] * 2
    assert not masks["token_low"].any() and not masks["token_high"].any()
    assert masks["keep"].tolist() == [False] * 5 + [True] * 2
    for g, e in zip(grad, [0.0] * 5 + [-math.exp(0.2) / SCALE, -math.exp(-0.2) / SCALE], strict=True):
        close(g, e)
    # L = -w*A*π with π = log r here: -(e^0.2 * 0.2) - (e^-0.2 * -0.2)
    close(loss, (-0.2 * math.exp(0.2) + 0.2 * math.exp(-0.2)) / SCALE)
    assert stats["geo_masked_samples"].item() == 2 and stats["masked_tokens"].item() == 5
    assert stats["masked_low"].item() == 0 and stats["masked_high"].item() == 0


def test_sequence_mask_drops_whole_sample():
    cfg = LossConfig(sequence_mask_low=0.5, sequence_mask_high=1.5)
    ids = [0, 0, 1, 1, 2, 2]
    log_r = [0.0, 0.6, -0.8, 0.0, 0.3, -0.3]
    # Sample 0: max r = e^0.6 = 1.82 > 1.5 -> sequence_high (its r = 1 token too).
    # Sample 1: min r = e^-0.8 = 0.449 < 0.5 -> sequence_low.
    # Sample 2: r in [0.74, 1.35] -> kept. Geo means 0.3, -0.4, 0 and token ratios are all in range.
    masks = ratio_masks(torch.tensor(log_r, dtype=F64), torch.ones(6, dtype=torch.bool), torch.tensor(ids), 3, cfg)
    assert masks["sequence_high"].tolist() == [True, True, False, False, False, False]
    assert masks["sequence_low"].tolist() == [False, False, True, True, False, False]
    assert masks["keep"].tolist() == [False] * 4 + [True] * 2
    _, grad, stats = run(cfg, log_r, [0.0] * 6, [1.0] * 6, [True] * 6, ids, 3, SCALE)
    assert grad[:4] == [0.0] * 4 and all(g < 0 for g in grad[4:])
    assert stats["sequence_masked_samples"].item() == 2 and stats["geo_masked_samples"].item() == 0


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_non_loss_tokens_never_contribute(objective):
    cfg = LossConfig(objective=objective, gspo_eps_low=0.5, gspo_eps_high=0.5)
    base_pi, base_mu, base_adv = [-1.0, -0.9, -1.2], [-1.1, -1.0, -1.0], [1.0, 1.0, -0.5]
    # The same two samples plus non-loss tokens with absurd ratios (r = e^1000 = inf, e^-1000 = 0) and advantages.
    ref_loss, ref_grad, ref_stats = run(cfg, base_pi, base_mu, base_adv, [True] * 3, [0, 0, 1], 2, SCALE)
    pi = [0.0, -1.0, -0.9, 0.0, -1.2]
    mu = [-1000.0, -1.1, -1.0, 1000.0, -1.0]
    adv = [1e30, 1.0, 1.0, -1e30, -0.5]
    mask = [False, True, True, False, True]
    loss, grad, stats = run(cfg, pi, mu, adv, mask, [0, 0, 0, 1, 1], 2, SCALE)
    close(loss, ref_loss)
    assert grad[0] == 0.0 and grad[3] == 0.0
    for g, e in zip([grad[1], grad[2], grad[4]], ref_grad, strict=True):
        close(g, e)
    for key, value in ref_stats.items():
        close(stats[key].item(), value.item())


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_masked_loss_token_with_infinite_ratio_gives_zero_not_nan(objective):
    # A loss token with r = e^1000 (inf) is masked; its zero gradient must not become inf * 0 = NaN.
    cfg = LossConfig(objective=objective)
    pi, mu = [0.0, -1.0, -1.0], [-1000.0, -1.0, -1.0]
    loss, grad, stats = run(cfg, pi, mu, [1.0, 1.0, 1.0], [True] * 3, [0, 1, 1], 2, SCALE)
    # Sample 1 is on-policy (r = 1): grad -A/scale for both tokens (gspo: -A/(2*scale), its 2 tokens weighing
    # 1/2 each); sample 0 is fully masked.
    per_token = 1.0 / 2 if objective == "gspo" else 1.0
    assert grad == [0.0, -per_token / SCALE, -per_token / SCALE]
    assert math.isfinite(loss) and stats["masked_high"].item() == 1


def test_sample_without_loss_tokens_is_unaffected():
    cfg = LossConfig()
    # Sample 1 is a padding row (no loss tokens) with wild ratios; sample 3 has no tokens at all.
    ids = torch.tensor([0, 0, 1, 1, 2, 2])
    mask = torch.tensor([True, True, False, False, True, True])
    log_r = torch.tensor([0.1, -0.1, 50.0, -50.0, 0.2, 0.0], dtype=F64)
    mean_log_r, min_r, max_r = sequence_stats(log_r, mask, ids, 4)
    # Means over loss tokens only: (0.1-0.1)/2 = 0, 0 (empty), 0.2/2 = 0.1, 0 (empty)
    assert torch.allclose(mean_log_r, torch.tensor([0.0, 0.0, 0.1, 0.0], dtype=F64), atol=1e-15)
    assert min_r[1] == 1.0 and max_r[1] == 1.0 and min_r[3] == 1.0 and max_r[3] == 1.0
    close(min_r[0].item(), math.exp(-0.1))
    close(max_r[2].item(), math.exp(0.2))
    masks = ratio_masks(log_r, mask, ids, 4, LossConfig(geo_mask_low=0.99, geo_mask_high=1.01))
    # Tight geo bounds: only sample 2 (g = e^0.1 = 1.105) is dropped; empty samples (g = 1) never are.
    assert masks["geo_high"].tolist() == [False, False, False, False, True, True]
    _, _, stats = run(cfg, log_r.tolist(), [0.0] * 6, [1.0] * 6, mask.tolist(), ids.tolist(), 4, SCALE)
    assert stats["samples"].item() == 2  # samples with loss tokens
    assert stats["masked_tokens"].item() == 0 and stats["geo_masked_samples"].item() == 0


def test_kl_tau_pulls_towards_sampler():
    cfg = LossConfig(objective="aipo", delta=1.5, kl_tau=0.5)
    log_r = [0.5, -0.2, 0.0, 3.0]
    mask = [True, True, True, False]
    # A = 0, so Â = -tau*log r and L = -w*Â*π = tau*w*log r*π -> grad = tau*min(r, delta)*log r / scale:
    # t0: 0.5*1.5*0.5 = +0.375 (π > μ: descent lowers π), t1: 0.5*e^-0.2*(-0.2) = -0.08187 (raises π), t2: 0.
    _, grad, _ = run(cfg, log_r, [0.0] * 4, [0.0] * 4, mask, [0, 0, 1, 1], 2, SCALE)
    for g, e in zip(grad, [0.375 / SCALE, 0.5 * math.exp(-0.2) * -0.2 / SCALE, 0.0, 0.0], strict=True):
        close(g, e)
    _, grad, _ = run(cfg.model_copy(update={"kl_tau": 0.0}), log_r, [0.0] * 4, [0.0] * 4, mask, [0, 0, 1, 1], 2, 10)
    assert grad == [0.0] * 4


def make_samples(seed=0, num=6, log_r_std=0.2):
    """Random samples: (π, μ, advantages, loss_mask) per sample, with a prompt token and one token-masked outlier."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(num):
        n = int(torch.randint(3, 9, (1,), generator=gen))
        mu = -torch.rand(n, generator=gen, dtype=F64) * 3
        log_r = torch.randn(n, generator=gen, dtype=F64) * log_r_std
        if i == 2:
            log_r[-1] = 3.0  # r = 20 > 8: token-masked
        mask = torch.ones(n, dtype=torch.bool)
        mask[0] = False  # prompt token
        adv = torch.full((n,), float(torch.randn(1, generator=gen, dtype=F64)), dtype=F64)
        samples.append((mu + log_r, mu, adv, mask))
    return samples


def pack(samples, pi_leaf, offsets, order):
    """Concatenate samples in `order`; π is taken from the shared leaf so gradients accumulate into it."""
    parts = [[], [], [], [], []]
    for new_id, i in enumerate(order):
        _, mu, adv, mask = samples[i]
        start = offsets[i]
        parts[0].append(pi_leaf[start : start + len(mu)])
        parts[1].append(mu)
        parts[2].append(adv)
        parts[3].append(mask)
        parts[4].append(torch.full((len(mu),), new_id, dtype=torch.long))
    return [torch.cat(p) for p in parts]


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_micro_batching_and_packing_order_give_one_batch_gradient(objective):
    cfg = LossConfig(objective=objective, gspo_eps_low=0.05, gspo_eps_high=0.05)
    samples = make_samples()
    lengths = [len(s[1]) for s in samples]
    offsets = [sum(lengths[:i]) for i in range(len(samples))]
    scale = step_loss_scale(cfg, sum(int(s[3].sum()) for s in samples), len(samples))  # the whole "step"'s

    def grad_of(batches):
        pi = torch.cat([s[0] for s in samples]).requires_grad_(True)
        total_stats = {}
        for order in batches:
            p, mu, adv, mask, ids = pack(samples, pi, offsets, order)
            loss, stats = compute_loss(p, mu, adv, mask, ids, len(order), scale, cfg)
            loss.backward()
            for k, v in stats.items():
                total_stats[k] = total_stats.get(k, 0.0) + v.item()
        return pi.grad, total_stats

    one_batch, one_stats = grad_of([range(6)])
    micro, micro_stats = grad_of([[0, 1], [2, 3], [4, 5]])
    shuffled, _ = grad_of([[5, 2, 0], [3, 1, 4]])
    assert one_batch.abs().max() > 1e-3  # not a vacuous all-zero comparison
    assert torch.allclose(micro, one_batch, atol=1e-12, rtol=0)
    assert torch.allclose(shuffled, one_batch, atol=1e-12, rtol=0)
    assert micro_stats == pytest.approx(one_stats, abs=1e-12)
    assert one_stats["masked_high"] == 1 and one_stats["samples"] == 6


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_on_policy_every_objective_is_the_policy_gradient(objective):
    # π = μ: r = 1, g = s = 1, nothing clipped or masked, so the gradient is -A/scale on every loss token; gspo
    # weights each of sample i's n_i tokens 1/n_i, so its tokens get -A/(n_i*scale): -A/scale per sequence.
    samples = make_samples(seed=1, log_r_std=0.0)
    samples = [(mu.clone(), mu, adv, mask) for _, mu, adv, mask in samples]
    pi = torch.cat([s[0] for s in samples]).requires_grad_(True)
    offsets = [0]
    for s in samples[:-1]:
        offsets.append(offsets[-1] + len(s[1]))
    p, mu, adv, mask, ids = pack(samples, pi, offsets, range(6))
    loss, stats = compute_loss(p, mu, adv, mask, ids, 6, 37.0, LossConfig(objective=objective))
    (grad,) = torch.autograd.grad(loss, pi)
    n = torch.cat([torch.full((len(m),), float(m.sum()), dtype=F64) for *_, m in samples])
    expected = -adv / 37.0 / (n if objective == "gspo" else 1.0)
    assert torch.allclose(grad, torch.where(mask, expected, 0.0), atol=1e-14, rtol=0)
    assert stats["clipped_tokens"] == 0 and stats["masked_tokens"] == 0 and stats["mismatch_kl_sum"] == 0


def test_stats_sums():
    cfg = LossConfig(token_mask_high=1.5)
    log_r = [0.5, -0.2, 0.0, 7.0, 0.1]
    mask = [True, True, True, False, True]
    # k3 = r - log r - 1 over loss tokens: (e^0.5 - 1.5) + (e^-0.2 - 0.8) + 0 + (e^0.1 - 1.1)
    #    = 0.148721 + 0.018731 + 0 + 0.005171 = 0.172623; the non-loss token (log r = 7) is excluded.
    # Token mask high 1.5: e^0.5 = 1.65 is masked high; nothing is masked low.
    _, _, stats = run(cfg, log_r, [0.0] * 5, [1.0] * 5, mask, [0, 0, 0, 1, 1], 2, SCALE)
    close(stats["mismatch_kl_sum"].item(), math.exp(0.5) - 1.5 + math.exp(-0.2) - 0.8 + math.exp(0.1) - 1.1)
    assert stats["loss_tokens"].item() == 4 and stats["samples"].item() == 2
    assert stats["masked_tokens"].item() == 1 and stats["masked_high"].item() == 1 and stats["masked_low"].item() == 0
    assert all(v.dim() == 0 and v.dtype == F64 and not v.requires_grad for v in stats.values())


@pytest.mark.parametrize("prefix", ["token_mask", "geo_mask", "sequence_mask"])
def test_config_rejects_unordered_bounds(prefix):
    with pytest.raises(ValidationError, match=f"{prefix}_low"):
        LossConfig(**{f"{prefix}_low": 5.0, f"{prefix}_high": 5.0})


@pytest.mark.parametrize(("field", "value"), [("delta", 0.0), ("eps_low", -0.1), ("gspo_eps_high", -1e-4)])
def test_config_rejects_bad_values(field, value):
    with pytest.raises(ValidationError, match=field):
        LossConfig(**{field: value})


def test_config_documents_every_field():
    assert all(field.description for field in LossConfig.model_fields.values())
    with pytest.raises(ValidationError):
        LossConfig(objective="ppo")
