"""Preflight: everything that can be wrong is found before any process starts.

A missing model directory, an output dir another run still writes to, a run secret that is missing or weak, and
(when `rl` starts no server of its own) a bad environment: each ends `rl` with one line and exit code 2 (`fail`, like
a config error), before any process starts and each prints its own traceback. With a server to start, `rl` starts it
first and leaves the environments to the orchestrator, which loads them first thing.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from prime_rl.orchestrator.config import OrchestratorConfig
from prime_rl.rl.config import RLConfig
from prime_rl.utils.locks import OutputDirBusy, OutputDirLock, check_free
from prime_rl.utils.net import port_in_use
from prime_rl.utils.secret import SECRET_VAR, RunKeys, SecretError, derive_keys, new_secret, take_keys


def fail(message: str) -> None:
    """Preflight errors exit like config errors: one line, exit code 2, nothing started."""
    print(f"rl: error: {message}", file=sys.stderr)
    sys.exit(2)


def check_model_exists(name: str) -> None:
    """A local-looking model path that does not exist is an error now, not a traceback in three processes later."""
    path = Path(name).expanduser()
    if path.exists():
        return
    local_looking = name.startswith(("/", ".", "~")) or Path(name.split("/")[0]).is_dir()
    if local_looking or os.environ.get("HF_HUB_OFFLINE") == "1":
        fail(f"model directory {name!r} does not exist (build it, e.g. `uv run tiny-model --output {name}`)")


def check_server_ports(config: RLConfig) -> None:
    """The ports of the servers `rl` will start (the policy's, `[teacher]`'s) must be free now: a server already there
    (another run's, an attachable one) would answer our health check before ours fails to bind, and the run would talk
    to it (a 401 at best)."""
    if config.attach or config.inference is None or "inference" not in config.deployment.roles:
        return
    host = config.inference.server.host
    ports = [("[inference.server] port", config.inference.server.port)]
    if config.teacher is not None:
        ports.append(("[teacher] port", config.teacher.port))
    for what, port in ports:
        if port is not None and port_in_use(host, port):
            fail(
                f"{what} {port} on {host} is in use by another process (a server of another run?): choose a free "
                "one, or attach to a running server of yours with --attach"
            )


def check_environments(orchestrators: list[OrchestratorConfig]) -> None:
    """Load every environment and check its prompts against seq_len, as the orchestrators will: a bad environment
    config is reported now, not after a minute or two of vLLM start-up (runs with the same environments: once)."""
    from prime_rl.orchestrator.orchestrator import load_environments

    checked = []
    for orch in orchestrators:
        key = (orch.model, orch.seq_len, orch.sampling.max_tokens, orch.env, orch.eval)
        if key in checked:
            continue
        checked.append(key)
        try:
            orch.model.renderer_config()
            load_environments(orch)
        except (RuntimeError, ValueError) as e:
            fail(str(e))


def claim_output_dir(output_dir: Path, name: str, roles: list[str]) -> OutputDirLock:
    """Refuse to start while another run (or a process it left behind) writes to `output_dir`: two trainers or
    orchestrators there would consume each other's batches. Held until `rl` exits; the kernel drops it if we die."""
    try:
        lock = OutputDirLock(output_dir, name)
        check_free(output_dir, roles)
    except OutputDirBusy as e:
        fail(str(e))
    return lock


def provide_keys(config: RLConfig) -> RunKeys:
    """The run's keys (`utils.secret`), derived from the run secret given, or on one host a new one that no file, log
    or environment ever holds. Hosts of one run must share theirs, so a run over several hosts refuses to make one up.
    The HTTP token is the servers' API key where the config gives one."""
    try:
        keys = take_keys()
    except SecretError as e:
        fail(str(e))
    if keys.store is None:
        if not config.deployment.single_host:
            fail(
                f"a run over several hosts needs the same run secret on every host: set {SECRET_VAR} "
                f"(e.g. `export {SECRET_VAR}=$(openssl rand -hex 32)`; deploy/slurm and the Helm chart do it for you)"
            )
        keys = derive_keys(new_secret())
    return RunKeys(keys.store, config.api_key() or keys.http)
