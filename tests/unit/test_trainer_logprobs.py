"""The chunked log-prob head: the same log-probs, entropy and gradients as the full [tokens x vocab] computation,
and packed rows whose samples never see each other."""

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma2Config, Qwen3ForCausalLM

from prime_rl.models.tiny import TinyModelConfig, build_tiny_model
from prime_rl.trainer.model.logprobs import (
    HeadError,
    LogProbHead,
    chunked_logprobs,
    forward_logprobs,
    install_logprob_head,
    next_token_logprobs,
    next_token_targets,
    shared_prompt_mask,
    shift_to_tokens,
)
from prime_rl.trainer.packing import PackedRow, collate


def full_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperatures: torch.Tensor):
    """The plain computation the head replaces: fp32 log-softmax of every logit at once."""
    logp_all = torch.log_softmax(logits.float() / temperatures[:, None], dim=-1)
    logp = logp_all.gather(-1, targets[:, None])[:, 0]
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


@pytest.mark.parametrize("chunk", [1, 7, 16, 37, 100])
def test_chunks_match_the_full_computation(chunk):
    """37 positions: chunks of 7 and 16 leave a remainder, 37 is one chunk, 100 more than the row."""
    g = torch.Generator().manual_seed(0)
    n, hidden_size, vocab = 37, 16, 50
    hidden = torch.randn(n, hidden_size, generator=g).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=g) / 2).requires_grad_()  # logits of a few units
    targets = torch.randint(0, vocab, (n,), generator=g)
    temperatures = torch.where(torch.arange(n) < 20, 0.7, 1.3)  # two samples of different temperatures
    upstream = torch.randn(n, generator=g)  # an arbitrary loss sum(upstream * logp) exercises every position

    logp, entropy = full_logprobs(hidden @ weight.T, targets, temperatures)
    (upstream * logp).sum().backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    chunked_logp, chunked_entropy = chunked_logprobs(hidden, weight, targets, temperatures, chunk)
    (upstream * chunked_logp).sum().backward()
    assert not chunked_entropy.requires_grad  # entropy is a metric: no graph is kept for it
    # fp32 throughout; only the summation order of the matmul and the logsumexp differ (a few ulp of values
    # of ~10), so 1e-5 is ~30x the observed difference and orders of magnitude below any real mistake.
    for ours, reference in (
        (chunked_logp, logp),
        (chunked_entropy, entropy),
        (hidden.grad, grads[0]),
        (weight.grad, grads[1]),
    ):
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)


def test_scores_by_hand():
    """Token t is scored by logits[t-1] / T; the first token of every sample gets 0. With hidden states = logits
    and an identity output weight the head sees exactly the logits below."""
    logits = torch.tensor([[0.0, 1.0, 2.0], [1.0, 0.0, 0.0], [0.0, 0.0, 3.0], [2.0, 2.0, 0.0]])
    ids = torch.tensor([[2, 1, 0, 1]])
    pos = torch.tensor([[0, 1, 0, 1]])  # two samples: [2, 1] and [0, 1]
    temps = torch.tensor([2.0, 2.0, 1.0, 1.0])
    targets = next_token_targets(ids)
    assert targets.tolist() == [[1, 0, 1, 0]]
    next_logp, next_entropy = chunked_logprobs(logits, torch.eye(3), targets[0], temps, chunk=3)
    logp, entropy = shift_to_tokens(next_logp[None], pos), shift_to_tokens(next_entropy[None], pos)
    # token 1 (id 1) under logits[0] / 2 = [0, .5, 1]: 0.5 - log(1 + e^.5 + e^1)
    expected_1 = 0.5 - torch.log(1 + torch.exp(torch.tensor(0.5)) + torch.exp(torch.tensor(1.0)))
    # token 3 (id 1) under logits[2] = [0, 0, 3]: 0 - log(2 + e^3)
    expected_3 = -torch.log(2 + torch.exp(torch.tensor(3.0)))
    torch.testing.assert_close(logp[0], torch.stack([torch.tensor(0.0), expected_1, torch.tensor(0.0), expected_3]))
    # entropy of [0, 0, 3]: p = [1, 1, e^3] / (2 + e^3), H = log(2 + e^3) - 3 e^3 / (2 + e^3)
    z = 2 + torch.exp(torch.tensor(3.0))
    torch.testing.assert_close(entropy[0, 3], torch.log(z) - 3 * torch.exp(torch.tensor(3.0)) / z)
    assert entropy[0, 0] == 0 and entropy[0, 2] == 0 and entropy[0, 1] > 0


def test_shift_to_tokens_by_hand():
    values = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0], [6.0, 7.0, 8.0, 9.0, 10.0]])
    positions = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 0, 0, 1]])
    # value of token t = value at t-1, except where a sample starts (position 0)
    assert shift_to_tokens(values, positions).tolist() == [[0, 1, 2, 0, 4], [0, 6, 0, 0, 9]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(TinyModelConfig(output=tmp_path_factory.mktemp("m") / "tiny", dtype="float32"))


def load(model_dir, chunk: int | None = 5):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    if chunk is not None:
        install_logprob_head(model, chunk)
    return model


@pytest.fixture(scope="module")
def model(model_dir):
    return load(model_dir).eval()


def row_of(samples: list[list[int]], temperature: float = 1.0) -> PackedRow:
    n = sum(len(s) for s in samples)
    return PackedRow(
        input_ids=torch.tensor([t for s in samples for t in s]),
        position_ids=torch.cat([torch.arange(len(s)) for s in samples]),
        loss_mask=torch.ones(n, dtype=torch.bool),
        inference_logprobs=torch.zeros(n),
        advantages=torch.zeros(n),
        temperatures=torch.full((n,), temperature),
        sample_ids=torch.cat([torch.full((len(s),), k) for k, s in enumerate(samples)]),
        num_samples=len(samples),
        sample_indices=list(range(len(samples))),
    )


def row_logprobs(model, samples: list[list[int]], temperature: float = 1.0):
    with torch.no_grad():
        logp, entropy = forward_logprobs(model, collate([row_of(samples, temperature)], concatenate=False))
    return logp[0], entropy[0]


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
    leaked, _ = row_logprobs(model, [a + b])
    alone, _ = row_logprobs(model, [b])
    assert (leaked[len(a) + 1 :] - alone[1:]).abs().max() > 1e-3


def test_the_tiny_model_gets_the_gradients_of_the_unchunked_head(model_dir):
    """Through the real model with tied embeddings: every parameter's gradient, the shared embedding's included
    (it gets the head's gradient and the embedding's), matches the plain forward's full log-softmax."""
    g = torch.Generator().manual_seed(1)
    samples = [torch.randint(0, 400, (n,), generator=g).tolist() for n in (9, 14, 6)]
    batch = collate([row_of(samples)], concatenate=False)
    batch.temperatures = torch.where(batch.sample_ids == 1, 0.6, 1.0)  # per-token temperatures
    weights = torch.randn(batch.input_ids.shape, generator=g)

    plain = load(model_dir, chunk=None)
    assert plain.lm_head.weight is plain.model.embed_tokens.weight
    logits = plain(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits[0]
    targets = next_token_targets(batch.input_ids)[0]
    next_logp, next_entropy = full_logprobs(logits, targets, batch.temperatures[0])
    logp = shift_to_tokens(next_logp[None], batch.position_ids)
    entropy = shift_to_tokens(next_entropy[None], batch.position_ids)
    (weights * logp).sum().backward()

    chunked = load(model_dir, chunk=4)  # 29 positions: 7 chunks and a remainder of 1
    assert isinstance(chunked.lm_head, LogProbHead) and chunked.lm_head.weight is chunked.model.embed_tokens.weight
    assert "lm_head.weight" in dict(chunked.named_parameters(remove_duplicate=False))  # the name checkpoints use
    chunked_logp, chunked_entropy = forward_logprobs(chunked, batch)
    (weights * chunked_logp).sum().backward()

    # fp32; the two paths differ only in summation order (1e-5 is ~10x the observed difference).
    torch.testing.assert_close(chunked_logp, logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chunked_entropy, entropy, rtol=1e-5, atol=1e-5)
    grads = dict(plain.named_parameters())
    for name, param in chunked.named_parameters():
        reference = grads[name].grad
        # A reordered fp32 sum is off by a few ulp of its largest terms, not of its (possibly cancelling)
        # result, so the tolerance scales with the tensor's largest gradient: 1e-5 of it is ~10x the
        # observed difference, while a wrong or missing term (the head's share of the tied embedding's
        # gradient, a temperature not applied) moves entries by a sizeable fraction of it.
        scale = reference.abs().max().item()
        assert scale > 0, name
        torch.testing.assert_close(
            param.grad, reference, rtol=0, atol=1e-5 * scale, msg=lambda m, name=name: f"{name}: {m}"
        )


def test_only_positions_that_predict_trained_tokens_are_scored(model_dir, monkeypatch):
    """Samples of prompt + completion, padded to one length: the head scores only the positions whose next token is
    on the loss mask. Trained tokens get the values and every parameter the gradient of scoring every position."""
    from prime_rl.trainer.model import logprobs as module

    g = torch.Generator().manual_seed(4)
    rows = []
    for prompt, completion in ((6, 5), (4, 9), (7, 2)):
        row = row_of([torch.randint(0, 400, (prompt + completion,), generator=g).tolist()], temperature=0.8)
        row.loss_mask[:prompt] = False
        rows.append(row)
    batch = collate(rows, concatenate=False)  # [3, 13]: 6 of its 39 positions are padding
    every = collate(rows, concatenate=False)
    every.loss_mask = torch.ones_like(every.loss_mask)  # the same rows, every position scored
    trained = batch.loss_mask
    weights = torch.randn(trained.shape, generator=g)

    sizes = []
    real = module.chunked_logprobs
    monkeypatch.setattr(
        module, "chunked_logprobs", lambda hidden, *a: sizes.append(hidden.shape[0]) or real(hidden, *a)
    )
    results = {}
    for name, b in (("trained", batch), ("every", every)):
        model = load(model_dir, chunk=4)
        logp, entropy = forward_logprobs(model, b)
        (weights * torch.where(trained, logp, 0.0)).sum().backward()
        results[name] = logp, entropy, {n: p.grad for n, p in model.named_parameters()}
    assert sizes == [16, 36]  # the 16 trained tokens' predecessors; every position but each row's last

    (logp, entropy, grads), (every_logp, every_entropy, every_grads) = results["trained"], results["every"]
    assert bool((logp[~trained] == 0).all()) and bool((entropy[~trained] == 0).all())
    assert bool((every_entropy[~trained & (batch.position_ids > 0)] > 0).all())  # which the full path does score
    # fp32, the same kernels over fewer rows: 1e-5 as in the unchunked comparison above.
    torch.testing.assert_close(logp[trained], every_logp[trained], rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy[trained], every_entropy[trained], rtol=0, atol=1e-5)
    for name, grad in grads.items():
        scale = every_grads[name].abs().max().item()  # as above: the reordered sum's error scales with its terms
        assert scale > 0, name
        torch.testing.assert_close(
            grad, every_grads[name], rtol=0, atol=1e-5 * scale, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_concatenated_and_padded_micro_batches_score_alike(model):
    """flash_attention_2 gets the micro-batch as one concatenated row, sdpa as padded rows: same per-token values."""
    g = torch.Generator().manual_seed(2)
    rows = [row_of([torch.randint(0, 400, (n,), generator=g).tolist() for n in lengths]) for lengths in ((5, 8), (3,))]
    with torch.no_grad():
        padded, _ = forward_logprobs(model, collate(rows, concatenate=False))
        joined, _ = forward_logprobs(model, collate(rows, concatenate=True))
    assert padded.shape == (2, 13) and joined.shape == (1, 16)
    # fp32, same samples and masks, different batch layout: 1e-5 is far below a leak's effect (> 1e-3, above).
    torch.testing.assert_close(joined[0], torch.cat([padded[0], padded[1, :3]]), rtol=0, atol=1e-5)


def test_models_that_post_process_their_logits_are_refused(model_dir):
    config = Gemma2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, final_logit_softcapping=30.0,
    )  # fmt: skip
    with torch.device("meta"):
        gemma = AutoModelForCausalLM.from_config(config)
    with pytest.raises(HeadError, match="final_logit_softcapping"):
        install_logprob_head(gemma, 8)

    class ScaledLogits(Qwen3ForCausalLM):
        """Post-processing no config field announces: caught at the first forward."""

        def forward(self, **kwargs):
            out = super().forward(**kwargs)
            out.logits = out.logits * 2
            return out

    scaled = ScaledLogits.from_pretrained(model_dir, dtype=torch.float32)
    install_logprob_head(scaled, 8)
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(HeadError, match="changes the output layer's result"):
        next_token_logprobs(scaled, ids, torch.arange(3)[None], next_token_targets(ids), torch.ones(1, 3))


def test_shared_prompt_mask_by_hand():
    # A prompt of 2 tokens (positions 0, 1), two continuations from position 2 (3 and 2 tokens), then a sample alone.
    positions = torch.tensor([[0, 1, 2, 3, 4, 2, 3, 0, 1]])
    visible = {  # for each token, the tokens it may attend to
        0: [0], 1: [0, 1],
        2: [0, 1, 2], 3: [0, 1, 2, 3], 4: [0, 1, 2, 3, 4],  # the prompt and itself
        5: [0, 1, 5], 6: [0, 1, 5, 6],  # the prompt and itself, never the first continuation
        7: [7], 8: [7, 8],  # a sample of its own
    }  # fmt: skip
    mask = shared_prompt_mask(positions)
    assert mask.shape == (1, 1, 9, 9)
    assert {q: mask[0, 0, q].nonzero()[:, 0].tolist() for q in range(9)} == visible
    assert shared_prompt_mask(torch.tensor([[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]])) is None  # nothing shared: no mask
    assert shift_to_tokens(torch.arange(1.0, 10.0)[None], positions).tolist() == [[0, 1, 2, 3, 4, 0, 6, 0, 8]]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_continuations_of_a_shared_prompt_score_as_the_samples_alone(model_dir, attn):
    """The row [prompt | continuation 1 | continuation 2] gives each continuation's tokens the log-probs of its
    sample run alone, under both attention kernels the packer shares prompts for."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attn).eval()
    install_logprob_head(model, chunk=16)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 400, (6,), generator=g).tolist()
    tails = [torch.randint(0, 400, (n,), generator=g).tolist() for n in (5, 8)]
    row = row_of([prompt[:-1]])  # the shared part; each continuation starts with the prompt's last token
    shared = collate([row], concatenate=False)
    for tail in tails:
        piece = [prompt[-1], *tail]
        shared.input_ids = torch.cat([shared.input_ids, torch.tensor([piece])], 1)
        shared.position_ids = torch.cat([shared.position_ids, torch.arange(5, 5 + len(piece))[None]], 1)
    shared.temperatures = torch.full(shared.input_ids.shape, 0.8)
    shared.loss_mask = torch.ones(shared.input_ids.shape, dtype=torch.bool)
    with torch.no_grad():
        logp, entropy = forward_logprobs(model, shared)
    start = 5
    for tail in tails:
        alone_logp, alone_entropy = row_logprobs(model, [prompt + tail], temperature=0.8)
        n = len(tail) + 1
        # the continuation's tokens after its first (which opens a piece: 0), scored as in the sample alone;
        # fp32, different row layouts: 1e-5 is far below what seeing the other continuation moves (> 1e-3, above)
        torch.testing.assert_close(logp[0, start + 1 : start + n], alone_logp[6:], rtol=0, atol=1e-5)
        torch.testing.assert_close(entropy[0, start + 1 : start + n], alone_entropy[6:], rtol=0, atol=1e-5)
        start += n
