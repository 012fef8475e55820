"""Fill an FSDP2-sharded model from a Hugging Face checkpoint, each rank reading only its own part of each tensor.

`checkpoint_plan` decides, on the unsharded skeleton, whether the safetensors files can be read as they are
(same names and shapes as the model's parameters and persistent buffers, and no value conversion registered
for the architecture); `load_shards` then reads `safe_open(file).get_slice(name)[a:b]` for this rank's
slice of every parameter, as given by its DTensor's local shape and global offset. Anything else goes
through `scatter_from_rank0`: one full model on rank 0, sent shard by shard to the ranks that own them.

The scatter is a collective, so every rank must take the same path: rank 0 decides and broadcasts the plan,
then every rank checks that it can open the planned files (another node may not see them) and the ranks
agree before anyone reads a shard; if one rank cannot, all of them scatter.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from loguru import logger
from safetensors import safe_open
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from prime_rl.trainer.parallel.distributed import World, broadcast_object

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
SCATTER = "rank 0 loads it with from_pretrained and scatters the shards"


@dataclass
class CheckpointPlan:
    """Where each tensor of the model lies: name -> safetensors file in `directory` (names are the model's own).

    File names are relative so that a rank that does not see rank 0's directory can use its own copy."""

    directory: Path
    files: dict[str, str]

    def paths(self) -> dict[str, Path]:
        return {file: self.directory / file for file in set(self.files.values())}


def local_checkpoint_dir(name: str) -> Path:
    """The directory holding the safetensors files of `name` (a directory, or a hub id's snapshot in this node's
    cache). Raises when there is none (an unknown id, no network, no access): the caller says why."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download  # a transformers dependency; only for hub ids

    return Path(snapshot_download(name, allow_patterns=["*.safetensors", SAFETENSORS_INDEX]))


def tensor_files(directory: Path) -> dict[str, str]:
    """Tensor name -> the safetensors file (relative to `directory`) that holds it (empty when there is none)."""
    index = directory / SAFETENSORS_INDEX
    if index.exists():
        return dict(json.loads(index.read_text())["weight_map"])
    single = directory / SAFETENSORS_SINGLE
    if not single.exists():
        return {}
    with safe_open(single, framework="pt") as f:
        return dict.fromkeys(f.keys(), SAFETENSORS_SINGLE)


def tied_aliases(model: nn.Module) -> set[str]:
    """Names under which an already named parameter appears again (the output layer of tied embeddings)."""
    unique = {name for name, _ in model.named_parameters()}
    return {name for name, _ in model.named_parameters(remove_duplicate=False)} - unique


def converts_values(model: nn.Module) -> bool:
    """Whether transformers registers a conversion for this architecture that is more than renaming keys."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    return any(not isinstance(t, WeightRenaming) for t in get_model_conversion_mapping(model))


def unreadable(plan: CheckpointPlan, expected: dict[str, tuple[int, ...]]) -> str | None:
    """Why this rank cannot read every planned tensor with the model's shape (None when it can). Only the
    files' headers are read."""
    try:
        with ExitStack() as stack:
            opened = {f: stack.enter_context(safe_open(path, framework="pt")) for f, path in plan.paths().items()}
            for name, file in plan.files.items():
                shape = tuple(opened[file].get_slice(name).get_shape())
                if shape != expected[name]:
                    return f"{name} has shape {shape} in the checkpoint, {expected[name]} in the model"
    except Exception as e:  # a missing or unreadable file, a file without the tensor
        return f"{type(e).__name__}: {e}"
    return None


def rank0_plan(model: nn.Module, name: str, expected: dict[str, tuple[int, ...]]) -> CheckpointPlan | None:
    """Rank 0's decision: the plan when the checkpoint's tensors are exactly the model's; None, with the reason
    logged, when it has to go through `from_pretrained`."""
    try:
        directory = local_checkpoint_dir(name)
    except Exception as e:  # any hub failure; from_pretrained may still find the checkpoint (or say why not)
        logger.warning(f"{name}: no local copy of its safetensors files ({type(e).__name__}: {e}); {SCATTER}")
        return None
    files = tensor_files(directory)
    aliases = tied_aliases(model)
    reason = None
    if not files:
        reason = f"no safetensors files in {directory}"
    elif converts_values(model):
        reason = f"transformers converts {type(model).__name__} checkpoints on load"
    elif missing := sorted(set(expected) - set(files)):
        reason = f"the checkpoint lacks {missing[:3]} (names differ from the model's)"
    elif unknown := sorted(set(files) - set(expected) - aliases):
        reason = f"the checkpoint has tensors the model does not name: {unknown[:3]}"
    else:
        plan = CheckpointPlan(directory, {n: files[n] for n in expected})
        reason = unreadable(plan, expected)
    if reason is not None:
        logger.info(f"{name}: {reason}; {SCATTER}")
        return None
    return plan


def this_ranks_plan(plan: CheckpointPlan, name: str) -> CheckpointPlan:
    """Rank 0's plan, read from rank 0's directory when this rank sees it (one node, a shared file system), else
    from this rank's own copy of `name` (a hub id's snapshot in this node's cache). Raises when there is none."""
    if plan.directory.is_dir():
        return plan
    return CheckpointPlan(local_checkpoint_dir(name), plan.files)


def checkpoint_plan(model: nn.Module, name: str, world: World) -> CheckpointPlan | None:
    """This rank's plan for reading its shards directly, or None on every rank when they must all take the
    scatter instead (a collective: a rank reading shards meanwhile would leave the others waiting in it).

    Call on every rank, on the unsharded skeleton. Rank 0 decides; every rank then checks that it can read the
    planned files and all learn which could not, so that they take the same path."""
    aliases = tied_aliases(model)
    expected = {n: tuple(t.shape) for n, t in model.state_dict().items() if n not in aliases}
    plan = broadcast_object(rank0_plan(model, name, expected) if world.is_main else None, world)
    if plan is None:
        return None
    try:
        plan = this_ranks_plan(plan, name)
    except Exception as e:  # no hub snapshot on this node
        problem = f"rank {world.rank} cannot see {plan.directory} and has no copy of its own ({type(e).__name__}: {e})"
    else:
        if (problem := unreadable(plan, expected)) is not None:
            problem = f"rank {world.rank} cannot read {plan.directory}: {problem}"
    problems = [None] * world.world_size
    dist.all_gather_object(problems, problem)
    problems = [p for p in problems if p is not None]
    if problems:
        if world.is_main:
            logger.warning(f"{name}: {'; '.join(problems)}; {SCATTER}")
        return None
    return plan


@torch.no_grad()
def load_shards(model: nn.Module, plan: CheckpointPlan) -> None:
    """Copy this rank's part of every planned tensor into the (materialised, sharded) model: sharded
    parameters read only their slice, unsharded tensors (buffers) the whole tensor. The cast to the model's
    dtype (fp32 master weights) is exact, as `from_pretrained` does it."""
    targets = dict(model.state_dict(keep_vars=True))
    with ExitStack() as stack:
        opened = {f: stack.enter_context(safe_open(path, framework="pt")) for f, path in plan.paths().items()}
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
