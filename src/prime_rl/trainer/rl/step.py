"""One RL step's forward/backward over this rank's rows, and the metrics only RL logs; shared by the full-weights
loop (`train.py`) and the LoRA loop (`train_lora.py`), whose rows carry several runs' adapter slots."""

from contextlib import nullcontext
from functools import partial

import torch

from prime_rl.trainer.config import TrainerConfig
from prime_rl.trainer.model.logprobs import forward_logprobs, forward_passes
from prime_rl.trainer.packing import MicroBatch, PackedRow
from prime_rl.trainer.parallel.distributed import World
from prime_rl.trainer.perf import PhaseTimer
from prime_rl.trainer.rl.loss import ce_loss, compute_loss
from prime_rl.trainer.rl.reference import Reference


def train_step(
    model,
    rows: list[PackedRow],
    loss_scales: dict[int, float],
    config: TrainerConfig,
    world: World,
    adapters=None,
    reference: Reference | None = None,
    timer: PhaseTimer | None = None,
    stream_scales: dict[str, float] | None = None,
) -> dict[int, dict[str, float]]:
    """Forward/backward every micro-batch of this rank; returns summed statistics per slot (rows of slot s are run s's,
    their loss divided by `loss_scales[s]`, run s's loss tokens in the whole step). Not yet reduced across ranks; the
    ranks of a context-parallel group compute the same ones, which only its first rank reports. `adapters`: the LoRA
    adapters (`model/lora.py`), told which slot each token trains; `reference`: the frozen policy of the KL penalty;
    `timer`: where forward and backward time go; `stream_scales`: the step's count of each loss component the batch
    ships beside rl (`STREAM_SCALES`: "ce" tokens, "ref_kl" tokens, all ranks), present only where that count is
    > 0, so every rank reports the same statistics (one slot only: the LoRA loop refuses streams)."""
    stream_scales = stream_scales or {}
    if stream_scales and len(loss_scales) > 1:
        raise ValueError("loss streams (ce, ref_kl) are trained for one run at a time, not beside other runs")
    totals: dict[int, dict[str, torch.Tensor]] = {slot: {} for slot in loss_scales}
    first = min(loss_scales)

    def add(slot: int, key: str, value: torch.Tensor) -> None:
        value = value.detach().double()
        totals[slot][key] = totals[slot][key] + value if key in totals[slot] else value

    phase = timer or (lambda _: nullcontext())
    for batch in forward_passes(rows, config.micro_batch_tokens or config.seq_len, config.model.attn, world):
        with phase("forward"):
            ref_logp = reference.logprobs(batch, world) if reference is not None else None
        with adapters.tokens(batch.slots, first) if adapters is not None else nullcontext():
            with phase("forward"):
                loss = batch_loss(model, batch, loss_scales, first, config, world, add, ref_logp, stream_scales)
            with phase("backward"):
                loss.backward()
    keys = {key for slot_totals in totals.values() for key in slot_totals}  # every rank ran at least one micro-batch
    zero = torch.zeros((), dtype=torch.float64)
    if world.cp_rank != 0:
        return {slot: dict.fromkeys(keys, 0.0) for slot in totals}
    return {slot: {k: t.get(k, zero).item() for k in keys} for slot, t in totals.items()}  # one sync per statistic


def batch_loss(
    model,
    batch: MicroBatch,
    loss_scales: dict[int, float],
    first: int,
    config: TrainerConfig,
    world: World,
    add,
    ref_logp: torch.Tensor | None,
    stream_scales: dict[str, float] | None = None,
) -> torch.Tensor:
    """The forward of one micro-batch and its loss, summed over the runs (slots) it holds; `add` collects statistics.

    Each loss component is divided by its own step-wide count: rl by `loss_scales[slot]`, the streams by
    `stream_scales` (a stream this micro-batch lacks adds zero statistics, so every rank has the same keys)."""
    stream_scales = stream_scales or {}
    logp, entropy = forward_logprobs(model, batch, world)
    tokens = {name: getattr(batch, name).view(-1) for name in ("loss_mask", "inference_logprobs", "advantages")}
    logp, entropy, sample_ids, slots = logp.view(-1), entropy.view(-1), batch.sample_ids.view(-1), batch.slots
    present = [s for s in torch.unique(slots).tolist() if s >= 0] or [first]
    loss = 0.0
    for slot in present:
        pick = whole if len(present) == 1 else partial(select, slots.view(-1) == slot)
        mask = pick(tokens["loss_mask"])
        kl = {} if ref_logp is None else {"ref_logprobs": pick(ref_logp), "beta": config.reference.beta}
        if "ref_kl" in stream_scales and batch.ref_kl_mask is not None and batch.ref_logprobs is not None:
            kl |= {"ref_kl_mask": pick(batch.ref_kl_mask.view(-1)), "ref_kl_logprobs": pick(batch.ref_logprobs.view(-1)),
                   "ref_kl_scale": stream_scales["ref_kl"]}  # fmt: skip
        slot_loss, stats = compute_loss(
            pick(logp), pick(tokens["inference_logprobs"]), pick(tokens["advantages"]), mask,
            pick(sample_ids), batch.num_samples, loss_scales[slot], config.loss, **kl,
        )  # fmt: skip
        if "ce" in stream_scales:
            if batch.ce_weights is not None:
                ce, ce_stats = ce_loss(pick(logp), pick(batch.ce_weights.view(-1)), stream_scales["ce"])
                slot_loss, stats = slot_loss + ce, stats | ce_stats
            stats.setdefault("ce_loss_sum", logp.new_zeros((), dtype=torch.float64))
        if "ref_kl" in stream_scales:
            for key in ("ref_kl_stream_sum", "ref_kl_masked_tokens"):
                stats.setdefault(key, logp.new_zeros((), dtype=torch.float64))
        loss = loss + slot_loss
        add(slot, "loss", slot_loss)
        add(slot, "entropy_sum", torch.where(mask, pick(entropy), 0.0).sum())
        add(slot, "processed_tokens", torch.tensor(mask.numel() if len(present) > 1 else batch.num_tokens))
        add(slot, "padding_tokens", torch.tensor(batch.num_padding if len(present) == 1 else 0))  # not split by run
        for key, value in stats.items():
            add(slot, key, value)
    return loss


def whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def select(mask: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    return tensor[mask]


def rl_metrics(sums: dict, info: dict, times: dict[str, float]) -> dict:
    """What only RL logs: entropy, sampler/trainer mismatch, masked and clipped fractions, policy versions, and the
    time publishing took (`time_wait_taken`: waiting for the orchestrator to take an in-memory policy)."""
    tokens = max(info["loss_tokens"], 1)
    samples = max(sums.get("samples", 0), 1)
    metrics = {
        "entropy": sums["entropy_sum"] / tokens,
        "time_publish": times.get("time_publish", 0.0),
        "time_wait_taken": times.get("time_wait_taken", 0.0),
        "policy_version/min": info["policy_version/min"],
        "policy_version/max": info["policy_version/max"],
        "mismatch_kl": sums.get("mismatch_kl_sum", 0.0) / tokens,
    }
    if "ref_kl_sum" in sums:  # [reference]: the drift from the frozen reference, KL(pi || pi_ref) per loss token
        metrics["ref_kl"] = sums["ref_kl_sum"] / tokens
    metrics |= stream_metrics(sums, info)
    for key in ("masked_tokens", "masked_low", "masked_high", "clipped_tokens"):
        metrics[key.removesuffix("_tokens") + "_fraction"] = sums.get(key, 0.0) / tokens
    for key in ("geo_masked_samples", "sequence_masked_samples"):
        metrics[key.removesuffix("_samples") + "_fraction"] = sums.get(key, 0.0) / samples
    return metrics


STREAM_SCALES = {"ce": "ce_tokens", "ref_kl": "ref_kl_tokens"}
"""Each loss stream (`train_step`'s `stream_scales`) and the step total of `next_rows` it is divided by."""


def stream_scales(info: dict) -> dict[str, float]:
    """`train_step`'s `stream_scales` from the step totals of `next_rows`: the streams this step has tokens of."""
    return {name: float(info[key]) for name, key in STREAM_SCALES.items() if info.get(key, 0) > 0}


def stream_metrics(sums: dict, info: dict) -> dict:
    """The loss streams' metrics, for the streams the step has: `ce_loss` (Σ -w log pi / CE tokens, the component's
    loss), `ref_kl_stream` (mean log pi - ref over ref_kl tokens; `ref_kl` is `[reference]`'s) and the token counts."""
    metrics = {}
    if info.get("ce_tokens", 0) > 0:
        metrics |= {"ce_loss": sums["ce_loss_sum"] / info["ce_tokens"], "ce_tokens": info["ce_tokens"]}
    if (n := info.get("ref_kl_tokens", 0)) > 0:
        metrics |= {"ref_kl_stream": sums["ref_kl_stream_sum"] / n, "ref_kl_tokens": n,
                    "ref_kl_masked_fraction": sums["ref_kl_masked_tokens"] / n}  # fmt: skip
    return metrics
