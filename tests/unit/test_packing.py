"""First-fit-decreasing packing into rows and equal-count, token-balanced sharding over ranks."""

from types import SimpleNamespace

import pytest
import torch

from prime_rl.batch import TrainingSample
from prime_rl.trainer.packing import (
    PackedRow,
    Unit,
    collate,
    first_fit_decreasing,
    layout_units,
    micro_batches,
    pack_samples,
    pack_units,
    packs_across_samples,
    padding_row,
    row_capacity,
    shard_rows,
    unit_cost,
)
from prime_rl.trainer.perf import attention_entry_cost


def make_sample(n: int, base: int = 0, temperature: float = 1.0) -> TrainingSample:
    """A sample whose values encode (base, position) so misplaced tokens are easy to spot."""
    return TrainingSample(
        token_ids=[base + i for i in range(n)],
        loss_mask=[i % 2 == 1 for i in range(n)],
        inference_logprobs=[-(base + i) / 100 if i % 2 == 1 else 0.0 for i in range(n)],
        advantages=[base / 10] * n,
        temperature=temperature,
    )


def test_ffd_hand_derived():
    # Descending order: 2(8) 4(7) 0(5) 1(3) 3(2) 5(1).
    # 8 -> bin0 (room 2); 7 -> bin1 (room 3); 5 -> bin2 (room 5); 3 -> bin1 (room 0); 2 -> bin0 (room 0); 1 -> bin2.
    assert first_fit_decreasing([5, 3, 8, 2, 7, 1], 10) == [[2, 3], [4, 1], [0, 5]]


def test_ffd_ties_are_broken_by_index():
    # All equal: index order; three 4s per bin of 12.
    assert first_fit_decreasing([4] * 7, 12) == [[0, 1, 2], [3, 4, 5], [6]]
    # Exactly full bins and an item equal to capacity.
    assert first_fit_decreasing([6, 10, 4, 6], 10) == [[1], [0, 2], [3]]


def test_ffd_empty_and_errors():
    assert first_fit_decreasing([], 10) == []
    with pytest.raises(ValueError, match="item 1 has length 11"):
        first_fit_decreasing([3, 11, 2], 10)
    with pytest.raises(ValueError):
        first_fit_decreasing([1], 0)


def test_pack_samples_invariants():
    lengths = [5, 3, 8, 2, 7, 1, 10, 4]
    samples = [make_sample(n, base=100 * k, temperature=0.5 + k / 10) for k, n in enumerate(lengths)]
    rows = pack_samples(samples, seq_len=10)
    seen = sorted(i for row in rows for i in row.sample_indices)
    assert seen == list(range(len(samples)))
    for row in rows:
        assert row.num_tokens <= 10
        assert row.num_samples == len(row.sample_indices)
        for tensor in (row.position_ids, row.loss_mask, row.inference_logprobs, row.advantages, row.temperatures):
            assert tensor.shape == row.input_ids.shape
        assert row.input_ids.dtype == row.position_ids.dtype == row.sample_ids.dtype == torch.long
        assert row.loss_mask.dtype == torch.bool
        assert row.inference_logprobs.dtype == row.advantages.dtype == row.temperatures.dtype == torch.float32
        expected_positions = torch.cat([torch.arange(len(samples[i].token_ids)) for i in row.sample_indices])
        assert torch.equal(row.position_ids, expected_positions)
        assert row.num_loss_tokens == sum(sum(samples[i].loss_mask) for i in row.sample_indices)
    assert sum(row.num_tokens for row in rows) == sum(lengths)


def test_pack_samples_row_element_by_element():
    samples = [make_sample(3, base=10, temperature=0.5), make_sample(6, base=20, temperature=1.5)]
    (row,) = pack_samples(samples, seq_len=10)
    assert row.sample_indices == [1, 0]  # longest first
    assert row.num_samples == 2
    assert row.input_ids.tolist() == [20, 21, 22, 23, 24, 25, 10, 11, 12]
    assert row.position_ids.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2]
    assert row.sample_ids.tolist() == [0, 0, 0, 0, 0, 0, 1, 1, 1]
    assert row.loss_mask.tolist() == [False, True, False, True, False, True, False, True, False]
    assert row.inference_logprobs.tolist() == pytest.approx([0, -0.21, 0, -0.23, 0, -0.25, 0, -0.11, 0])
    assert row.advantages.tolist() == pytest.approx([2.0] * 6 + [1.0] * 3)
    assert row.temperatures.tolist() == [1.5] * 6 + [0.5] * 3
    assert row.num_tokens == 9 and row.num_loss_tokens == 4


def test_pack_samples_rejects_oversized_sample():
    with pytest.raises(ValueError):
        pack_samples([make_sample(4), make_sample(11)], seq_len=10)


def test_padding_row():
    row = padding_row(pad_token_id=7, length=3)
    assert row.input_ids.tolist() == [7, 7, 7]
    assert row.position_ids.tolist() == [0, 1, 2]
    assert row.num_loss_tokens == 0 and row.num_samples == 1 and row.sample_indices == []
    assert row.advantages.abs().sum() == 0 and row.inference_logprobs.abs().sum() == 0
    assert row.temperatures.tolist() == [1.0] * 3 and row.sample_ids.tolist() == [0, 0, 0]


def rows_of(lengths: list[int]) -> list[PackedRow]:
    """One row per length (each sample alone in its row), sample index = position in `lengths`."""
    rows = []
    for k, n in enumerate(lengths):
        (row,) = pack_samples([make_sample(n, base=k)], seq_len=n)
        row.sample_indices = [k]
        rows.append(row)
    return rows


def test_shard_rows_equal_counts_with_padding():
    rows = rows_of([9, 3, 7, 2, 8, 8, 1, 4, 6, 5, 2])
    shards = shard_rows(rows, world_size=4)
    assert [len(shard) for shard in shards] == [3, 3, 3, 3]
    real = [row for shard in shards for row in shard if row.sample_indices]
    padding = [row for shard in shards for row in shard if not row.sample_indices]
    assert sorted(id(r) for r in real) == sorted(id(r) for r in rows)
    assert len(padding) == 1 and padding[0].num_loss_tokens == 0
    assert all(sum(1 for row in shard if not row.sample_indices) <= 1 for shard in shards)


def test_shard_rows_world_size_one_keeps_everything_in_order():
    rows = rows_of([3, 9, 1])
    assert [[id(r) for r in shard] for shard in shard_rows(rows, 1)] == [[id(r) for r in rows]]
    assert shard_rows([], 2) == [[], []]
    with pytest.raises(ValueError):
        shard_rows(rows, 0)


def test_shard_rows_is_deterministic():
    rows = rows_of([5, 5, 3, 3, 8, 1, 1])
    first = [[r.sample_indices for r in shard] for shard in shard_rows(rows, 3)]
    second = [[r.sample_indices for r in shard] for shard in shard_rows(rows, 3)]
    assert first == second


def test_shard_rows_balances_better_than_round_robin():
    lengths = [100, 10, 90, 10, 80, 10, 70, 10]
    rows = rows_of(lengths)

    def spread(shards: list[list[PackedRow]]) -> int:
        loads = [sum(r.num_tokens for r in shard if r.sample_indices) for shard in shards]
        return max(loads) - min(loads)

    round_robin = [rows[r::2] for r in range(2)]
    assert spread(round_robin) == 300
    shards = shard_rows(rows, 2)
    assert [len(s) for s in shards] == [4, 4]
    assert spread(shards) == 0


def test_pack_samples_rejects_unequal_lists():
    bad = TrainingSample(token_ids=[1, 2, 3], loss_mask=[True], inference_logprobs=[0.0] * 3, advantages=[0.0] * 3)
    with pytest.raises(ValueError, match="unequal"):
        pack_samples([make_sample(2), bad], seq_len=10)


def test_collate_pads_each_row_with_a_sample_of_its_own():
    short, long = rows_of([3, 6])
    batch = collate([short, long], concatenate=False)
    assert batch.input_ids.tolist() == [[0, 1, 2, 0, 0, 0], [1, 2, 3, 4, 5, 6]]
    assert batch.position_ids[0].tolist() == [0, 1, 2, 0, 1, 2]  # padding restarts at 0: a block of its own
    assert batch.loss_mask[0].tolist() == [False, True, False, False, False, False]
    assert batch.sample_ids.tolist() == [[0, 0, 0, 1, 1, 1], [2] * 6]  # unique over the micro-batch
    assert batch.num_samples == 3 and batch.num_tokens == 12
    assert batch.temperatures[0, 3:].tolist() == [1.0] * 3
    assert batch.advantages[0, 3:].abs().sum() == 0 and batch.inference_logprobs[0, 3:].abs().sum() == 0


def test_collate_concatenates_for_flash_attention():
    a, b = rows_of([3, 2])
    batch = collate([a, b], concatenate=True)
    assert batch.input_ids.tolist() == [[0, 1, 2, 1, 2]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 1]]
    assert batch.sample_ids.tolist() == [[0, 0, 0, 1, 1]] and batch.num_samples == 2
    assert batch.loss_mask.tolist() == [[False, True, False, False, True]]


def test_micro_batches_fill_a_token_budget_longest_rows_first():
    rows = rows_of([3, 9, 5, 8, 2])
    lengths = lambda groups: [[row.num_tokens for row in group] for group in groups]  # noqa: E731
    # stacked [B, L]: a group costs B x its longest row (the first: longest first); 9+9 > 16 starts a new group
    assert lengths(micro_batches(rows, 16, concatenate=False)) == [[9], [8, 5], [3, 2]]
    assert lengths(micro_batches(rows, 18, concatenate=False)) == [[9, 8], [5, 3, 2]]  # 2 x 9 = 18 fits
    # concatenated [1, ΣL]: a group costs the sum of its rows
    assert lengths(micro_batches(rows, 17, concatenate=True)) == [[9, 8], [5, 3, 2]]
    assert lengths(micro_batches(rows, 1, concatenate=False)) == [[9], [8], [5], [3], [2]]  # too long: alone
    assert lengths(micro_batches(rows, 10**6, concatenate=False)) == [[9, 8, 5, 3, 2]]
    # every row exactly once
    assert sorted(r.sample_indices[0] for g in micro_batches(rows, 16, False) for r in g) == [0, 1, 2, 3, 4]


def test_stacked_micro_batches_split_where_padding_costs_more_than_a_forward():
    lengths = lambda groups: [[row.num_tokens for row in group] for group in groups]  # noqa: E731
    # [100, 60] stacked pads 40 positions: cheaper than a second forward of 64, dearer than one of 32
    assert lengths(micro_batches(rows_of([60, 100]), 1000, False, forward_cost=64)) == [[100, 60]]
    assert lengths(micro_batches(rows_of([60, 100]), 1000, False, forward_cost=32)) == [[100], [60]]
    # the cheapest grouping, positions + 64 per forward, over rows 100 90 90 50 50 (380 positions without padding):
    # all in one 500 + 64 = 564 (what taking each row whose padding is under 64 would give), 100 90 90 | 50 50
    # 300 + 100 + 128 = 528, 100 | 90 90 | 50 50 380 + 192 = 572
    rows = rows_of([50, 90, 100, 50, 90])
    assert lengths(micro_batches(rows, 1000, False, forward_cost=64)) == [[100, 90, 90], [50, 50]]
    # a budget of 200: 100 90 | 90 | 50 50 costs 390 + 192 = 582, 100 | 90 90 | 50 50 572
    assert lengths(micro_batches(rows, 200, False, forward_cost=64)) == [[100], [90, 90], [50, 50]]
    # a forward that costs next to nothing: no padding, in as few forwards as that allows (383); concatenated rows
    # pad nothing and ignore the cost
    assert lengths(micro_batches(rows, 1000, False, forward_cost=1)) == [[100], [90, 90], [50, 50]]
    assert lengths(micro_batches(rows, 1000, True, forward_cost=1)) == [[100, 90, 90, 50, 50]]


def test_micro_batches_drop_padding_rows_unless_a_rank_has_nothing_else():
    shards = shard_rows(rows_of([9, 3, 7, 2, 8, 8, 1, 4, 6, 5, 2]), world_size=4)  # 3 rows each, one padding
    assert any(row.is_padding for row in shards[3])
    real = [row for row in shards[3] if not row.is_padding]
    # a padding row is dropped where real rows keep the forward going (it would be padded for nothing)
    assert [row for group in micro_batches(shards[3], 100, False) for row in group] == real
    only_padding = [padding_row(), padding_row()]
    assert micro_batches(only_padding, 2, False) == [[only_padding[0]]]  # still one forward
    assert micro_batches([], 2, False) == []
    with pytest.raises(ValueError, match="budget"):
        micro_batches(only_padding, 0, False)


def test_row_capacity_is_seq_len_for_varlen_kernels_and_the_longest_sample_otherwise():
    assert row_capacity([5, 12, 7], seq_len=64, varlen=True) == 64
    assert row_capacity([5, 12, 7], seq_len=64, varlen=False) == 12
    assert row_capacity([5, 80], seq_len=64, varlen=False) == 64  # too long: packing reports the sample
    assert row_capacity([], seq_len=64, varlen=False) == 64
    assert packs_across_samples("flash_attention_2", cp=1) and packs_across_samples("sdpa", cp=2)
    assert not packs_across_samples("sdpa", cp=1) and not packs_across_samples("eager", cp=1)


def shared_sample(tokens: list[int], first_trained: int, advantage: float = 1.0) -> TrainingSample:
    n = len(tokens)
    return TrainingSample(
        token_ids=tokens,
        loss_mask=[t >= first_trained for t in range(n)],
        inference_logprobs=[-0.5 if t >= first_trained else 0.0 for t in range(n)],
        advantages=[advantage] * n,
    )


def test_samples_of_one_prompt_share_it_by_hand():
    # A and B: prompt [1, 2, 3], trained from index 3. They share [1, 2]; each keeps the prompt's last token 3,
    # whose logits predict its first trained token. So does C, whose prompt ends in 4. D has the same tokens as B
    # but is trained from index 2; E's prompt starts otherwise.
    a = shared_sample([1, 2, 3, 10, 11], 3, advantage=1.0)
    b = shared_sample([1, 2, 3, 20], 3, advantage=-1.0)
    c = shared_sample([1, 2, 4, 30], 3)
    d = shared_sample([1, 2, 3, 40], 2)
    e = shared_sample([7, 2, 3, 50], 3)
    units = layout_units([a, b, c, d, e], max_length=64, attention_cost=0.0)
    assert [(u.samples, u.prompt, u.length) for u in units] == [
        ((0, 1, 2), 2, 2 + 3 + 2 + 2),
        ((3,), 0, 4),
        ((4,), 0, 4),
    ]
    assert [(u.samples, u.prompt) for u in layout_units([a, b, c, d, e], 64, attention_cost=None)] == [
        ((i,), 0) for i in range(5)
    ]
    units = layout_units([a, b], max_length=64, attention_cost=0.0)
    (row,) = pack_units([a, b], units[:1], capacity=7)
    assert row.input_ids.tolist() == [1, 2, 3, 10, 11, 3, 20]
    assert row.position_ids.tolist() == [0, 1, 2, 3, 4, 2, 3]  # each continuation goes on from the prompt's end
    assert row.loss_mask.tolist() == [False, False, False, True, True, False, True]
    assert row.sample_ids.tolist() == [0, 0, 0, 0, 0, 1, 1]  # the prompt carries A's id: it holds no loss token
    assert row.advantages.tolist() == [1.0, 1.0, 1.0, 1.0, 1.0, -1.0, -1.0]
    assert row.inference_logprobs.tolist() == [0.0, 0.0, 0.0, -0.5, -0.5, 0.0, -0.5]
    assert row.num_samples == 2 and row.sample_indices == [0, 1] and row.num_loss_tokens == 3


def test_a_group_longer_than_a_row_is_split_and_repeats_its_prompt():
    group = [shared_sample([5, 6, 7, 8] + [9] * n, 4) for n in (4, 4, 4)]  # prompt [5, 6, 7] shared, then 5 each
    units = layout_units(group, max_length=14, attention_cost=0.0)
    assert [(u.samples, u.prompt, u.length) for u in units] == [((0, 1), 3, 3 + 5 + 5), ((2,), 0, 8)]
    assert sorted(i for row in pack_units(group, units, 14) for i in row.sample_indices) == [0, 1, 2]
    # no trained token, or one right after the first token: nothing to share
    lone = [
        shared_sample([1, 2, 3], 3),
        shared_sample([1, 2, 3], 3),
        shared_sample([1, 2], 1),
        shared_sample([1, 2], 1),
    ]
    assert [u.prompt for u in layout_units(lone, 64, attention_cost=0.0)] == [0, 0, 0, 0]


def test_a_group_shares_its_prompt_only_where_that_costs_less():
    # two 10-token samples with the prompt [1, 2, 3, 4] (trained from index 4): shared, one masked unit of 3 + 2 x 7 =
    # 17 positions; alone, two causal ones of 10. At a cost of a per score entry (in positions), sharing costs
    # 17 + 17² a and alone 2 x (10 + 10² a / 2): sharing is cheaper exactly while 189 a < 3, i.e. a < 0.01587
    group = [shared_sample([1, 2, 3, 4] + [5 + k] * 6, 4) for k in range(2)]
    assert unit_cost(Unit((0, 1), 3, 17), 0.015) == pytest.approx(17 + 289 * 0.015)
    assert unit_cost(Unit((0,), 0, 10), 0.015) == pytest.approx(10 + 50 * 0.015)
    assert [(u.samples, u.prompt, u.length) for u in layout_units(group, 64, attention_cost=0.015)] == [((0, 1), 3, 17)]
    assert [(u.samples, u.prompt, u.length) for u in layout_units(group, 64, attention_cost=0.016)] == [
        ((0,), 0, 10),
        ((1,), 0, 10),
    ]
    # a per-entry cost by hand: h 4, 2 heads of 2, kv 2, MLP 8, one layer, vocab 10. Weights in the layers: q, k, v,
    # o 4 x (4 x 4) = 64, MLP 3 x 4 x 8 = 96: 160 (the head's 40 left out). An entry: 12 L H d = 48 FLOPs; a position
    # in the layers 6 x 160 = 960
    tiny = SimpleNamespace(
        hidden_size=4, num_attention_heads=2, num_key_value_heads=2, head_dim=2, intermediate_size=8,
        num_hidden_layers=1, vocab_size=10,
    )  # fmt: skip
    assert attention_entry_cost(tiny) == pytest.approx(48 / 960)


@pytest.mark.parametrize(
    ("prompt", "shared"),
    [(128, False), (512, False), (896, True)],  # an H200 measured 0.79 vs 0.42 s, 0.41 vs 0.37, 0.21 vs 0.33
)
def test_groups_share_at_qwen3_scale_where_the_h200_found_it_faster(prompt, shared):
    """GRPO groups of 8 samples of 1,024 tokens, the 16k-token shapes `docs/gpu.md` measured on an H200, shared or
    alone (`bench_trainer_overhead.py`): at Qwen3-0.6B's entry cost the layout is the one that ran faster there."""
    qwen3 = SimpleNamespace(
        hidden_size=1024, num_attention_heads=16, num_key_value_heads=8, head_dim=128, intermediate_size=3072,
        num_hidden_layers=28, vocab_size=151936,
    )  # fmt: skip
    cost = attention_entry_cost(qwen3)
    assert 1 / cost == pytest.approx(3840)  # 2 L H d = 114,688 over 28 x 15,728,640 weights in the layers
    group = [shared_sample(list(range(prompt)) + [1000 + k] * (1024 - prompt), prompt) for k in range(8)]
    units = layout_units(group, 16384, cost)
    assert [u.prompt for u in units] == ([prompt - 1] if shared else [0] * 8)


def test_the_demos_groups_share_their_prompt():
    """The reverse-text demo's step: 8 samples of a 108-token prompt and 15 generated tokens, at the demo model's
    entry cost (2 layers of 8 heads of 32, hidden 128, MLP 512: 1/640)."""
    demo = SimpleNamespace(
        hidden_size=128, num_attention_heads=8, num_key_value_heads=8, head_dim=32, intermediate_size=512,
        num_hidden_layers=2, vocab_size=282,
    )  # fmt: skip
    assert 1 / attention_entry_cost(demo) == pytest.approx(640)
    group = [shared_sample(list(range(108)) + [1000 + k] * 15, 108) for k in range(8)]
    assert [(u.prompt, u.length) for u in layout_units(group, 512, attention_entry_cost(demo))] == [(107, 107 + 8 * 16)]


# The loss streams (ce_weights, ref_logprobs, ref_kl_mask) ride with their tokens through every layout.


def stream_sample(tokens: list[int], first_trained: int, base: float, ce=True, ref=True) -> TrainingSample:
    """Stream values that encode (base, position): ce weight base + t, ref log-prob −(base + t), on the trained
    tail; `ce`/`ref` False leave that stream empty."""
    n = len(tokens)
    tail = [t >= first_trained for t in range(n)]
    return TrainingSample(
        token_ids=tokens,
        loss_mask=[False] * n,
        inference_logprobs=[-0.5 if m else 0.0 for m in tail],
        advantages=[0.0] * n,
        ce_weights=[base + t if m else 0.0 for t, m in enumerate(tail)] if ce else [],
        ref_logprobs=[-(base + t) if m else 0.0 for t, m in enumerate(tail)] if ref else [],
        ref_kl_mask=tail if ref else [],
    )


def expected_streams(row: PackedRow, samples: list[TrainingSample]) -> dict[str, list]:
    """Each token's stream values looked up in its own sample by (sample, position): what packing must have put there."""
    out = {"ce_weights": [], "ref_logprobs": [], "ref_kl_mask": []}
    for k, position in zip(row.sample_ids.tolist(), row.position_ids.tolist(), strict=True):
        sample = samples[row.sample_indices[k]]
        for name, zero in (("ce_weights", 0.0), ("ref_logprobs", 0.0), ("ref_kl_mask", False)):
            values = getattr(sample, name)
            out[name].append(values[position] if values else zero)
    return out


def test_streams_stay_aligned_in_rows_of_mixed_samples():
    samples = [
        stream_sample(list(range(100, 107)), 3, base=10.0),
        stream_sample(list(range(200, 205)), 2, base=20.0, ref=False),  # ce only
        stream_sample(list(range(300, 306)), 4, base=30.0, ce=False),  # ref_kl only
        make_sample(5, base=400),  # rl only: no stream
    ]
    rows = pack_samples(samples, seq_len=12)
    assert sorted(i for row in rows for i in row.sample_indices) == [0, 1, 2, 3]
    for row in rows:
        for name, values in expected_streams(row, samples).items():
            tensor = getattr(row, name)  # None: no sample of the row has the stream
            assert (tensor.tolist() if tensor is not None else [0] * row.num_tokens) == values, name
    assert any(row.ce_weights is not None and row.ref_kl_mask is not None for row in rows)  # some row mixes them
    assert sum(row.num_ce_tokens for row in rows) == 4 + 3  # weights > 0: sample 0's tail of 4, sample 1's of 3
    assert sum(row.num_ref_kl_tokens for row in rows) == 4 + 2
    alone = pack_samples([make_sample(5)], seq_len=12)[0]
    assert (alone.ce_weights, alone.ref_logprobs, alone.ref_kl_mask) == (None, None, None)  # GRPO: nothing more
    assert alone.num_ce_tokens == alone.num_ref_kl_tokens == 0
    assert (padding_row().ce_weights, padding_row().ref_kl_mask) == (None, None)


def test_a_shared_prompt_ends_before_the_first_token_any_stream_trains():
    # A and B: tokens [1, 2, 3, 4, ...], no loss token; A's streams start at index 3, B's ce at 3 too: they share
    # [1, 2] (the prompt less its last token) and each continuation keeps its own values. C has the same tokens as
    # A but a ref_kl token at index 1: its prompt is [1], too short to share (as a loss token there would make it).
    a = stream_sample([1, 2, 3, 4, 10], 3, base=1.0)
    b = stream_sample([1, 2, 3, 4, 20], 3, base=2.0, ref=False)
    c = stream_sample([1, 2, 3, 4, 10], 1, base=3.0, ce=False)
    units = layout_units([a, b, c], max_length=64, attention_cost=0.0)
    assert [(u.samples, u.prompt) for u in units] == [((0, 1), 2), ((2,), 0)]
    (row,) = pack_units([a, b, c], units[:1], capacity=64)
    assert row.input_ids.tolist() == [1, 2, 3, 4, 10, 3, 4, 20]
    assert row.ce_weights.tolist() == [0.0, 0.0, 0.0, 4.0, 5.0, 0.0, 5.0, 6.0]
    assert row.ref_logprobs.tolist() == [0.0, 0.0, 0.0, -4.0, -5.0, 0.0, 0.0, 0.0]  # B has no reference
    assert row.ref_kl_mask.tolist() == [False, False, False, True, True, False, False, False]
    assert row.ce_weights.tolist() == expected_streams(row, [a, b, c])["ce_weights"]


def test_collate_fills_streams_with_zeros_for_rows_and_padding_without_them():
    with_streams = pack_samples([stream_sample([5, 6, 7], 1, base=1.0)], seq_len=8)[0]  # ce [0, 2, 3]
    plain = pack_samples([make_sample(5, base=10)], seq_len=8)[0]
    batch = collate([with_streams, plain], concatenate=False)
    assert batch.ce_weights.tolist() == [[0.0, 2.0, 3.0, 0.0, 0.0], [0.0] * 5]
    assert batch.ref_logprobs.tolist() == [[0.0, -2.0, -3.0, 0.0, 0.0], [0.0] * 5]
    assert batch.ref_kl_mask.tolist() == [[False, True, True, False, False], [False] * 5]
    # the forward scores every token some component trains: loss tokens of the plain row, stream tokens of the other
    assert batch.trained_mask.tolist() == [[False, True, True, False, False], plain.loss_mask.tolist()]
    joined = collate([plain, with_streams], concatenate=True)
    assert joined.ce_weights.tolist() == [[0.0] * 5 + [0.0, 2.0, 3.0]]
    assert joined.ref_kl_mask.tolist() == [[False] * 5 + [False, True, True]]
    grpo = collate([plain, padding_row(length=2)], concatenate=False)
    assert (grpo.ce_weights, grpo.ref_logprobs, grpo.ref_kl_mask) == (None, None, None)
    assert torch.equal(grpo.trained_mask, grpo.loss_mask)
    moved = batch.to(torch.device("cpu"))
    assert torch.equal(moved.ref_logprobs, batch.ref_logprobs) and grpo.to(torch.device("cpu")).ce_weights is None


def test_context_parallel_padding_extends_the_streams():
    from prime_rl.trainer.parallel.context_parallel import pad_row

    row = pack_samples([stream_sample([5, 6, 7, 8, 9], 2, base=1.0)], seq_len=8)[0]
    padded = pad_row(row, 4)  # 5 tokens -> 8: the three pad tokens train nothing
    assert padded.ce_weights.tolist() == [0.0, 0.0, 3.0, 4.0, 5.0, 0.0, 0.0, 0.0]
    assert padded.ref_logprobs.tolist() == [0.0, 0.0, -3.0, -4.0, -5.0, 0.0, 0.0, 0.0]
    assert padded.ref_kl_mask.tolist() == [False, False, True, True, True, False, False, False]
    assert pad_row(pack_samples([make_sample(5)], 8)[0], 4).ce_weights is None
