"""Pack variable-length samples into rows, spread rows evenly over data-parallel ranks, and group a rank's rows
into micro-batches (one forward each).

Samples are concatenated inside a row; position ids restart at 0 for each sample, which is what lets the attention
kernel treat the row as block-diagonal (no cross-sample attention). Where the kernel computes the whole row anyway
(sdpa, eager), the samples of a group that share their prompt may share one copy of it (`layout_units`): the prompt
once, then each sample's continuation with positions going on from the prompt's end, and an explicit attention mask
(`model/logprobs.py: shared_prompt_mask`) lets each continuation see the prompt and itself only. GRPO's 8-16
rollouts of a prompt then cost one prompt's forward and backward instead of 8-16, but attend as one long row: a
group shares only where that costs less (`unit_cost`).

How long a row may be depends on the kernel (`row_capacity`): a varlen kernel (`flash_attention_2`, or context
parallelism) skips the blocks between samples, so rows fill `seq_len`; sdpa and eager compute the whole L x L score
matrix under a block-diagonal mask, so rows are kept as short as the step's longest unit. A micro-batch runs rows
that fit a token budget as one [B, L] batch, rows padded to the longest with a padding block of their own (position
ids restarting at 0 again, loss-masked), or, for `flash_attention_2`, which finds packed samples only in a batch of
one row, as one [1, ΣL] row. Rows of very different lengths go to different forwards where the padding would cost
more than the forward (`micro_batches`).
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
    ce_weights: torch.Tensor | None = None
    """[L] float32, or None when no sample of the row has the stream (`STREAM_FIELDS`): a GRPO row builds none."""
    ref_logprobs: torch.Tensor | None = None
    """[L] float32, or None."""
    ref_kl_mask: torch.Tensor | None = None
    """[L] bool, or None."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def num_ce_tokens(self) -> int:
        return 0 if self.ce_weights is None else int((self.ce_weights > 0).sum())

    @property
    def num_ref_kl_tokens(self) -> int:
        return 0 if self.ref_kl_mask is None else int(self.ref_kl_mask.sum())

    @property
    def is_padding(self) -> bool:
        return not self.sample_indices


TENSOR_FIELDS = ("input_ids", "position_ids", "loss_mask", "inference_logprobs", "advantages", "temperatures")
"""The per-token fields of a row that a micro-batch stacks as they are (`sample_ids` are renumbered)."""

STREAM_FIELDS = {
    "ce_weights": ("f", torch.float32),
    "ref_logprobs": ("f", torch.float32),
    "ref_kl_mask": ("b", torch.bool),
}
"""The optional per-token streams of `TrainingSample` (name: array typecode, dtype). A row, or micro-batch, holds one
only when one of its samples has it (else None, so a GRPO step packs and moves nothing more); where some of its samples
have it, the others get zeros (no such token)."""


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
    num_padding: int = 0
    """Positions that only pad: padding rows, and the padding that evens the rows' lengths."""
    ce_weights: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    ref_kl_mask: torch.Tensor | None = None
    """The optional streams (`STREAM_FIELDS`), each [B, L] or None."""

    @property
    def num_tokens(self) -> int:
        """Positions the model computes, padding included."""
        return int(self.input_ids.numel())

    @property
    def trained_mask(self) -> torch.Tensor:
        """[B, L] bool: tokens some loss component trains (rl, ce or ref_kl), the ones the forward must score."""
        mask = self.loss_mask
        if self.ce_weights is not None:
            mask = mask | (self.ce_weights > 0)
        if self.ref_kl_mask is not None:
            mask = mask | self.ref_kl_mask
        return mask

    def to(self, device: torch.device) -> MicroBatch:
        streams = {name: getattr(self, name) for name in STREAM_FIELDS}
        return MicroBatch(
            **{name: getattr(self, name).to(device) for name in (*TENSOR_FIELDS, "sample_ids", "slots")},
            num_samples=self.num_samples,
            num_padding=self.num_padding,
            **{name: None if t is None else t.to(device) for name, t in streams.items()},
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


@dataclass(frozen=True)
class Unit:
    """Samples laid out together in a row: one sample alone (`prompt` 0), or several that continue one copy of their
    common first `prompt` tokens."""

    samples: tuple[int, ...]
    prompt: int
    length: int
    """Positions the unit takes in a row: the prompt once plus each sample's tokens after it."""


def layout_units(samples: Sequence[TrainingSample], max_length: int, attention_cost: float | None) -> list[Unit]:
    """The units the samples are packed as: each alone, or grouped by the tokens before their first loss token, less
    that prompt's last token, which each sample keeps (its logits predict the sample's first trained token, so each
    continuation needs its own copy of it).

    Only identical prompts are shared, never a token that is trained, so every trained token sees exactly the
    tokens it saw alone. A group longer than `max_length` is split into units that each repeat the prompt. A group
    shares only where its units cost less than its samples alone (`unit_cost` with `attention_cost`; None: never,
    for varlen kernels, which cannot take the mask sharing needs).
    """
    groups: dict[object, list[int]] = {}
    for i, sample in enumerate(samples):
        shared = first_trained(sample) - 1 if attention_cost is not None else 0
        key = (shared, array("q", sample.token_ids[:shared]).tobytes()) if shared > 0 else i
        groups.setdefault(key, []).append(i)
    cost = attention_cost or 0.0  # (None shares nothing: every group above is one sample)
    units: list[Unit] = []
    for key, members in groups.items():
        prompt = key[0] if isinstance(key, tuple) else 0
        together, current, length = [], [], prompt
        for i in members:
            added = len(samples[i].token_ids) - prompt
            if current and length + added > max_length:
                together.append(_unit(samples, current, prompt))
                current, length = [], prompt
            current.append(i)
            length += added
        together.append(_unit(samples, current, prompt))
        alone = [_unit(samples, [i], 0) for i in members]
        if sum(unit_cost(u, cost) for u in together) < sum(unit_cost(u, cost) for u in alone):
            units += together
        else:
            units += alone
    return units


def first_trained(sample: TrainingSample) -> int:
    """Index of the sample's first token that any loss component trains (loss mask, ce weight > 0, ref_kl mask), or 0
    if none: what precedes it trains nothing, so samples may share one copy of it (`layout_units`)."""
    candidates = [sample.loss_mask.index(True)] if True in sample.loss_mask else []
    if sample.ce_weights and (ce := next((t for t, w in enumerate(sample.ce_weights) if w > 0), None)) is not None:
        candidates.append(ce)
    if True in sample.ref_kl_mask:
        candidates.append(sample.ref_kl_mask.index(True))
    return min(candidates, default=0)


def unit_cost(unit: Unit, attention_cost: float) -> float:
    """What a unit costs to train, in positions: each position's layers, plus its attention score entries at
    `attention_cost` positions each (`perf.attention_entry_cost`). A sample alone is one causal row, half its
    `length`² entries (what a causal kernel computes); a shared prompt's unit needs the explicit mask, under which
    sdpa and eager compute all `length`² entries.

    Sharing saves positions but makes one long masked unit: 8 samples of 1,024 tokens after a 128-token prompt are
    8 x 1,024 positions alone, one unit of 7,303 shared. At Qwen3-0.6B's 1/3,840 that costs 9,284 alone against
    21,192 shared; with 512-token prompts 9,284 against 10,161; with 896-token prompts 9,284 against 2,894. An H200
    measured 0.42 s against 0.79, 0.37 against 0.41, and 0.33 against 0.21 (`docs/gpu.md`). The demo's 108-token
    prompts and 15 generated tokens share at under a third of the cost alone.
    """
    entries = unit.length * unit.length if unit.prompt else unit.length * unit.length / 2
    return unit.length + attention_cost * entries


def _unit(samples: Sequence[TrainingSample], members: list[int], prompt: int) -> Unit:
    if len(members) == 1:  # nothing to share: the sample as it is
        return Unit((members[0],), 0, len(samples[members[0]].token_ids))
    return Unit(tuple(members), prompt, prompt + sum(len(samples[i].token_ids) - prompt for i in members))


def _build_row(samples: Sequence[TrainingSample], units: Sequence[Unit]) -> PackedRow:
    """Lay the units end to end as one row.

    A row is a list of pieces, each a slice [start, end) of one sample with positions start..end-1: a lone sample
    whole, or a unit's prompt (taken from its first sample, whose id it carries: it holds no loss token) followed
    by each sample's tokens after it. Per-piece constants are built as small tensors and concatenated: cheap
    single-threaded ops, where repeat_interleave would open a parallel region per call.
    """
    pieces: list[tuple[int, int, int, int]] = []  # (sample index, start, end, id of the sample within the row)
    order: list[int] = []
    for unit in units:
        if unit.prompt:
            pieces.append((unit.samples[0], 0, unit.prompt, len(order)))
        for i in unit.samples:
            pieces.append((i, unit.prompt, len(samples[i].token_ids), len(order)))
            order.append(i)

    def field(name: str, typecode: str, dtype: torch.dtype) -> torch.Tensor:
        return _flat_tensor((getattr(samples[i], name)[start:end] for i, start, end, _ in pieces), typecode, dtype)

    input_ids = field("token_ids", "q", torch.long)
    loss_mask = field("loss_mask", "b", torch.bool)
    logprobs = field("inference_logprobs", "f", torch.float32)
    advantages = field("advantages", "f", torch.float32)
    if not loss_mask.numel() == logprobs.numel() == advantages.numel() == input_ids.numel():
        raise ValueError(f"samples {order} have per-token lists of unequal length (run validate_batch first)")
    streams = {}
    for name, (typecode, dtype) in STREAM_FIELDS.items():
        if any(getattr(samples[i], name) for i in order):  # a sample without the stream: zeros, no such token
            zero = False if dtype == torch.bool else 0.0
            parts = ((getattr(samples[i], name) or [zero] * len(samples[i].token_ids))[a:b] for i, a, b, _ in pieces)
            streams[name] = _flat_tensor(parts, typecode, dtype)
            if streams[name].numel() != input_ids.numel():
                raise ValueError(f"samples {order} have a {name} of the wrong length (run validate_batch first)")
    return PackedRow(
        input_ids=input_ids,
        position_ids=torch.cat([torch.arange(start, end, dtype=torch.long) for _, start, end, _ in pieces]),
        loss_mask=loss_mask,
        inference_logprobs=logprobs,
        advantages=advantages,
        temperatures=torch.cat(
            [torch.full((end - start,), samples[i].temperature, dtype=torch.float32) for i, start, end, _ in pieces]
        ),
        sample_ids=torch.cat([torch.full((end - start,), k, dtype=torch.long) for _, start, end, k in pieces]),
        num_samples=len(order),
        sample_indices=order,
        **streams,
    )


def piece_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """[..., L] -> bool [..., L]: where a piece of a row starts, i.e. where a position does not follow the one before
    it (and a row's first token). A piece is a sample, a shared prompt, or a sample's continuation of one; the rule is
    transformers' `find_packed_sequence_indices`, so every path sees the samples the unsharded `sdpa` path sees."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[..., 1:] = position_ids[..., 1:] != position_ids[..., :-1] + 1
    return starts


def pack_units(samples: Sequence[TrainingSample], units: Sequence[Unit], capacity: int) -> list[PackedRow]:
    """Pack the units into as few rows of at most `capacity` positions as FFD finds; every unit lands in one row."""
    bins = first_fit_decreasing([unit.length for unit in units], capacity)
    return [_build_row(samples, [units[j] for j in indices]) for indices in bins]


def pack_samples(
    samples: Sequence[TrainingSample], seq_len: int, attention_cost: float | None = None
) -> list[PackedRow]:
    """Pack all samples into rows of at most seq_len positions (`attention_cost`: a group's prompt once where that
    costs less, `layout_units`; None: every sample whole)."""
    return pack_units(samples, layout_units(samples, seq_len, attention_cost), seq_len)


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
        **{name: _stream(rows, name, torch.cat) for name in STREAM_FIELDS},
    )


def _stream(rows: Sequence[PackedRow], name: str, combine) -> torch.Tensor | None:
    """Stream `name` of `rows` put together by `combine` (`torch.cat` or `torch.stack`), zeros for a row without it;
    None when no row has it."""
    if all(getattr(row, name) is None for row in rows):
        return None
    dtype = STREAM_FIELDS[name][1]
    return combine(
        [t if (t := getattr(row, name)) is not None else torch.zeros(row.num_tokens, dtype=dtype) for row in rows]
    )


def collate(rows: Sequence[PackedRow], concatenate: bool) -> MicroBatch:
    """One micro-batch of `rows`: a [1, ΣL] row when `concatenate` (what `flash_attention_2` needs), else [B, L]
    with each row padded to the longest by a padding row (its own sample: positions from 0, no loss tokens)."""
    if not rows:
        raise ValueError("a micro-batch needs at least one row")
    num_padding = sum(row.num_tokens for row in rows if row.is_padding)
    if concatenate:
        slots = torch.cat([torch.full((r.num_tokens,), r.slot, dtype=torch.long) for r in rows]).unsqueeze(0)
        rows = [join_rows(rows)]
    else:
        longest = max(row.num_tokens for row in rows)
        num_padding += sum(longest - row.num_tokens for row in rows)
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
        num_padding=num_padding,
        **{name: _stream(rows, name, torch.stack) for name in STREAM_FIELDS},
    )


def packs_across_samples(attn: str, cp: int) -> bool:
    """Whether the attention kernel skips the blocks between a row's samples (varlen): `flash_attention_2`, and
    context parallelism, whose ring attention runs on one concatenated row."""
    return attn == "flash_attention_2" or cp > 1


def row_capacity(lengths: Sequence[int], seq_len: int, varlen: bool) -> int:
    """How long the rows of a step may be: `seq_len` for a varlen kernel, else the step's longest unit (a sample,
    or samples sharing their prompt: `layout_units`), `lengths` being the units'.

    sdpa and eager attend over the whole row under a block-diagonal mask, so a row of L tokens costs L² score
    entries whichever samples it holds: 64 samples of 123 tokens cost 16 x 512² in rows of 512, 64 x 123² (4x
    fewer) in rows of 123. Rows no longer than the longest sample still take several short samples, and are
    nearly equal in length, so stacking them pads little. (A sample longer than `seq_len` stays an error.)
    """
    return seq_len if varlen or not lengths else min(seq_len, max(lengths))


FORWARD_COST = {"cpu": 64}
"""What one more forward and backward costs, in positions, by device type: a pass's fixed work (every layer's
kernels, every parameter's gradient written) over one position's. Measured on the 2-core CPU with plain
transformers (`benchmarks/bench_trainer_overhead.py` shows the effect): ~5 ms, ~80 positions, for the demo's
model, ~0.4 s, ~50 positions, for SmolLM2-135M. Unmeasured on GPUs: there rows stack as many as fit, as before."""


def micro_batches(
    rows: list[PackedRow], max_tokens: int, concatenate: bool, forward_cost: float = float("inf")
) -> list[list[PackedRow]]:
    """Group one rank's rows into micro-batches of at most `max_tokens` positions each, padding included.

    Concatenated rows (`concatenate`: [1, ΣL]) pad nothing, so each group takes rows until the budget is full. A
    stacked group of B rows ([B, L]) computes B x its longest row, so a short row beside a long one is mostly
    padding: the groups are the ones that cost least, counting each group's positions plus `forward_cost` positions
    for each forward (`FORWARD_COST`; infinite: as few forwards as possible). Rows go longest first and a group
    takes consecutive ones, so that is a short dynamic program. A row longer than the budget runs alone. The rows'
    grouping does not change the gradient (a sum over micro-batches). A padding row only exists to make its rank
    run a forward, so it is dropped from a group that has real rows and kept in a group that has none. The ranks
    may end up with different counts: `forward_passes` evens them out.
    """
    if max_tokens < 1:
        raise ValueError(f"micro-batch token budget must be >= 1, got {max_tokens}")
    real = sorted((row for row in rows if not row.is_padding), key=lambda row: -row.num_tokens)
    if not real:
        return [rows[:1]] if rows else []
    if concatenate:
        groups: list[list[PackedRow]] = []
        for row in real:
            if groups and sum(r.num_tokens for r in groups[-1]) + row.num_tokens <= max_tokens:
                groups[-1].append(row)
            else:
                groups.append([row])
        return groups
    # best[j]: (forwards, positions) of the cheapest grouping of real[:j]; start[j]: where its last group starts.
    # Compared by positions + forward_cost per forward, then by forwards, then positions (all that counts when the
    # cost is infinite).
    best: list[tuple[int, int]] = [(0, 0)]
    start: list[int] = [0]
    for j in range(1, len(real) + 1):
        choices = []
        for i in range(j - 1, -1, -1):  # the last group is real[i:j], as wide as its first (longest) row
            if i < j - 1 and (j - i) * real[i].num_tokens > max_tokens:
                break
            forwards, positions = best[i][0] + 1, best[i][1] + (j - i) * real[i].num_tokens
            choices.append((positions + forward_cost * forwards, forwards, positions, i))
        _, forwards, positions, i = min(choices)
        best.append((forwards, positions))
        start.append(i)
    groups, j = [], len(real)
    while j > 0:
        groups.append(real[start[j] : j])
        j = start[j]
    return groups[::-1]
