"""`rl --attach`: the run uses a server that outlives it (`inference --server.attachable`, `inference/attach.py`).

Before anything starts: the server's card is read and checked against the run's `[inference]` section (model,
tokenizer, dtype, context length, adapters, its output dir under the server's weight roots), the attachment lock is
taken, the config is loaded again with the server's in-memory weight-broadcast settings (its store's type, host and
port: the server was started with them) unless the run sends weights by the filesystem, and the server is reset to
the base weights. The run's keys are the server's: its token, and its store key for the trainer's store.
"""

from __future__ import annotations

import sys
from typing import IO

from prime_rl.config.loader import load_config
from prime_rl.inference.attach import AttachError, ServerCard, claim, reset
from prime_rl.rl.config import OPSD_ON_LORA, RLConfig, opsd_envs
from prime_rl.rl.preflight import fail
from prime_rl.utils.secret import RunKeys


def broadcast_flags(config: RLConfig, card: ServerCard) -> list[str]:
    """How new policies reach the attached server: a run that asks for the filesystem keeps it (the server loads
    `broadcasts/step_n` under its roots); one that asks for an in-memory broadcast, or says nothing, uses the store the
    server was started to receive from (its type, host and port); another in-memory type is an error."""
    asked, served = config.weight_broadcast, card.weight_broadcast
    if asked is not None and asked.type == "filesystem":
        return []
    if served["type"] == "filesystem":
        if asked is not None:
            fail(f"--attach: this run sends weights by {asked.type}, the server receives them only from the filesystem")
        return ["--weight-broadcast.type", "filesystem"]
    if asked is not None and asked.type != served["type"]:
        fail(f"--attach: this run sends weights by {asked.type}, the server receives them by {served['type']}")
    return [f"--weight-broadcast.{key}={served[key]}" for key in ("type", "host", "port")]


def attach_server(config: RLConfig, argv: list[str] | None) -> tuple[RLConfig, RunKeys, IO, str]:
    """The run's config as it runs on the attached server, its keys, the held lock and a line saying what the server
    served before the reset. Exit 2 (`fail`) when the server cannot take this run."""
    inference = config.inference
    if inference is None:
        fail("--attach needs the `[inference]` section: the port of the server and what it must serve")
    if not config.deployment.single_host or config.runs:
        fail("--attach serves one run on one host (no `[deployment]` over several hosts, no `[[runs]]`)")
    rank = inference.lora.max_lora_rank if inference.lora is not None else None
    try:
        card, lock = claim(inference.server, inference.model, rank, [config.output_dir])
    except AttachError as e:
        fail(f"--attach: {e}")
    if card.max_lora_rank is not None and opsd_envs(config.orchestrator):
        lock.close()
        fail(f"--attach: {opsd_envs(config.orchestrator)} run opsd, whose scoring {OPSD_ON_LORA}: attach to a server "
             "started without --lora")  # fmt: skip
    config, _ = load_config(RLConfig, "rl", [*(sys.argv[1:] if argv is None else argv), *broadcast_flags(config, card)])
    try:
        before = reset(card)
    except AttachError as e:
        lock.close()
        fail(f"--attach: {e}")
    line = f"attached to the inference server at {card.url} (pid {card.pid}; it served {before}, now the base weights)"
    return config, card.keys, lock, line
