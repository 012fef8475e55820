"""Fill an FSDP2-sharded model from a Hugging Face checkpoint, each rank reading only its own part of each tensor.

`checkpoint_plan` decides, on the unsharded skeleton, whether the safetensors files can be read as they are
(same names and shapes as the model's parameters and persistent buffers, and no value conversion registered
for the architecture); `load_shards` then reads `safe_open(file).get_slice(name)[a:b]` for this rank's
slice of every parameter, as given by its DTensor's local shape and global offset. Anything else goes
through `scatter_from_rank0`: one full model on rank 0, sent shard by shard to the ranks that own them.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from loguru import logger
from safetensors import safe_open
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"


@dataclass
class CheckpointPlan:
    """Where each tensor of the model lies: name -> safetensors file (names are the model's own)."""

    files: dict[str, Path]


def local_checkpoint_dir(name: str) -> Path | None:
    """The directory holding the safetensors files of `name` (a directory, or a hub id's local snapshot)."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download  # a transformers dependency; only for hub ids

    try:
        return Path(snapshot_download(name, allow_patterns=["*.safetensors", SAFETENSORS_INDEX]))
    except Exception as e:  # any hub failure: from_pretrained on rank 0 gets the chance to say what is wrong
        logger.warning(f"{name}: no local snapshot of its safetensors files ({e})")
        return None


def tensor_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it (empty when the directory has none)."""
    index = directory / SAFETENSORS_INDEX
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    single = directory / SAFETENSORS_SINGLE
    if not single.exists():
        return {}
    with safe_open(single, framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def tied_aliases(model: nn.Module) -> set[str]:
    """Names under which an already named parameter appears again (the output layer of tied embeddings)."""
    unique = {name for name, _ in model.named_parameters()}
    return {name for name, _ in model.named_parameters(remove_duplicate=False)} - unique


def converts_values(model: nn.Module) -> bool:
    """Whether transformers registers a conversion for this architecture that is more than renaming keys."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    return any(not isinstance(t, WeightRenaming) for t in get_model_conversion_mapping(model))


def checkpoint_plan(model: nn.Module, name: str) -> CheckpointPlan | None:
    """Read the checkpoint directly when its tensors are exactly the model's (call on the unsharded
    skeleton); None, with the reason logged, when it has to go through `from_pretrained`."""
    directory = local_checkpoint_dir(name)
    files = tensor_files(directory) if directory is not None else {}
    aliases = tied_aliases(model)
    expected = {n: tuple(t.shape) for n, t in model.state_dict().items() if n not in aliases}
    reason = None
    if not files:
        reason = "no safetensors files"
    elif converts_values(model):
        reason = f"transformers converts {type(model).__name__} checkpoints on load"
    elif missing := sorted(set(expected) - set(files)):
        reason = f"the checkpoint lacks {missing[:3]} (names differ from the model's)"
    elif unknown := sorted(set(files) - set(expected) - aliases):
        reason = f"the checkpoint has tensors the model does not name: {unknown[:3]}"
    else:
        with ExitStack() as stack:
            opened = {f: stack.enter_context(safe_open(f, framework="pt")) for f in set(files.values())}
            shapes = {n: tuple(opened[files[n]].get_slice(n).get_shape()) for n in expected}
        if wrong := [n for n in expected if shapes[n] != expected[n]]:
            reason = f"{wrong[0]} has shape {shapes[wrong[0]]} in the checkpoint, {expected[wrong[0]]} in the model"
    if reason is not None:
        logger.info(f"{name}: {reason}; rank 0 loads it with from_pretrained and scatters the shards")
        return None
    return CheckpointPlan({n: files[n] for n in expected})


@torch.no_grad()
def load_shards(model: nn.Module, plan: CheckpointPlan) -> None:
    """Copy this rank's part of every planned tensor into the (materialised, sharded) model: sharded
    parameters read only their slice, unsharded tensors (buffers) the whole tensor. The cast to the model's
    dtype (fp32 master weights) is exact, as `from_pretrained` does it."""
    targets = dict(model.state_dict(keep_vars=True))
    with ExitStack() as stack:
        opened = {f: stack.enter_context(safe_open(f, framework="pt")) for f in set(plan.files.values())}
        for name, file in plan.files.items():
            target = targets[name]
            if isinstance(target, DTensor):
                local = target.to_local()
                shape, offset = compute_local_shape_and_global_offset(
                    target.shape, target.device_mesh, target.placements
                )
                assert tuple(local.shape) == tuple(shape), (name, tuple(local.shape), shape)
                if local.numel() == 0:  # a tensor with fewer rows than ranks
                    continue
                local.copy_(
                    opened[file].get_slice(name)[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
                )
            else:
                target.copy_(opened[file].get_tensor(name))


def scatter_from_rank0(model: nn.Module, full: nn.Module | None) -> None:
    """Rank 0's full model (`full`; None on the other ranks) into every rank's shards (a collective)."""
    state = full.state_dict() if full is not None else {}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, state, options=options)
