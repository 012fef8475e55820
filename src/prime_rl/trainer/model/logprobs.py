"""Per-token log-probabilities and entropy under the model, without a [tokens x vocab] tensor for the whole row.

A row of 16k tokens over Qwen3's 151,936-token vocabulary has 2.5e9 logits: 10 GB per fp32 copy, and a plain
log-softmax keeps several. Instead the model's output layer is replaced (before sharding) by `LogProbHead`,
which holds the very same weight Parameter and, inside the model's own forward, scores `chunk` positions at a
time: the log-prob of a given target token under logits / T and the entropy of that distribution. Forward
keeps the hidden states and each position's log-partition; backward recomputes each chunk's logits.

    install_logprob_head(model, chunk)                       # once, before FSDP
    logp, entropy = forward_logprobs(model, batch)           # [B, L]: log p(token t | tokens < t), 0 at piece starts

`forward_logprobs` is the one forward path of both training loops (`rl/train.py`, `sft/train.py`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import Tensor, nn

from prime_rl.trainer.packing import (
    FORWARD_COST,
    MicroBatch,
    PackedRow,
    collate,
    micro_batches,
    packs_across_samples,
    padding_row,
    piece_starts,
)
from prime_rl.trainer.parallel.context_parallel import cp_context, gather_row, pad_row, shard_row
from prime_rl.trainer.parallel.distributed import World

POST_PROCESSED_LOGITS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "logits_soft_cap")
"""Config fields of architectures whose forward changes the head's output (Gemma's soft-capping, Cohere's and
Granite's scaling): refused at once. Any other change is caught at the first forward (`next_token_logprobs`)."""


class HeadError(ValueError):
    """A model whose output layer the chunked head cannot stand in for."""


class ChunkedLogProbs(torch.autograd.Function):
    """log softmax(h W^T / T)[target] and the entropy of that distribution, `chunk` positions at a time.

    Logits are computed in the weight's dtype (as `nn.Linear` would), then scored in fp32, exactly as the
    full computation upcasts them. Only `hidden`, `weight` and the log-partition per position are kept for
    backward, which recomputes each chunk's logits; the weight's gradient is accumulated in fp32.
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, temperatures: Tensor, chunk: int):
        n = hidden.shape[0]
        logp = hidden.new_empty(n, dtype=torch.float32)
        entropy = torch.empty_like(logp)
        log_z = torch.empty_like(logp)
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            logits = (hidden[start:end] @ weight.T).float().div_(temperatures[start:end, None])
            lse = torch.logsumexp(logits, dim=-1)
            log_z[start:end] = lse
            logp[start:end] = logits.gather(-1, targets[start:end, None])[:, 0] - lse
            shifted = logits.sub_(lse[:, None])  # log p, in place
            entropy[start:end] = -(shifted.exp() * shifted).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, temperatures, log_z)
        ctx.chunk = chunk
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: Tensor, _grad_entropy: Tensor):
        hidden, weight, targets, temperatures, log_z = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        )
        for start in range(0, hidden.shape[0], ctx.chunk):
            end = min(start + ctx.chunk, hidden.shape[0])
            h = hidden[start:end]
            scale = grad_logp[start:end] / temperatures[start:end]  # d logp / d logits = (onehot - p) / T
            logits = (h @ weight.T).float().div_(temperatures[start:end, None])
            grad = logits.sub_(log_z[start:end, None]).exp_().mul_(-scale[:, None])
            grad.scatter_add_(-1, targets[start:end, None], scale[:, None])
            grad = grad.to(weight.dtype)
            if grad_hidden is not None:
                grad_hidden[start:end] = grad @ weight
            if grad_weight is not None:
                grad_weight.add_(grad.T @ h)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def chunked_logprobs(
    hidden: Tensor, weight: Tensor, targets: Tensor, temperatures: Tensor, chunk: int
) -> tuple[Tensor, Tensor]:
    """[N, H] hidden states, [V, H] output weight, [N] targets and temperatures -> [N] log-prob, [N] entropy."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    return ChunkedLogProbs.apply(hidden, weight, targets, temperatures.float(), chunk)


class LogProbHead(nn.Module):
    """Stands in for the model's output layer with the same weight Parameter (same name, same FSDP unit, ties
    kept). Called by the model's forward on the final hidden states [B, L, H]; returns [B, L, 2] fp32, the
    log-prob of each position's target and the entropy, for the targets `next_token_logprobs` set."""

    def __init__(self, weight: nn.Parameter, chunk: int):
        super().__init__()
        self.weight = weight
        self.chunk = chunk
        self.targets: Tensor | None = None
        self.temperatures: Tensor | None = None
        self.scored: Tensor | None = None
        self.output: Tensor | None = None

    def forward(self, hidden: Tensor) -> Tensor:
        if self.targets is None or self.temperatures is None:
            raise RuntimeError("LogProbHead scores given targets: run the model through next_token_logprobs")
        if hidden.shape[:-1] != self.targets.shape:
            raise RuntimeError(f"hidden states {tuple(hidden.shape)} do not match targets {tuple(self.targets.shape)}")
        flat = hidden.reshape(-1, hidden.shape[-1])
        targets, temperatures = self.targets.reshape(-1), self.temperatures.reshape(-1)
        if self.scored is None:
            logp, entropy = chunked_logprobs(flat, self.weight, targets, temperatures, self.chunk)
        else:  # only the positions asked for: the head's matmuls, forward and backward, scale with their count
            index = self.scored.reshape(-1).nonzero()[:, 0]
            part_logp, part_entropy = chunked_logprobs(
                flat.index_select(0, index), self.weight, targets[index], temperatures[index], self.chunk
            )
            logp = part_logp.new_zeros(flat.shape[0]).index_copy(0, index, part_logp)
            entropy = part_entropy.new_zeros(flat.shape[0]).index_copy(0, index, part_entropy)
        shape = hidden.shape[:-1]
        self.output = torch.stack([logp.view(shape), entropy.view(shape)], dim=-1)  # not a view: FSDP hooks it
        return self.output


def install_logprob_head(model: nn.Module, chunk: int) -> LogProbHead:
    """Replace the model's output layer by a `LogProbHead` on the same weight (call before sharding)."""
    for field in POST_PROCESSED_LOGITS:
        if getattr(model.config, field, None) is not None:
            raise HeadError(
                f"{type(model).__name__} post-processes its logits (config.{field}={getattr(model.config, field)}); "
                "the trainer's chunked log-prob head cannot score it"
            )
    old = model.get_output_embeddings()
    if not isinstance(old, nn.Linear):
        raise HeadError(f"{type(model).__name__}'s output layer is {type(old).__name__}, not a plain Linear")
    if old.bias is not None:
        raise HeadError(f"{type(model).__name__}'s output layer has a bias, which the chunked head does not add")
    head = LogProbHead(old.weight, chunk)
    model.set_output_embeddings(head)
    return head


def next_token_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    position_ids: Tensor,
    targets: Tensor,
    temperatures: Tensor,
    attention_mask: Tensor | None = None,
    scored: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """log p(targets[b, t] | tokens <= t) under logits / temperatures[b, t], and that distribution's entropy.

    All [B, L]. `targets` are explicit so a caller can score a slice of a row whose last target lies beyond
    it. `scored` (bool, [B, L]): the positions to score, 0 at the others (None: all). No KV cache. Without
    `attention_mask` ([B, 1, L, L], `model_attention_mask`) transformers derives a block-diagonal mask (or varlen
    flash attention) from the position ids restarting at 0, so packed samples never see each other.
    """
    head = model.get_output_embeddings()
    if not isinstance(head, LogProbHead):
        raise HeadError("the model has no LogProbHead: call install_logprob_head before sharding")
    head.targets, head.temperatures, head.scored = targets, temperatures, scored
    try:
        out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, use_cache=False)
        output, returned = head.output, out.logits
    finally:
        head.targets = head.temperatures = head.scored = head.output = None
    if returned is not output:
        raise HeadError(
            f"{type(model).__name__}'s forward changes the output layer's result (e.g. soft-capping or scaling "
            "the logits); the trainer's chunked log-prob head cannot score it"
        )
    return output[..., 0], output[..., 1]


def next_token_targets(input_ids: Tensor) -> Tensor:
    """[B, L] -> the token (or any per-token value) after each position ([B, L]; 0 at the last, whose prediction is
    never used)."""
    targets = torch.zeros_like(input_ids)
    targets[:, :-1] = input_ids[:, 1:]
    return targets


def shift_to_tokens(next_token_values: Tensor, position_ids: Tensor) -> Tensor:
    """Values "of the next token at position t" -> "of token t": shift right by one, 0 where a piece starts.

    A piece is a run of consecutive positions: a sample, a shared prompt, or a sample's continuation of one. A
    piece's first token has no prediction from the token before it in the row, so it gets 0 (it is always prompt,
    never trained); the prediction across the boundary, from the previous piece's last token, drops.
    """
    shifted = torch.cat(
        [next_token_values.new_zeros(*next_token_values.shape[:-1], 1), next_token_values[..., :-1]], -1
    )
    return torch.where(piece_starts(position_ids), 0.0, shifted)


def shared_prompt_mask(position_ids: Tensor) -> Tensor | None:
    """[B, L] position ids -> the [B, 1, L, L] boolean attention mask (True: may attend) of rows where samples
    share their prompt (`packing.layout_units`), or None when no row does.

    A row is a sequence of pieces (`piece_starts`). A piece starting at position 0 is a sample or a shared prompt;
    one starting at p > 0 continues the prompt before it: it sees the prompt's tokens (positions < p, of the last
    piece that started at 0) and its own, never the other continuations (positions >= p). Causal throughout.
    """
    starts = piece_starts(position_ids)
    if not bool((starts & (position_ids > 0)).any()):
        return None
    index = torch.arange(position_ids.shape[-1], device=position_ids.device).expand_as(position_ids)
    piece = torch.where(starts, index, 0).cummax(-1).values  # index of each token's piece start
    root = torch.where(starts & (position_ids == 0), index, 0).cummax(-1).values  # ... of its sample or prompt
    first_position = position_ids.gather(-1, piece)
    same_piece = piece[:, :, None] == piece[:, None, :]
    prompt_before = (root[:, :, None] == root[:, None, :]) & (position_ids[:, None, :] < first_position[:, :, None])
    causal = torch.ones(index.shape[-1], index.shape[-1], dtype=torch.bool, device=index.device).tril()
    return ((same_piece | prompt_before) & causal)[:, None]


def model_attention_mask(model: nn.Module, position_ids: Tensor, dtype: torch.dtype) -> Tensor | None:
    """`shared_prompt_mask` in the form the model's attention takes: boolean for sdpa, additive (0 / -inf-like) in
    `dtype` for eager; None when nothing is shared. Varlen kernels cannot take it: the packer never shares there."""
    mask = shared_prompt_mask(position_ids)
    if mask is None:
        return None
    attn = model.config._attn_implementation
    if attn == "eager":
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
    if attn != "sdpa":
        raise ValueError(f"rows with shared prompts need sdpa or eager attention, the model runs {attn}")
    return mask


def forward_passes(rows: list[PackedRow], max_tokens: int, attn: str, world: World) -> Iterator[MicroBatch]:
    """This rank's rows as the micro-batches of its forward passes, on its device, for `forward_logprobs`:
    as many rows per forward as fit `max_tokens` positions, unless padding a short row to a long one costs more
    than another forward (`micro_batches`, `FORWARD_COST`).

    FSDP's collectives run once per forward, so every rank must run as many as the others: the ranks agree on the
    largest count (one small all-reduce) and the ones with fewer add forwards of a padding row, which carry no loss.
    With context parallelism each micro-batch is one row (its rows concatenated), padded to a multiple of cp,
    and the loop body (forward *and* backward: activation checkpointing recomputes attention) runs inside
    `cp_context`, which gives every layer's attention the whole row's position ids.
    """
    cp = world.cp
    concatenate = packs_across_samples(attn, cp)
    groups = micro_batches(rows, max_tokens, concatenate, FORWARD_COST.get(world.device.type, float("inf")))
    if world.world_size > 1:
        counts = torch.zeros(world.world_size, dtype=torch.long, device=world.device)
        counts[world.rank] = len(groups)
        dist.all_reduce(counts)  # every rank's count (a sum of one-hots); the largest is everyone's
        groups += [[padding_row()] for _ in range(int(counts.max()) - len(groups))]
    for group in groups:
        if cp > 1:
            group = [pad_row(row, cp) for row in group]
        batch = collate(group, concatenate=concatenate).to(world.device)
        with cp_context(world.cp_group, batch.position_ids) if cp > 1 else nullcontext():
            yield batch


def forward_logprobs(model: nn.Module, batch: MicroBatch, world: World | None = None) -> tuple[Tensor, Tensor]:
    """The forward of a micro-batch ([B, L] tensors on the model's device): log p(token t | what precedes it
    in its sample) under the sampling temperature, and the entropy of that distribution; both [B, L] fp32,
    0 at each piece's first token (`shift_to_tokens`) and at every token no loss component trains
    (`MicroBatch.trained_mask`): the head scores only the positions that predict a trained token (no prompt, no padding), as every caller reads no others. Both
    training loops and the reference run every forward through here.

    With context parallelism (`world.cp` > 1, inside `forward_passes`' context) this rank runs the model on its
    chunk of the row, scoring each position's next token taken from the whole row (a chunk's last position
    predicts the next rank's first token), and the chunks are gathered: every rank of the group gets the whole
    row's values, and backward sends each rank only the gradient of its own chunk.
    """
    targets = next_token_targets(batch.input_ids)
    scored = next_token_targets(batch.trained_mask)  # position t is scored when token t + 1 is trained (any component)
    tensors = (batch.input_ids, batch.position_ids, targets, batch.temperatures, scored)
    if world is None or world.cp == 1:
        mask = model_attention_mask(model, batch.position_ids, model.get_output_embeddings().weight.dtype)
        logp, entropy = next_token_logprobs(model, *tensors[:4], attention_mask=mask, scored=scored)
    else:
        ids, positions, targets, temperatures, scored = (shard_row(t, world.cp_rank, world.cp) for t in tensors)
        logp, entropy = next_token_logprobs(model, ids, positions, targets, temperatures, scored=scored)
        logp, entropy = gather_row(logp, world.cp_group), gather_row(entropy, world.cp_group)
    return shift_to_tokens(logp, batch.position_ids), shift_to_tokens(entropy, batch.position_ids)
