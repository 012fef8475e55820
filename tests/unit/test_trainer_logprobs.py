"""Packed rows: a sample's logprobs inside a row equal its logprobs alone (attention does not leak)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from prime_rl.models.tiny import TinyModelConfig, build_tiny_model
from prime_rl.trainer.logprobs import shifted_logprobs


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = build_tiny_model(TinyModelConfig(output=tmp_path_factory.mktemp("m") / "tiny", dtype="float32"))
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()


def row_logprobs(model, samples: list[list[int]], temperature: float = 1.0):
    ids = torch.tensor([t for s in samples for t in s])
    pos = torch.cat([torch.arange(len(s)) for s in samples])
    temps = torch.full((len(ids),), temperature)
    with torch.no_grad():
        logits = model(input_ids=ids[None], position_ids=pos[None], use_cache=False).logits[0]
    return shifted_logprobs(logits, ids, pos, temps)


def test_packed_row_equals_samples_alone(model):
    g = torch.Generator().manual_seed(0)
    samples = [torch.randint(0, 400, (n,), generator=g).tolist() for n in (7, 1, 12, 5)]
    packed_logp, packed_ent = row_logprobs(model, samples, temperature=0.7)
    start = 0
    for s in samples:
        alone_logp, alone_ent = row_logprobs(model, [s], temperature=0.7)
        # fp32, same kernels, only the mask differs: any leak across samples would move these by >> 1e-5.
        torch.testing.assert_close(packed_logp[start : start + len(s)], alone_logp, rtol=0, atol=1e-5)
        torch.testing.assert_close(packed_ent[start : start + len(s)], alone_ent, rtol=0, atol=1e-5)
        start += len(s)


def test_leak_would_be_detected(model):
    """Control: the same tokens as one continuous sample (positions not restarted) give different logprobs."""
    a, b = list(range(10, 20)), list(range(30, 40))
    ids = torch.tensor(a + b)
    continuous = torch.arange(len(ids))
    with torch.no_grad():
        logits = model(input_ids=ids[None], position_ids=continuous[None], use_cache=False).logits[0]
    leaked, _ = shifted_logprobs(logits, ids, continuous, torch.ones(len(ids)))
    alone, _ = row_logprobs(model, [b])
    assert (leaked[len(a) + 1 :] - alone[1:]).abs().max() > 1e-3


def test_shifted_logprobs_by_hand():
    """Token t is scored by logits[t-1] / T; the first token of every sample gets 0."""
    logits = torch.tensor([[0.0, 1.0, 2.0], [1.0, 0.0, 0.0], [0.0, 0.0, 3.0], [2.0, 2.0, 0.0]])
    ids = torch.tensor([2, 1, 0, 1])
    pos = torch.tensor([0, 1, 0, 1])  # two samples: [2, 1] and [0, 1]
    temps = torch.tensor([1.0, 2.0, 1.0, 1.0])
    logp, entropy = shifted_logprobs(logits, ids, pos, temps)
    # token 1 (id 1) under logits[0] / 2 = [0, .5, 1]: 0.5 - log(1 + e^.5 + e^1)
    expected_1 = 0.5 - torch.log(1 + torch.exp(torch.tensor(0.5)) + torch.exp(torch.tensor(1.0)))
    # token 3 (id 1) under logits[2] = [0, 0, 3]: 0 - log(2 + e^3)
    expected_3 = -torch.log(2 + torch.exp(torch.tensor(3.0)))
    torch.testing.assert_close(logp, torch.stack([torch.tensor(0.0), expected_1, torch.tensor(0.0), expected_3]))
    assert entropy[0] == 0 and entropy[2] == 0 and entropy[1] > 0
