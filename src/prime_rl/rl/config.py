"""`RLConfig`: the one config of an `rl` run, and what it checks before anything starts.

Its sections (`[trainer]`, `[orchestrator]`, `[inference]`) are the three processes' own configs; the shared
top-level fields (model, max_steps, max_async_level, seq_len, tensorboard, output_dir, ckpt, wandb,
weight_broadcast) are copied into them and a contradiction with a value set in a section is refused, so the
processes cannot start disagreeing. `DeploymentConfig` says which processes this host starts when a run spans
several hosts; `RunSpec` is one of several runs sharing one LoRA trainer (`[[runs]]`). Validation only: nothing
here touches the output dir or starts a process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator

from prime_rl.config import (
    BaseConfig,
    BenchConfig,
    CheckpointConfig,
    EntrypointConfig,
    ModelConfig,
    WeightBroadcastConfig,
)
from prime_rl.config.algorithm import TEACHER_ALGOS, FrozenModelConfig
from prime_rl.config.loader import deep_merge, fill_discriminators, load_toml
from prime_rl.inference.config import VLLM_LORA_RANKS, InferenceConfig
from prime_rl.inference.config import LoRAConfig as ServedLoRAConfig
from prime_rl.models.tokenizers import tokenizer_mismatch
from prime_rl.orchestrator.config import AdapterConfig, OrchestratorConfig
from prime_rl.trainer.config import TrainerConfig
from prime_rl.utils.monitor_config import WandbConfig
from prime_rl.utils.net import client_host, free_port

API_KEY_VAR = "PRIME_RL_INFERENCE_API_KEY"
"""The `client.api_key_var` of the orchestrators `rl` starts: `rl` hands them the servers' token on stdin, and their
rollout workers hold it under this name for verifiers' clients, whose subprocess runtime passes no variable named
`*API_KEY*` to the programs it runs."""
ROLES = ("inference", "orchestrator", "trainer")


SLURM_WORD = r"^[\w.,:\[\]+-]{1,200}$"  # what an #SBATCH value may be: no space, quote or newline reaches the script


class SlurmConfig(BaseConfig):
    """Submit this run as one SLURM job (`deploy/slurm/rl.sbatch`, docs/deployment.md) instead of running it here:
    `rl` writes the job's script and config under `{output_dir}/slurm/` and calls `sbatch`."""

    job_name: str = Field("prime-rl", pattern=SLURM_WORD)
    """The job's name (`#SBATCH --job-name`)."""

    nodes: int = Field(1, ge=1)
    """Nodes of the job: one runs everything; more are `inference_nodes` inference nodes and the rest trainer nodes."""

    inference_nodes: int = Field(1, ge=1)
    """Inference nodes of a multi-node job (node 0 also runs the orchestrator)."""

    gpus_per_node: int = Field(8, ge=1)
    """GPUs each node's processes use."""

    partition: str | None = Field(None, pattern=SLURM_WORD)
    """`#SBATCH --partition` (None: the cluster's default)."""

    account: str | None = Field(None, pattern=SLURM_WORD)
    """`#SBATCH --account` (None: yours by default)."""

    time: str | None = Field(None, pattern=r"^[\d:-]{1,20}$")
    """Wall-time limit, e.g. `24:00:00` or `7-00:00:00` (`#SBATCH --time`)."""

    nodelist: str | None = Field(None, pattern=SLURM_WORD)
    """Nodes to run on (`#SBATCH --nodelist`)."""

    exclude: str | None = Field(None, pattern=SLURM_WORD)
    """Nodes not to run on (`#SBATCH --exclude`)."""

    sbatch: str = "sbatch"
    """The submit command (a path, e.g. to a site wrapper)."""

    @model_validator(mode="after")
    def _check(self) -> SlurmConfig:
        if self.nodes > 1 and self.inference_nodes >= self.nodes:
            raise ValueError(f"slurm.inference_nodes ({self.inference_nodes}) must leave trainer nodes of {self.nodes}")
        return self


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


class TeacherServerConfig(BaseConfig):
    """A frozen teacher `rl` serves for `opd` (`[teacher]`): a second `inference` process beside the policy's, with
    the policy server's settings, the run's token and no weight updates; stopped with the run."""

    model: str
    """The teacher's model: a local directory or a hub id. It must have the policy's tokenizer."""

    port: int | None = Field(None, ge=1, le=65535)
    """Its port on this host; None: a free one."""

    gpu_ids: list[int] = []
    """Its GPUs (CUDA_VISIBLE_DEVICES); ignored on CPU, where it shares the CPUs with the rest."""


OPSD_ON_LORA = (
    "prefills on the policy's server, and vLLM's prompt log-probs crash a server serving LoRA adapters (vllm#16668)"
)


def opsd_envs(orch) -> list[str]:
    """The environments of `orch` that run opsd (their scoring needs a policy server without LoRA)."""
    return [e.display_name for e in orch.env if orch.env_algo(e.display_name).type == "opsd"]


class RLConfig(EntrypointConfig):
    # A shared key given on the command line overrides the sections' values from files (`rl @ cluster.toml
    # --model.name ./small-model`); set in a file, a section's different value is refused as a contradiction.
    CLI_OVERRIDES_SECTIONS: ClassVar[dict[tuple[str, ...], tuple[tuple[str, ...], ...]]] = {
        ("model", "name"): (("trainer", "model", "name"), ("orchestrator", "model", "name"),
                            ("inference", "model", "name")),
        ("max_steps",): (("trainer", "max_steps"), ("orchestrator", "max_steps")),
        ("max_async_level",): (("trainer", "max_async_level"), ("orchestrator", "max_async_level")),
        ("seq_len",): (("trainer", "seq_len"), ("orchestrator", "seq_len")),
    }  # fmt: skip

    trainer: TrainerConfig = TrainerConfig()
    """The trainer (`[trainer]`, or `--trainer @ t.toml`)."""

    orchestrator: OrchestratorConfig = OrchestratorConfig()
    """The orchestrator (`[orchestrator]`)."""

    inference: InferenceConfig | None = None
    """The inference server to start (`[inference]`); None: use the running servers in `orchestrator.client`."""

    attach: bool = False
    """Use the attachable server already on `inference.server.port` (`inference --server.attachable`) instead of
    starting one: checked to serve this run's model, reset to its base weights, left running at the end."""

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

    slurm: SlurmConfig | None = None
    """Submit the run to SLURM instead of running it here (`[slurm]`); `rl` exits once the job is queued."""

    runs: list[RunSpec] = []
    """Several runs in one LoRA trainer (`[[runs]]`, needs `[trainer.model.lora]`): one orchestrator each, on
    `output_dir/run_<name>`, with `[orchestrator]` plus its own keys; `[orchestrator]` itself is not started."""

    teacher: TeacherServerConfig | None = None
    """A frozen teacher to serve for every `opd` environment that names none (`[teacher] model = ...`)."""

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
        if self.seq_len is None and "seq_len" not in trainer.model_fields_set and "seq_len" in orch.model_fields_set:
            trainer.seq_len = orch.seq_len  # the samples' length is the orchestrator's; packed rows hold one at least
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
            url = f"http://{client_host(inf.server.host)}:{inf.server.port}/v1"
            _share(orch.client, "base_url", [url], "orchestrator.client", "inference.server (host, port)")
        elif inf is not None and "orchestrator" in deploy.roles:
            raise ValueError(
                "the orchestrator runs on this host but inference does not: name the servers in "
                "deployment.inference_hosts (or INFERENCE_SERVER_IP)"
            )
        if self.api_key() is not None:
            _share(orch.client, "api_key_var", API_KEY_VAR, "orchestrator.client", "the inference API key")
        elif inf is not None and "api_key_var" not in orch.client.model_fields_set:
            orch.client.api_key_var = API_KEY_VAR  # where its workers hold the run's HTTP token (`utils.secret`)
        if inf is not None and inf.max_num_seqs is None and "orchestrator" in deploy.roles:
            inf.max_num_seqs = self._rollouts_in_flight()
        self._teacher()
        if inf is not None and inf.lora is not None and opsd_envs(orch):
            raise ValueError(f"{opsd_envs(orch)} run opsd, whose scoring {OPSD_ON_LORA}; unset [inference.lora]")
        if self.bench is not None:
            self._bench()
        if self.runs and trainer.model.lora is None:
            raise ValueError("runs: each run trains a LoRA adapter of the shared base model; set [trainer.model.lora]")
        if trainer.model.lora is not None:
            self._lora()
        self._check_agreement()
        return self

    def _rollouts_in_flight(self) -> int | None:
        """The most rollouts this host's orchestrators keep in flight, each with at most one model call at a time:
        the servers never need more sequences at once (more calls, e.g. a judge's, queue). An online eval pass runs
        beside them: its rollouts count too, up to as many again (a larger pass queues). None when a run's config
        does not load (reported when the runs start)."""
        try:
            orchs = list(self.run_orchestrators().values()) if self.runs else [self.orchestrator]
        except ValueError:
            return None
        total = 0
        for o in orchs:
            training = o.groups_in_flight * o.rollouts_per_example
            per_pass = o.eval_rollouts_per_pass
            total += training + (training if per_pass is None else min(training, per_pass))
        return total

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

    def _teacher(self) -> None:
        """Point every opd or sft environment without a teacher at the one `[teacher]` serves (on this host, the run's
        token), after checking that the two models have one tokenizer."""
        if self.teacher is None:
            return
        orch = self.orchestrator
        algos = [orch.algo] + [e.algo for e in orch.env if e.algo is not None]
        waiting = [a for a in algos if a.type in TEACHER_ALGOS and a.teacher is None]
        if not waiting:
            raise ValueError(
                f"[teacher]: no environment runs {' or '.join(TEACHER_ALGOS)} without a teacher of its own; "
                "remove [teacher]"
            )
        if self.runs or not self.deployment.single_host or self.inference is None:
            raise ValueError("[teacher] is served on this host with the settings of [inference], for one run")
        problem = tokenizer_mismatch(orch.model.name, self.teacher.model)
        if problem:
            raise ValueError(f"[teacher] {problem}: the policy trains on the teacher's tokens or log-probs as they are")
        if self.teacher.port is None:
            self.teacher.port = free_port()
        teacher = FrozenModelConfig(
            name=self.teacher.model,
            base_url=f"http://127.0.0.1:{self.teacher.port}/v1",
            api_key_var=orch.client.api_key_var,  # unset there: the run's token, which `rl` gives the teacher too
        )
        for algo in waiting:
            algo.teacher = teacher

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
