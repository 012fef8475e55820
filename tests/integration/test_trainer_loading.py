"""The trainer's model loading on gloo ranks: each rank reads only its shards from the safetensors files, and
the sharded model is bit-identical to `from_pretrained`, with dimensions that do not split evenly; a rank that
cannot read the checkpoint sends every rank through rank 0's scatter instead (not only itself: a hang)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from prime_rl.models.tiny import TinyModelConfig, build_tiny_model

pytestmark = pytest.mark.slow

# No dimension divides by 3: hidden 64, MLP 100, vocab 512 (the tiny tokenizer's), k/v 32, head norms 32.
DIMS = dict(hidden_size=64, intermediate_size=100, head_dim=32, num_heads=2, num_kv_heads=1)


def load_on_ranks(tmp_path: Path, ranks: int, dirs: list[Path], env: dict[str, str] | None = None, timeout=600):
    """Run `load_ranks.py` on `ranks` gloo ranks: torchrun's result and the report. A hung rank fails the test
    at `timeout` (the ranks die with torchrun)."""
    report_path = tmp_path / "report.json"
    script = Path(__file__).parent / "load_ranks.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", str(script)]
    cmd += [str(report_path), *map(str, dirs)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc, json.loads(report_path.read_text())


def test_three_ranks_load_exactly_what_from_pretrained_loads(tmp_path):
    tied = build_tiny_model(TinyModelConfig(output=tmp_path / "tied", dtype="bfloat16", **DIMS))
    untied = build_tiny_model(
        TinyModelConfig(output=tmp_path / "untied", dtype="float32", tie_word_embeddings=False, seed=1, **DIMS)
    )
    # An older checkpoint layout: a tensor the model does not name (from_pretrained ignores it). The names
    # differ, so rank 0 loads it with from_pretrained and scatters the shards instead.
    legacy = tmp_path / "legacy"
    shutil.copytree(untied, legacy)
    tensors = load_file(legacy / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(16)
    save_file(tensors, legacy / "model.safetensors", metadata={"format": "pt"})

    proc, report = load_on_ranks(tmp_path, 3, [tied, untied, legacy])

    assert set(report) == {"tied", "untied", "legacy", "tied-random"}
    for name, result in report.items():
        assert result["names_match"], name
        assert result["unequal"] == [], name  # bit-identical (the bf16 checkpoint cast to fp32 exactly)
        assert result["embedding_rows_per_rank"] == [171, 171, 170], name  # 512 rows: an uneven split
    assert report["tied"]["tied"] and report["tied-random"]["tied"]  # one Parameter, as from_pretrained ties it
    assert not report["untied"]["tied"] and not report["legacy"]["tied"]
    assert report["tied"]["path_per_rank"] == report["untied"]["path_per_rank"] == ["shards"] * 3
    assert report["legacy"]["path_per_rank"] == report["tied-random"]["path_per_rank"] == ["scatter"] * 3
    # Only the legacy checkpoint (and random weights) went through rank 0; the others were read in shards.
    scattered = [line for line in proc.stderr.splitlines() if "scatters the shards" in line]
    assert scattered and all(str(legacy) in line for line in scattered), scattered


def test_a_rank_that_cannot_read_the_checkpoint_sends_every_rank_through_the_scatter(tmp_path):
    """Rank 0 plans shard reads of `tied`, but rank 1 does not have the directory (another node, say): both ranks
    scatter from rank 0 and load the same, correct weights; `untied`, readable everywhere, is still read in
    shards. Before, rank 1 alone entered the scatter (a collective) while rank 0 read shards: a hang."""
    tied = build_tiny_model(TinyModelConfig(output=tmp_path / "tied", dtype="bfloat16", **DIMS))
    untied = build_tiny_model(
        TinyModelConfig(output=tmp_path / "untied", dtype="float32", tie_word_embeddings=False, seed=1, **DIMS)
    )
    env = {"LOAD_RANKS_UNREADABLE": f"1:{tied}"}
    proc, report = load_on_ranks(tmp_path, 2, [tied, untied], env=env, timeout=300)

    for name, result in report.items():
        assert result["names_match"] and result["unequal"] == [], name
    assert report["tied"]["path_per_rank"] == ["scatter", "scatter"]
    assert report["untied"]["path_per_rank"] == ["shards", "shards"]
    warned = [line for line in proc.stderr.splitlines() if "scatters the shards" in line and str(tied) in line]
    # Who could not read what, and why (the lookup of a name that is neither a directory here nor a hub id).
    assert len(warned) == 1 and f"rank 1 cannot see {tied}" in warned[0] and "HFValidationError" in warned[0], warned
    assert "rank 0 cannot" not in warned[0]
