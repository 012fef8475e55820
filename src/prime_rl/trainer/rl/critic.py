"""PPO's learned critic: a value model trained beside the policy, and GAE advantages from its values.

    critic = build_critic(config, world, max_steps, resume_step, progress)  # a `Run`: FSDP2 value model, optimizer
    samples = [with_token_rewards(s) for s in samples]  # rank 0: rows carry each token's reward as its "advantage"
    prepared, sums = prepare(critic.model, rows, config.critic, world)  # V_old (no grad) -> GAE -> rows' advantages
    ... the policy trains on the rows as usual ...
    sums, grad_norm = train_values(critic, rows, prepared, loss_scale, config.critic, world)  # `epochs` value steps

A sample is one trajectory: its sampled (`loss_mask`) tokens in order, environment tokens between turns skipped.
Its reward comes on the last sampled token, 0 before; V(s_t) is the value head on the hidden state that predicts
token t (the one at position t - 1), and the value after the last sampled token is 0 (terminal). The values are
computed here, at train time, by the critic as of this step, for tokens that a policy up to `max_async_level`
steps older sampled (docs/algorithms.md, "PPO with a learned critic").
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import torch
from loguru import logger
from torch import Tensor, nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from transformers import AutoModel

from prime_rl.batch import TrainingSample
from prime_rl.config.optim import ConstantSchedulerConfig
from prime_rl.trainer.ckpt import COMPLETE, CheckpointManager, Progress, step_dir
from prime_rl.trainer.config import CriticConfig, TrainerModelConfig
from prime_rl.trainer.model.build import (
    SetupError,
    check_device,
    export_dtype,
    load_arch,
    materialise,
    parameters_on_meta,
    shard_model,
)
from prime_rl.trainer.model.loading import scatter_from_rank0
from prime_rl.trainer.model.logprobs import model_attention_mask, shift_to_tokens
from prime_rl.trainer.optim import build_optimizer, build_scheduler
from prime_rl.trainer.packing import MicroBatch, PackedRow, collate
from prime_rl.trainer.parallel.distributed import World
from prime_rl.trainer.scaffold import Run

CHECKPOINT_NAME = "critic"
"""The critic's subdirectory of `checkpoints/step_n/` (the policy's is `trainer`)."""


# ---------------------------------------------------------------------------------------------------------
# The math: pure functions on flat per-token tensors (as in loss.py), each sample's tokens in order.


def gae(rewards: Tensor, values: Tensor, loss_mask: Tensor, sample_ids: Tensor, gamma: float, lam: float) -> Tensor:
    """Per-token GAE advantages over each sample's sampled tokens; 0 off the loss mask.

    Over sample i's loss tokens t_0 < t_1 < ... < t_{T-1} (other tokens are skipped, not steps):
    delta_k = r_k + gamma * V_{k+1} - V_k with V_T = 0, and A_k = delta_k + gamma * lam * A_{k+1}, A_T = 0.
    With gamma = lam = 1 and V = 0, A_k is the sum of the rewards from k on (REINFORCE's return). Computed in
    float64 on the host in one backward sweep: a sequential scan, O(tokens).
    """
    n = rewards.shape[0]
    for name, tensor in (("values", values), ("loss_mask", loss_mask), ("sample_ids", sample_ids)):
        if tensor.shape != (n,):
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected ({n},)")
    r = rewards.detach().double().cpu().tolist()
    v = values.detach().double().cpu().tolist()
    mask = loss_mask.bool().cpu().tolist()
    ids = sample_ids.cpu().tolist()
    advantages = [0.0] * n
    next_value: dict[int, float] = {}
    next_advantage: dict[int, float] = {}
    for t in range(n - 1, -1, -1):
        if not mask[t]:
            continue
        sample = ids[t]
        delta = r[t] + gamma * next_value.get(sample, 0.0) - v[t]
        advantages[t] = delta + gamma * lam * next_advantage.get(sample, 0.0)
        next_value[sample], next_advantage[sample] = v[t], advantages[t]
    return torch.tensor(advantages, dtype=torch.float64).to(device=rewards.device, dtype=rewards.dtype)


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, loss_mask: Tensor, clip: float, loss_scale: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped value loss, Σ over loss tokens of 0.5 * max((V - R)^2, (V_old + clip(V - V_old, ±clip) - R)^2),
    divided by `loss_scale` (the step's loss tokens, as `compute_loss` does), and detached stats.

    The max is pessimistic: a value that moved more than `clip` from V_old, away from R, keeps the larger error
    of its clipped value, whose gradient is 0. Where the two terms tie the unclipped one (gradient V - R) is taken.
    """
    mask = loss_mask.bool()
    old_values, returns = old_values.detach(), returns.detach()
    unclipped = (values - returns) ** 2
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    clipped = (clipped_values - returns) ** 2
    binds = mask & (clipped > unclipped)
    per_token = 0.5 * torch.where(binds, clipped, unclipped)
    loss = torch.where(mask, per_token, 0.0).sum() / loss_scale
    stats = {"value_loss": loss.detach().double(), "value_clipped_tokens": binds.sum().double()}
    return loss, stats


def with_token_rewards(sample: TrainingSample) -> TrainingSample:
    """The sample with its reward on its last sampled token and 0 elsewhere, in place of its advantages: what the
    rows of a critic run carry in their `advantages` field until `prepare` replaces them by GAE advantages."""
    rewards = [0.0] * len(sample.token_ids)
    last = next((t for t in range(len(sample.loss_mask) - 1, -1, -1) if sample.loss_mask[t]), None)
    if last is not None:
        rewards[last] = sample.reward
    return msgspec.structs.replace(sample, advantages=rewards)


# ---------------------------------------------------------------------------------------------------------
# The value model.


class ValueModel(nn.Module):
    """A causal LM's trunk (transformers' base model, loaded by its own code) and a scalar head on its final hidden
    states. Parameter names are the causal LM checkpoint's (`model.layers.0...`) plus `value_head.*`.

    The head starts at zero (weight and bias): the first step's values are 0, so the first advantages are the
    rewards-to-go, as with REINFORCE, and the trunk gets gradient once the head has moved off zero.
    """

    def __init__(self, trunk: nn.Module, hidden_size: int):
        super().__init__()
        self.model = trunk
        self.value_head = nn.Linear(hidden_size, 1)

    def gradient_checkpointing_enable(self, **kwargs) -> None:  # `shard_model`'s activation checkpointing
        self.model.gradient_checkpointing_enable(**kwargs)

    def forward(self, input_ids: Tensor, position_ids: Tensor) -> Tensor:
        """[B, L] -> [B, L] fp32 values of the states after each position (packed samples: positions restart at 0;
        shared prompts: `shared_prompt_mask`)."""
        mask = model_attention_mask(self.model, position_ids, self.model.get_input_embeddings().weight.dtype)
        hidden = self.model(
            input_ids=input_ids, position_ids=position_ids, attention_mask=mask, use_cache=False
        ).last_hidden_state
        values = self.value_head(hidden.float().reshape(-1, hidden.shape[-1]))  # 2-D: a matmul's own output
        return values.view(input_ids.shape).clone()  # not a view: FSDP hooks the outputs of its modules


def build_value_model(config: TrainerModelConfig, world: World) -> ValueModel:
    """The FSDP2-sharded value model: the trunk sharded as the policy is (`shard_model`), the head in fp32 in a unit
    of its own; rank 0 loads the trunk with `AutoModel.from_pretrained` and scatters the shards."""
    arch = load_arch(config)
    kwargs = dict(dtype=torch.float32, attn_implementation=config.attn, trust_remote_code=config.trust_remote_code)
    hidden_size = arch.get_text_config().hidden_size
    with parameters_on_meta():
        model = ValueModel(AutoModel.from_config(arch, **kwargs), hidden_size)
    model.model.config.use_cache = False
    offload = {"offload_policy": CPUOffloadPolicy()} if config.cpu_offload else {}  # as `shard_model` does
    fully_shard(model.value_head, mesh=world.mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32), **offload)
    shard_model(model, config, world)  # per decoder layer, then the root; gradients summed over ranks
    materialise(model, torch.device("cpu") if config.cpu_offload else world.device)
    full = None
    if world.is_main:
        full = ValueModel(AutoModel.from_pretrained(config.name, **kwargs), hidden_size)
        nn.init.zeros_(full.value_head.weight)
        nn.init.zeros_(full.value_head.bias)
    scatter_from_rank0(model, full)
    del full
    return model


def build_critic(config, world: World, max_steps: int | None, resume_step: int | None, progress: Progress) -> Run:
    """The critic as a `Run` (value model, its optimizer, a constant schedule, checkpoints under `critic/`),
    restored from `checkpoints/step_{resume_step}/critic` when the policy resumed from that step."""
    critic: CriticConfig = config.critic
    model_config = config.model.model_copy(update={"name": critic.model or config.model.name})
    check_device(model_config, critic.optim, world.device)
    vocab, policy_vocab = (load_arch(c).get_text_config().vocab_size for c in (model_config, config.model))
    if vocab < policy_vocab:
        raise SetupError(
            f"critic.model {model_config.name!r} has a vocabulary of {vocab} tokens, fewer than the policy's "
            f"{policy_vocab}: the value model reads the policy's token ids (use a model of the same tokenizer)"
        )
    model = build_value_model(model_config, world)
    optimizer = build_optimizer(model.parameters(), critic.optim)
    scheduler = build_scheduler(optimizer, ConstantSchedulerConfig(), max_steps)
    ckpt = None
    if config.ckpt is not None:
        ckpt = CheckpointManager(config.output_dir, config.ckpt, world.is_main, CHECKPOINT_NAME)  # the policy's cadence
    if resume_step is not None and resume_step > 0:
        if not (step_dir(config.output_dir, resume_step, CHECKPOINT_NAME) / COMPLETE).exists():
            raise FileNotFoundError(
                f"{step_dir(config.output_dir, resume_step, CHECKPOINT_NAME)}: no complete critic checkpoint to "
                f"resume step {resume_step} with (was that run started without [critic]?)"
            )
        ckpt.load(resume_step, model, optimizer, scheduler)
        logger.info(f"critic resumed from step {resume_step}")
    params = sum(p.numel() for p in model.parameters()) / 1e6
    logger.info(f"critic: value model on {model_config.name}, {params:.2f}M params")
    offload = world.device if critic.optim.cpu_offload else None
    dtype = export_dtype(load_arch(model_config), model_config.dtype)
    return Run(model, optimizer, scheduler, ckpt, progress, dtype, offload)


# ---------------------------------------------------------------------------------------------------------
# One step.


@dataclass
class PreparedRow:
    """What the value pass at the step's start leaves for the value loss, per row (on the row's device)."""

    old_values: Tensor
    returns: Tensor


def row_values(model: ValueModel, row: PackedRow, world: World) -> tuple[Tensor, MicroBatch]:
    """V(s_t) for every token of `row` ([L] fp32, 0 at each piece's first token: `shift_to_tokens`) and the row on
    the device. One row per forward: every rank has as many rows as the others (`shard_rows`), so as many forwards."""
    batch = collate([row], concatenate=True).to(world.device)
    values = model(batch.input_ids, batch.position_ids)
    return shift_to_tokens(values, batch.position_ids).view(-1), batch


@torch.no_grad()
def prepare(model: ValueModel, rows: list[PackedRow], config: CriticConfig, world: World) -> tuple[list, dict]:
    """The values at the step's start (V_old), GAE advantages written into each row's `advantages` (which held the
    token rewards, `with_token_rewards`) and the returns A + V_old; plus this rank's sums for the metrics."""
    prepared = []
    sums = dict.fromkeys(("values_sum", "returns_sum", "returns_sq_sum", "error_sum", "error_sq_sum"), 0.0)
    model.eval()
    for row in rows:
        values, batch = row_values(model, row, world)
        mask, ids = batch.loss_mask.view(-1), batch.sample_ids.view(-1)
        advantages = gae(batch.advantages.view(-1), values, mask, ids, config.gamma, config.lam)
        returns = torch.where(mask, advantages + values, 0.0)
        row.advantages = advantages.cpu()
        prepared.append(PreparedRow(values, returns))
        v, r = values[mask].double(), returns[mask].double()
        for key, total in (("values_sum", v), ("returns_sum", r), ("returns_sq_sum", r * r),
                           ("error_sum", r - v), ("error_sq_sum", (r - v) ** 2)):  # fmt: skip
            sums[key] += total.sum().item()
    model.train()
    return prepared, sums


def train_values(
    critic: Run,
    rows: list[PackedRow],
    prepared: list[PreparedRow],
    loss_scale: float,
    config: CriticConfig,
    world: World,
) -> tuple[dict[str, float], float]:
    """`config.epochs` optimizer steps of the clipped value loss over this rank's rows; returns this rank's sums of
    the last epoch (`value_loss`, `value_clipped_tokens`: the first epoch's clip never binds) and the gradient norm
    of its step (the same on every rank)."""
    sums: dict[str, float] = {}
    grad_norm = 0.0
    for _ in range(config.epochs):
        sums = {"value_loss": 0.0, "value_clipped_tokens": 0.0}
        for row, old in zip(rows, prepared, strict=True):
            values, batch = row_values(critic.model, row, world)
            loss, stats = value_loss(values, old.old_values, old.returns, batch.loss_mask.view(-1),
                                     config.value_clip, loss_scale)  # fmt: skip
            loss.backward()
            for key, value in stats.items():
                sums[key] += value.item()
        grad_norm, _ = critic.optimizer_step(config.optim.max_norm)
    return sums, grad_norm


def critic_metrics(sums: dict[str, float], loss_tokens: int, grad_norm: float) -> dict[str, float | None]:
    """The critic's metrics from the step's all-reduced sums (those of `prepare` and `train_values` among them): means over the step's loss tokens, and the explained variance
    1 - Var(R - V) / Var(R) of the step-start values (1: perfect; 0: no better than the mean; None when Var(R) = 0)."""
    n = max(loss_tokens, 1)
    var_returns = sums["returns_sq_sum"] / n - (sums["returns_sum"] / n) ** 2
    var_error = sums["error_sq_sum"] / n - (sums["error_sum"] / n) ** 2
    return {
        "value_loss": sums["value_loss"],
        "value_clipped_fraction": sums["value_clipped_tokens"] / n,
        "values/mean": sums["values_sum"] / n,
        "returns/mean": sums["returns_sum"] / n,
        "explained_variance": 1 - var_error / var_returns if var_returns > 0 else None,
        "critic_grad_norm": grad_norm,
    }
