"""Per-token logprobs and entropy of a packed row, as the sampler saw them."""

import torch


def shifted_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor, temperatures: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """logprob and entropy of token t under logits[t-1] / T_t (fp32), one row of shape [L, V].

    The first token of each sample (position 0) has no prediction inside its sample: it gets 0 for both
    (it is always prompt, never trained).
    """
    scaled = logits[:-1].float() / temperatures[1:, None]
    logp_all = torch.log_softmax(scaled, dim=-1)
    logp = logp_all.gather(-1, input_ids[1:, None])[:, 0]
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    starts = position_ids[1:] == 0
    zero = logp.new_zeros(1)
    logp = torch.cat([zero, torch.where(starts, 0.0, logp)])
    entropy = torch.cat([zero, torch.where(starts, 0.0, entropy)])
    return logp, entropy
