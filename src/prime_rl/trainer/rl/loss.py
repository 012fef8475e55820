"""RL losses for asynchronous training: importance weighting, ratio masks and the per-token objectives.

Tokens were sampled by the inference server with logprobs μ, possibly a few policy steps ago; the trainer
recomputes them as π. Every objective weights the policy gradient by some function of the ratio
r = exp(π − μ), and ratios that are far from 1 (stale samples, numerical mismatch between vLLM and the
trainer) are masked out entirely rather than trusted.

Everything works on flat per-token tensors of length N (one packed row, or any concatenation of tokens)
with `sample_ids` saying which sample each token belongs to. The loss is a weighted *sum* over kept tokens
divided by `loss_scale`, a count over the whole step (`step_loss_scale`), so summing gradients over
micro-batches and data-parallel ranks gives exactly the gradient of one big batch, however the samples were
packed. Token-level objectives weight every token 1 and count loss tokens; GSPO weights each of a sample's
kept tokens 1/(its kept tokens) and counts samples, so every sequence weighs 1/G as in the paper.
"""

from collections.abc import Callable

import torch
from torch import Tensor

from prime_rl.trainer.config import LossConfig


def importance_log_ratio(trainer_logprobs: Tensor, inference_logprobs: Tensor) -> Tensor:
    """log r = π − μ per token. μ is data from the sampler, so it is detached; the gradient flows through π."""
    return trainer_logprobs - inference_logprobs.detach()


def sequence_stats(
    log_ratio: Tensor, loss_mask: Tensor, sample_ids: Tensor, num_samples: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample mean log-ratio (keeps gradient) and min / max ratio (detached) over each sample's loss tokens.

    exp(mean_log_r) is the geometric-mean ratio, i.e. GSPO's length-normalised sequence ratio. A sample with
    no loss tokens (padding) gets mean 0 and min = max = 1, the on-policy values, so no mask ever fires on it.
    Written with scatter ops and no boolean indexing, so it does not synchronise with the device.
    """
    counts = torch.zeros(num_samples, dtype=log_ratio.dtype, device=log_ratio.device)
    counts.index_add_(0, sample_ids, loss_mask.to(log_ratio.dtype))
    sums = torch.zeros(num_samples, dtype=log_ratio.dtype, device=log_ratio.device)
    sums = sums.index_add(0, sample_ids, torch.where(loss_mask, log_ratio, 0.0))
    mean_log_r = sums / counts.clamp(min=1)

    ratio = log_ratio.detach().exp()
    inf = torch.full_like(counts, float("inf"))
    min_r = inf.scatter_reduce(0, sample_ids, torch.where(loss_mask, ratio, float("inf")), "amin")
    max_r = (-inf).scatter_reduce(0, sample_ids, torch.where(loss_mask, ratio, -float("inf")), "amax")
    has_tokens = counts > 0
    min_r = torch.where(has_tokens, min_r, 1.0)
    max_r = torch.where(has_tokens, max_r, 1.0)
    return mean_log_r, min_r, max_r


def ratio_masks(
    log_ratio: Tensor, loss_mask: Tensor, sample_ids: Tensor, num_samples: int, config: LossConfig
) -> dict[str, Tensor]:
    """Per-token bool masks of loss tokens dropped for an untrustworthy ratio, and `keep` = trained tokens.

    Token masks drop single outliers; the geo and sequence masks drop the whole sample, because one wildly
    off-policy stretch means the rest of that trajectory was not sampled by anything like the current policy
    either. Thresholds are strict: a ratio exactly at a bound is kept. Every mask is False off the loss mask.
    """
    log_ratio = log_ratio.detach()
    mean_log_r, min_r, max_r = sequence_stats(log_ratio, loss_mask, sample_ids, num_samples)
    ratio = log_ratio.exp()
    geo = mean_log_r.exp()
    masks = {
        "token_low": ratio < config.token_mask_low,
        "token_high": ratio > config.token_mask_high,
        "geo_low": (geo < config.geo_mask_low)[sample_ids],
        "geo_high": (geo > config.geo_mask_high)[sample_ids],
        "sequence_low": (min_r < config.sequence_mask_low)[sample_ids],
        "sequence_high": (max_r > config.sequence_mask_high)[sample_ids],
    }
    masks = {name: mask & loss_mask for name, mask in masks.items()}
    dropped = torch.zeros_like(loss_mask)
    for mask in masks.values():
        dropped = dropped | mask
    masks["keep"] = loss_mask & ~dropped
    return masks


# Per-token objectives. Shared signature: (trainer_logprobs π, log_ratio, advantages Â, config) ->
# (per-token loss L_t, bool "weight was truncated/clipped" per token). `advantages` is the effective advantage
# (KL shaping already applied). Masking and normalisation happen in `compute_loss`.


def aipo_loss(
    trainer_logprobs: Tensor, log_ratio: Tensor, advantages: Tensor, config: LossConfig
) -> tuple[Tensor, Tensor]:
    """Truncated importance-weighted REINFORCE: L = −sg(min(r, δ))·Â·π.

    The weight corrects for staleness while the truncation bounds the variance a single token can inject;
    unlike PPO clipping, a truncated token still gets a (bounded) gradient.
    """
    ratio = log_ratio.detach().exp()
    weight = ratio.clamp(max=config.delta)
    return -weight * advantages * trainer_logprobs, ratio > config.delta


def _clipped_surrogate(log_ratio: Tensor, advantages: Tensor, low: float, high: float) -> tuple[Tensor, Tensor]:
    """−min(r·Â, clip(r, low, high)·Â). Where the clipped term wins the min it is a constant: zero gradient."""
    ratio = log_ratio.exp()
    clipped_ratio = ratio.detach().clamp(min=low, max=high)
    clipped = clipped_ratio * advantages < ratio.detach() * advantages
    return -torch.where(clipped, clipped_ratio * advantages, ratio * advantages), clipped


def grpo_loss(
    trainer_logprobs: Tensor, log_ratio: Tensor, advantages: Tensor, config: LossConfig
) -> tuple[Tensor, Tensor]:
    """PPO clip per token with separate epsilons: −min(r·Â, clip(r, 1−eps_low, 1+eps_high)·Â).

    The min is pessimistic: a token stops being pushed once its ratio has moved past the trust region in the
    direction its advantage wants (above 1+eps_high for Â>0, below 1−eps_low for Â<0). A larger eps_high
    (clip-higher) leaves room to raise low-probability tokens, which keeps entropy from collapsing.
    """
    return _clipped_surrogate(log_ratio, advantages, 1 - config.eps_low, 1 + config.eps_high)


def gspo_loss(
    trainer_logprobs: Tensor, seq_log_ratio: Tensor, advantages: Tensor, config: LossConfig
) -> tuple[Tensor, Tensor]:
    """PPO clip on the sequence ratio s_i = exp(mean log r over sample i's kept tokens), broadcast to each of them.

    `seq_log_ratio` is log s_i per token (mean_log_r[sample_ids], with gradient). Rewards are per sequence, so
    the ratio is too: the length-normalised ratio has low variance, which is why its clip range is ~1e-4.
    Clipping removes the gradient of the whole sample at once. Each token carries its sample's whole sequence
    loss; `compute_loss` weights it 1/(kept tokens of the sample) (`token_weights`), so a sample counts once.
    """
    return _clipped_surrogate(seq_log_ratio, advantages, 1 - config.gspo_eps_low, 1 + config.gspo_eps_high)


def cispo_loss(
    trainer_logprobs: Tensor, log_ratio: Tensor, advantages: Tensor, config: LossConfig
) -> tuple[Tensor, Tensor]:
    """Clipped importance-sampling-weight REINFORCE: L = −sg(clip(r, 1−eps_low, 1+eps_high))·Â·π.

    Clips the weight, not the update: a token outside the trust region still gets gradient −clip(r)·Â,
    whereas PPO would drop it. Rare tokens whose probability jumps are often the important ones (forks in
    reasoning), and PPO would silence exactly those.
    """
    ratio = log_ratio.detach().exp()
    low, high = 1 - config.eps_low, 1 + config.eps_high
    weight = ratio.clamp(min=low, max=high)
    return -weight * advantages * trainer_logprobs, (ratio < low) | (ratio > high)


OBJECTIVES: dict[str, Callable[[Tensor, Tensor, Tensor, LossConfig], tuple[Tensor, Tensor]]] = {
    "aipo": aipo_loss,
    "grpo": grpo_loss,
    "gspo": gspo_loss,
    "cispo": cispo_loss,
}


def reference_kl(trainer_logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(π || π_ref): exp(ref − π) − (ref − π) − 1, ≥ 0, exactly 0 where π = ref.

    With x = π_ref / π at a token sampled from π, E[x] = 1 and E[−log x] = KL(π || π_ref), so k3 = x − 1 − log x is
    unbiased with lower variance than −log x alone (Schulman, "Approximating KL divergence"). The tokens come from
    the sampler μ, not π; the ratio masks keep only tokens where μ ≈ π. The reference is data: gradient flows through
    π only, d k3 / dπ = 1 − exp(ref − π) (pushes π down where it exceeds the reference, up where it falls below).
    """
    log_ratio = ref_logprobs.detach() - trainer_logprobs
    return log_ratio.exp() - log_ratio - 1


def ce_token_loss(trainer_logprobs: Tensor, ce_weights: Tensor) -> Tensor:
    """Per-token weighted cross-entropy −w·π: supervised tokens (a teacher's sample, a demonstration). π is the
    log-prob at the sample's temperature, exactly as the policy gradient sees it (logits / T); 0 where w = 0."""
    return torch.where(ce_weights > 0, -ce_weights.detach() * trainer_logprobs, 0.0)


def ref_kl_token_loss(trainer_logprobs: Tensor, inference_logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token reverse KL to a frozen reference in score-function form: L = ρ·sg(π − ref), ρ = exp(π − sg(μ)).

    The value is the importance-weighted k1 estimate of KL(π || ref) from a token sampled by μ; the gradient is
    ρ·(π − ref)·∇π, on-policy (π = μ, ρ = 1) exactly (π − ref)·∇π: the REINFORCE gradient of KL(π || ref) with
    the per-token reward ref − π, what on-policy distillation minimises. A token π rates above the reference is
    pushed down, one below pushed up. The (π − ref) factor is a reward, so it carries no gradient itself.
    """
    log_ratio = importance_log_ratio(trainer_logprobs, inference_logprobs)
    return log_ratio.exp() * (trainer_logprobs - ref_logprobs).detach()


def ce_loss(trainer_logprobs: Tensor, ce_weights: Tensor, loss_scale: float) -> tuple[Tensor, dict[str, Tensor]]:
    """Σ `ce_token_loss` / `loss_scale` (the step's CE tokens, all micro-batches and ranks: N_ce), and `ce_loss_sum`,
    the same sum undivided, to be averaged over N_ce. Not importance weighted nor ratio masked: supervised."""
    per_token = ce_token_loss(torch.where(ce_weights > 0, trainer_logprobs, 0.0), ce_weights)
    total = per_token.sum()
    return total / loss_scale, {"ce_loss_sum": total.detach().to(torch.float64)}


SEQUENCE_WEIGHTED = frozenset({"gspo"})
"""Objectives defined as a mean over sequences (each weighs 1/G); the others are means over loss tokens."""


def step_loss_scale(config: LossConfig, loss_tokens: int, samples: int) -> float:
    """`compute_loss`'s `loss_scale` for a step of `loss_tokens` loss tokens in `samples` samples (all ranks).

    What the objective averages over: samples for a sequence-weighted objective (GSPO's 1/G), loss tokens for the
    others. Both are whole-step totals every rank knows before its backward, so the ranks agree. At least 1.
    """
    return float(max(samples if config.objective in SEQUENCE_WEIGHTED else loss_tokens, 1))


def token_weights(objective: str, keep: Tensor, sample_ids: Tensor, num_samples: int, dtype: torch.dtype) -> Tensor:
    """Per-token weight of L_t in the loss sum: 1 on kept tokens, or 1/(kept tokens of its sample) for GSPO.

    GSPO's L_t is its sample's sequence loss repeated on every kept token; summed unweighted, a 4-token sample
    would get 4x the gradient of a 1-token one with the same advantage. With 1/n_i each sample sums to one
    sequence loss whatever its length. A sample never spans two calls (packing keeps it in one row), so the
    counts here are its whole counts. 0 on dropped tokens.
    """
    if objective not in SEQUENCE_WEIGHTED:
        return keep.to(dtype)
    counts = torch.zeros(num_samples, dtype=dtype, device=keep.device).index_add(0, sample_ids, keep.to(dtype))
    return torch.where(keep, 1.0 / counts.clamp(min=1)[sample_ids], 0.0)


def _count_samples(token_mask: Tensor, sample_ids: Tensor, num_samples: int) -> Tensor:
    """Number of samples with at least one token in `token_mask`."""
    hits = torch.zeros(num_samples, dtype=torch.float64, device=token_mask.device)
    return hits.index_add(0, sample_ids, token_mask.to(torch.float64)).gt(0).sum().to(torch.float64)


def compute_loss(
    trainer_logprobs: Tensor,
    inference_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    sample_ids: Tensor,
    num_samples: int,
    loss_scale: float,
    config: LossConfig,
    ref_logprobs: Tensor | None = None,
    beta: float = 0.0,
    ref_kl_mask: Tensor | None = None,
    ref_kl_logprobs: Tensor | None = None,
    ref_kl_scale: float = 1.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Σ over kept tokens of the objective's L_t times `token_weights`, divided by `loss_scale`, and detached stats.

    With `ref_logprobs` (a frozen reference's, `[reference]`), β·`reference_kl` joins every kept token's L_t, so
    the penalty is weighted, normalised and masked exactly like the objective; the stats gain `ref_kl_sum`, k3
    summed over every loss token (kept or not), averaged like `mismatch_kl_sum`.

    `loss_scale` is `step_loss_scale` of the whole step (all micro-batches and ranks), not of this call: its loss
    tokens, or its samples for GSPO, so the summed gradients equal those of one big batch. Stats are float64 0-d
    sums and counts, made to be all-reduced with SUM and then averaged: `*_tokens` and `mismatch_kl_sum` over
    `loss_tokens`, `*_samples` over `samples`.

    With `ref_kl_mask` (the batch's `ref_kl_mask` stream, and `ref_kl_logprobs` its `ref_logprobs`), the reverse-KL
    component `ref_kl_token_loss` joins: summed over its kept tokens and divided by `ref_kl_scale` (the step's
    ref_kl tokens, N_ref). The ratio masks are computed over rl and ref_kl tokens together, so an off-policy sample
    is dropped from both; the rl statistics stay those of loss tokens. Extra stats: `ref_kl_stream_sum` (Σ π − ref
    over every ref_kl token, to be averaged over N_ref) and `ref_kl_masked_tokens`.
    """
    n = trainer_logprobs.shape[0]
    for name, tensor in (("inference_logprobs", inference_logprobs), ("advantages", advantages)):
        if tensor.shape != (n,):
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected ({n},)")
    if ref_logprobs is not None and ref_logprobs.shape != (n,):
        raise ValueError(f"ref_logprobs has shape {tuple(ref_logprobs.shape)}, expected ({n},)")
    if loss_mask.shape != (n,) or sample_ids.shape != (n,):
        raise ValueError(f"loss_mask {tuple(loss_mask.shape)} and sample_ids {tuple(sample_ids.shape)} must be ({n},)")
    loss_mask = loss_mask.bool()

    log_ratio = importance_log_ratio(trainer_logprobs, inference_logprobs)
    if ref_kl_mask is None:
        masks = ratio_masks(log_ratio, loss_mask, sample_ids, num_samples, config)
        keep = masks["keep"]
    else:
        ref_kl_mask = ref_kl_mask.bool()
        if ref_kl_mask.shape != (n,) or ref_kl_logprobs is None or ref_kl_logprobs.shape != (n,):
            raise ValueError(f"ref_kl_mask and ref_kl_logprobs must both be ({n},)")
        masks = ratio_masks(log_ratio, loss_mask | ref_kl_mask, sample_ids, num_samples, config)
        kept = masks["keep"]
        masks = {name: mask & loss_mask for name, mask in masks.items()}  # the rl statistics: loss tokens only
        keep = masks["keep"]

    # Zero every input on dropped tokens before any exp or product: a masked token with a huge ratio would
    # otherwise put inf into the graph and turn its zero gradient into inf * 0 = NaN.
    effective_adv = torch.where(keep, advantages - config.kl_tau * log_ratio.detach(), 0.0)
    if config.objective == "gspo":
        # The sequence ratio is the geometric mean over the *kept* tokens: averaging over every loss token
        # would let a token dropped by the token masks steer (and receive gradient through) its sample's ratio.
        mean_log_r, _, _ = sequence_stats(log_ratio, keep, sample_ids, num_samples)
        ratio_input = mean_log_r[sample_ids]
    else:
        ratio_input = log_ratio
    ratio_input = torch.where(keep, ratio_input, 0.0)
    policy_logprobs = torch.where(keep, trainer_logprobs, 0.0)

    per_token, clipped = OBJECTIVES[config.objective](policy_logprobs, ratio_input, effective_adv, config)
    if ref_logprobs is not None:  # zeroed like π on dropped tokens, where k3 is then exactly 0
        per_token = per_token + beta * reference_kl(policy_logprobs, torch.where(keep, ref_logprobs, 0.0))
    weights = token_weights(config.objective, keep, sample_ids, num_samples, per_token.dtype)
    loss = torch.where(keep, per_token * weights, 0.0).sum() / loss_scale
    if ref_kl_mask is not None:
        ref_keep = kept & ref_kl_mask  # zeroed on dropped tokens like the rl inputs above
        ref_kl = ref_kl_token_loss(
            torch.where(ref_keep, trainer_logprobs, 0.0),
            torch.where(ref_keep, inference_logprobs, 0.0),
            torch.where(ref_keep, ref_kl_logprobs, 0.0),
        )
        loss = loss + torch.where(ref_keep, ref_kl, 0.0).sum() / ref_kl_scale

    with torch.no_grad():
        f64 = torch.float64
        lr = log_ratio.detach().to(f64)
        k3 = lr.exp() - lr - 1  # unbiased, always >= 0 estimator of KL(μ || π) from samples of μ
        geo = masks["geo_low"] | masks["geo_high"]
        seq = masks["sequence_low"] | masks["sequence_high"]
        stats = {
            "loss_tokens": loss_mask.sum().to(f64),
            "samples": _count_samples(loss_mask, sample_ids, num_samples),
            "mismatch_kl_sum": torch.where(loss_mask, k3, 0.0).sum(),
            "masked_tokens": (loss_mask & ~keep).sum().to(f64),
            "masked_low": masks["token_low"].sum().to(f64),
            "masked_high": masks["token_high"].sum().to(f64),
            "geo_masked_samples": _count_samples(geo, sample_ids, num_samples),
            "sequence_masked_samples": _count_samples(seq, sample_ids, num_samples),
            "clipped_tokens": (clipped & keep).sum().to(f64),
        }
        if ref_logprobs is not None:
            ref_kl = reference_kl(trainer_logprobs.detach().to(f64), ref_logprobs.to(f64))
            stats["ref_kl_sum"] = torch.where(loss_mask, ref_kl, 0.0).sum()
        if ref_kl_mask is not None:
            gap = trainer_logprobs.detach().to(f64) - ref_kl_logprobs.to(f64)
            stats["ref_kl_stream_sum"] = torch.where(ref_kl_mask, gap, 0.0).sum()
            stats["ref_kl_masked_tokens"] = (ref_kl_mask & ~kept).sum().to(f64)
    return loss, stats
