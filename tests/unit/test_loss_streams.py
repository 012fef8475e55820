"""The loss streams beside the policy gradient: cross-entropy (`ce_weights`) and the reverse KL to a reference
(`ref_kl_mask` + `ref_logprobs`), each normalised by its own count in the whole step.

Notation: π the trainer's log-prob of a token, μ the sampler's (`inference_logprobs`), ref the reference's,
ρ = exp(π − sg(μ)). ce: L_t = −w_t·π_t. ref_kl: L_t = ρ_t·sg(π_t − ref_t), whose gradient on-policy is
(π_t − ref_t)·∇π_t. Step loss: L_rl / N_rl + L_ce / N_ce + L_ref / N_ref.
"""

import math
import random

import msgspec
import pytest
import torch
from test_trainer_step import model, model_dir  # noqa: F401 (the tiny model with its log-prob head: fixtures)
from transformers import AutoModelForCausalLM

from prime_rl.batch import TrainingBatch, TrainingSample, batch_path, write_batch
from prime_rl.trainer.ckpt import Progress
from prime_rl.trainer.config import LossConfig, TrainerConfig
from prime_rl.trainer.packing import pack_samples
from prime_rl.trainer.parallel.distributed import World
from prime_rl.trainer.rl.loss import ce_loss, compute_loss, ref_kl_token_loss
from prime_rl.trainer.rl.runs import Run
from prime_rl.trainer.rl.step import stream_metrics, stream_scales, train_step
from prime_rl.trainer.rl.train_lora import take_batches

F64 = torch.float64
LN2 = math.log(2)


def ref_kl_step(logits, tokens, mu, ref, loss_mask, ref_mask, ref_scale):
    """compute_loss on the log-probs of `tokens` under `logits` (temperature 1), every token one sample;
    returns (loss, d loss / d logits, stats)."""
    logits = torch.tensor(logits, dtype=F64, requires_grad=True)
    pi = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]
    n = len(tokens)
    loss, stats = compute_loss(
        pi, torch.tensor(mu, dtype=F64), torch.zeros(n, dtype=F64), torch.tensor(loss_mask), torch.arange(n), n,
        1.0, LossConfig(), ref_kl_mask=torch.tensor(ref_mask), ref_kl_logprobs=torch.tensor(ref, dtype=F64),
        ref_kl_scale=ref_scale,
    )  # fmt: skip
    (grad,) = torch.autograd.grad(loss, logits)
    return loss.item(), grad, stats


def test_ref_kl_value_and_gradient_by_hand_on_two_tokens():
    # Vocab 3. Token 1: logits [ln 2, 0, 0] -> p = [1/2, 1/4, 1/4], sampled token 0: π1 = ln 1/2.
    #          Token 2: logits [0, 0, ln 2] -> p = [1/4, 1/4, 1/2], sampled token 1: π2 = ln 1/4.
    # Token 1 was sampled off-policy, μ1 = ln 1/4: ρ1 = (1/2)/(1/4) = 2; token 2 on-policy, μ2 = π2: ρ2 = 1.
    # ref1 = ln 1/4: π1 − ref1 = ln 2; ref2 = ln 1/2: π2 − ref2 = −ln 2.
    # L1 = 2·ln 2, L2 = 1·(−ln 2); N_ref = 2: loss = (2 ln 2 − ln 2) / 2 = ln 2 / 2.
    # dL_t/dz_t = ρ_t·(π_t − ref_t)·(onehot(x_t) − p_t) (d π / d z = onehot − p at temperature 1), over N_ref:
    #   z1: 2·ln 2·([1, 0, 0] − [1/2, 1/4, 1/4]) / 2 = ln 2·[1/2, −1/4, −1/4]
    #   z2: −ln 2·([0, 1, 0] − [1/4, 1/4, 1/2]) / 2 = ln 2·[1/8, −3/8, 1/4]
    loss, grad, stats = ref_kl_step(
        [[LN2, 0.0, 0.0], [0.0, 0.0, LN2]], [0, 1], mu=[math.log(0.25), math.log(0.25)],
        ref=[math.log(0.25), math.log(0.5)], loss_mask=[False, False], ref_mask=[True, True], ref_scale=2.0,
    )  # fmt: skip
    assert loss == pytest.approx(LN2 / 2, abs=1e-15)
    expected = torch.tensor([[1 / 2, -1 / 4, -1 / 4], [1 / 8, -3 / 8, 1 / 4]], dtype=F64) * LN2
    torch.testing.assert_close(grad, expected, rtol=0, atol=1e-15)
    # Σ (π − ref) over ref_kl tokens = ln 2 − ln 2 = 0; no rl token, so none of the rl statistics counts
    assert stats["ref_kl_stream_sum"].item() == pytest.approx(0.0, abs=1e-15)
    assert stats["ref_kl_masked_tokens"].item() == 0 and stats["loss_tokens"].item() == 0


def test_ref_kl_token_loss_on_policy_has_the_gradient_of_the_kl_reward():
    # On-policy (μ = π): value π − ref, gradient (π − ref)·∇π = (−0.5 − (−1.5))·1 = 1.0 (per unit of π).
    pi = torch.tensor([-0.5], dtype=F64, requires_grad=True)
    loss = ref_kl_token_loss(pi, torch.tensor([-0.5], dtype=F64), torch.tensor([-1.5], dtype=F64))
    assert loss.item() == 1.0
    (grad,) = torch.autograd.grad(loss.sum(), pi)
    assert grad.item() == 1.0


def test_ref_kl_tokens_get_the_ratio_masks_of_rl_tokens():
    # Sample 0: rl token (r = 1) and a ref_kl token with r = e^3 ≈ 20 > token_mask_high = 8: dropped, no gradient,
    # counted in N_ref (the caller's scale) and in ref_kl_masked_tokens, not in the rl masked_tokens.
    # Sample 1: a ref_kl token with r = 1: kept. Value: ρ·(π − ref) = 1·(−1 − (−2)) = 1, over N_ref = 2: 0.5.
    pi = torch.tensor([-1.0, -1.0, -1.0], dtype=F64, requires_grad=True)
    loss, stats = compute_loss(
        pi, torch.tensor([-1.0, -4.0, -1.0], dtype=F64), torch.tensor([1.0, 0.0, 0.0], dtype=F64),
        torch.tensor([True, False, False]), torch.tensor([0, 0, 1]), 2, 1.0, LossConfig(),
        ref_kl_mask=torch.tensor([False, True, True]), ref_kl_logprobs=torch.tensor([0.0, -2.0, -2.0], dtype=F64),
        ref_kl_scale=2.0,
    )  # fmt: skip
    (grad,) = torch.autograd.grad(loss, pi)
    # rl (aipo, A = 1, r = 1): L = −π = 1 over N_rl = 1; d/dπ0 = −1. ref_kl token 2: d/dπ = ρ·(π − ref) / 2 = 0.5.
    assert loss.item() == 1.0 + 0.5
    assert grad.tolist() == [-1.0, 0.0, 0.5]
    assert stats["ref_kl_masked_tokens"].item() == 1 and stats["masked_tokens"].item() == 0
    assert stats["masked_high"].item() == 0 and stats["loss_tokens"].item() == 1


def test_ce_weights_by_hand():
    # w = [0, 2, 0.5], π = [−1, −0.5, −2]: −w·π = [0, 1, 1]; N_ce = 2 (tokens with w > 0): loss = 2 / 2 = 1.
    # d/dπ = −w / N_ce = [0, −1, −0.25]; ce_loss_sum (undivided) = 2, so the metric ce_loss = 2 / N_ce = 1.
    pi = torch.tensor([-1.0, -0.5, -2.0], dtype=F64, requires_grad=True)
    loss, stats = ce_loss(pi, torch.tensor([0.0, 2.0, 0.5], dtype=F64), 2.0)
    (grad,) = torch.autograd.grad(loss, pi)
    assert loss.item() == 1.0 and stats["ce_loss_sum"].item() == 2.0
    assert grad.tolist() == [0.0, -1.0, -0.25]


def test_micro_batches_mixing_components_sum_to_the_whole_step_formula():
    # Micro-batch 1: rl only, π = [−1, −2], A = [1, −1], on-policy (aipo, r = 1): L_rl = −(1·−1) − (−1·−2) = −1.
    # Micro-batch 2, π = [−0.5, −0.5]: ce on token 0 (w = 3): L_ce = −3·(−0.5) = 1.5; ref_kl on token 1
    # (on-policy, ρ = 1, π − ref = −0.5 − (−1) = 0.5): L_ref = 0.5. N_rl = 2, N_ce = 1, N_ref = 1.
    # Whole step: −1/2 + 1.5/1 + 0.5/1 = 1.5. Gradients: mb1 d/dπ = −A / 2 = [−0.5, 0.5];
    # mb2 d/dπ = [−w / N_ce, (π − ref) / N_ref] = [−3, 0.5].
    config, scales = LossConfig(), {"rl": 2.0, "ce": 1.0, "ref_kl": 1.0}
    pi1 = torch.tensor([-1.0, -2.0], dtype=F64, requires_grad=True)
    loss1, _ = compute_loss(
        pi1, pi1.detach().clone(), torch.tensor([1.0, -1.0], dtype=F64), torch.tensor([True, True]),
        torch.tensor([0, 0]), 1, scales["rl"], config,
    )  # fmt: skip
    pi2 = torch.tensor([-0.5, -0.5], dtype=F64, requires_grad=True)
    loss2, _ = compute_loss(
        pi2, pi2.detach().clone(), torch.zeros(2, dtype=F64), torch.tensor([False, False]), torch.tensor([0, 0]), 1,
        scales["rl"], config, ref_kl_mask=torch.tensor([False, True]),
        ref_kl_logprobs=torch.tensor([0.0, -1.0], dtype=F64), ref_kl_scale=scales["ref_kl"],
    )  # fmt: skip
    ce, _ = ce_loss(pi2, torch.tensor([3.0, 0.0], dtype=F64), scales["ce"])
    loss1.backward()
    (loss2 + ce).backward()
    assert loss1.item() + loss2.item() + ce.item() == 1.5
    assert pi1.grad.tolist() == [-0.5, 0.5] and pi2.grad.tolist() == [-3.0, 0.5]


def test_stream_scales_and_metrics_only_for_streams_the_step_has():
    info = {"loss_tokens": 10, "samples": 2, "ce_tokens": 4, "ref_kl_tokens": 0}
    assert stream_scales(info) == {"ce": 4.0}  # no ref_kl token: no ref_kl component, no division by 0
    assert stream_scales({"loss_tokens": 3}) == {}  # a loop that counts no streams (sft)
    assert stream_metrics({"ce_loss_sum": 2.0}, info) == {"ce_loss": 0.5, "ce_tokens": 4}
    both = stream_metrics(
        {"ce_loss_sum": 0.0, "ref_kl_stream_sum": -3.0, "ref_kl_masked_tokens": 1.0},
        info | {"ce_tokens": 0, "ref_kl_tokens": 6},
    )
    assert both == {"ref_kl_stream": -0.5, "ref_kl_tokens": 6, "ref_kl_masked_fraction": 1 / 6}


# Through `train_step` on the tiny model, against the formula evaluated on plain per-sample forwards.

VOCAB = 480


@pytest.fixture(scope="module")
def plain(model_dir):  # noqa: F811 (test_trainer_step's fixture)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")


def mixed_samples(seed: int = 0) -> dict[str, TrainingSample]:
    """rl only, ce only, ce + ref_kl, rl + ref_kl; μ near the tiny model's near-uniform ln(1/512) ≈ −6.24."""
    rng = random.Random(seed)

    def sample(prompt, completion, rl=False, ce=False, ref=False, temperature=1.0):
        n = prompt + completion
        tail = [False] * prompt + [True] * completion
        return TrainingSample(
            token_ids=[rng.randrange(VOCAB) for _ in range(n)],
            loss_mask=tail if rl else [False] * n,
            inference_logprobs=[rng.uniform(-6.4, -6.1) if t else 0.0 for t in tail],
            advantages=[rng.choice([-1.0, 1.0])] * n if rl else [0.0] * n,
            temperature=temperature,
            ce_weights=[rng.choice([0.0, 0.5, 1.0, 2.0]) if t else 0.0 for t in tail] if ce else [],
            ref_logprobs=[rng.uniform(-8.0, -4.0) if t else 0.0 for t in tail] if ref else [],
            ref_kl_mask=tail if ref else [],
        )

    return {
        "rl": sample(4, 7, rl=True),
        "ce": sample(3, 9, ce=True, temperature=0.7),
        "ce_ref": sample(5, 6, ce=True, ref=True),
        "rl_ref": sample(2, 8, rl=True, ref=True, temperature=0.7),
    }


def formula_loss(plain, samples: list[TrainingSample], n_rl: int, n_ce: int, n_ref: int) -> torch.Tensor:
    """L_rl / N_rl + L_ce / N_ce + L_ref / N_ref from full-vocabulary forwards of each sample alone (aipo, every
    ratio inside the masks and below delta = 2, which the test checks)."""
    loss = torch.zeros(())
    for s in samples:
        ids = torch.tensor([s.token_ids])
        logits = plain(input_ids=ids).logits[0].float() / s.temperature
        pi = torch.cat([torch.zeros(1), torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None])[:, 0]])
        mu = torch.tensor(s.inference_logprobs)
        ratio = (pi - mu).detach().exp()
        for t in range(len(s.token_ids)):
            if s.loss_mask[t] or (s.ref_kl_mask and s.ref_kl_mask[t]):
                assert 0.125 < ratio[t] < 2.0  # kept, and aipo's weight min(r, 2) = r
            if s.loss_mask[t]:
                loss = loss - ratio[t] * s.advantages[t] * pi[t] / n_rl
            if s.ce_weights and s.ce_weights[t] > 0:
                loss = loss - s.ce_weights[t] * pi[t] / n_ce
            if s.ref_kl_mask and s.ref_kl_mask[t]:
                loss = loss + (pi[t] - mu[t]).exp() * (pi[t] - s.ref_logprobs[t]).detach() / n_ref
    return loss


def step_grads(policy, rows, info, micro_batch_tokens, directory):
    policy.zero_grad(set_to_none=True)
    world = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), mesh=None)
    config = TrainerConfig(model={"name": str(directory)}, micro_batch_tokens=micro_batch_tokens)
    totals = train_step(policy, rows, {0: max(info["loss_tokens"], 1)}, config, world,
                        stream_scales=stream_scales(info))[0]  # fmt: skip
    return totals, {name: p.grad.clone() for name, p in policy.named_parameters()}


def assert_grads_close(actual: dict, expected: dict) -> None:
    for name, grad in expected.items():
        scale = grad.abs().max().item()
        assert scale > 0, name
        torch.testing.assert_close(actual[name], grad, rtol=0, atol=2e-5 * scale, msg=lambda m, n=name: f"{n}: {m}")


def counts(samples: list[TrainingSample]) -> dict:
    return {
        "loss_tokens": sum(sum(s.loss_mask) for s in samples),
        "ce_tokens": sum(sum(w > 0 for w in s.ce_weights) for s in samples),
        "ref_kl_tokens": sum(sum(s.ref_kl_mask) for s in samples),
    }


def test_train_step_normalises_each_component_by_its_own_step_count(model, plain, model_dir):  # noqa: F811
    s = mixed_samples()
    # Two rows: rl only, and ce + ref_kl with rl + ref_kl (N from all rows, as `next_rows` counts them).
    rows = pack_samples([s["rl"]], 64) + pack_samples([s["ce"], s["ce_ref"], s["rl_ref"]], 64)
    assert rows[0].ce_weights is None and rows[0].ref_kl_mask is None  # an rl-only row carries no stream
    info = counts(list(s.values()))
    assert [sum(row.num_ce_tokens for row in rows), sum(row.num_ref_kl_tokens for row in rows)] == [
        info["ce_tokens"], info["ref_kl_tokens"],
    ]  # fmt: skip
    apart, apart_grads = step_grads(model, rows, info, 1, model_dir)  # one forward per row
    together, together_grads = step_grads(model, rows, info, 4096, model_dir)  # one padded [2, L] forward

    plain.zero_grad(set_to_none=True)
    expected = formula_loss(plain, list(s.values()), info["loss_tokens"], info["ce_tokens"], info["ref_kl_tokens"])
    expected.backward()
    expected_grads = {name: p.grad for name, p in plain.named_parameters()}

    assert apart["loss"] == pytest.approx(expected.item(), rel=1e-5)
    assert together["loss"] == pytest.approx(expected.item(), rel=1e-5)
    assert_grads_close(apart_grads, expected_grads)
    assert_grads_close(together_grads, expected_grads)
    metrics = stream_metrics(apart, info)
    assert metrics["ce_tokens"] == info["ce_tokens"] and metrics["ref_kl_tokens"] == info["ref_kl_tokens"]
    assert metrics["ref_kl_masked_fraction"] == 0.0 and apart["masked_tokens"] == 0


def test_a_component_absent_from_the_step_contributes_nothing(model, plain, model_dir):  # noqa: F811
    s = mixed_samples(seed=1)
    # rl + ce, no ref_kl token: no ref_kl statistic, loss = L_rl / N_rl + L_ce / N_ce.
    samples = [s["rl"], s["ce"]]
    info = counts(samples)
    assert info["ref_kl_tokens"] == 0
    totals, grads = step_grads(model, pack_samples(samples, 64), info, 4096, model_dir)
    assert "ce_loss_sum" in totals and not any(key.startswith("ref_kl_stream") for key in totals)
    plain.zero_grad(set_to_none=True)
    formula_loss(plain, samples, info["loss_tokens"], info["ce_tokens"], 1).backward()
    assert_grads_close(grads, {name: p.grad for name, p in plain.named_parameters()})

    # ce only: no loss token (N_rl = 0, its scale clamps to 1 and nothing is divided by it), the loss is L_ce / N_ce.
    info = counts([s["ce"]])
    assert info["loss_tokens"] == 0
    totals, grads = step_grads(model, pack_samples([s["ce"]], 64), info, 4096, model_dir)
    assert math.isfinite(totals["loss"]) and totals["loss"] == pytest.approx(totals["ce_loss_sum"] / info["ce_tokens"])
    plain.zero_grad(set_to_none=True)
    formula_loss(plain, [s["ce"]], 1, info["ce_tokens"], 1).backward()
    assert_grads_close(grads, {name: p.grad for name, p in plain.named_parameters()})

    # A row whose only stream is an all-False ref_kl_mask without ref_logprobs (valid: it trains nothing) beside a
    # row of ref_kl tokens: the first trains rl alone, the step is the formula's.
    silent = msgspec.structs.replace(s["rl"], ref_kl_mask=[False] * 11)
    samples = [silent, s["ce_ref"]]
    info = counts(samples)
    totals, grads = step_grads(model, pack_samples([silent], 64) + pack_samples([s["ce_ref"]], 64), info, 1, model_dir)
    plain.zero_grad(set_to_none=True)
    formula_loss(plain, samples, info["loss_tokens"], info["ce_tokens"], info["ref_kl_tokens"]).backward()
    assert_grads_close(grads, {name: p.grad for name, p in plain.named_parameters()})

    # rl only (a GRPO step): exactly today's statistics, no stream key
    info = counts([s["rl"]])
    totals, _ = step_grads(model, pack_samples([s["rl"]], 64), info, 4096, model_dir)
    assert not any(key.startswith(("ce_", "ref_kl_")) for key in totals)


def test_the_lora_loop_fails_a_run_whose_batch_carries_streams(tmp_path):
    # The multi-run LoRA loop trains rl only: such a run ends with a message naming its batch, the others train on.
    s = mixed_samples()
    runs = []
    for slot, (name, samples) in enumerate({"streams": [s["rl"], s["ce_ref"]], "grpo": [s["rl"]]}.items()):
        write_batch(TrainingBatch(step=1, samples=samples), batch_path(tmp_path / name, 1))
        runs.append(Run(name, tmp_path / name, slot, config=None, optimizer=None, scheduler=None,
                        progress=Progress(0, 0, 0), max_steps=None, max_norm=1.0, monitor=None, config_mtime=0.0))  # fmt: skip
    samples, facts = take_batches(runs, VOCAB, 64)
    assert list(samples) == [1] and list(facts["failed"]) == ["streams"]
    assert str(tmp_path / "streams") in facts["failed"]["streams"]
    assert "loss streams" in facts["failed"]["streams"] and "model.lora" in facts["failed"]["streams"]
