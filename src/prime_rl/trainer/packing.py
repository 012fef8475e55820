"""Pack variable-length samples into padding-free rows, and spread rows evenly over data-parallel ranks.

Each row is one micro-batch with batch dimension 1. Samples are concatenated inside a row; position ids restart at 0
for each sample, which is what lets the attention kernel treat the row as block-diagonal (no cross-sample attention).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import chain

import torch

from prime_rl.batch import TrainingSample


@dataclass
class PackedRow:
    """One micro-batch: several samples laid end to end, every tensor of shape [L]."""

    input_ids: torch.Tensor
    """[L] long."""
    position_ids: torch.Tensor
    """[L] long, restarting at 0 for each sample."""
    loss_mask: torch.Tensor
    """[L] bool."""
    inference_logprobs: torch.Tensor
    """[L] float32."""
    advantages: torch.Tensor
    """[L] float32."""
    temperatures: torch.Tensor
    """[L] float32, per token so samples of different temperatures can share a row."""
    sample_ids: torch.Tensor
    """[L] long, 0..num_samples-1 within this row."""
    num_samples: int
    sample_indices: list[int]
    """Indices into the batch's sample list, in row order (empty for padding rows)."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Group item indices into bins of total length <= capacity, using few bins (FFD is within 11/9 of optimal).

    Items are placed longest first (ties by index, so the result is deterministic) into the first bin with room;
    each bin lists its items in placement order.
    """
    if capacity <= 0:
        raise ValueError(f"capacity must be positive, got {capacity}")
    for i, length in enumerate(lengths):
        if length < 0:
            raise ValueError(f"item {i} has negative length {length}")
        if length > capacity:
            raise ValueError(f"item {i} has length {length}, more than the capacity {capacity}")
    bins: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        target = next((b for b, room in enumerate(free) if room >= lengths[i]), None)
        if target is None:
            bins.append([])
            free.append(capacity)
            target = len(bins) - 1
        bins[target].append(i)
        free[target] -= lengths[i]
    return bins


def _flat_tensor(lists: Iterable[list], typecode: str, dtype: torch.dtype) -> torch.Tensor:
    """Concatenate per-sample lists into one tensor.

    Going through array.array (a C loop) and sharing its buffer is ~4x faster than torch.tensor on a Python list,
    which matters because a batch holds millions of tokens and every rank packs it each step.
    """
    buffer = array(typecode, chain.from_iterable(lists))
    if not buffer:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype)


def _build_row(samples: Sequence[TrainingSample], indices: list[int]) -> PackedRow:
    """Concatenate the given samples into one row.

    Per-sample constants (positions, sample id, temperature) are built as small per-sample tensors and
    concatenated: cheap single-threaded ops, where repeat_interleave would open a parallel region per call.
    """
    chosen = [samples[i] for i in indices]
    lengths = [len(s.token_ids) for s in chosen]
    input_ids = _flat_tensor((s.token_ids for s in chosen), "q", torch.long)
    loss_mask = _flat_tensor((s.loss_mask for s in chosen), "b", torch.bool)
    logprobs = _flat_tensor((s.inference_logprobs for s in chosen), "f", torch.float32)
    advantages = _flat_tensor((s.advantages for s in chosen), "f", torch.float32)
    if not loss_mask.numel() == logprobs.numel() == advantages.numel() == input_ids.numel():
        raise ValueError(f"samples {indices} have per-token lists of unequal length (run validate_batch first)")
    return PackedRow(
        input_ids=input_ids,
        position_ids=torch.cat([torch.arange(n, dtype=torch.long) for n in lengths]),
        loss_mask=loss_mask,
        inference_logprobs=logprobs,
        advantages=advantages,
        temperatures=torch.cat(
            [torch.full((n,), s.temperature, dtype=torch.float32) for n, s in zip(lengths, chosen, strict=True)],
        ),
        sample_ids=torch.cat([torch.full((n,), k, dtype=torch.long) for k, n in enumerate(lengths)]),
        num_samples=len(chosen),
        sample_indices=list(indices),
    )


def pack_samples(samples: Sequence[TrainingSample], seq_len: int) -> list[PackedRow]:
    """Pack all samples into as few rows of at most seq_len tokens as FFD finds; every sample lands in one row."""
    bins = first_fit_decreasing([len(s.token_ids) for s in samples], seq_len)
    return [_build_row(samples, indices) for indices in bins]


def padding_row(pad_token_id: int = 0, length: int = 1) -> PackedRow:
    """A row that contributes nothing to the loss, for ranks that would otherwise run fewer micro-batches."""
    if length < 1:
        raise ValueError(f"padding row length must be >= 1, got {length}")
    return PackedRow(
        input_ids=torch.full((length,), pad_token_id, dtype=torch.long),
        position_ids=torch.arange(length, dtype=torch.long),
        loss_mask=torch.zeros(length, dtype=torch.bool),
        inference_logprobs=torch.zeros(length, dtype=torch.float32),
        advantages=torch.zeros(length, dtype=torch.float32),
        temperatures=torch.ones(length, dtype=torch.float32),
        sample_ids=torch.zeros(length, dtype=torch.long),
        num_samples=1,
        sample_indices=[],
    )


def shard_rows(rows: list[PackedRow], world_size: int) -> list[list[PackedRow]]:
    """Split rows over data-parallel ranks: equal row counts per rank, real tokens balanced across ranks.

    FSDP's collectives run once per micro-batch, so every rank must run the same number of rows or the job
    hangs; padding rows fill the gap. Balancing tokens keeps ranks from idling at the collectives. Rows go longest
    first to the rank with the fewest tokens among ranks that have fewer than their equal share of rows (ties by
    rank, then by row index, so every rank computes the same assignment). Each rank keeps its real rows in their
    input order, padding last.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    per_rank = -(-len(rows) // world_size)
    assigned: list[list[int]] = [[] for _ in range(world_size)]
    tokens = [0] * world_size
    for i in sorted(range(len(rows)), key=lambda i: (-rows[i].num_tokens, i)):
        rank = min((r for r in range(world_size) if len(assigned[r]) < per_rank), key=lambda r: (tokens[r], r))
        assigned[rank].append(i)
        tokens[rank] += rows[i].num_tokens
    return [
        [rows[i] for i in sorted(indices)] + [padding_row() for _ in range(per_rank - len(indices))]
        for indices in assigned
    ]
