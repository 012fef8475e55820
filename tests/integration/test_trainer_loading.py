"""The trainer's model loading on 3 gloo ranks: each rank reads only its shards from the safetensors files, and
the sharded model is bit-identical to `from_pretrained`, with dimensions that do not split evenly."""

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

    report_path = tmp_path / "report.json"
    script = Path(__file__).parent / "load_ranks.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3", str(script)]
    cmd += [str(report_path), str(tied), str(untied), str(legacy)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    report = json.loads(report_path.read_text())

    assert set(report) == {"tied", "untied", "legacy", "tied-random"}
    for name, result in report.items():
        assert result["names_match"], name
        assert result["unequal"] == [], name  # bit-identical (the bf16 checkpoint cast to fp32 exactly)
        assert result["embedding_rows_per_rank"] == [171, 171, 170], name  # 512 rows: an uneven split
    assert report["tied"]["tied"] and report["tied-random"]["tied"]  # one Parameter, as from_pretrained ties it
    assert not report["untied"]["tied"] and not report["legacy"]["tied"]
    # Only the legacy checkpoint (and random weights) went through rank 0; the others were read in shards.
    scattered = [line for line in proc.stderr.splitlines() if "scatters the shards" in line]
    assert scattered and all(str(legacy) in line for line in scattered), scattered
