"""Publish the trainer's weights as a Hugging Face directory the inference server can load.

`broadcasts/step_n/` = safetensors (+ config, generation config, tokenizer), written to a temporary
name, renamed into place, then marked `STABLE`: a reader that sees `STABLE` sees a complete directory.
"""

import json
import shutil
from pathlib import Path

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from prime_rl.utils.fs import atomic_dir

STABLE = "STABLE"


def broadcast_dir(output_dir: Path, step: int) -> Path:
    return Path(output_dir) / "broadcasts" / f"step_{step}"


def weights_dir(output_dir: Path, step: int) -> Path:
    """Where `sft` exports the weights of `step` for `from_pretrained` and the inference server."""
    return Path(output_dir) / "weights" / f"step_{step}"


def full_state_dict(model, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Unsharded weights on rank 0's CPU (a collective: every rank must call it); empty on other ranks."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # stored once, as the embedding (what from_pretrained expects)
    return {name: tensor.to(dtype).contiguous() for name, tensor in state.items()}


def save_hf_dir(
    state: dict[str, torch.Tensor],
    model_config,
    tokenizer,
    target: Path,
    marker: str | None = None,
    generation_config=None,
) -> Path:
    """Write `state` as an HF model directory at `target`, atomically (tmp dir + rename, then `marker`).

    `generation_config` (the source model's) carries what config.json may lack, such as every end-of-turn token
    (Llama-3's config names only <|end_of_text|>, its generation_config also <|eot_id|>): without it, a server
    of the exported weights would not stop at the end of a turn.
    """
    target = Path(target)
    with atomic_dir(target) as tmp:
        split = split_torch_state_dict_into_shards(
            state, filename_pattern="model{suffix}.safetensors", max_shard_size="5GB"
        )
        for filename, names in split.filename_to_tensors.items():
            save_file({n: state[n] for n in names}, str(tmp / filename), metadata={"format": "pt"})
        if split.is_sharded:
            index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        model_config.save_pretrained(tmp)
        if generation_config is not None:  # written as is: save_pretrained would reject sampling flags without
            (tmp / "generation_config.json").write_text(generation_config.to_json_string())  # do_sample
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    if marker:
        (target / marker).touch()
    return target


def prune_broadcasts(output_dir: Path, current_step: int, max_async_level: int, keep: set[int]) -> list[int]:
    """Delete published steps inference can no longer need: older than `current_step - max_async_level`.

    The orchestrator may still be moving servers to any policy the async bound allows (>= n-1-k for batch
    n, and batch current_step+1 is the next). Steps in `keep` stay: the checkpoint steps a resume may start
    from (`CheckpointManager.live_steps`), whose weights the orchestrator serves first after resuming. A
    checkpoint step that `keep` no longer names (pruned by `keep_last`) goes, so the published directories
    stay O(max_async_level + kept checkpoints) however long the run.
    """
    oldest_needed = current_step - max_async_level
    removed = []
    root = Path(output_dir) / "broadcasts"
    for path in root.glob("step_*"):
        step = int(path.name.split("_")[1])
        if step < oldest_needed and step not in keep:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(step)
    return sorted(removed)
