"""One training step's forward/backward (`train_step` of the RL trainer and of sft) on the tiny model: several
rows per forward (micro-batches) give the loss, statistics and gradient of one row per forward, with a LoRA adapter
too (whose parameters alone get gradients)."""

import random
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from prime_rl.batch import TrainingSample
from prime_rl.models.tiny import TinyModelConfig, build_tiny_model
from prime_rl.trainer.config import LoRAConfig, TrainerConfig
from prime_rl.trainer.model.logprobs import install_logprob_head
from prime_rl.trainer.model.lora import LoRAAdapters
from prime_rl.trainer.packing import pack_samples, padding_row, row_capacity
from prime_rl.trainer.parallel.distributed import World
from prime_rl.trainer.perf import PhaseTimer
from prime_rl.trainer.rl import step as train
from prime_rl.trainer.sft import train as sft
from prime_rl.trainer.sft.config import SFTConfig


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(TinyModelConfig(output=tmp_path_factory.mktemp("m") / "tiny", dtype="float32"))


@pytest.fixture(scope="module")
def model(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    install_logprob_head(model, chunk=16)
    return model


def samples(seed: int = 0) -> list[TrainingSample]:
    rng = random.Random(seed)
    out = []
    for _ in range(9):
        prompt, completion = rng.randint(2, 10), rng.randint(3, 20)
        n = prompt + completion
        out.append(
            TrainingSample(
                token_ids=[rng.randrange(480) for _ in range(n)],
                loss_mask=[False] * prompt + [True] * completion,
                inference_logprobs=[0.0] * prompt + [rng.uniform(-6.6, -5.8) for _ in range(completion)],
                advantages=[rng.choice([-1.0, 0.5, 1.0])] * n,
                temperature=rng.choice([1.0, 0.7]),
            )
        )
    return out


def run_step(step_fn, model, config, rows, loss_scale):
    model.zero_grad(set_to_none=True)
    world = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), mesh=None)  # no collective used
    if step_fn is train.train_step:  # per run slot (one here)
        totals = step_fn(model, rows, {0: loss_scale}, config, world)[0]
    else:
        totals = step_fn(model, rows, loss_scale, config, world)
    return totals, {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("loop", ["rl", "sft"])
def test_micro_batches_give_the_gradient_of_one_row_per_forward(model, model_dir, loop):
    rows = pack_samples(samples(), seq_len=40)
    assert len({row.num_tokens for row in rows}) > 1  # rows of different lengths: micro-batches get padded
    rows.append(padding_row())  # as `shard_rows` adds them
    loss_scale = sum(row.num_loss_tokens for row in rows)
    if loop == "rl":
        step_fn = train.train_step
        configs = [TrainerConfig(model={"name": str(model_dir)}, micro_batch_tokens=k) for k in (1, 120)]
    else:
        step_fn = sft.train_step
        configs = [SFTConfig(model={"name": str(model_dir)}, micro_batch_tokens=k) for k in (1, 120)]

    # a budget of 1 position runs each row alone; 120 fits three rows of <= 40 tokens per forward
    one, one_grads = run_step(step_fn, model, configs[0], rows, loss_scale)
    three, three_grads = run_step(step_fn, model, configs[1], rows, loss_scale)

    assert three["processed_tokens"] > one["processed_tokens"]  # the padding, counted as work done
    assert three["padding_tokens"] > one["padding_tokens"] == 0  # ... and as padding
    assert three["processed_tokens"] - three["padding_tokens"] == one["processed_tokens"]
    for key in one:
        if key not in ("processed_tokens", "padding_tokens"):
            # sums of the same per-token fp32 values in another order (counts are exact)
            assert three[key] == pytest.approx(one[key], rel=1e-5, abs=1e-6), key
    assert one["loss"] != 0
    for name, grad in one_grads.items():
        # A reordered fp32 sum is off by a few ulp of its largest terms, so the tolerance scales with the
        # tensor's largest gradient; a padding token that leaked into the loss or the attention of a real
        # token would move entries by a sizeable fraction of it.
        scale = grad.abs().max().item()
        assert scale > 0, name
        torch.testing.assert_close(
            three_grads[name], grad, rtol=0, atol=1e-5 * scale, msg=lambda m, name=name: f"{name}: {m}"
        )


def test_with_an_adapter_only_it_gets_gradients_and_micro_batches_give_the_same_ones(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    install_logprob_head(model, chunk=16)
    model.requires_grad_(False)  # as `build_model` freezes the base with `model.lora`
    adapters = LoRAAdapters(model, LoRAConfig(rank=4), slots=1, device=torch.device("cpu"))
    adapters.reset_slot(0, seed=0)
    with torch.no_grad():  # B = 0 would leave A without gradient: as after some training
        for key in adapters.B:
            adapters.B[key][0].normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
    rows = pack_samples(samples(), seq_len=40)
    rows.append(padding_row())  # slot -1: runs through slot 0's adapter, with no loss
    loss_scale = sum(row.num_loss_tokens for row in rows)
    world = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), mesh=None)
    grads = []
    for k in (1, 120):  # one row per forward; three rows of <= 40 tokens per forward
        config = SFTConfig(model={"name": str(model_dir), "lora": {"rank": 4}}, micro_batch_tokens=k)
        for p in adapters.slot_params(0):
            p.grad = None
        sft.train_step(model, rows, loss_scale, config, world, adapters)
        assert all(p.grad is None for p in model.parameters())  # the frozen base
        grads.append([p.grad.clone() for p in adapters.slot_params(0)])
    for one, three in zip(*grads, strict=True):
        scale = one.abs().max().item()
        assert scale > 0
        # reordered fp32 sums, as in the test above
        torch.testing.assert_close(three, one, rtol=0, atol=1e-5 * scale)


def test_rows_as_long_as_the_longest_sample_give_the_gradient_of_full_rows(model, model_dir):
    """sdpa computes a row's whole L x L score matrix, so the trainer packs into rows only as long as the step's
    longest sample (`row_capacity`) instead of `seq_len`; the samples, and so loss and gradient, stay the same."""
    batch = samples()
    longest = max(len(s.token_ids) for s in batch)
    capacity = row_capacity([len(s.token_ids) for s in batch], seq_len=40, varlen=False)
    assert capacity == longest < 40
    assert row_capacity([len(s.token_ids) for s in batch], seq_len=40, varlen=True) == 40
    full, short = pack_samples(batch, seq_len=40), pack_samples(batch, seq_len=capacity)
    assert len(short) > len(full)
    loss_scale = sum(len(s.token_ids) for s in batch)
    config = TrainerConfig(model={"name": str(model_dir)}, micro_batch_tokens=4096)  # each layout in one forward
    full_totals, full_grads = run_step(train.train_step, model, config, full, loss_scale)
    short_totals, short_grads = run_step(train.train_step, model, config, short, loss_scale)
    # [B, L] positions computed: each layout pads to its longest row; attention scores B x L², fewer when short
    assert (
        short_totals["processed_tokens"] == len(short) * longest and full_totals["processed_tokens"] == len(full) * 40
    )
    assert len(short) * longest**2 < len(full) * 40**2
    for key in ("loss", "entropy_sum", "mismatch_kl_sum"):
        assert short_totals[key] == pytest.approx(full_totals[key], rel=1e-5, abs=1e-6), key
    for name, grad in full_grads.items():
        scale = grad.abs().max().item()  # reordered fp32 sums, as in the tests above
        torch.testing.assert_close(
            short_grads[name], grad, rtol=0, atol=1e-5 * scale, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_the_phase_timer_splits_a_step_into_forward_and_backward(model, model_dir):
    timer = PhaseTimer(torch.device("cpu"))
    config = TrainerConfig(model={"name": str(model_dir)}, micro_batch_tokens=40)
    rows = pack_samples(samples(), seq_len=40)
    world = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), mesh=None)
    t0 = time.perf_counter()
    train.train_step(model, rows, {0: 100.0}, config, world, timer=timer)
    elapsed = time.perf_counter() - t0
    times = timer.pop()
    assert set(times) == {"time_forward", "time_backward"}
    assert 0 < times["time_forward"] and 0 < times["time_backward"]
    assert times["time_forward"] + times["time_backward"] <= elapsed  # parts of the step, never more than it
    assert timer.pop() == {}  # popped: the next step starts from zero


def grouped_samples(seed: int = 0) -> list[TrainingSample]:
    """Three prompts x 4 rollouts as GRPO makes them, one with a second trained turn after an environment's tokens,
    and one sample alone."""
    rng = random.Random(seed)
    out = []
    for n_prompt in (6, 9, 4):
        prompt = [rng.randrange(480) for _ in range(n_prompt)]
        for _ in range(4):
            turns = [(rng.randint(2, 8), True)] + (
                [(3, False), (rng.randint(2, 5), True)] if rng.random() < 0.5 else []
            )
            tokens, mask = list(prompt), [False] * n_prompt
            for n, trained in turns:
                tokens += [rng.randrange(480) for _ in range(n)]
                mask += [trained] * n
            out.append(
                TrainingSample(
                    token_ids=tokens,
                    loss_mask=mask,
                    inference_logprobs=[rng.uniform(-6.6, -5.8) if m else 0.0 for m in mask],
                    advantages=[rng.choice([-1.0, 0.5, 1.0])] * len(tokens),
                    temperature=rng.choice([1.0, 0.7]),
                )
            )
    return out + samples(seed)[:1]


@pytest.mark.parametrize("loop", ["rl", "sft"])
def test_samples_sharing_their_prompt_get_the_gradient_of_the_samples_alone(model, model_dir, loop):
    """`layout_units` lays a group's prompt out once: fewer positions computed, the same loss, statistics and
    gradient as each sample in full."""
    batch = grouped_samples()
    alone, shared = pack_samples(batch, seq_len=64), pack_samples(batch, seq_len=64, attention_cost=0.0)
    # each group of 4 computes its prompt (less the last token, which each continuation keeps) once instead of 4x
    saved = sum(3 * (n - 1) for n in (6, 9, 4))
    assert sum(r.num_tokens for r in alone) - sum(r.num_tokens for r in shared) == saved
    loss_scale = sum(row.num_loss_tokens for row in alone)
    if loop == "rl":
        step_fn, config = train.train_step, TrainerConfig(model={"name": str(model_dir)}, micro_batch_tokens=4096)
    else:
        step_fn, config = sft.train_step, SFTConfig(model={"name": str(model_dir)}, micro_batch_tokens=4096)
    alone_totals, alone_grads = run_step(step_fn, model, config, alone, loss_scale)
    shared_totals, shared_grads = run_step(step_fn, model, config, shared, loss_scale)
    assert alone_totals["loss"] != 0
    for key in alone_totals:
        if key not in ("processed_tokens", "padding_tokens"):
            # sums of the same per-token fp32 values computed in other row layouts
            assert shared_totals[key] == pytest.approx(alone_totals[key], rel=1e-5, abs=1e-6), key
    for name, grad in alone_grads.items():
        # the prompt's gradient is summed over its continuations in one pass instead of per sample: a reordered
        # fp32 sum, as in the tests above; a continuation seeing another would move entries by far more
        scale = grad.abs().max().item()
        assert scale > 0, name
        torch.testing.assert_close(
            shared_grads[name], grad, rtol=0, atol=1e-5 * scale, msg=lambda m, n=name: f"{n}: {m}"
        )
