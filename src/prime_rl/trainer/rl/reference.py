"""The frozen reference policy of the KL penalty (`[reference]`): its per-token logprobs for every micro-batch.

    reference = load_reference(config, world, model, adapters)   # None without [reference]
    ref_logp = reference.logprobs(batch, world)                   # [N] fp32, no graph; before the policy's forward
    compute_loss(..., ref_logprobs=ref_logp, beta=...)            # + beta * k3(pi, ref) on each kept token

The reference is built by the policy's own code (`model/build.py`'s `build_model`: FSDP2 shards, chunked log-prob head,
context parallelism) and scored by its forward (`forward_logprobs`, same temperatures), so before the first update
it gives exactly the policy's logprobs. It is frozen (no gradients, never in the optimizer, never checkpointed): a
resumed run loads it again from its name. With `model.lora` the default reference is the policy's own base with
every adapter off, which costs no second copy.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

from prime_rl.trainer.config import TrainerConfig
from prime_rl.trainer.model.build import SetupError, build_model, load_arch
from prime_rl.trainer.model.logprobs import forward_logprobs
from prime_rl.trainer.model.lora import LoRAAdapters
from prime_rl.trainer.packing import MicroBatch
from prime_rl.trainer.parallel.distributed import World


@dataclass
class Reference:
    model: nn.Module
    """The frozen reference (FSDP2-sharded, eval mode), or with `adapters` the policy itself."""
    adapters: LoRAAdapters | None = None
    """Set when `model` is the LoRA policy: its forward runs with every adapter off, i.e. the frozen base."""

    @torch.no_grad()
    def logprobs(self, batch: MicroBatch, world: World) -> Tensor:
        """Flat [B * L] logprobs of the micro-batch's tokens under the reference (0 at each piece's first token)."""
        with self.adapters.base_only() if self.adapters is not None else nullcontext():
            logp, _ = forward_logprobs(self.model, batch, world)
        if self.adapters is None:
            release(self.model)
        return logp.view(-1)


def release(model: nn.Module) -> None:
    """After a forward without backward: free the root's gathered parameters (FSDP2 keeps the root's unsharded
    after forward, for the backward that never comes) and forget the forward order FSDP2 records for backward
    prefetching, which only a backward clears (torch 2.13: it would grow by a few entries per micro-batch)."""
    if isinstance(model, FSDPModule):  # else a plain module (tests): nothing gathered, nothing recorded
        model.reshard()
        model._get_fsdp_state()._comm_ctx.post_forward_order.clear()


def load_reference(
    config: TrainerConfig, world: World, policy: nn.Module, adapters: LoRAAdapters | None = None
) -> Reference | None:
    """The reference of `config.reference` (None without one). `policy`: the built policy, whose vocabulary the
    reference must share; with `adapters` (LoRA) and no other `reference.model` it is the reference itself."""
    if config.reference is None:
        return None
    name = config.reference.model or config.model.name
    if adapters is not None and name == config.model.name:
        return Reference(policy, adapters)
    # The initial policy when `name` is the policy's own (the same seeded weights with `random_init`).
    random_init = config.model.random_init and name == config.model.name
    model_config = config.model.model_copy(update={"name": name, "lora": None, "ac": False, "random_init": random_init})
    try:
        arch = load_arch(model_config)
    except SetupError as e:  # only an explicit reference.model can fail here: the policy's loaded already
        raise SetupError(str(e).replace("model.name", "reference.model", 1)) from None
    vocab, policy_vocab = arch.get_text_config().vocab_size, policy.config.get_text_config().vocab_size
    if vocab != policy_vocab:
        raise SetupError(
            f"reference.model {name!r} has a vocabulary of {vocab} tokens, the policy {config.model.name!r} "
            f"{policy_vocab}: the reference must score the policy's tokens"
        )
    model = build_model(model_config, arch, world, config.seed)
    model.requires_grad_(False)
    model.eval()
    return Reference(model)
