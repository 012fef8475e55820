"""The real trainer (torchrun, gloo, 2 CPU ranks) on batches that carry the loss streams `ce_weights` and
`ref_kl_mask` + `ref_logprobs` beside the policy gradient: each rank trains its own rows (one rank's rows carry
no stream at all), and the step's metrics report each stream against a forward of the initial model."""

import json
import random

import pytest
import torch
from test_trainer import model_dir, trainer  # noqa: F401 (a fixture)
from transformers import AutoModelForCausalLM

from prime_rl.batch import TrainingBatch, TrainingSample, batch_path, write_batch

pytestmark = pytest.mark.slow

LENGTH = 40
"""Every sample's length: sdpa rows are as long as the longest sample, so each sample is a row of its own and the
two ranks get one each."""


def stream_batch(step: int) -> TrainingBatch:
    """Sample 0: rl only. Sample 1: no rl token, ce on half its completion (weights 1 and 2) and ref_kl on all of it."""
    rng = random.Random(0)  # every step the same samples: step 2 shows what step 1 trained
    prompt = 10
    tail = [t >= prompt for t in range(LENGTH)]
    mu = [rng.uniform(-6.4, -6.1) if m else 0.0 for m in tail]
    rl = TrainingSample(
        token_ids=[rng.randrange(480) for _ in range(LENGTH)],
        loss_mask=tail,
        inference_logprobs=mu,
        advantages=[1.0] * LENGTH,
    )
    streams = TrainingSample(
        token_ids=[rng.randrange(480) for _ in range(LENGTH)],
        loss_mask=[False] * LENGTH,
        inference_logprobs=mu,
        advantages=[0.0] * LENGTH,
        ce_weights=[(1.0 if t % 2 else 2.0) if m and t % 4 < 2 else 0.0 for t, m in enumerate(tail)],
        ref_logprobs=[rng.uniform(-8.0, -5.0) if m else 0.0 for m in tail],
        ref_kl_mask=tail,
    )
    return TrainingBatch(step=step, samples=[rl, streams])


def test_the_trainer_trains_the_streams_and_reports_them(model_dir, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    for step in (1, 2):
        write_batch(stream_batch(step), batch_path(out, step))
    trainer(model_dir, out, "--max-steps", "2")
    first, second = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    # Step 1 runs the initial weights: its stream metrics are those of a plain forward of the sample.
    sample = stream_batch(1).samples[1]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([sample.token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
    logp = [0.0, *logp.tolist()]
    ce = [(w, p) for w, p in zip(sample.ce_weights, logp, strict=True) if w > 0]
    gaps = [p - r for p, r, m in zip(logp, sample.ref_logprobs, sample.ref_kl_mask, strict=True) if m]
    assert first["ce_tokens"] == len(ce) == 14 and first["ref_kl_tokens"] == len(gaps) == LENGTH - 10
    assert first["ce_loss"] == pytest.approx(sum(-w * p for w, p in ce) / len(ce), rel=1e-5)
    assert first["ref_kl_stream"] == pytest.approx(sum(gaps) / len(gaps), rel=1e-5)
    assert first["ref_kl_masked_fraction"] == 0.0
    assert "ref_kl" not in first  # `[reference]`'s metric: no reference model here
    assert second["ce_loss"] < first["ce_loss"]  # the CE tokens were trained (lr 1e-2)
    log = (out / "logs" / "trainer.log").read_text()
    assert "step 2 |" in log and "ce_loss" in log and "ref_kl_stream" in log
