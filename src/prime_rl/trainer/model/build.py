"""Build a Hugging Face causal LM as FSDP2 shards, without a full copy of the model on every rank.

    skeleton (parameters on the meta device, real buffers) -> chunked log-prob head -> activation checkpointing,
    compile, `fully_shard` -> materialise this rank's shards -> read them from the checkpoint (`loading.py`)

Buffers stay real throughout: rotary frequencies are computed in `__init__` and are not in the checkpoint.
"""

from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedConfig, PreTrainedModel

from prime_rl.trainer.config import TrainerModelConfig
from prime_rl.trainer.model.loading import checkpoint_plan, load_shards, scatter_from_rank0
from prime_rl.trainer.model.logprobs import install_logprob_head
from prime_rl.trainer.parallel.context_parallel import enable_context_parallel
from prime_rl.trainer.parallel.distributed import World

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class SetupError(Exception):
    """A setting that cannot work on this machine."""


def check_device(config: TrainerModelConfig, optim, device: torch.device) -> None:
    """Fail before loading anything when the settings need hardware this process does not have."""
    if config.cpu_offload and device.type != "cuda":
        raise SetupError("--model.cpu-offload keeps GPU weights in pinned CPU memory; it needs a CUDA device")
    if optim.cpu_offload and device.type != "cuda":
        raise SetupError("--optim.cpu-offload keeps optimizer state off the GPU; it needs a CUDA device")
    if optim.cpu_offload and config.cpu_offload:
        raise SetupError("--optim.cpu-offload is part of --model.cpu-offload (everything on the host): choose one")


def load_arch(config: TrainerModelConfig) -> PreTrainedConfig:
    try:
        return AutoConfig.from_pretrained(config.name, trust_remote_code=config.trust_remote_code)
    except OSError as e:  # a missing directory, an unknown hub id, no network
        raise SetupError(f"model.name {config.name!r}: {e}") from None


def export_dtype(arch: PreTrainedConfig, compute_dtype: str) -> torch.dtype:
    """Dtype the weights leave the trainer in, to the sampler and to disk: the checkpoint's own (bfloat16 where its
    config names none usable), but float32 where the trainer computes in float32.

    An fp32 policy rounded to a bf16 checkpoint's dtype is not the policy the trainer scores: the sampler would
    draw from other weights than those the gradient is taken at (the demo at k = 0: mismatch KL 8e-6 to 5e-4 on every
    step after the first, 7e-13 on the first, whose weights both sides read from the same file; ~1e-12 throughout now).
    """
    if compute_dtype == "float32":
        return torch.float32
    return arch.dtype if arch.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.bfloat16


@contextmanager
def parameters_on_meta():
    """Modules created inside get their parameters on the meta device and keep real buffers.

    A parameter is allocated (uninitialised: `torch.empty`, nothing touches it) and moved to meta as it is
    registered, before `reset_parameters` or HF's init could fill it, so building costs no memory or time.
    """
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def generation_config(config: TrainerModelConfig, default: GenerationConfig) -> GenerationConfig:
    """The checkpoint's generation config, as `from_pretrained` reads it: published weights keep every stop token
    it names (config.json may name fewer). `default` (derived from config.json) when there is none."""
    try:
        return GenerationConfig.from_pretrained(config.name, trust_remote_code=config.trust_remote_code)
    except OSError:
        return default


def ties_embeddings(model: PreTrainedModel) -> bool:
    return bool(model.config.get_text_config().tie_word_embeddings)


def tie_output_embeddings(model: PreTrainedModel) -> None:
    """When the config ties them, make the output layer's weight the very Parameter of the input embedding: one
    tensor to shard, train and checkpoint. Done again after materialising: replacing a shared meta parameter
    can leave each module its own copy (`to_empty` does on some torch versions; `check_tied` asserts the end)."""
    if ties_embeddings(model):
        model.get_output_embeddings().weight = model.get_input_embeddings().weight


def check_tied(model: PreTrainedModel) -> None:
    """Tied embeddings must still be one Parameter once the model is built (else they would train apart)."""
    if ties_embeddings(model) and model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
        raise RuntimeError(f"{type(model).__name__}: the tied output and input embeddings are separate tensors")


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
    return model


def materialise(model: nn.Module, device: torch.device) -> None:
    """Allocate this rank's (uninitialised) shards of every meta parameter on `device`.

    `to_empty` would also replace the buffers, which are real already (and which FSDP has put on its device),
    so only meta tensors are touched; FSDP's `_apply` then pads and registers the new shards (and pins them
    for CPU offload).
    """
    model._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t)


def build_model(config: TrainerModelConfig, arch: PreTrainedConfig, world: World, seed: int) -> PreTrainedModel:
    """The FSDP2-sharded model, fp32 master weights, with the chunked log-prob head as its output layer.

    Each rank reads only its shards from the safetensors files. A checkpoint whose names or shapes are not
    the model's (architectures transformers converts on load), or that some rank cannot read, is loaded by
    `from_pretrained` on rank 0 and scattered; so are seeded random weights (`random_init`: every rank would draw
    the same). `checkpoint_plan` makes every rank take the same of the two paths.
    """
    kwargs = dict(dtype=torch.float32, attn_implementation=config.attn, trust_remote_code=config.trust_remote_code)
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(arch, **kwargs)
    model.config.use_cache = False
    model.generation_config = generation_config(config, model.generation_config)
    install_logprob_head(model, config.logprob_chunk)
    if config.cp > 1:
        try:
            enable_context_parallel(model, config.cp)
        except ValueError as e:
            raise SetupError(str(e)) from None
    tie_output_embeddings(model)
    plan = None if config.random_init else checkpoint_plan(model, config.name, world)  # the same on every rank
    if config.lora is not None:  # only the adapters train (`lora.py`); FSDP2 reads requires_grad when it shards
        model.requires_grad_(False)

    shard_model(model, config, world)
    materialise(model, torch.device("cpu") if config.cpu_offload else world.device)
    tie_output_embeddings(model)

    if plan is not None:
        load_shards(model, plan)
    else:
        full = None
        if world.is_main and config.random_init:
            torch.manual_seed(seed)
            full = AutoModelForCausalLM.from_config(arch, **kwargs)
        elif world.is_main:
            full = AutoModelForCausalLM.from_pretrained(config.name, **kwargs)
        scatter_from_rank0(model, full)
        del full
    check_tied(model)
    return model
