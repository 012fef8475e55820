"""Publish the trainer's weights as a Hugging Face directory the inference server can load.

`broadcasts/step_n/` = safetensors (+ config, generation config, tokenizer), written to a temporary
name, renamed into place, then marked `STABLE`: a reader that sees `STABLE` sees a complete directory.

Weights with a NaN or an infinity are never published (`NonFiniteWeights`, naming the tensor): a diverged policy
would be served as NaN, and the servers refuse it anyway (422). The check is of the values as published, cast to the
export dtype (a float32 value beyond float16's range is an infinity once exported).
"""

import json
import math
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from prime_rl.utils.fs import atomic_dir

STABLE = "STABLE"


def broadcast_dir(output_dir: Path, step: int) -> Path:
    return Path(output_dir) / "broadcasts" / f"step_{step}"


def weights_dir(output_dir: Path, step: int) -> Path:
    """Where `sft` exports the weights of `step` for `from_pretrained` and the inference server."""
    return Path(output_dir) / "weights" / f"step_{step}"


class NonFiniteWeights(RuntimeError):
    """Weights about to be published hold a NaN or an infinity (the policy diverged): they are not published."""


def all_finite(tensor: torch.Tensor) -> bool:
    """No NaN or infinity in `tensor`: a non-finite element makes the sum non-finite, so a finite sum (one pass, no
    mask) settles it; a non-finite sum (or finite values that overflowed it) is checked exactly."""
    return math.isfinite(tensor.sum(dtype=torch.float32).item()) or bool(torch.isfinite(tensor).all())


def nonfinite_tensor_name(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> str | None:
    """The first of `tensors` (in order) that holds a NaN or an infinity once cast to `dtype`, or None."""
    return next((name for name, tensor in tensors.items() if not all_finite(tensor.to(dtype))), None)


def nonfinite_parameter(model: torch.nn.Module, dtype: torch.dtype) -> str | None:
    """Every rank (a collective): the first parameter of `model` that holds a NaN or an infinity, cast to `dtype`, in
    any rank's shard, or None. Each rank reads its own shards only (no gather); one MIN all-reduce of the index."""
    named = [(name, p.detach()) for name, p in model.named_parameters()]
    local = {name: p.to_local() if isinstance(p, DTensor) else p for name, p in named}
    first = next((i for i, name in enumerate(local) if not all_finite(local[name].to(dtype))), len(named))
    if dist.is_initialized() and dist.get_world_size() > 1:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        index = torch.tensor([first], dtype=torch.int64, device=device)
        dist.all_reduce(index, op=dist.ReduceOp.MIN)
        first = int(index.item())
    return named[first][0] if first < len(named) else None


def check_finite(model: torch.nn.Module, dtype: torch.dtype, what: str) -> None:
    """Every rank (a collective): `NonFiniteWeights` on every rank if any parameter holds a NaN or an infinity.
    `what` names the weights in the message ("policy step 7")."""
    name = nonfinite_parameter(model, dtype)
    if name is not None:
        raise NonFiniteWeights(
            f"{what} has non-finite values (NaN or inf) in {name}: the training diverged, nothing is published"
        )


def full_state_dict(model, dtype: torch.dtype, what: str = "the model to publish") -> dict[str, torch.Tensor]:
    """Unsharded weights on rank 0's CPU (a collective: every rank must call it); empty on other ranks.
    `NonFiniteWeights` on every rank, before anything is gathered, for weights with a NaN or an infinity (`what`
    names them in the message)."""
    check_finite(model, dtype, what)
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
