"""KL penalty against a frozen reference (`[reference]`): the k3 estimator and its gradient by hand, how it joins the
loss (masked and normalised like the objective), the reference's logprobs inside `train_step` on the tiny model
(identical policy and reference: exactly no penalty; LoRA: the base with the adapters off), and the config."""

import copy
import math
import random

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoModelForCausalLM

from prime_rl.batch import TrainingSample
from prime_rl.config.loader import load_config
from prime_rl.models.tiny import TinyModelConfig, build_tiny_model
from prime_rl.trainer.config import LoRAConfig, LossConfig, ReferenceConfig, TrainerConfig
from prime_rl.trainer.model.build import SetupError
from prime_rl.trainer.model.logprobs import forward_logprobs, install_logprob_head
from prime_rl.trainer.model.lora import LoRAAdapters
from prime_rl.trainer.packing import collate, pack_samples
from prime_rl.trainer.parallel.distributed import World
from prime_rl.trainer.rl import step as train
from prime_rl.trainer.rl.loss import compute_loss, reference_kl
from prime_rl.trainer.rl.reference import Reference, load_reference

F64 = torch.float64
LN2 = math.log(2)
WORLD = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), mesh=None)  # no collective used


def test_k3_values_and_gradient_by_hand():
    # pi = ln 0.5, ref = ln 0.25: ref - pi = -ln 2, k3 = 1/2 + ln 2 - 1, d/dpi = 1 - 1/2
    # pi = ln 0.25, ref = ln 0.5: ref - pi = ln 2,  k3 = 2 - ln 2 - 1,   d/dpi = 1 - 2
    # pi = ref: k3 = 0, d/dpi = 0
    pi = torch.tensor([math.log(0.5), math.log(0.25), -1.3], dtype=F64, requires_grad=True)
    ref = torch.tensor([math.log(0.25), math.log(0.5), -1.3], dtype=F64, requires_grad=True)
    kl = reference_kl(pi, ref)
    assert kl.tolist() == pytest.approx([LN2 - 0.5, 1 - LN2, 0.0], abs=1e-15)
    grad_pi, grad_ref = torch.autograd.grad(kl.sum(), (pi, ref), allow_unused=True)
    assert grad_pi.tolist() == pytest.approx([0.5, -1.0, 0.0], abs=1e-15)
    assert grad_ref is None  # the reference is data


def test_k3_is_unbiased_for_samples_of_the_policy():
    # pi = (1/2, 1/4, 1/4), ref = (1/4, 1/2, 1/4): KL(pi || ref) = 1/2 ln 2 + 1/4 ln(1/2) = ln(2) / 4, and the
    # expectation of k3 under pi is exactly that (E_pi[ref / pi] = 1).
    pi = torch.tensor([0.5, 0.25, 0.25], dtype=F64)
    ref = torch.tensor([0.25, 0.5, 0.25], dtype=F64)
    expectation = (pi * reference_kl(pi.log(), ref.log())).sum().item()
    assert expectation == pytest.approx(LN2 / 4, abs=1e-15)


def loss_and_grad(pi, ref=None, beta=0.0, objective="aipo"):
    """compute_loss on: sample 0 = tokens 0..2 (token 0 prompt), sample 1 = tokens 3..4; scale 10."""
    pi = torch.tensor(pi, dtype=F64, requires_grad=True)
    kl = {} if ref is None else {"ref_logprobs": torch.tensor(ref, dtype=F64), "beta": beta}
    loss, stats = compute_loss(
        pi,
        torch.tensor([-1.0, -1.0, -0.8, -2.0, -0.1], dtype=F64),  # mu
        torch.tensor([1.0, 2.0, 2.0, -1.0, -1.0], dtype=F64),
        torch.tensor([False, True, True, True, True]),
        torch.tensor([0, 0, 0, 1, 1]),
        2,
        10.0,
        LossConfig(objective=objective, token_mask_high=4.0),
        **kl,
    )
    (grad,) = torch.autograd.grad(loss, pi)
    return loss.item(), grad.tolist(), stats


def test_penalty_joins_kept_tokens_only_normalised_like_the_loss():
    pi = [-3.0, -1.5, -0.8, -2.0, -0.3]  # log r = pi - mu: token 1 at -0.5; token 4 at -0.2
    pi[2] = -0.8 + 2.0  # token 2: r = e^2 > token_mask_high = 4: dropped
    # token 0: prompt; token 1: ref - pi = -ln 2; token 2 (dropped): a huge gap; token 3: ref = pi;
    # token 4: ref - pi = ln 2.
    ref = [5.0, -1.5 - LN2, 1.2 + 40.0, -2.0, -0.3 + LN2]
    beta = 0.3
    plain_loss, plain_grad, plain_stats = loss_and_grad(pi)
    loss, grad, stats = loss_and_grad(pi, ref, beta)
    assert plain_stats["masked_tokens"].item() == 1 and "ref_kl_sum" not in plain_stats
    # kept: tokens 1, 3, 4: beta * (ln2 - 1/2 + 0 + 1 - ln2) / 10 = beta * 0.5 / 10
    assert loss - plain_loss == pytest.approx(beta * 0.5 / 10, abs=1e-14)
    expected = [0.0, beta * 0.5 / 10, 0.0, 0.0, beta * -1.0 / 10]  # beta * (1 - e^(ref - pi)) / 10 on kept tokens
    for g, p, e in zip(grad, plain_grad, expected, strict=True):
        assert g - p == pytest.approx(e, abs=1e-14)
    # The metric counts every loss token (the dropped one too: e^40 - 41 - 1) and never the prompt.
    k3_dropped = math.exp(40.0) - 40.0 - 1
    assert stats["ref_kl_sum"].item() == pytest.approx(0.5 + k3_dropped, rel=1e-12)
    for key in plain_stats:
        assert torch.equal(stats[key], plain_stats[key]), key  # everything else untouched


@pytest.mark.parametrize("objective", ["aipo", "grpo", "gspo", "cispo"])
def test_a_reference_equal_to_the_policy_adds_exactly_nothing(objective):
    pi = [-3.0, -1.5, -0.8, -2.0, -0.3]
    plain_loss, plain_grad, _ = loss_and_grad(pi, objective=objective)
    loss, grad, stats = loss_and_grad(pi, pi, beta=0.7, objective=objective)
    assert loss == plain_loss and grad == plain_grad  # exactly: k3 and its gradient are 0.0 at ref = pi
    assert stats["ref_kl_sum"].item() == 0.0


# ----------------------------------------------------------------------------------------------------------
# The reference inside `train_step`, on the tiny model (one process, unsharded: the loop is the same code).


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(TinyModelConfig(output=tmp_path_factory.mktemp("m") / "tiny", dtype="float32"))


def samples() -> list[TrainingSample]:
    rng = random.Random(0)
    out = []
    for _ in range(6):
        prompt, completion = rng.randint(2, 10), rng.randint(3, 20)
        out.append(
            TrainingSample(
                token_ids=[rng.randrange(480) for _ in range(prompt + completion)],
                loss_mask=[False] * prompt + [True] * completion,
                inference_logprobs=[0.0] * prompt + [rng.uniform(-6.6, -5.8) for _ in range(completion)],
                advantages=[rng.choice([-1.0, 0.5, 1.0])] * (prompt + completion),
                temperature=rng.choice([1.0, 0.7]),
            )
        )
    return out


def load(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    install_logprob_head(model, chunk=16)
    return model


def step(model, config, rows, reference=None, adapters=None):
    model.zero_grad(set_to_none=True)
    scale = sum(row.num_loss_tokens for row in rows)
    totals = train.train_step(model, rows, {0: scale}, config, WORLD, adapters, reference)[0]
    return totals, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_train_step_with_the_policy_as_reference_is_unchanged_and_with_another_is_penalised(model_dir):
    model = load(model_dir)
    rows = pack_samples(samples(), seq_len=40)
    plain_config = TrainerConfig(model={"name": str(model_dir)}, micro_batch_tokens=80)
    config = TrainerConfig(model={"name": str(model_dir)}, micro_batch_tokens=80, reference={"beta": 0.5})
    plain, plain_grads = step(model, plain_config, rows)
    same, same_grads = step(model, config, rows, Reference(copy.deepcopy(model).eval().requires_grad_(False)))
    assert same.pop("ref_kl_sum") == 0.0  # pi == pi_ref: the same forward on the same weights, bit for bit
    assert same == plain
    assert same_grads.keys() == plain_grads.keys()
    assert all(torch.equal(same_grads[n], plain_grads[n]) for n in plain_grads)

    other = copy.deepcopy(model).eval().requires_grad_(False)
    with torch.no_grad():
        other.model.norm.weight.mul_(1.5)  # sharper distributions: another policy
    penalised, grads = step(model, config, rows, Reference(other))
    assert all(p.grad is None for p in other.parameters())  # frozen
    assert penalised["masked_tokens"] == 0  # every loss token kept: the penalty covers the metric's tokens
    assert penalised["ref_kl_sum"] > 0
    # beta * sum k3 / loss tokens joins the loss: the difference of two fp32 losses (sums of ~100 terms of size
    # < 1, each rounded at ~6e-8; the stat is float64) is exact to ~1e-6, while a wrong beta or normalisation
    # (e.g. per micro-batch) would be off by a sizeable fraction of the 6e-3 difference.
    scale = sum(row.num_loss_tokens for row in rows)
    assert penalised["loss"] - plain["loss"] == pytest.approx(0.5 * penalised["ref_kl_sum"] / scale, abs=1e-6)
    assert any(not torch.equal(grads[n], plain_grads[n]) for n in plain_grads)
    metrics = train.rl_metrics(penalised, {"loss_tokens": scale, "policy_version/min": 0, "policy_version/max": 0}, {})
    assert metrics["ref_kl"] == penalised["ref_kl_sum"] / scale
    assert "ref_kl" not in train.rl_metrics(plain, {"loss_tokens": scale, "policy_version/min": 0,
                                                    "policy_version/max": 0}, {})  # fmt: skip


def test_with_lora_the_reference_is_the_base_with_the_adapters_off(model_dir):
    model = load(model_dir)
    model.requires_grad_(False)  # as `build_model` freezes the base with `model.lora`
    adapters = LoRAAdapters(model, LoRAConfig(rank=4), slots=1, device=torch.device("cpu"))
    adapters.reset_slot(0, seed=0)
    with torch.no_grad():  # a trained adapter: it changes the logits
        for key in adapters.B:
            adapters.B[key][0].normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
    rows = pack_samples(samples(), seq_len=40)
    batch = collate(rows[:1], concatenate=False)
    reference = Reference(model, adapters)
    base = forward_logprobs(load(model_dir), batch)[0].view(-1)  # a model without adapter hooks
    assert torch.equal(reference.logprobs(batch, WORLD), base)
    with adapters.tokens(batch.slots, 0):
        assert not torch.equal(forward_logprobs(model, batch)[0].view(-1), base)  # the adapter is on by default

    config = TrainerConfig(model={"name": str(model_dir), "lora": {"rank": 4}}, reference={})
    totals, grads = step(model, config, rows, reference, adapters)
    assert totals["ref_kl_sum"] > 0
    assert grads == {}  # the frozen base: only the adapter has gradients
    assert all(p.grad is not None for p in adapters.slot_params(0))


# ----------------------------------------------------------------------------------------------------------
# Config.


def test_config_defaults_and_bounds(tmp_path):
    assert TrainerConfig().reference is None
    assert all(field.description for field in ReferenceConfig.model_fields.values())
    argv = ["--output-dir", str(tmp_path), "--reference"]
    config, _ = load_config(TrainerConfig, "trainer", argv)
    assert config.reference.beta == 0.04 and config.reference.model is None
    config, _ = load_config(TrainerConfig, "trainer", argv[:2] + ["--reference.beta", "0.1", "--reference.model", "m"])
    assert (config.reference.beta, config.reference.model) == (0.1, "m")
    for beta in (0.0, -0.1):
        with pytest.raises(ValidationError, match="reference.beta"):
            TrainerConfig(reference={"beta": beta})
    with pytest.raises(ValidationError, match="reference.bta"):
        TrainerConfig(reference={"bta": 0.1})  # unknown keys are named


def test_a_reference_that_cannot_be_loaded_or_has_another_vocabulary_is_named(model_dir, tmp_path):
    policy = load(model_dir)
    missing = TrainerConfig(model={"name": str(model_dir)}, reference={"model": str(tmp_path / "nowhere")})
    with pytest.raises(SetupError, match=r"^reference\.model '.*nowhere'"):
        load_reference(missing, WORLD, policy)
    other = build_tiny_model(TinyModelConfig(output=tmp_path / "other", vocab_size=640))
    config = TrainerConfig(model={"name": str(model_dir)}, reference={"model": str(other)})
    with pytest.raises(SetupError, match="reference.model .* has a vocabulary of 640 tokens, the policy .* 512"):
        load_reference(config, WORLD, policy)
    assert load_reference(TrainerConfig(model={"name": str(model_dir)}), WORLD, policy) is None
