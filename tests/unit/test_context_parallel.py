"""Context parallelism (Ulysses): a row sharded over 2 gloo ranks gives the unsharded row's log-probs and gradients.

One torchrun job (tests/unit/cp_worker.py) runs every CP computation; the reference is the trainer's ordinary path in
this process: the whole row through transformers' own `sdpa` attention, whose block-diagonal mask transformers derives
from the position ids.
"""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from prime_rl.batch import TrainingSample
from prime_rl.models.tiny import TinyModelConfig, build_tiny_model
from prime_rl.trainer.packing import pack_samples
from prime_rl.trainer.parallel.context_parallel import block_causal_mask, enable_context_parallel, pad_row, shard_row

CP = 2
LENGTHS = [37, 61, 23, 50]  # packed longest first: 61, 50, 37, 23 = 171 tokens, padded to 172
# Each case: (tiny model settings, activation checkpointing).
CASES = {
    # 2 kv heads per rank, each read by 2 of its 4 query heads
    "gqa": (dict(num_heads=8, num_kv_heads=4, head_dim=16), False),
    "gqa_ac": (dict(num_heads=8, num_kv_heads=4, head_dim=16), True),  # attention recomputed in backward
    # kv heads repeated until cp divides them: 1 -> 2 (the tiny default), and 3 -> 6, where the copies must stay
    # next to their originals (0 0 1 1 2 2) for query head h to read kv head h // 2
    "kv_repeat": (dict(num_heads=2, num_kv_heads=1), False),
    "llama_kv_repeat": (dict(family="llama", hidden_size=96, num_heads=6, num_kv_heads=3, head_dim=16), False),
}


def make_row():
    """One packed row of several samples (a sample spans the chunk boundary), with next-token targets and weights."""
    rng = random.Random(0)
    samples = [
        TrainingSample(
            token_ids=[rng.randrange(400) for _ in range(n)],
            loss_mask=[True] * n,
            inference_logprobs=[0.0] * n,
            advantages=[0.0] * n,
        )
        for n in LENGTHS
    ]
    (row,) = pack_samples(samples, seq_len=sum(LENGTHS))
    row = pad_row(row, CP)
    ids, pos = row.input_ids, row.position_ids
    # Position t predicts token t + 1 of the full row: for the last position of rank 0's chunk that token lies on
    # rank 1, so targets come from the full row. Weights are zero where t + 1 starts another sample or is padding.
    targets = torch.cat([ids[1:], ids[:1]])
    trained = torch.cat([row.loss_mask[1:] & (pos[1:] != 0), torch.tensor([False])])
    weights = torch.randn(len(ids), generator=torch.Generator().manual_seed(0)) * trained
    boundary = len(ids) // CP
    assert pos[boundary] != 0 and weights[boundary - 1] != 0  # a sample spans the ranks; its cross-rank target counts
    return {"input_ids": ids, "position_ids": pos, "targets": targets, "weights": weights}


def reference(model_dir: Path, row: dict, position_ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The unsharded row through the model's own sdpa attention: log-probs of the targets and parameter gradients."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    logits = model(input_ids=row["input_ids"][None], position_ids=position_ids[None], use_cache=False).logits[0]
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, row["targets"][:, None])[:, 0]
    (logp * row["weights"]).sum().backward()
    return logp.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    """A float32 tiny model per case (cases with the same settings share one)."""
    root = tmp_path_factory.mktemp("models")
    built: dict[str, Path] = {}
    dirs = {}
    for name, (settings, _) in CASES.items():
        key = json.dumps(settings, sort_keys=True)
        if key not in built:
            built[key] = build_tiny_model(TinyModelConfig(output=root / name, dtype="float32", **settings))
        dirs[name] = built[key]
    return dirs


@pytest.fixture(scope="module")
def cp_run(model_dirs, tmp_path_factory) -> tuple[Path, dict]:
    """Run the CP worker once on 2 ranks over every case; returns its output directory and the row it ran on."""
    root = tmp_path_factory.mktemp("cp")
    row = make_row()
    torch.save(row, root / "row.pt")
    cases = [{"name": name, "model": str(model_dirs[name]), "ac": ac} for name, (_, ac) in CASES.items()]
    (root / "spec.json").write_text(json.dumps({"out": str(root), "row": str(root / "row.pt"), "cases": cases}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={CP}"]
    cmd += [str(Path(__file__).with_name("cp_worker.py")), str(root / "spec.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return root, row


@pytest.mark.parametrize("case", list(CASES))
def test_cp_row_matches_the_unsharded_row(cp_run, model_dirs, case):
    root, row = cp_run
    result = torch.load(root / f"case_{case}.pt")
    logp_ref, grads_ref = reference(model_dirs[case], row, row["position_ids"])

    logp_err = (result["logp"] - logp_ref).abs().max().item()
    grad_err = max(((result["grads"][n] - g).abs().max() / g.abs().max()).item() for n, g in grads_ref.items())
    print(f"{case}: max |logp - ref| = {logp_err:.2e}, max grad error / max |grad| = {grad_err:.2e}")
    assert result["grads"].keys() == grads_ref.keys()
    # fp32, eps = 2^-23 ~ 1.2e-7. The CP forward differs from the reference only in matrix shapes (a rank's 86 tokens
    # instead of 172; attention for H/cp heads at a time), which reorders no sum over a row's elements on this CPU
    # (measured: bit-identical) and by a few ulps at most with other kernels; 1e-5 on log-probs of size ~6 is ~14
    # ulps. A weight gradient sums over the row's tokens; CP sums each rank's half and adds the halves over the group,
    # a reassociation worth a few ulps of the largest entry (measured <= 7.5e-7, ~6 ulps); the bound is 1e-5 (~80).
    # The mistakes this test catches (a mask letting samples see each other, kv heads read by the wrong query heads,
    # a gradient sliced for the wrong rank) move log-probs by > 0.5 and gradients by more than their own size.
    assert logp_err < 1e-5
    assert grad_err < 1e-5

    # The check is sharp enough to see a wrong mask: the same row without the sample boundaries (one long sample)
    # moves the log-probs of every sample but the first by far more than the tolerance.
    logp_unpacked, _ = reference(model_dirs[case], row, torch.arange(len(row["position_ids"])))
    assert (logp_unpacked - logp_ref).abs().max().item() > 100 * 1e-5


def test_cp_misuse_is_refused(cp_run):
    root, _ = cp_run
    errors = torch.load(root / "case_gqa.pt")["errors"]
    assert "outside cp_context" in errors["outside_context"]
    assert "position ids other than its chunk" in errors["wrong_chunk"]


def test_collectives(cp_run):
    root, _ = cp_run
    ranks = [torch.load(root / f"collectives_rank{r}.pt") for r in range(CP)]
    for r, got in enumerate(ranks):
        # all_to_all: block i of rank r's result is block r of rank i's input; its backward is the inverse exchange,
        # so rank r's input gradient block i is block r of rank i's upstream gradient (and not its own).
        assert torch.equal(got["a2a_out"], torch.stack([ranks[i]["a2a_x"][r] for i in range(CP)]))
        assert torch.equal(got["a2a_grad"], torch.stack([ranks[i]["a2a_y"][r] for i in range(CP)]))
        # heads_to_sequence: rank r holds heads 2r, 2r+1 (of 4) for all 6 tokens (3 per rank), in row order.
        h, s, e = torch.meshgrid(torch.arange(2) + 2 * r, torch.arange(6), torch.arange(2), indexing="ij")
        assert torch.equal(got["h2s_out"], (1000 * h + 10 * s + e).double())
        # sequence_to_heads undoes it, and so does the round trip's backward.
        assert torch.equal(got["roundtrip_grad"], got["roundtrip_g"])
        # gather_row: ranks' chunks in rank order; the backward is this rank's slice of the (shared) gradient.
        assert torch.equal(got["gather_full"], torch.cat([torch.arange(5) + 10 * i for i in range(CP)]).double())
        assert torch.equal(got["gather_grad"], (torch.arange(5 * CP).double() * 0.5 - 3)[5 * r : 5 * r + 5])


def test_block_causal_mask_by_hand():
    # Samples [0, 1, 2], [0, 1], [0]; then positions 3 -> 5 jump, so 5 starts a sample, as in transformers.
    mask = block_causal_mask(torch.tensor([0, 1, 2, 0, 1, 0, 5, 6]))
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0, 0, 0],
            [0, 0, 0, 1, 0, 0, 0, 0],
            [0, 0, 0, 1, 1, 0, 0, 0],
            [0, 0, 0, 0, 0, 1, 0, 0],
            [0, 0, 0, 0, 0, 0, 1, 0],
            [0, 0, 0, 0, 0, 0, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)


def test_shard_and_pad_row():
    samples = [TrainingSample(token_ids=[7] * n, loss_mask=[True] * n, inference_logprobs=[-1.0] * n,
                              advantages=[0.5] * n, temperature=0.7) for n in (3, 2)]  # fmt: skip
    (row,) = pack_samples(samples, seq_len=8)
    padded = pad_row(row, 4)  # 5 tokens -> 8: three pad tokens continue the last sample (positions 2, 3, 4)
    assert padded.input_ids.tolist() == [7, 7, 7, 7, 7, 0, 0, 0]
    assert padded.position_ids.tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
    assert padded.sample_ids.tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    assert padded.loss_mask.tolist() == [True] * 5 + [False] * 3
    assert padded.advantages.tolist() == [0.5] * 5 + [0.0] * 3
    assert padded.inference_logprobs.tolist() == [-1.0] * 5 + [0.0] * 3
    assert padded.temperatures.tolist() == pytest.approx([0.7] * 5 + [1.0] * 3)
    assert padded.num_samples == 2 and padded.num_loss_tokens == 5
    assert pad_row(padded, 4) is padded
    assert shard_row(padded.position_ids, 1, 4).tolist() == [2, 0]
    assert shard_row(torch.arange(12).reshape(2, 6), 2, 3, dim=1).tolist() == [[4, 5], [10, 11]]
    with pytest.raises(ValueError, match="5 tokens does not split into cp=4"):
        shard_row(row.input_ids, 0, 4)


def test_enable_refuses_a_cp_that_does_not_divide_the_heads(model_dirs):
    model = AutoModelForCausalLM.from_pretrained(model_dirs["kv_repeat"])  # 2 heads
    with pytest.raises(ValueError, match="cp=4 must divide the model's num_attention_heads=2"):
        enable_context_parallel(model, 4)
    assert model.config._attn_implementation != "prime_rl_ulysses"
