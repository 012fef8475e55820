"""What both RL loops (`train.py`, `train_lora.py`) do around the orchestrator's batches: wait on rank 0 (for a
batch, or for the orchestrator to take a policy) while serving weight transfers, and read a batch, checked."""

import time
from collections.abc import Callable

from loguru import logger

from prime_rl.batch import BatchError, TrainingSample, batch_path, read_batch, validate_batch
from prime_rl.trainer.parallel.distributed import World, broadcast_object
from prime_rl.trainer.rl.broadcast import WeightSender
from prime_rl.trainer.scaffold import Run

BATCH_ERRORS = (BatchError, TimeoutError)
"""A batch that is unusable or never comes: the run stops with a message naming the file."""


def wait_until(
    world: World,
    ready: Callable[[], bool],
    what: str,
    timeout: float | None,
    sender: WeightSender | None,
    run: Run | None,
    warn_every: float = 60.0,
) -> None:
    """Every rank: block until rank 0's `ready()` holds, sending the weights whenever the orchestrator asks.

    Rank 0 polls and tells the other ranks what happened (they must join every transfer: gathering full tensors is
    a collective), at least every `HEARTBEAT` seconds, so no collective waits longer than that. Warns every
    `warn_every` seconds naming `what` it waits for; after `timeout` seconds (None: never) every rank raises
    `TimeoutError`.
    """
    start = time.monotonic()
    next_warning = start + warn_every
    while True:
        event: object = None
        if world.is_main:
            last_event, delay = time.monotonic(), 0.002
            while event is None:
                now = time.monotonic()
                if ready():
                    event = "ready"
                elif sender is not None and sender.pending():
                    event = "serve"
                elif timeout is not None and now - start > timeout:
                    event = TimeoutError(f"waited {now - start:.0f} s for {what} (timeout {timeout:g} s)")
                elif now - last_event > HEARTBEAT:
                    event = "alive"
                else:
                    if now > next_warning:
                        logger.warning(f"waiting {now - start:.0f} s for {what}")
                        next_warning += warn_every
                    time.sleep(max(0.0, min(delay, next_warning - now)))
                    delay = min(2 * delay, 0.25 if sender is None else 0.002)  # a transfer request: answered at once
        event = broadcast_object(event, world)
        if isinstance(event, Exception):
            raise event
        if event == "ready":
            return
        if event == "serve":
            sender.serve(run.model, run.export_dtype)


HEARTBEAT = 30.0
"""Seconds rank 0 lets the other ranks wait in one collective while it waits (well under any collective timeout)."""


def load_batch(output_dir, step: int, vocab_size: int, seq_len: int) -> list[TrainingSample]:
    """The checked samples of `rollouts/step_n/batch.bin` (`BatchError` naming the file when unusable)."""
    path = batch_path(output_dir, step)
    batch = read_batch(path)
    if batch.step != step:
        raise BatchError(f"{path}: holds step {batch.step}, expected {step}")
    validate_batch(batch, path, vocab_size, seq_len)
    return batch.samples


def policy_versions(samples: list[TrainingSample]) -> dict:
    versions = [v for s in samples for v in s.policy_versions]
    return {"policy_version/min": min(versions, default=None), "policy_version/max": max(versions, default=None)}
