"""Context parallelism (Ulysses) for packed rows: `cp` ranks share one row, each holding a contiguous chunk of tokens.

Everything in a decoder layer but attention is token-local, so each rank runs the model on its own chunk. Attention
needs every token: the CP attention function exchanges q, k, v with an all-to-all from [local tokens, all heads] to
[all tokens, heads / cp], runs attention over the whole row with the row's block-diagonal causal mask (built once per
forward from the full row's position ids), and exchanges the output back. Each rank feeds the model its chunk's own
position ids (the per-sample positions of the full row), so rotary embeddings are those of the unsharded row.

How a training loop uses it, per row (its length padded to a multiple of cp with `pad_row`; r = rank in the CP group):

    enable_context_parallel(model, cp)                     # once, after loading
    targets = next token of every position of the full row # rank r's last position predicts rank r+1's first token
    with cp_context(cp_group, row.position_ids):           # backward inside too: activation checkpointing
        logits = model(input_ids=shard_row(row.input_ids, r, cp)[None],      # recomputes attention there
                       position_ids=shard_row(row.position_ids, r, cp)[None]).logits[0]
        logp = gather_row(logprobs(logits, shard_row(targets, r, cp)), cp_group)   # [L], the same on every CP rank
        loss = the loss of the full row, from logp          # the same on every CP rank
        loss.backward()

Gradients: every CP rank computes the same loss of the gathered row, and `gather_row`'s backward keeps only this
rank's slice of the incoming gradient, so the sum of parameter gradients over the CP ranks (FSDP's reduce-scatter with
divide factor 1 does that sum) is the gradient of the unsharded row, counted once.

The attention is `torch.nn.functional.scaled_dot_product_attention` with a dense [L, L] boolean mask (what
transformers' own `sdpa` path builds for a packed row, too). A varlen kernel (flash-attn, or torch 2.13's
`torch.nn.attention.varlen.varlen_attn`) would avoid the mask on GPU; it is not here because nothing could test it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

if TYPE_CHECKING:
    from transformers import PreTrainedModel

from prime_rl.trainer.packing import STREAM_FIELDS, PackedRow, piece_starts

CP_ATTENTION = "prime_rl_ulysses"
"""The name under which the CP attention is registered in transformers' AttentionInterface."""


# ---------------------------------------------------------------------------------------------------------------------
# Differentiable collectives


class _AllToAll(torch.autograd.Function):
    """Block i of dim 0 goes to rank i; block i of the result came from rank i.

    The exchange is a permutation of blocks between ranks, and its adjoint is the inverse permutation, which for equal
    blocks is the same exchange again: the backward all-to-alls the gradient.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def all_to_all(x: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """Differentiable all-to-all of equal blocks along dim 0 (whose size must be a multiple of the group size)."""
    cp = dist.get_world_size(group)
    if x.shape[0] % cp:
        raise ValueError(f"all_to_all: dim 0 of size {x.shape[0]} does not split into {cp} equal blocks")
    return _AllToAll.apply(x, group)


def heads_to_sequence(x: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """[heads, local tokens, d] -> [heads / cp, all tokens, d]: rank j gets heads j*H/cp .. (j+1)*H/cp - 1."""
    cp = dist.get_world_size(group)
    heads, local, d = x.shape
    received = all_to_all(x.reshape(cp, heads // cp, local, d), group)  # [source rank, my heads, its tokens, d]
    return received.transpose(0, 1).reshape(heads // cp, cp * local, d)


def sequence_to_heads(x: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """The inverse of `heads_to_sequence`: [heads / cp, all tokens, d] -> [heads, local tokens, d]."""
    cp = dist.get_world_size(group)
    my_heads, total, d = x.shape
    chunks = x.reshape(my_heads, cp, total // cp, d).transpose(0, 1)  # [destination rank, my heads, its tokens, d]
    return all_to_all(chunks, group).reshape(cp * my_heads, total // cp, d)


class _GatherRow(torch.autograd.Function):
    """All-gather along `dim`; the backward returns this rank's slice of the incoming gradient, not a sum over ranks.

    That is the right gradient when every rank computes the same function of the gathered row (each then holds the
    whole, identical gradient of it), which is how the trainer uses it.
    """

    @staticmethod
    def forward(ctx, local: torch.Tensor, dim: int, group: ProcessGroup | None) -> torch.Tensor:
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        parts = [torch.empty_like(local) for _ in range(cp)]
        dist.all_gather(parts, local.contiguous(), group=group)
        ctx.dim, ctx.start, ctx.size = dim, rank * local.shape[dim], local.shape[dim]
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad.narrow(ctx.dim, ctx.start, ctx.size).contiguous(), None, None


def gather_row(local: torch.Tensor, group: ProcessGroup | None = None, dim: int = -1) -> torch.Tensor:
    """The full row from every CP rank's chunk along `dim` (chunks in rank order; all ranks' chunks equally long)."""
    return _GatherRow.apply(local, dim % local.dim(), group)


def shard_row(tensor: torch.Tensor, cp_rank: int, cp: int, dim: int = -1) -> torch.Tensor:
    """This rank's contiguous chunk of `dim` (a view). The length must be a multiple of cp (see `pad_row`)."""
    length = tensor.shape[dim]
    if length % cp:
        raise ValueError(f"a row of {length} tokens does not split into cp={cp} equal chunks; pad it with pad_row")
    if not 0 <= cp_rank < cp:
        raise ValueError(f"cp_rank={cp_rank} is not in 0..{cp - 1}")
    size = length // cp
    return tensor.narrow(dim, cp_rank * size, size)


def pad_row(row: PackedRow, cp: int, pad_token_id: int = 0) -> PackedRow:
    """`row` lengthened to a multiple of cp: the extra tokens continue the last sample (next positions) without loss.

    Appended after the last sample's tokens, they are never attended to by a real token (attention is causal), and
    the sample keeps its id, so per-sample statistics over loss tokens are unchanged.
    """
    pad = -row.num_tokens % cp
    if pad == 0:
        return row
    last_pos = int(row.position_ids[-1]) if row.num_tokens else -1
    last_sample = int(row.sample_ids[-1]) if row.num_tokens else 0

    def extend(tensor: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
        return torch.cat([tensor, tail.to(tensor.dtype)])

    return replace(
        row,
        input_ids=extend(row.input_ids, torch.full((pad,), pad_token_id)),
        position_ids=extend(row.position_ids, torch.arange(last_pos + 1, last_pos + 1 + pad)),
        loss_mask=extend(row.loss_mask, torch.zeros(pad)),
        inference_logprobs=extend(row.inference_logprobs, torch.zeros(pad)),
        advantages=extend(row.advantages, torch.zeros(pad)),
        temperatures=extend(row.temperatures, torch.ones(pad)),
        sample_ids=extend(row.sample_ids, torch.full((pad,), last_sample)),
        **{name: extend(t, torch.zeros(pad)) for name in STREAM_FIELDS if (t := getattr(row, name)) is not None},
    )


# ---------------------------------------------------------------------------------------------------------------------
# The attention


def block_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """[L, L] bool, True where query q may attend key k: same sample and k <= q.

    A sample starts wherever the position does not follow its predecessor by 1 (`packing.piece_starts`), so CP sees
    exactly the samples the unsharded `sdpa`/`eager` paths see.
    """
    position_ids = position_ids.reshape(-1)
    sample = piece_starts(position_ids).cumsum(0)
    index = torch.arange(len(position_ids), device=position_ids.device)
    return (sample[:, None] == sample[None, :]) & (index[None, :] <= index[:, None])


@dataclass
class _Forward:
    """What the attention of every layer needs during one CP forward (and its backward's recomputation)."""

    group: ProcessGroup | None
    cp: int
    rank: int
    mask: torch.Tensor
    """[1, 1, L, L] bool, for sdpa."""
    local_position_ids: torch.Tensor
    """This rank's chunk of the row's position ids, to catch a model fed the wrong chunk."""
    checked: bool = False


_active: _Forward | None = None


@contextmanager
def cp_context(group: ProcessGroup | None, full_position_ids: torch.Tensor) -> Iterator[None]:
    """Run the CP forward of one row (and its backward, when activation checkpointing recomputes attention) inside.

    `full_position_ids` ([L] or [1, L]) are the whole row's, L a multiple of the group size; the row's tokens are
    split over the group's ranks in rank order. Builds the row's [L, L] attention mask once (best on the model's
    device: pass position ids that are already there).
    """
    global _active
    if _active is not None:
        raise RuntimeError("cp_context is already active: one CP row at a time")
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    full_position_ids = full_position_ids.reshape(-1)
    _active = _Forward(
        group=group,
        cp=cp,
        rank=rank,
        mask=block_causal_mask(full_position_ids)[None, None],
        local_position_ids=shard_row(full_position_ids, rank, cp),
    )
    try:
        yield
    finally:
        _active = None


def ulysses_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: q [1, H, S, D], k/v [1, Hkv, S, D] of this rank's S tokens -> [1, S, H, D]."""
    state = _active
    if state is None:
        raise RuntimeError(
            f"the model runs {CP_ATTENTION!r} attention outside cp_context; with activation checkpointing, "
            "backward recomputes attention, so it must run inside cp_context too"
        )
    if sliding_window is not None:
        raise NotImplementedError(f"{CP_ATTENTION!r} does not support sliding-window attention layers")
    if not getattr(module, "is_causal", True):
        raise NotImplementedError(f"{CP_ATTENTION!r} supports causal attention only ({type(module).__name__})")
    batch, heads, local, head_dim = query.shape
    kv_heads = key.shape[1]
    cp = state.cp
    if batch != 1:
        raise ValueError(f"{CP_ATTENTION!r} runs one packed row at a time (batch 1), got batch {batch}")
    if attention_mask is not None:
        raise ValueError(
            f"{CP_ATTENTION!r} builds the row's mask from cp_context's position ids: pass no attention_mask"
        )
    if local * cp != state.mask.shape[-1]:
        raise ValueError(
            f"the model got {local} tokens, but a rank's chunk of the {state.mask.shape[-1]}-token row in "
            f"cp_context is {state.mask.shape[-1] // cp}: feed it shard_row(...) of that row"
        )
    if heads % cp:
        raise ValueError(f"cp={cp} must divide the number of attention heads, {heads}")
    if not state.checked:  # once per row: one device sync, and the mask moved to the model's device if need be
        position_ids = kwargs.get("position_ids")
        if position_ids is not None and not torch.equal(
            position_ids.reshape(-1), state.local_position_ids.to(position_ids.device)
        ):
            raise ValueError(f"CP rank {state.rank} was fed position ids other than its chunk of the cp_context row")
        state.mask = state.mask.to(query.device)
        state.checked = True

    # kv heads repeated just enough for cp to divide them, each kept next to its copies: query head h still reads
    # kv head h // (heads // kv_heads), now spread over the ranks alongside the query heads that read it.
    repeat = cp // math.gcd(kv_heads, cp)
    if repeat > 1:
        key = key.repeat_interleave(repeat, dim=1)
        value = value.repeat_interleave(repeat, dim=1)

    q = heads_to_sequence(query[0], state.group)  # [H / cp, L, D]
    k = heads_to_sequence(key[0], state.group)  # [Hkv' / cp, L, D]
    v = heads_to_sequence(value[0], state.group)
    groups = q.shape[0] // k.shape[0]
    if groups > 1:  # sdpa's own GQA does not take an explicit mask on every backend
        k = k.repeat_interleave(groups, dim=0)
        v = v.repeat_interleave(groups, dim=0)
    out = torch.nn.functional.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=state.mask, dropout_p=dropout, scale=scaling
    )[0]  # [H / cp, L, D]
    return sequence_to_heads(out, state.group).transpose(0, 1)[None], None


def enable_context_parallel(model: PreTrainedModel, cp: int) -> None:
    """Switch a loaded model to the CP attention, after checking that cp can split its heads.

    Registering a name transformers has no mask builder for also makes it build no mask at all for the local chunk
    (`masking_utils` returns None early), which is right: the CP attention builds the full row's mask itself.
    """
    from transformers import AttentionInterface  # here: importing transformers takes seconds, and the head needs none

    config = model.config.get_text_config()
    heads = config.num_attention_heads
    if cp < 1 or heads % cp:
        raise ValueError(f"context parallelism cp={cp} must divide the model's num_attention_heads={heads}")
    # Collectives and a Python-side state: kept out of compiled decoder layers. Wrapped here rather than decorated,
    # because `torch.compiler.disable` imports dynamo (~2.7 s), and the log-prob head imports this module.
    AttentionInterface.register(CP_ATTENTION, torch.compiler.disable(ulysses_attention))
    model.set_attn_implementation(CP_ATTENTION)
    if model.config._attn_implementation != CP_ATTENTION:
        raise ValueError(
            f"{type(model).__name__} does not dispatch attention through transformers' AttentionInterface, "
            "so it cannot run context parallel"
        )
