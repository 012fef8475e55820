"""`checkpoint_plan` on one rank: what rank 0 decides, what a rank checks before it reads shards, and that a
failed hub lookup says why (the multi-rank agreement is in tests/integration/test_trainer_loading.py)."""

import shutil

import huggingface_hub
import pytest
import torch
from loguru import logger
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from prime_rl.models.tiny import TinyModelConfig, build_tiny_model
from prime_rl.trainer.config import TrainerModelConfig
from prime_rl.trainer.model import loading
from prime_rl.trainer.model.build import export_dtype, load_arch, parameters_on_meta
from prime_rl.trainer.model.loading import CheckpointPlan, checkpoint_plan, this_ranks_plan, unreadable


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(TinyModelConfig(output=tmp_path_factory.mktemp("m") / "tiny", dtype="float32"))


def skeleton(directory):
    with parameters_on_meta():
        return AutoModelForCausalLM.from_config(load_arch(TrainerModelConfig(name=str(directory))))


def expected_shapes(model):
    aliases = loading.tied_aliases(model)
    return {n: tuple(t.shape) for n, t in model.state_dict().items() if n not in aliases}


@pytest.fixture
def messages():
    lines = []
    sink = logger.add(lines.append, format="{level} {message}")
    yield lines
    logger.remove(sink)


def test_a_readable_checkpoint_is_planned_for_shard_reads_with_file_names_relative_to_its_directory(
    model_dir, one_rank, messages
):
    model = skeleton(model_dir)
    plan = checkpoint_plan(model, str(model_dir), one_rank)
    assert plan is not None and plan.directory == model_dir
    assert set(plan.files) == set(expected_shapes(model)) and set(plan.files.values()) == {"model.safetensors"}
    assert not any("scatters" in line for line in messages)


def test_a_failed_hub_lookup_is_logged_with_its_reason(model_dir, one_rank, messages, monkeypatch):
    def offline(*args, **kwargs):
        raise OSError("the hub is unreachable from this node")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    assert checkpoint_plan(skeleton(model_dir), "some-org/some-model", one_rank) is None
    [line] = [line for line in messages if "some-org/some-model" in line]
    assert line.startswith("WARNING") and "OSError: the hub is unreachable from this node" in line
    assert "scatters the shards" in line


def test_a_rank_that_cannot_see_rank_0s_directory_reads_its_own_copy_of_a_hub_id(model_dir, tmp_path, monkeypatch):
    """Hub ids resolve to a per-node cache: rank 0's snapshot path may not exist on another node."""
    copy = shutil.copytree(model_dir, tmp_path / "this-nodes-snapshot")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *args, **kwargs: str(copy))
    files = {"model.embed_tokens.weight": "model.safetensors"}
    assert this_ranks_plan(CheckpointPlan(model_dir, files), "some-org/some-model").directory == model_dir
    assert this_ranks_plan(CheckpointPlan(tmp_path / "rank-0s-cache", files), "some-org/some-model").directory == copy


def test_a_planned_file_that_is_missing_or_differs_is_unreadable_and_says_why(model_dir, tmp_path):
    expected = expected_shapes(skeleton(model_dir))
    files = dict.fromkeys(expected, "model.safetensors")
    assert unreadable(CheckpointPlan(model_dir, files), expected) is None

    assert "FileNotFoundError" in unreadable(CheckpointPlan(tmp_path / "elsewhere", files), expected)

    other = shutil.copytree(model_dir, tmp_path / "other")
    tensors = load_file(other / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:-1]
    save_file(tensors, other / "model.safetensors", metadata={"format": "pt"})
    reason = unreadable(CheckpointPlan(other, files), expected)
    assert reason.startswith("model.norm.weight has shape") and "in the model" in reason


def test_weights_leave_the_trainer_in_float32_when_it_trains_in_float32(model_dir, tmp_path):
    """A bf16 checkpoint trained in fp32 was published in bf16: the sampler drew from rounded weights, not the ones
    the trainer scored. Training in bf16 keeps the checkpoint's dtype, as does an fp32 checkpoint either way."""
    bf16_dir = build_tiny_model(TinyModelConfig(output=tmp_path / "bf16", dtype="bfloat16"))
    bf16, fp32 = (load_arch(TrainerModelConfig(name=str(d))) for d in (bf16_dir, model_dir))
    assert (bf16.dtype, fp32.dtype) == (torch.bfloat16, torch.float32)
    assert export_dtype(bf16, "float32") == torch.float32
    assert export_dtype(bf16, "bfloat16") == torch.bfloat16
    assert export_dtype(fp32, "bfloat16") == export_dtype(fp32, "float32") == torch.float32
