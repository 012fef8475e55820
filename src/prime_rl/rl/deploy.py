"""A run over several hosts: every host runs `rl` with the same config and its own `deployment.roles`.

What they need to find and not trip over each other: the seed's multi-node variables read as ours
(`seed_environment`), per-host names for files in the shared output dir (`host_tag`), and the run marker
(`run.json`) by which the orchestrator's host tells trainer hosts that the output dir is prepared for this
`run_id` (`publish_run`, `wait_for_run`), so a trainer never reads a stale batch of an earlier run.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

from loguru import logger

from prime_rl.rl.config import RLConfig
from prime_rl.rl.preflight import fail
from prime_rl.utils.fs import write_atomic

# The multi-node variables of the system we are modelled on, read as the `PRIME_*` variables they stand for
# (below TOML and flags, like every environment variable).
SEED_ENV = {
    "OUTPUT_DIR": "PRIME_OUTPUT_DIR",
    "INFERENCE_SERVER_IP": "PRIME_DEPLOYMENT__INFERENCE_HOSTS",
    "INFERENCE_SERVER_API_KEY": "PRIME_DEPLOYMENT__INFERENCE_API_KEY",
}


def seed_environment(environ: dict[str, str]) -> None:
    """OUTPUT_DIR, INFERENCE_SERVER_IP, INFERENCE_SERVER_API_KEY (the seed's multi-node variables) set the
    `PRIME_*` variables they stand for, unless those are set themselves."""
    for seed, ours in SEED_ENV.items():
        if seed in environ and ours not in environ:
            value = environ[seed]
            if seed == "INFERENCE_SERVER_IP":  # a list field: the environment source reads JSON
                value = json.dumps([h.strip() for h in value.split(",") if h.strip()])
            environ[ours] = value


def host_tag(config: RLConfig) -> str:
    """Names this host's files in a shared output dir: '' on one host, else `.<host>` (`.<host>-<port>` for a
    host serving inference, so several servers on one machine keep apart)."""
    if config.deployment.single_host:
        return ""
    host = socket.gethostname()
    if "inference" in config.deployment.roles and config.inference is not None:
        bind = config.inference.server.host
        return f".{host if bind in ('0.0.0.0', '::', '') else bind}-{config.inference.server.port}"
    if "trainer" in config.deployment.roles and config.deployment.trainer_nodes > 1:
        return f".{host}-node{config.deployment.trainer_node_rank}"
    return f".{host}"


def run_marker(output_dir: Path) -> Path:
    return output_dir / "run.json"


def publish_run(config: RLConfig, resume_step: int | None) -> None:
    """The orchestrator's host, once stale outputs are gone: trainer hosts of this run_id may start."""
    body = json.dumps({"run_id": config.deployment.run_id, "resume_step": resume_step, "host": socket.gethostname()})
    write_atomic(run_marker(config.output_dir), body.encode())


def wait_for_run(config: RLConfig) -> None:
    """A trainer host without the orchestrator waits until the output dir is prepared for its run_id: a stale
    batch left by an earlier run is deleted before our trainer could read it."""
    path, run_id = run_marker(config.output_dir), config.deployment.run_id
    deadline = time.monotonic() + config.deployment.start_timeout
    next_warning = time.monotonic() + 60
    while True:
        try:
            if json.loads(path.read_text()).get("run_id") == run_id:
                return
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            fail(
                f"no orchestrator prepared run {run_id!r} in {config.output_dir} within "
                f"{config.deployment.start_timeout:.0f}s ({path} missing or of another run): is `rl` with role "
                "orchestrator running with the same run_id and output_dir (a shared filesystem)?"
            )
        if time.monotonic() > next_warning:
            logger.warning(f"still waiting for the orchestrator's host to prepare run {run_id!r} ({path})")
            next_warning += 60
        time.sleep(1)
