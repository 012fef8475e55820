"""Load a Hugging Face causal LM and shard it with FSDP2."""

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from prime_rl.trainer.config import TrainerModelConfig
from prime_rl.trainer.distributed import World

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class SetupError(Exception):
    """A setting that cannot work on this machine."""


def check_device(config: TrainerModelConfig, device: torch.device) -> None:
    """Fail before loading anything when the model settings need hardware this process does not have."""
    if config.cpu_offload and device.type != "cuda":
        raise SetupError("--model.cpu-offload keeps GPU weights in pinned CPU memory; it needs a CUDA device")


def stored_dtype(config: TrainerModelConfig) -> torch.dtype:
    """Dtype of the checkpoint (per its config): exported weights go back to it; bfloat16 when it is unusable."""
    arch = AutoConfig.from_pretrained(config.name, trust_remote_code=config.trust_remote_code)
    return arch.dtype if arch.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.bfloat16


def load_model(config: TrainerModelConfig, seed: int) -> PreTrainedModel:
    """fp32 master weights on CPU: from the checkpoint, or random (same seed on every rank => same init)."""
    kwargs = dict(dtype=torch.float32, attn_implementation=config.attn, trust_remote_code=config.trust_remote_code)
    if config.random_init:
        arch = AutoConfig.from_pretrained(config.name, trust_remote_code=config.trust_remote_code)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(arch, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(config.name, **kwargs)
    model.config.use_cache = False
    return model


def decoder_layers(model: PreTrainedModel) -> torch.nn.ModuleList:
    for path in ("model.layers", "model.decoder.layers", "transformer.h"):
        module = model
        for part in path.split("."):
            module = getattr(module, part, None)
        if isinstance(module, torch.nn.ModuleList):
            return module
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")


def shard_model(model: PreTrainedModel, config: TrainerModelConfig, world: World) -> PreTrainedModel:
    """Activation checkpointing -> compile -> `fully_shard` per decoder layer, then the root."""
    if config.ac:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = decoder_layers(model)
    if config.compile:
        for layer in layers:
            layer.compile()
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[config.dtype], reduce_dtype=torch.float32)
    kwargs = dict(mesh=world.mesh, mp_policy=mp)
    if config.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # Every rank's loss is already divided by the whole step's token count, so gradients must be
            # summed over ranks; FSDP's default averages (divides by the world size). Gloo has no
            # PREMUL_SUM, hence the plain-sum collectives.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    if not config.cpu_offload:
        model.to(world.device)
    return model
