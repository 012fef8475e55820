"""Pack variable-length samples into rows, spread rows evenly over data-parallel ranks, and group a rank's rows
into micro-batches (one forward each).

Samples are concatenated inside a row; position ids restart at 0 for each sample, which is what lets the attention
kernel treat the row as block-diagonal (no cross-sample attention). How long a row may be depends on the kernel
(`row_capacity`): a varlen kernel (`flash_attention_2`, or context parallelism) skips the blocks between samples, so
rows fill `seq_len`; sdpa and eager compute the whole L x L score matrix under a block-diagonal mask, so rows are
kept as short as the step's longest sample. A micro-batch runs as many rows as fit a token budget as one [B, L]
batch, rows padded to the longest with a padding block of their own (position ids restarting at 0 again,
loss-masked), or, for `flash_attention_2`, which finds packed samples only in a batch of one row, as one [1, ΣL] row.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate, chain

import torch

from prime_rl.batch import TrainingSample


@dataclass
class PackedRow:
    """Several samples laid end to end, every tensor of shape [L]."""

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
    slot: int = 0
    """The run whose samples these are: its adapter slot with LoRA (`model/lora.py`), 0 otherwise; -1 for padding."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def is_padding(self) -> bool:
        return not self.sample_indices


TENSOR_FIELDS = ("input_ids", "position_ids", "loss_mask", "inference_logprobs", "advantages", "temperatures")
"""The per-token fields of a row that a micro-batch stacks as they are (`sample_ids` are renumbered)."""


@dataclass
class MicroBatch:
    """Rows run through the model in one forward: the per-token fields of `PackedRow`, each [B, L].

    `sample_ids` are unique across the whole micro-batch (0..num_samples-1), so the loss can treat the
    flattened [B * L] tokens as one long row.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    inference_logprobs: torch.Tensor
    advantages: torch.Tensor
    temperatures: torch.Tensor
    sample_ids: torch.Tensor
    num_samples: int
    slots: torch.Tensor
    """[B, L] long: each token's row's `slot` (-1 for padding)."""

    @property
    def num_tokens(self) -> int:
        """Positions the model computes, padding included."""
        return int(self.input_ids.numel())

    def to(self, device: torch.device) -> MicroBatch:
        return MicroBatch(
            **{name: getattr(self, name).to(device) for name in (*TENSOR_FIELDS, "sample_ids", "slots")},
            num_samples=self.num_samples,
        )


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
        slot=-1,
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


def join_rows(rows: Sequence[PackedRow]) -> PackedRow:
    """Lay rows end to end as one row, renumbering their samples (each row's position ids already restart)."""
    offsets = list(accumulate((row.num_samples for row in rows[:-1]), initial=0))
    return PackedRow(
        **{name: torch.cat([getattr(row, name) for row in rows]) for name in TENSOR_FIELDS},
        sample_ids=torch.cat([row.sample_ids + offset for row, offset in zip(rows, offsets, strict=True)]),
        num_samples=sum(row.num_samples for row in rows),
        sample_indices=[i for row in rows for i in row.sample_indices],
        slot=rows[0].slot,
    )


def collate(rows: Sequence[PackedRow], concatenate: bool) -> MicroBatch:
    """One micro-batch of `rows`: a [1, ΣL] row when `concatenate` (what `flash_attention_2` needs), else [B, L]
    with each row padded to the longest by a padding row (its own sample: positions from 0, no loss tokens)."""
    if not rows:
        raise ValueError("a micro-batch needs at least one row")
    if concatenate:
        slots = torch.cat([torch.full((r.num_tokens,), r.slot, dtype=torch.long) for r in rows]).unsqueeze(0)
        rows = [join_rows(rows)]
    else:
        longest = max(row.num_tokens for row in rows)
        slots = torch.stack([torch.full((longest,), r.slot, dtype=torch.long) for r in rows])
        rows = [
            join_rows([r, padding_row(length=longest - r.num_tokens)]) if r.num_tokens < longest else r for r in rows
        ]
    offsets = list(accumulate((row.num_samples for row in rows[:-1]), initial=0))
    return MicroBatch(
        **{name: torch.stack([getattr(row, name) for row in rows]) for name in TENSOR_FIELDS},
        sample_ids=torch.stack([row.sample_ids + offset for row, offset in zip(rows, offsets, strict=True)]),
        num_samples=sum(row.num_samples for row in rows),
        slots=slots,
    )


def packs_across_samples(attn: str, cp: int) -> bool:
    """Whether the attention kernel skips the blocks between a row's samples (varlen): `flash_attention_2`, and
    context parallelism, whose ring attention runs on one concatenated row."""
    return attn == "flash_attention_2" or cp > 1


def row_capacity(lengths: Sequence[int], seq_len: int, varlen: bool) -> int:
    """How long the rows of a step may be: `seq_len` for a varlen kernel, else the step's longest sample.

    sdpa and eager attend over the whole row under a block-diagonal mask, so a row of L tokens costs L² score
    entries whichever samples it holds: 64 samples of 123 tokens cost 16 x 512² in rows of 512, 64 x 123² (4x
    fewer) in rows of 123. Rows no longer than the longest sample still take several short samples, and are
    nearly equal in length, so stacking them pads little. (A sample longer than `seq_len` stays an error.)
    """
    return seq_len if varlen or not lengths else min(seq_len, max(lengths))


def micro_batches(rows: list[PackedRow], max_tokens: int, concatenate: bool) -> list[list[PackedRow]]:
    """Group one rank's rows into micro-batches of at most `max_tokens` positions each, padding included.

    A group of B rows stacked [B, L] computes B x (its longest row) positions, concatenated ones (`concatenate`)
    the sum of their lengths; a row longer than the budget runs alone. Rows go longest first, so a group's
    rows are alike in length. The rows' order does not change the gradient (a sum over micro-batches). A padding
    row only exists to make its rank run a forward, so it is dropped from a group that has real rows and kept in
    a group that has none. The ranks may end up with different counts: `forward_passes` evens them out.
    """
    if max_tokens < 1:
        raise ValueError(f"micro-batch token budget must be >= 1, got {max_tokens}")
    real = sorted((row for row in rows if not row.is_padding), key=lambda row: -row.num_tokens)
    if not real:
        return [rows[:1]] if rows else []
    groups: list[list[PackedRow]] = []
    for row in real:
        group = groups[-1] if groups else None
        if group:
            cost = sum(r.num_tokens for r in group) if concatenate else group[0].num_tokens * len(group)
            if cost + (row.num_tokens if concatenate else group[0].num_tokens) <= max_tokens:
                group.append(row)
                continue
        groups.append([row])
    return groups
