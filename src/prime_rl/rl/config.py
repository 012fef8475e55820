"""`rl` entry point: inference, orchestrator and trainer from one config, supervised as one run.

    uv run rl @ configs/reverse_text/rl.toml
    uv run rl --trainer @ t.toml --orchestrator @ o.toml --inference @ i.toml --max-steps 20
    uv run rl @ run.toml --bench [--bench.steps N]     # a short real run, then one throughput table

Before anything starts, the shared top-level fields (model, max_steps, max_async_level, seq_len, tensorboard,
output_dir, ckpt, wandb) are copied into the three sections and contradictions are refused. Then: clean stale
rollouts and weights (or those after the resumed step), start inference and wait until it is healthy, start the
orchestrator and the `torchrun` trainer. Every process runs in its own process group and logs to
`{output_dir}/logs/`; the console follows the orchestrator's and trainer's step lines. When any process
fails, or on Ctrl-C, every process group is terminated (then killed after a grace period) and `rl` exits
non-zero naming the process, its exit code and the end of its output. With `--bench` the run is `bench.steps`
long, without checkpoints and W&B, and ends with one table of both processes' step metrics (`bench_table`).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from loguru import logger
from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator

from prime_rl.config import (
    BaseConfig,
    BenchConfig,
    CheckpointConfig,
    EntrypointConfig,
    ModelConfig,
    WeightBroadcastConfig,
)
from prime_rl.config.loader import (
    deep_merge,
    fill_discriminators,
    load_config,
    load_toml,
    to_toml,
    write_resolved_config,
)
from prime_rl.inference.config import VLLM_LORA_RANKS, InferenceConfig
from prime_rl.inference.config import LoRAConfig as ServedLoRAConfig
from prime_rl.orchestrator import ckpt as orchestrator_ckpt
from prime_rl.orchestrator.config import AdapterConfig, OrchestratorConfig
from prime_rl.trainer.config import TrainerConfig
from prime_rl.utils.bench import Column, format_bench_table
from prime_rl.utils.fs import write_atomic
from prime_rl.utils.health import wait_healthy
from prime_rl.utils.locks import OutputDirBusy, OutputDirLock, check_free
from prime_rl.utils.logging import setup_logging
from prime_rl.utils.monitor_config import WandbConfig
from prime_rl.utils.net import free_port
from prime_rl.utils.processes import Process, stop_all
from prime_rl.utils.secret import SECRET_VAR, SecretError, new_secret, run_secret

API_KEY_VAR = "PRIME_RL_INFERENCE_API_KEY"
TRAINER_DONE_GRACE = 60.0
"""Seconds a run's orchestrator may still run after the trainer finished (its last checkpoint, W&B)."""
BIN = Path(sys.executable).parent
ROLES = ("inference", "orchestrator", "trainer")
# The multi-node variables of the system we are modelled on, read as the `PRIME_*` variables they stand for
# (below TOML and flags, like every environment variable).
SEED_ENV = {
    "OUTPUT_DIR": "PRIME_OUTPUT_DIR",
    "INFERENCE_SERVER_IP": "PRIME_DEPLOYMENT__INFERENCE_HOSTS",
    "INFERENCE_SERVER_API_KEY": "PRIME_DEPLOYMENT__INFERENCE_API_KEY",
}


class DeploymentConfig(BaseConfig):
    """Which processes this host starts when a run spans several hosts: every host runs `rl` with the same
    config and its own `roles` (and trainer node rank); `output_dir` must be one shared filesystem."""

    roles: list[Literal["inference", "orchestrator", "trainer"]] = list(ROLES)
    """The processes `rl` starts here; the others run on other hosts."""

    trainer_nodes: int = Field(1, ge=1)
    """Nodes of the trainer (torchrun `--nnodes`); each runs `rl` with role `trainer` and its node rank."""

    trainer_node_rank: int = Field(0, ge=0)
    """This host's trainer node (torchrun `--node-rank`); node 0 hosts the rendezvous."""

    master_addr: str = "127.0.0.1"
    """Address of trainer node 0, reachable from every trainer node (torchrun `--master-addr`)."""

    master_port: int = Field(29500, ge=1, le=65535)
    """Rendezvous port on trainer node 0 (torchrun `--master-port`)."""

    inference_hosts: list[str] = []
    """Inference servers started on other hosts, `host` or `host:port` (port default: `inference.server.port`);
    env `INFERENCE_SERVER_IP` (comma-separated). The orchestrator spreads groups over them."""

    run_id: str | None = Field(None, pattern=r"^[\w.-]{1,100}$")
    """Names this launch on every host (new for each launch, e.g. `$SLURM_JOB_ID`); needed when roles are
    split: trainer hosts start only once the orchestrator's host has prepared the output dir for this run."""

    start_timeout: float = Field(1800.0, gt=0)
    """Seconds a trainer host waits for the orchestrator's host to prepare the output dir for `run_id`."""

    inference_api_key: SecretStr | None = None
    """API key of the inference servers (env `INFERENCE_SERVER_API_KEY`); a started server uses it unless
    `inference.server.api_key` is set, and the orchestrator sends it."""

    @field_validator("inference_hosts", mode="before")
    @classmethod
    def _comma_separated(cls, value):
        return [h.strip() for h in value.split(",") if h.strip()] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check(self) -> DeploymentConfig:
        if not self.roles:
            raise ValueError("roles is empty: name at least one of inference, orchestrator, trainer")
        if not self.single_host and "orchestrator" not in self.roles and "trainer" in self.roles and not self.run_id:
            raise ValueError(
                "a trainer host without the orchestrator needs deployment.run_id (the same on every host, new for "
                "each launch, e.g. $SLURM_JOB_ID): it starts once the orchestrator's host has prepared that run"
            )
        if self.trainer_node_rank >= self.trainer_nodes:
            raise ValueError(f"trainer_node_rank {self.trainer_node_rank} >= trainer_nodes {self.trainer_nodes}")
        return self

    @property
    def single_host(self) -> bool:
        return set(self.roles) == set(ROLES) and self.trainer_nodes == 1


class RunSpec(BaseConfig):
    """One of several runs sharing the trainer and the inference servers (`[[runs]]`): an orchestrator of its own,
    training its own LoRA adapter."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    """The run's name: its adapter's name on the servers and its directory, `output_dir/run_<name>`."""

    config: Path | None = None
    """An orchestrator TOML for this run, over `[orchestrator]` (a path relative to the working directory)."""

    orchestrator: dict[str, Any] = {}
    """Orchestrator keys for this run, over `config` and `[orchestrator]` (e.g. `adapter.optim.lr = 1e-3`)."""


class RLConfig(EntrypointConfig):
    trainer: TrainerConfig = TrainerConfig()
    """The trainer (`[trainer]`, or `--trainer @ t.toml`)."""

    orchestrator: OrchestratorConfig = OrchestratorConfig()
    """The orchestrator (`[orchestrator]`)."""

    inference: InferenceConfig | None = None
    """The inference server to start (`[inference]`); None: use the running servers in `orchestrator.client`."""

    model: ModelConfig | None = None
    """Shared model (name, trust_remote_code), copied into every section; the trainer's starting weights."""

    max_steps: int | None = Field(None, ge=1)
    """Shared: trainer and orchestrator stop after this step."""

    max_async_level: int | None = Field(None, ge=0)
    """Shared: k, how many steps inference may lag behind the trainer."""

    seq_len: int | None = Field(None, ge=1)
    """Shared: longest sample (orchestrator) and packed row length (trainer)."""

    ckpt: CheckpointConfig | None = None
    """Shared checkpoints of trainer and orchestrator (`--ckpt` enables with defaults); `resume_step = -1` is the
    latest step both saved."""

    wandb: WandbConfig | None = None
    """Shared W&B logging: runs `<name>-trainer` and `<name>-orchestrator` in one group (`--wandb` enables)."""

    tensorboard: bool | None = None
    """Shared: TensorBoard event files of trainer and orchestrator under `{output_dir}/tensorboard/` (`--tensorboard`)."""

    weight_broadcast: WeightBroadcastConfig | None = None
    """Shared: how new policies reach inference (`type = "gloo"` or `"nccl"`: in memory from the trainer; on one host
    `rl` picks a free port, on several the store defaults to `deployment.master_addr`, `deployment.master_port + 1`)."""

    trainer_gpu_ids: list[int] = [1]
    """GPUs of the trainer (CUDA_VISIBLE_DEVICES); also the number of trainer ranks (on CPU only the count is used)."""

    inference_gpu_ids: list[int] = [0]
    """GPUs of the inference server (may overlap the trainer's; ignored on CPU)."""

    inference_timeout: float = Field(900.0, gt=0)
    """Seconds to wait for the inference server to become healthy."""

    stop_grace: float = Field(15.0, ge=0)
    """Seconds a stopping process gets after SIGTERM before SIGKILL."""

    deployment: DeploymentConfig = DeploymentConfig()
    """Multi-host runs: the roles this host starts, trainer nodes, where the inference servers are."""

    runs: list[RunSpec] = []
    """Several runs in one LoRA trainer (`[[runs]]`, needs `[trainer.model.lora]`): one orchestrator each, on
    `output_dir/run_<name>`, with `[orchestrator]` plus its own keys; `[orchestrator]` itself is not started."""

    bench: BenchConfig | None = None
    """A short real run of the whole system (`--bench` enables): `bench.steps` steps with real rollouts and weight
    updates, checkpoints and W&B off; ends with one table of the orchestrator's and the trainer's step metrics."""

    @model_validator(mode="after")
    def _propagate(self) -> RLConfig:
        trainer, orch, inf = self.trainer, self.orchestrator, self.inference
        sections = [("trainer", trainer), ("orchestrator", orch)] + ([("inference", inf)] if inf else [])
        for name, section in sections:
            _share(section, "output_dir", self.output_dir, name, "output_dir")
        models = [("trainer", trainer.model), ("orchestrator", orch.model)] + (
            [("inference", inf.model)] if inf else []
        )
        if self.model is not None:
            for key in {"name"} | self.model.model_fields_set:
                for name, model in models:
                    _share(model, key, getattr(self.model, key), f"{name}.model", f"model.{key}")
        if inf is not None and inf.model.served_name is not None:
            _share(
                orch.model, "served_name", inf.model.served_name, "orchestrator.model", "inference.model.served_name"
            )
        for key in ("max_steps", "max_async_level", "seq_len", "tensorboard"):
            if getattr(self, key) is not None:
                _share(trainer, key, getattr(self, key), "trainer", key)
                _share(orch, key, getattr(self, key), "orchestrator", key)
        if self.ckpt is not None:  # what both halves must agree on always, anything else where it was set
            shared = self.ckpt.model_dump(include=self.ckpt.model_fields_set | {"interval", "resume_step"})
            trainer.ckpt = _merge(trainer.ckpt, CheckpointConfig, "trainer.ckpt", "ckpt", **shared)
            orch.ckpt = _merge(orch.ckpt, CheckpointConfig, "orchestrator.ckpt", "ckpt", **shared)
        if self.wandb is not None:
            shared = self.wandb.model_dump(include=self.wandb.model_fields_set)  # defaults don't override sections
            trainer.wandb = _merge(trainer.wandb, WandbConfig, "trainer.wandb", "wandb", **shared)
            orch.wandb = _merge(orch.wandb, WandbConfig, "orchestrator.wandb", "wandb", **shared)
        deploy = self.deployment
        if self.weight_broadcast is not None:
            shared = self.weight_broadcast.model_dump(include=self.weight_broadcast.model_fields_set | {"type"})
            if not deploy.single_host and "host" not in shared:
                shared["host"] = deploy.master_addr  # trainer rank 0 runs on trainer node 0
            if self.weight_broadcast.in_memory and shared.get("port") is None:
                # Every host must agree: on several, the port after the trainer's rendezvous port (the same config).
                port = free_port() if deploy.single_host else deploy.master_port + 1
                shared["port"] = self.weight_broadcast.port = port
            for name, section in [("trainer", trainer), ("orchestrator", orch)] + ([("inference", inf)] if inf else []):
                current = section.weight_broadcast
                for key, value in shared.items():
                    _share(current, key, value, f"{name}.weight_broadcast", f"weight_broadcast.{key}")
        if inf is not None and deploy.inference_api_key is not None and inf.server.api_key is None:
            inf.server.api_key = deploy.inference_api_key
        if deploy.inference_hosts:
            port = inf.server.port if inf is not None else 8000
            urls = [f"http://{h if ':' in h else f'{h}:{port}'}/v1" for h in deploy.inference_hosts]
            _share(orch.client, "base_url", urls, "orchestrator.client", "deployment.inference_hosts")
        elif inf is not None and "inference" in deploy.roles:
            url = f"http://{_client_host(inf.server.host)}:{inf.server.port}/v1"
            _share(orch.client, "base_url", [url], "orchestrator.client", "inference.server (host, port)")
        elif inf is not None and "orchestrator" in deploy.roles:
            raise ValueError(
                "the orchestrator runs on this host but inference does not: name the servers in "
                "deployment.inference_hosts (or INFERENCE_SERVER_IP)"
            )
        if self.api_key() is not None:
            _share(orch.client, "api_key_var", API_KEY_VAR, "orchestrator.client", "the inference API key")
        elif inf is not None and "api_key_var" not in orch.client.model_fields_set:
            orch.client.api_key_var = SECRET_VAR  # the run's servers take the run secret as token when they have no key
        if self.bench is not None:
            self._bench()
        if self.runs and trainer.model.lora is None:
            raise ValueError("runs: each run trains a LoRA adapter of the shared base model; set [trainer.model.lora]")
        if trainer.model.lora is not None:
            self._lora()
        self._check_agreement()
        return self

    def _lora(self) -> None:
        """LoRA: every run's orchestrator trains an adapter, the trainer has a slot for each, inference serves them."""
        trainer, inf, runs = self.trainer, self.inference, len(self.runs) or 1
        if self.bench is not None:
            raise ValueError("--bench measures full fine-tuning: leave trainer.model.lora off")
        if self.runs:
            names = [run.name for run in self.runs]
            if len(set(names)) != len(names):
                raise ValueError(f"runs: names must differ, got {names}")
            if "max_concurrent_runs" not in trainer.model_fields_set:
                trainer.max_concurrent_runs = runs + 1  # a spare slot: a run can be added to the running trainer
            elif trainer.max_concurrent_runs < max(runs, 2):  # 1: the trainer would train output_dir itself
                raise ValueError(
                    f"trainer.max_concurrent_runs = {trainer.max_concurrent_runs}: [[runs]] needs a slot for each of "
                    f"its {runs} run(s) in output_dir/run_<name> (and at least 2)"
                )
        elif self.orchestrator.adapter is None:
            self.orchestrator.adapter = AdapterConfig(name="lora")
        if inf is None:
            return
        rank = trainer.model.lora.rank
        if inf.lora is None:
            served_rank = min(r for r in VLLM_LORA_RANKS if r >= rank)  # the trainer refuses ranks vLLM cannot serve
            slots = trainer.max_concurrent_runs
            inf.lora = ServedLoRAConfig(max_loras=max(slots, ServedLoRAConfig().max_loras), max_lora_rank=served_rank)
        if inf.lora.max_loras < runs or inf.lora.max_lora_rank < rank:
            raise ValueError(
                f"inference.lora (max_loras {inf.lora.max_loras}, max_lora_rank {inf.lora.max_lora_rank}) cannot "
                f"serve {runs} adapter(s) of rank {rank}"
            )

    def run_orchestrators(self) -> dict[str, OrchestratorConfig]:
        """Each of `runs`' orchestrator configs: `[orchestrator]`, then its `config` file, then its own keys; its
        adapter named after the run and its output dir `output_dir/run_<name>`."""
        base = self.orchestrator.model_dump()
        configs = {}
        for i, run in enumerate(self.runs):
            if "output_dir" in run.orchestrator:
                raise ValueError(f"runs[{i}] ({run.name}): output_dir is output_dir/run_<name>; do not set it")
            try:
                data = deep_merge(base, load_toml(run.config)[0]) if run.config is not None else base
                data = deep_merge(data, run.orchestrator)
                data = deep_merge(
                    data, {"output_dir": self.output_dir / f"run_{run.name}", "adapter": {"name": run.name}}
                )
                configs[run.name] = OrchestratorConfig.model_validate(fill_discriminators(OrchestratorConfig, data))
            except (ValidationError, ValueError, OSError) as e:
                raise ValueError(f"runs[{i}] ({run.name}): {e}") from None
        return configs

    def _bench(self) -> None:
        """`--bench`: `bench.steps` steps of the real system, nothing kept for later (checkpoints, W&B)."""
        trainer, orch = self.trainer, self.orchestrator
        if any(c is not None and c.resuming for c in (self.ckpt, trainer.ckpt, orch.ckpt)):
            raise ValueError("--bench is a short fresh run and cannot resume from a checkpoint")
        for name, section in (("trainer", trainer), ("orchestrator", orch)):
            if section.bench is not None:
                raise ValueError(
                    f"{name}.bench benchmarks the {name} alone; `rl --bench` runs the trainer on the orchestrator's "
                    f"real batches: leave {name}.bench off"
                )
        self.max_steps = trainer.max_steps = orch.max_steps = self.bench.steps
        self.ckpt = trainer.ckpt = orch.ckpt = None
        self.wandb = trainer.wandb = orch.wandb = None

    def api_key(self) -> str | None:
        """The key the inference servers of this run require (None: none)."""
        key = self.inference.server.api_key if self.inference is not None else None
        key = key or self.deployment.inference_api_key
        return key.get_secret_value() if key is not None else None

    def _check_agreement(self) -> None:
        """Fields no shared value was given for must still agree between the sections (with `runs`: between the
        trainer and every run, whose length, async level and checkpoints are its own; building the runs' configs
        here also finds an invalid one now, not when its orchestrator starts)."""
        if self.runs:
            for orch in self.run_orchestrators().values():
                self._check_orchestrator(orch, f"runs.{orch.adapter.name}")
            return
        trainer, orch = self.trainer, self.orchestrator
        if trainer.max_async_level != orch.max_async_level:
            raise ValueError(
                f"trainer.max_async_level ({trainer.max_async_level}) != orchestrator.max_async_level "
                f"({orch.max_async_level}); set the shared `max_async_level`"
            )
        if trainer.max_steps != orch.max_steps:
            raise ValueError(
                f"trainer.max_steps ({trainer.max_steps}) != orchestrator.max_steps ({orch.max_steps}); "
                "set the shared `max_steps`"
            )
        if (trainer.ckpt is None) != (orch.ckpt is None):
            raise ValueError(
                "checkpoints must be on for both trainer and orchestrator or neither; use the shared `ckpt`"
            )
        both = ("interval", "resume_step", "keep_last", "keep_interval")
        if trainer.ckpt is not None and any(getattr(trainer.ckpt, k) != getattr(orch.ckpt, k) for k in both):
            raise ValueError(f"trainer.ckpt and orchestrator.ckpt disagree on {', '.join(both)}; use the shared `ckpt`")
        self._check_orchestrator(orch, "orchestrator")

    def _check_orchestrator(self, orch: OrchestratorConfig, name: str) -> None:
        """What one orchestrator must agree on with the trainer and the inference server."""
        trainer, inf = self.trainer, self.inference
        if trainer.seq_len < orch.seq_len:
            raise ValueError(
                f"trainer.seq_len ({trainer.seq_len}) < {name}.seq_len ({orch.seq_len}): the trainer would "
                "refuse the orchestrator's longest samples; set the shared `seq_len`"
            )
        if inf is not None and inf.model.name != trainer.model.name:
            raise ValueError(
                f"inference.model.name ({inf.model.name!r}) != trainer.model.name ({trainer.model.name!r}); "
                "set the shared `model.name`"
            )
        if inf is not None and orch.model.api_name != inf.model.api_name:
            raise ValueError(
                f"{name} asks for model {orch.model.api_name!r}, inference serves {inf.model.api_name!r}; "
                "set the shared `model.name`"
            )
        if trainer.critic is not None and orch.filter_zero_advantage:
            raise ValueError(
                f"trainer.critic with {name}.filter_zero_advantage: the critic's GAE advantages are not the group's, "
                "so a group whose rewards do not vary still trains the policy and the value model; set it to false"
            )
        if trainer.weight_broadcast != orch.weight_broadcast:
            raise ValueError(
                f"trainer.weight_broadcast and {name}.weight_broadcast disagree; use the shared `weight_broadcast`"
            )
        if inf is not None and inf.weight_broadcast != trainer.weight_broadcast:
            raise ValueError(
                "trainer.weight_broadcast and inference.weight_broadcast disagree; use the shared `weight_broadcast`"
            )


def _client_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def _share(section, field: str, value, section_name: str, shared_name: str) -> None:
    """Copy a shared value into a section, refusing a different value the user set there explicitly."""
    current = getattr(section, field)
    if field in section.model_fields_set and current != value:
        raise ValueError(
            f"{shared_name} = {value!r} contradicts {section_name}.{field} = {current!r}; set it in one place"
        )
    setattr(section, field, value)


def _merge(current, cls, section_name: str, shared_name: str, **shared):
    """A section's sub-config (e.g. `ckpt`) with the shared values, refusing explicit contradictions."""
    shared = {k: v for k, v in shared.items() if k in cls.model_fields and v is not None}
    if current is None:
        return cls(**shared)
    for key, value in shared.items():
        _share(current, key, value, section_name, f"{shared_name}.{key}")
    return current


# ---------------------------------------------------------------------------------------------------------
# Preflight: everything that can be wrong is found before any process starts.


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


def resolve_resume(config: RLConfig) -> int | None:
    """-1 -> the latest step both trainer and orchestrator checkpointed; N -> N, which both must have."""
    if config.trainer.ckpt is None or config.trainer.ckpt.resume_step is None:
        return None
    step = resume_step_in(config.output_dir, config.trainer.ckpt.resume_step)
    config.trainer.ckpt.resume_step = config.orchestrator.ckpt.resume_step = step
    return step


def resume_step_in(out: Path, requested: int) -> int:
    """The step a run directory resumes from: its trainer and its orchestrator both checkpointed it."""
    from prime_rl.trainer.ckpt import complete_steps

    both = sorted(set(complete_steps(out)) & set(orchestrator_ckpt.saved_steps(out)))
    if requested == -1:
        if not both:
            fail(f"--ckpt.resume-step -1: no step has both a trainer and an orchestrator checkpoint in {out}")
        return both[-1]
    if requested not in both:
        fail(f"no complete trainer + orchestrator checkpoint for step {requested} in {out} (have {both})")
    return requested


def resolve_run_resumes(runs: dict[str, OrchestratorConfig]) -> None:
    """With `runs`: each run resumes from its own latest (or named) step; the trainer reads it from the run's
    config. A run that has never checkpointed starts fresh under `resume_step = -1`."""
    for name, orch in runs.items():
        if orch.ckpt is None or orch.ckpt.resume_step is None:
            continue
        fresh = orch.ckpt.resume_step == -1 and not orchestrator_ckpt.saved_steps(orch.output_dir)
        orch.ckpt.resume_step = None if fresh else resume_step_in(orch.output_dir, orch.ckpt.resume_step)
        logger.info(f"run {name}: " + ("starts fresh" if fresh else f"resumes from step {orch.ckpt.resume_step}"))


def check_environments(orchestrators: list[OrchestratorConfig]) -> None:
    """Load every environment and check its prompts against seq_len, as the orchestrators will: a bad environment
    config is reported now, not after a minute or two of vLLM start-up (runs with the same environments: once)."""
    from prime_rl.orchestrator.orchestrator import load_environments

    checked = []
    for orch in orchestrators:
        key = (orch.model, orch.seq_len, orch.sampling.max_tokens, orch.env)
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


def clean_stale_outputs(output_dir: Path, resume_step: int | None) -> None:
    """Batches and weights of an earlier run would be consumed as if new: drop them (after the resumed step)."""
    for kind in ("rollouts", "broadcasts"):
        for path in (output_dir / kind).glob("step_*"):
            step = path.name.removeprefix("step_").split(".")[0]
            if resume_step is None or not step.isdigit() or int(step) > resume_step:
                shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------
# Logs.


STEP_LINE = re.compile(r"\| (?:INFO|SUCCESS)\s+\| \S+ \| [^|]+ \| (step \d+ \|.*)$")
PROBLEM_LINE = re.compile(r"\| (WARNING|ERROR|CRITICAL)\s+\| \S+ \| [^|]+ \| (.*)$")


def follow_logs(logs: dict[str, Path], stop: threading.Event) -> None:
    """Print the step lines (and warnings) of the orchestrator and trainer logs (label -> file) on the console, from
    what is written after we start: a resumed run appends to the logs of the run it continues, whose lines were
    shown."""
    files: dict[str, object] = {}
    start_at = {name: path.stat().st_size if path.exists() else 0 for name, path in logs.items()}
    while not stop.is_set():
        for name, path in logs.items():
            if name not in files:
                if not path.exists():
                    continue
                files[name] = open(path, errors="replace")
                files[name].seek(start_at[name])
            for line in files[name].readlines():
                if m := STEP_LINE.search(line.rstrip()):
                    print(f"[{name}] {m.group(1)}", flush=True)
                elif m := PROBLEM_LINE.search(line.rstrip()):
                    print(f"[{name}] {m.group(1)}: {m.group(2)}", flush=True)
        stop.wait(0.5)
    for f in files.values():
        f.close()


def write_section(config, path: Path) -> Path:
    write_atomic(path, to_toml(config).encode())
    return path


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


def trainer_command(config: RLConfig, trainer_cfg: Path) -> list[str]:
    """torchrun on this host's GPUs: standalone on one node, else a static rendezvous at node 0."""
    deploy = config.deployment
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={len(config.trainer_gpu_ids)}"]
    if deploy.trainer_nodes == 1:
        cmd.append("--standalone")
    else:
        cmd += [
            f"--nnodes={deploy.trainer_nodes}",
            f"--node-rank={deploy.trainer_node_rank}",
            f"--master-addr={deploy.master_addr}",
            f"--master-port={deploy.master_port}",
        ]
    return cmd + ["-m", "prime_rl.trainer.train", "@", str(trainer_cfg)]


def build_processes(
    config: RLConfig, orchs: dict[str, OrchestratorConfig], log_dir: Path, tag: str
) -> dict[str, Process]:
    """The processes of this host's roles, by role (not started); `orchs` from `orchestrators`."""
    out = config.output_dir
    launch_dir = out / "configs" / f"rl{tag}"
    base_env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    roles, processes = config.deployment.roles, {}
    api_key = config.api_key()
    if config.inference is not None and "inference" in roles:
        env = {**base_env, "CUDA_VISIBLE_DEVICES": ",".join(map(str, config.inference_gpu_ids))}
        if api_key is not None:
            env["PRIME_SERVER__API_KEY"] = api_key
        # The key goes by environment: the file would hold it masked, and a file value beats the environment.
        keyless = config.inference.server.model_copy(update={"api_key": None})
        cfg = write_section(config.inference.model_copy(update={"server": keyless}), launch_dir / "inference.toml")
        cmd = [str(BIN / "inference"), "@", str(cfg)] + (["--log.file", f"inference{tag}.log"] if tag else [])
        processes["inference"] = Process("inference", cmd, env, log_dir / f"inference{tag}.out")
    if "orchestrator" in roles:
        env = {**base_env, **({API_KEY_VAR: api_key} if api_key is not None else {})}
        for role, orch in orchs.items():
            stem = role.replace("/", ".")  # orchestrator/<run> -> orchestrator.<run>.toml, .out
            cmd = [str(BIN / "orchestrator"), "@", str(write_section(orch, launch_dir / f"{stem}.toml"))]
            processes[role] = Process(role, cmd, env, log_dir / f"{stem}{tag}.out")
    if "trainer" in roles:
        env = {**base_env, "CUDA_VISIBLE_DEVICES": ",".join(map(str, config.trainer_gpu_ids)), "OMP_NUM_THREADS": "1"}
        cmd = trainer_command(config, write_section(config.trainer, launch_dir / "trainer.toml"))
        processes["trainer"] = Process("trainer", cmd, env, log_dir / f"trainer{tag}.out")
    return processes


def orchestrators(config: RLConfig) -> dict[str, OrchestratorConfig]:
    """The orchestrators `rl` starts, by role name: `orchestrator`, or with `runs` one `orchestrator/<name>` each."""
    if not config.runs:
        return {"orchestrator": config.orchestrator}
    return {f"orchestrator/{name}": orch for name, orch in config.run_orchestrators().items()}


def wait_for_inference(config: RLConfig, inference: Process, interrupted: list) -> None:
    """Until the server started here is healthy; in slices, so Ctrl-C is honoured while vLLM starts."""
    url = f"http://{_client_host(config.inference.server.host)}:{config.inference.server.port}"
    logger.info(f"waiting for inference at {url} (vLLM takes a minute or two to start on CPU)")
    deadline = time.monotonic() + config.inference_timeout
    while True:
        if interrupted:
            raise KeyboardInterrupt
        try:
            slice_ = min(2.0, max(0.1, deadline - time.monotonic()))
            asyncio.run(wait_healthy([url], slice_, process=inference, warn_every=float("inf")))
            break
        except TimeoutError:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"inference not healthy after {config.inference_timeout:.0f}s:\n{inference.tail()}"
                ) from None
    logger.info("inference is healthy")


def launch(config: RLConfig, orchs: dict[str, OrchestratorConfig]) -> int:
    """Start this host's roles and supervise them: the run ends when its orchestrator and trainer (those started
    here) finish; a host that only serves inference runs until it is stopped. With `runs`, a run whose orchestrator
    fails ends alone (the trainer sees it go and trains the others) and `rl` exits 1 once the rest have finished."""
    out = config.output_dir
    log_dir = out / "logs"
    tag = host_tag(config)
    processes = build_processes(config, orchs, log_dir, tag)
    inference = processes.get("inference")
    finishers = [p for role, p in processes.items() if role != "inference"]
    runs = {role: p for role, p in processes.items() if role.startswith("orchestrator/")}
    failed_runs: list[str] = []
    trainer_done_at: float | None = None

    stop_following = threading.Event()
    followed = {role: Path(orch.output_dir) / "logs" / "orchestrator.log" for role, orch in orchs.items()}
    if "trainer" in processes:
        followed["trainer"] = log_dir / "trainer.log"
    follower = threading.Thread(target=follow_logs, args=(followed, stop_following))
    follower.daemon = True
    interrupted = []

    def on_signal(signum, frame):
        interrupted.append(signum)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        if inference is not None:
            inference.start()
            if finishers:
                wait_for_inference(config, inference, interrupted)
        for p in finishers:
            p.start()
        follower.start()
        while True:
            if interrupted:
                raise KeyboardInterrupt
            for p in processes.values():
                code = p.poll()
                if code is None or (code == 0 and p is not inference) or p.name in failed_runs:
                    continue
                what = "exited" if code == 0 else f"failed with exit code {code}"
                if p.name in runs:
                    logger.error(f"{p.name} {what}; the other runs go on. Last lines of {p.output}:\n{p.tail()}")
                    failed_runs.append(p.name)
                    continue
                logger.error(f"{p.name} {what}; stopping the run. Last lines of {p.output}:\n{p.tail()}")
                return 1
            left = [role for role, p in runs.items() if p.poll() is None]
            if runs and "trainer" in processes and processes["trainer"].poll() == 0 and left:
                # The trainer ends once every run left it: an orchestrator still running gets a moment to finish.
                trainer_done_at = trainer_done_at or time.monotonic()
                if time.monotonic() - trainer_done_at > TRAINER_DONE_GRACE:
                    logger.error(f"the trainer has finished but {', '.join(left)} did not: stopping them")
                    return 1
            if finishers and all(p.poll() is not None for p in finishers) and failed_runs:
                logger.error(f"{', '.join(failed_runs)} failed; the others completed (output in {out})")
                return 1
            if finishers and all(p.poll() == 0 for p in finishers):
                logger.success(f"run finished: {' and '.join(p.name for p in finishers)} completed (output in {out})")
                return 0
            time.sleep(0.5)
    except KeyboardInterrupt:
        logger.warning("interrupted: stopping every process")
        return 130
    except RuntimeError as e:
        logger.error(str(e))
        return 1
    finally:
        stop_all(list(processes.values()), config.stop_grace)
        stop_following.set()
        if follower.is_alive():
            follower.join(2)


# ---------------------------------------------------------------------------------------------------------
# `--bench`: one table of both processes' step metrics.


BENCH_COLUMNS = [
    Column("step", "step", "d"),
    Column("orch s", "orchestrator_seconds", ".2f", summary=True),
    Column("rollouts/s", "rollouts_per_s", ".1f", summary=True),
    Column("inf tok/s", "inference_tokens_per_s", ".0f", summary=True),
    Column("weights wait s", "wait_for_weights", ".2f"),
    Column("swap s", "update_weights", ".3f"),
    Column("trainer s", "trainer_seconds", ".2f", summary=True),
    Column("batch wait s", "wait_for_batch", ".2f"),
    Column("train s", "train_seconds", ".2f"),
    Column("publish s", "publish_seconds", ".2f"),
    Column("taken wait s", "wait_for_taken", ".2f"),
    Column("train tok/s", "train_tokens_per_s", ".0f", summary=True),
    Column("MFU %", "mfu", ".2f", summary=True),
    Column("peak GiB", "peak_memory_gib", ".2f"),
]
"""Orchestrator: step time (of which waiting for weights and swapping them), rollouts and tokens (prompt +
completion) per second through inference. Trainer: step time = waiting for the batch + training + publishing +
waiting for the orchestrator to take an in-memory policy, trained tokens per second, MFU (`-` without a known GPU
peak), peak memory."""


def bench_rows(lines: Iterable[str]) -> list[dict]:
    """`metrics.jsonl` lines -> one row per step with the orchestrator's and the trainer's metrics of that step side
    by side (`BENCH_COLUMNS`' keys; None where a process did not log the step; a step logged twice keeps its later
    line). The trainer logs tokens/s and MFU over a window of recent steps; the row has this step's own: tokens /
    training time, and MFU scaled by the same ratio (MFU is proportional to tokens/s)."""
    logged: dict[str, dict[int, dict]] = {"orchestrator": {}, "trainer": {}}
    for line in lines:
        if line.strip():
            metrics = json.loads(line)
            if metrics.get("process") in logged:
                logged[metrics["process"]][int(metrics["step"])] = metrics
    rows = []
    for step in sorted(logged["orchestrator"].keys() | logged["trainer"].keys()):
        orch, trainer = logged["orchestrator"].get(step, {}), logged["trainer"].get(step, {})
        times = [trainer.get(k) for k in ("time_data", "time_train", "time_publish")]
        tokens_per_s = mfu = None
        if trainer.get("tokens") is not None and trainer.get("time_train"):
            tokens_per_s = trainer["tokens"] / trainer["time_train"]
            if trainer.get("mfu") is not None and trainer.get("tokens_per_s"):
                mfu = trainer["mfu"] * tokens_per_s / trainer["tokens_per_s"]
        rows.append(
            {
                "step": step,
                "orchestrator_seconds": orch.get("time/step"),
                "rollouts_per_s": orch.get("rollouts_per_s"),
                "inference_tokens_per_s": orch.get("tokens_per_s"),
                "wait_for_weights": orch.get("time/wait_for_weights"),
                "update_weights": orch.get("time/update_weights"),
                "trainer_seconds": None if None in times else sum(times) + trainer.get("time_wait_taken", 0.0),
                "wait_for_batch": times[0],
                "train_seconds": times[1],
                "publish_seconds": times[2],
                "wait_for_taken": trainer.get("time_wait_taken"),
                "train_tokens_per_s": tokens_per_s,
                "mfu": mfu,
                "peak_memory_gib": trainer.get("peak_memory_gib"),
            }
        )
    return rows


def bench_table(lines: Iterable[str]) -> str:
    return format_bench_table(bench_rows(lines), BENCH_COLUMNS)


def metrics_size(output_dir: Path) -> int:
    """Bytes in `metrics.jsonl` now: this run's lines are the ones after them (the file keeps earlier runs')."""
    path = output_dir / "metrics.jsonl"
    return path.stat().st_size if path.exists() else 0


def print_bench_table(output_dir: Path, start: int) -> None:
    with open(output_dir / "metrics.jsonl") as f:
        f.seek(start)
        print(bench_table(f.read().splitlines()), flush=True)


def seed_environment(environ: dict[str, str]) -> None:
    """OUTPUT_DIR, INFERENCE_SERVER_IP, INFERENCE_SERVER_API_KEY (the seed's multi-node variables) set the
    `PRIME_*` variables they stand for, unless those are set themselves."""
    for seed, ours in SEED_ENV.items():
        if seed in environ and ours not in environ:
            value = environ[seed]
            if seed == "INFERENCE_SERVER_IP":  # a list field: the environment source reads JSON
                value = json.dumps([h.strip() for h in value.split(",") if h.strip()])
            environ[ours] = value


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


def provide_secret(config: RLConfig) -> None:
    """Every process of the run gets the run secret by environment: the one given, or on one host a new one. Hosts
    of one run must share theirs, so a run over several hosts refuses to make one up."""
    try:
        if run_secret() is not None:
            return
    except SecretError as e:
        fail(str(e))
    if not config.deployment.single_host:
        fail(
            f"a run over several hosts needs the same run secret on every host: set {SECRET_VAR} "
            f"(e.g. `export {SECRET_VAR}=$(openssl rand -hex 32)`; deploy/slurm and the Helm chart do it for you)"
        )
    os.environ[SECRET_VAR] = new_secret()  # inherited by every process `rl` starts, never written anywhere


def main(argv: list[str] | None = None) -> None:
    seed_environment(os.environ)
    config, _ = load_config(RLConfig, "rl", argv)
    provide_secret(config)
    roles = config.deployment.roles
    names = {config.trainer.model.name} if "trainer" in roles else set()
    if config.inference is not None and "inference" in roles:
        names.add(config.inference.model.name)
    for name in names:
        check_model_exists(name)
    tag = host_tag(config)
    orchs = orchestrators(config) if "orchestrator" in roles else {}
    writers = ["orchestrator"] if "orchestrator" in roles and not config.runs else []
    writers += ["trainer"] if "trainer" in roles and config.deployment.trainer_node_rank == 0 else []
    lock = claim_output_dir(config.output_dir, f"rl{tag}", writers)
    for orch in orchs.values() if config.runs else []:
        try:
            check_free(orch.output_dir, ["orchestrator"])
        except OutputDirBusy as e:
            fail(str(e))
    check_environments(list(orchs.values()))
    resume_step = None
    if not config.runs and ("inference" not in roles or len(roles) > 1):
        resume_step = resolve_resume(config)
    file_name = config.log.file or f"rl{tag}.log"
    setup_logging("rl", config.log.level, config.output_dir / "logs", file_name=file_name)
    write_resolved_config(config, f"rl{tag}")
    if config.runs:
        resolve_run_resumes(orchs)
    if "orchestrator" in roles:
        for orch in orchs.values():
            clean_stale_outputs(orch.output_dir, orch.ckpt.resume_step if orch.ckpt is not None else None)
        if not config.deployment.single_host:
            publish_run(config, resume_step)
    elif "trainer" in roles:
        wait_for_run(config)
    if resume_step is not None:
        resumed = [r for r in ("trainer", "orchestrator") if r in roles]  # the order the single-host log always had
        logger.info(f"resuming {' and '.join(resumed)} from step {resume_step}")
    if config.bench is not None:
        logger.info(f"bench: {config.bench.steps} steps, checkpoints and W&B off; a table follows the run")
    metrics_start = metrics_size(config.output_dir)
    code = launch(config, orchs)
    if code == 0 and config.bench is not None and {"orchestrator", "trainer"} & set(roles):
        print_bench_table(config.output_dir, metrics_start)
    lock.release()
    sys.exit(code)


if __name__ == "__main__":
    main()
