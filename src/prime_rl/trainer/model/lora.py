"""LoRA adapters for the trainer: per run slot, a low-rank update of every target linear layer of the frozen base.

    adapters = LoRAAdapters(model, config.model.lora, slots)   # hooks on the target layers; base frozen
    adapters.reset_slot(slot, seed)                            # A ~ kaiming-uniform(a=sqrt(5)), B = 0: the base model
    with adapters.tokens(batch.slots):                         # which slot each token of the forward trains
        loss.backward()
    adapters.all_reduce_grads(slots, world)                    # every rank holds the same replica
    with torch.no_grad(), adapters.base_only():                # every adapter off: the frozen base alone,
        ref_logp = forward(...)                                # the KL penalty's reference (`rl/reference.py`)

A target layer computes `base(x) + (alpha / r) * B_s A_s dropout(x)` for the tokens of slot `s`; padding (slot -1) gets
the base alone. The base is sharded by FSDP2 and frozen; adapters are small (r x (in + out) per layer), so every rank
holds a full replica of each and their gradients are summed over ranks once per step, as DDP would. That keeps them out
of FSDP's per-layer collectives, which need the same parameters with gradients on every rank: in a multi-run step one
rank may see only run a's rows and another only run b's.

Why not peft's layers: peft's forward with several adapters in one batch (`adapter_names`) refuses training mode, and
switching the active adapter per micro-batch would again leave ranks with different parameters to reduce. peft defines
the exported format (`LoraConfig.save_pretrained`) and loads the export in the tests.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import Tensor, nn

from prime_rl.trainer.config import LoRAConfig
from prime_rl.utils.fs import atomic_dir

ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
"""What peft puts before a module's path in the names of an exported adapter's tensors."""


class LoRAAdapters(nn.Module):
    """Every slot's A and B for every target layer (`A[path][slot]`: [r, in], `B[path][slot]`: [out, r], fp32)."""

    def __init__(self, model: nn.Module, config: LoRAConfig, slots: int, device: torch.device):
        super().__init__()
        self.config, self.slots = config, slots
        self.scaling = config.alpha / config.rank
        self.dropout = nn.Dropout(config.dropout)
        self.targets: dict[str, nn.Linear] = {}
        for path, module in model.named_modules():
            if path.rsplit(".", 1)[-1] in config.target_modules and isinstance(module, nn.Linear):
                self.targets[path] = module
        missing = set(config.target_modules) - {p.rsplit(".", 1)[-1] for p in self.targets}
        if missing:
            raise ValueError(f"model.lora.target_modules: no linear layer named {sorted(missing)} in the model")
        self.A = nn.ModuleDict()
        self.B = nn.ModuleDict()
        for path, layer in self.targets.items():
            key = path.replace(".", "/")  # ModuleDict keys cannot hold dots
            self.A[key] = nn.ParameterList(
                [nn.Parameter(torch.zeros(config.rank, layer.in_features, device=device)) for _ in range(slots)]
            )
            self.B[key] = nn.ParameterList(
                [nn.Parameter(torch.zeros(layer.out_features, config.rank, device=device)) for _ in range(slots)]
            )
            layer.register_forward_hook(self._hook(key))
        self.token_slots: Tensor | None = None
        self.present: list[int] = []
        self.whole_slot: int | None = None

    def _hook(self, key: str):
        def add_lora(_module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> Tensor:
            if self.token_slots is None:
                raise RuntimeError("a LoRA model runs inside `adapters.tokens(slots)`: which adapter each token uses")
            x = inputs[0].reshape(-1, inputs[0].shape[-1])
            out = output.reshape(-1, output.shape[-1])
            slots = self.token_slots.reshape(-1)
            for slot in self.present:
                a, b = self.A[key][slot], self.B[key][slot]
                if self.whole_slot == slot:  # every token: no gather (the single-run case)
                    return output + self._delta(x, a, b).view_as(output)
                index = (slots == slot).nonzero().squeeze(1)
                out = out.index_add(0, index, self._delta(x.index_select(0, index), a, b))
            return out.view_as(output)

        return add_lora

    def _delta(self, x: Tensor, a: Tensor, b: Tensor) -> Tensor:
        return (self.dropout(x) @ a.to(x.dtype).t() @ b.to(x.dtype).t()) * self.scaling

    @contextmanager
    def tokens(self, token_slots: Tensor, carrier: int):
        """Forward (and backward: activation checkpointing runs the forward again) with each token's slot.

        Padding tokens (-1) run through slot `carrier`'s adapter: they have no loss, so its gradient gets exact zeros
        from them, and a rank with only padding still runs backward through every layer. It must: backward gathers
        each FSDP layer's weights on every rank together."""
        token_slots = torch.where(token_slots < 0, carrier, token_slots)
        self.token_slots = token_slots
        self.present = [s for s in torch.unique(token_slots).tolist() if s >= 0]
        self.whole_slot = self.present[0] if len(self.present) == 1 else None
        try:
            yield
        finally:
            self.token_slots = None

    @contextmanager
    def base_only(self):
        """Forward through the frozen base alone, every adapter off (the reference of `[reference]`'s KL penalty)."""
        self.token_slots, self.present, self.whole_slot = torch.empty(0, dtype=torch.long), [], None
        try:
            yield
        finally:
            self.token_slots = None

    def slot_params(self, slot: int) -> list[nn.Parameter]:
        return [p for key in self.A for p in (self.A[key][slot], self.B[key][slot])]

    @torch.no_grad()
    def reset_slot(self, slot: int, seed: int) -> None:
        """A fresh adapter in `slot`: A kaiming-uniform (a = sqrt(5), as nn.Linear and peft), B zero. Drawn on the CPU
        from `seed` alone, so every rank draws the same and a run starts the same in whatever slot it lands."""
        generator = torch.Generator().manual_seed(seed)
        for key in self.A:
            a = self.A[key][slot]
            bound = 1 / math.sqrt(a.shape[1])  # kaiming_uniform_(a=sqrt(5)) on [r, in]: gain sqrt(1/3) * sqrt(3 / in)
            a.copy_(torch.empty(a.shape).uniform_(-bound, bound, generator=generator))
            self.B[key][slot].zero_()
        for p in self.slot_params(slot):
            p.grad = None

    def all_reduce_grads(self, slots: list[int], world_size: int) -> None:
        """Sum the gradients of `slots` over the ranks (a slot a rank did not see has none there: zeros)."""
        params = [p for slot in slots for p in self.slot_params(slot)]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if world_size > 1 and params:
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat)
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()

    # -- the adapter as files ------------------------------------------------------------------------------

    def state(self, slot: int) -> dict[str, Tensor]:
        """The slot's adapter under peft's tensor names (`base_model.model.<layer>.lora_A.weight`), fp32 on the CPU."""
        state = {}
        for path in self.targets:
            key = path.replace(".", "/")
            state[f"{PEFT_PREFIX}{path}.lora_A.weight"] = self.A[key][slot].detach().cpu().clone()
            state[f"{PEFT_PREFIX}{path}.lora_B.weight"] = self.B[key][slot].detach().cpu().clone()
        return state

    @torch.no_grad()
    def load_state(self, slot: int, state: dict[str, Tensor]) -> None:
        """Fill `slot` from `state()`'s form; every tensor must be there with its shape."""
        expected = self.state(slot)
        if set(state) != set(expected):
            raise ValueError(f"adapter tensors differ: missing {sorted(set(expected) - set(state))[:3]}, "
                             f"unexpected {sorted(set(state) - set(expected))[:3]}")  # fmt: skip
        for path in self.targets:
            key = path.replace(".", "/")
            for name, param in (("lora_A", self.A[key][slot]), ("lora_B", self.B[key][slot])):
                param.copy_(state[f"{PEFT_PREFIX}{path}.{name}.weight"])

    def peft_config(self, base_model: str):
        from peft import LoraConfig

        return LoraConfig(
            r=self.config.rank,
            lora_alpha=self.config.alpha,
            lora_dropout=self.config.dropout,
            target_modules=sorted(self.config.target_modules),
            base_model_name_or_path=base_model,
            task_type="CAUSAL_LM",
            bias="none",
        )

    def save(self, slot: int, target: Path, base_model: str, dtype: torch.dtype, marker: str | None = None) -> Path:
        """Write the slot's adapter as a peft adapter directory (what `PeftModel.from_pretrained` and vLLM load),
        atomically; `marker` (e.g. STABLE) is touched once it is complete."""
        target = Path(target)
        state = {name: t.to(dtype).contiguous() for name, t in self.state(slot).items()}
        with atomic_dir(target) as tmp:
            save_file(state, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
            self.peft_config(base_model).save_pretrained(str(tmp))
        if marker:
            (target / marker).touch()
        return target
