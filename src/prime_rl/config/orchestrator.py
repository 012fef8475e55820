"""Config of the `orchestrator` entry point.

It lives with the shared configs, not in `prime_rl.orchestrator`, because a LoRA trainer validates each run's
resolved orchestrator config (`configs/orchestrator.toml`) without importing the orchestrator;
`prime_rl.orchestrator.config` re-exports it."""

from typing import Any, Literal, NamedTuple

from pydantic import Field, field_validator, model_validator

from prime_rl.config import (
    BaseConfig,
    BenchConfig,
    CheckpointConfig,
    EntrypointConfig,
    ServedModelConfig,
    WeightBroadcastConfig,
)
from prime_rl.config.algorithm import ESTIMATOR_ALGOS, AlgoConfig, FrozenModelConfig, GrpoAlgo
from prime_rl.config.curriculum import GateConfig, SamplerConfig, StandardSampler
from prime_rl.config.optim import OptimizerConfig, SchedulerConfig
from prime_rl.utils.monitor_config import WandbConfig


class BufferConfig(BaseConfig):
    seed: int = 0
    """Seed of the buffer's own RNG for task sampling, so a run's task order is reproducible."""

    online_difficulty_filtering: bool = False
    """Drop groups that every rollout solved (min reward >= 1) or every rollout failed (max reward <= 0).

    Groups with identical rewards anywhere else also carry zero advantage; they are left to the
    advantage-side zero-advantage filter (`zero_advantage_groups`), not handled here.
    """

    easy_threshold: float | None = None
    """Retire a task into the easy pool once one of its groups has mean reward >= this (None disables)."""

    hard_threshold: float | None = None
    """Retire a task into the hard pool once one of its groups has mean reward <= this (None disables)."""

    sampler: SamplerConfig = StandardSampler()
    """Task sampler of every environment that sets none (docs/algorithms.md, "Curricula"): `standard` or
    `difficulty_pool`."""

    gate: GateConfig | None = None
    """Admission gate of every environment that sets none (`advantage_range`); None: no gate."""

    @model_validator(mode="after")
    def _thresholds_are_ordered(self) -> "BufferConfig":
        easy, hard = self.easy_threshold, self.hard_threshold
        if easy is not None and hard is not None and not easy > hard:
            raise ValueError(
                f"easy_threshold ({easy}) must be > hard_threshold ({hard}), "
                "otherwise a single group could retire its task as both easy and hard"
            )
        return self


class AdvantageConfig(BaseConfig):
    estimator: Literal[
        "grpo", "rloo", "opo", "reinforce", "reinforce_mean", "reinforce_pp", "reinforce_pp_baseline", "gpg"
    ] = "grpo"
    """Advantage estimator (docs/algorithms.md): `grpo` (group mean), `rloo` (leave-one-out mean), `opo`
    (length-weighted mean), `reinforce` (the reward), `reinforce_mean` (reward - running mean of past batches),
    `reinforce_pp` (reward normalised over the batch), `reinforce_pp_baseline` (group mean, then / batch std), `gpg`
    (group mean, scaled up by the share of the batch with signal)."""

    std_normalize: bool = False
    """GRPO only: divide by the group's reward std (+eps); off is the Dr. GRPO mean-baseline form."""

    eps: float = Field(1e-6, ge=0)
    """Added to a std before dividing by it (`grpo` with `std_normalize`, `reinforce_pp`, `reinforce_pp_baseline`)."""

    baseline_decay: float = Field(0.9, ge=0, lt=1)
    """`reinforce_mean` only: weight of the past in the running mean (per step: b <- decay * b + (1 - decay) * batch
    mean reward, bias-corrected); 0 uses the previous batch's mean alone."""

    @model_validator(mode="after")
    def _check(self) -> "AdvantageConfig":
        if self.std_normalize and self.estimator != "grpo":
            raise ValueError(f"advantage.std_normalize applies to the grpo estimator only, not {self.estimator}")
        return self


class ClientConfig(BaseConfig):
    base_url: list[str] = ["http://localhost:8000/v1"]
    """OpenAI base URL(s) of the inference servers, ending in `/v1` (one URL, a comma-separated or JSON list);
    groups are spread over them by load."""

    api_key_var: str = "VLLM_API_KEY"
    """Environment variable holding the inference servers' API key (unset: no key)."""

    timeout: float = Field(1800.0, gt=0)
    """Seconds an admin call (weight update, health check) may take before it counts as failed."""

    @field_validator("base_url", mode="before")
    @classmethod
    def _one_url_is_a_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("base_url")
    @classmethod
    def _check_urls(cls, urls: list[str]) -> list[str]:
        if not urls:
            raise ValueError("needs at least one inference base URL")
        bad = [u for u in urls if not u.rstrip("/").endswith("/v1")]
        if bad:
            raise ValueError(f"base URLs must end in /v1 (the OpenAI API root), got {bad}")
        return [u.rstrip("/") for u in urls]


def renderer_config(renderer: dict[str, Any] | None, key: str):
    """`renderer` (a `renderers` config as a dict, set at `key`) as a `renderers.RendererConfig`, None for None.
    Validated on use, not at config load: importing `renderers` costs seconds (openai SDK), which `rl --dry-run`
    and config errors should not pay."""
    if renderer is None:
        return None
    from pydantic import TypeAdapter, ValidationError
    from renderers import RendererConfig

    try:
        return TypeAdapter(RendererConfig).validate_python(renderer)
    except ValidationError as e:
        raise ValueError(f"{key} {renderer} is not a valid renderers config: {e}") from None


class ClientModelConfig(ServedModelConfig):
    """The model as a client of the inference servers sees it: `name` is where the client-side renderer loads its
    tokenizer from (the path or hub id the servers loaded), `served_name` what requests ask for."""

    renderer: dict[str, Any] | None = None
    """`renderers` config, e.g. `{name = "qwen3", enable_thinking = false}` (None: chosen from the model name).
    Multi-turn training wants a model-specific renderer that bridges turns, so sampled tokens are never re-tokenized."""

    def renderer_config(self):
        """The `renderers.RendererConfig` (None: auto)."""
        return renderer_config(self.renderer, "model.renderer")


class EnvSpec(BaseConfig):
    """Which verifiers environment to load; shared by the orchestrator, `eval` and `synthesize`."""

    id: str = "reverse-text"
    """verifiers taskset id: an importable module (`reverse-text` imports `reverse_text`)."""

    args: dict[str, Any] = {}
    """Taskset config values (the taskset's `TasksetConfig` fields), e.g. `{num_tasks = 1000}`."""

    harness: str | None = None
    """verifiers harness id for every seat that does not pin its own; None: the taskset's own harness if it exports
    one, else the in-process `prime-chat`."""

    env_args: dict[str, Any] = {}
    """Options of the environment itself (its `EnvConfig` fields, as verifiers' `--env.<key>` sets them), e.g.
    `{id = "user-sim"}` to pair an env with the taskset, or a seat's settings `{second = {max_turns = 4}}`."""

    name: str | None = None
    """Name in metrics and logs (default: `id`); must be unique across environments."""

    @property
    def display_name(self) -> str:
        return self.name or self.id


class EnvConfig(EnvSpec):
    ratio: float | None = Field(None, gt=0)
    """Share of groups drawn from this environment (normalised over all); None everywhere: by number of tasks."""

    sampler: SamplerConfig | None = None
    """This environment's task sampler, e.g. `{type = "difficulty_pool"}` (None: `buffer.sampler`)."""

    gate: GateConfig | None = None
    """This environment's admission gate, e.g. `{type = "advantage_range", low = -0.05, high = 0.05}` (None:
    `buffer.gate`)."""

    algo: AlgoConfig | None = None
    """This environment's training algorithm (docs/algorithms.md); None: the run's `algo`."""


class EvalEnvConfig(EnvSpec):
    """An environment to evaluate on (`eval`, `synthesize`, the orchestrator's online evals)."""

    num_examples: int | None = Field(None, ge=1)
    """Evaluate the first this many tasks of the taskset (None: all of them)."""

    rollouts_per_example: int = Field(1, ge=1)
    """Rollouts per task; > 1 also reports pass@k."""


class SamplingConfig(BaseConfig):
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature; the trainer divides its logits by it to match the sampler's logprobs."""

    max_tokens: int | None = Field(None, ge=1)
    """Max tokens per model turn (None: the rest of the context)."""

    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling (`eval`/`synthesize`); training needs 1.0, the distribution the trainer scores."""

    seed: int | None = None
    """Sampling seed sent with each request (None: random)."""


class TemperatureScalingConfig(BaseConfig):
    """Raise an environment's sampling temperature while its groups' rewards stop varying (MinRL): a group whose
    rollouts all score the same carries no group-relative signal, and a hotter policy explores more. Each
    environment has its own temperature, between `min_temperature` and `max_temperature`, starting at
    `sampling.temperature`; after each finished group it is multiplied by `up` (the group's reward std <=
    `std_threshold`) or by `down` (it varied)."""

    min_temperature: float | None = Field(None, gt=0)
    """Lowest temperature; None: `sampling.temperature`, so relaxing stops at the configured temperature."""

    max_temperature: float = Field(1.5, gt=0)
    """Highest temperature an environment whose rewards do not vary is raised to."""

    std_threshold: float = Field(0.0, ge=0)
    """A group counts as not varying when its rewards' population std is at most this (per seat, the largest);
    0: only groups whose rewards are all equal."""

    up: float = Field(1.1, gt=1)
    """Factor applied to the environment's temperature after a group that did not vary."""

    down: float = Field(0.95, gt=0, le=1)
    """Factor applied after a group that varied (1: the temperature never comes back down)."""


class TrainSamplingConfig(SamplingConfig):
    temperature_scaling: TemperatureScalingConfig | None = None
    """Per-environment temperature raised while rewards stop varying (`--sampling.temperature-scaling` enables with
    defaults); each sample records the temperature it was sampled with."""

    @model_validator(mode="after")
    def _check_scaling(self) -> "TrainSamplingConfig":
        scaling = self.temperature_scaling
        if scaling is None:
            return self
        low = scaling.min_temperature if scaling.min_temperature is not None else self.temperature
        if not low <= self.temperature <= scaling.max_temperature:
            raise ValueError(
                f"sampling.temperature_scaling: need min_temperature ({low}) <= sampling.temperature "
                f"({self.temperature}) <= max_temperature ({scaling.max_temperature})"
            )
        return self

    @property
    def min_temperature(self) -> float:
        """The temperature scaling's floor (`sampling.temperature` unless set)."""
        scaling = self.temperature_scaling
        return scaling.min_temperature if scaling and scaling.min_temperature is not None else self.temperature


class OnlineEvalEnvConfig(EvalEnvConfig):
    interval: int | None = Field(None, ge=1)
    """Evaluate this environment every this many steps (None: `eval.interval`)."""


EVAL_ENV_PREFIX = "eval/"
"""Rollout workers serve an eval environment under `eval/<name>`, beside the training environment of that name."""


class OnlineEvalConfig(BaseConfig):
    """Held-out evals of the policy during training (docs/rl.md, "Online evals"): the policy before step 1, every
    `interval` steps, and the final one, each pass on exactly one policy version."""

    interval: int = Field(10, ge=1)
    """Evaluate every this many steps (an environment may set its own `interval`)."""

    env: list[OnlineEvalEnvConfig] = [OnlineEvalEnvConfig()]
    """Environments to evaluate on (`[[eval.env]]` tables): the first `num_examples` tasks of the taskset as `args`
    configure it (e.g. another `seed` than training's for held-out tasks)."""

    sampling: SamplingConfig | None = None
    """Sampling of the eval requests: the fields set here replace the training `sampling`'s (None: the training
    sampling, without temperature scaling)."""

    pass_threshold: float = 1.0
    """A rollout counts as solved for pass@k when its reward is at least this."""

    @model_validator(mode="after")
    def _check_envs(self) -> "OnlineEvalConfig":
        names = [e.display_name for e in self.env]
        if not names:
            raise ValueError("eval.env: configure at least one environment (or leave [eval] out)")
        if len(set(names)) != len(names):
            raise ValueError(f"eval.env names must be unique, got {names}; set `name` to tell them apart")
        return self

    def env_interval(self, env: OnlineEvalEnvConfig) -> int:
        return env.interval or self.interval


class RolloutEnv(NamedTuple):
    """An environment a rollout worker serves: which one, with what sampling, and whether its tokens are trained on
    (training environments refuse traces sampled from another distribution than the trainer scores)."""

    spec: EnvSpec
    sampling: SamplingConfig
    training: bool


class LogExtrasConfig(BaseConfig):
    interval: int = Field(10, ge=1)
    """Log the extras every this many steps (they are larger than the per-step metrics)."""

    samples: bool = True
    """A table of 8 rollouts (env, prompt, completion, reward, advantage): W&B and `{output_dir}/tables.jsonl`."""

    distributions: bool = True
    """Distributions of rewards, advantages and sequence lengths: W&B histograms, summary stats in metrics.jsonl."""


class AdapterConfig(BaseConfig):
    """This run trains a LoRA adapter of the served base model (the trainer's `model.lora`), not the full weights."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    """The adapter's name on the inference servers; rollouts name it as the model once a trained step is loaded."""

    optim: OptimizerConfig | None = None
    """This run's optimizer in the trainer (default: the trainer's `optim`)."""

    scheduler: SchedulerConfig | None = None
    """This run's learning-rate schedule over its `max_steps` (default: the trainer's `scheduler`)."""

    seed: int | None = None
    """Seed of the adapter's initial weights (default: the trainer's `seed`)."""


class ConcurrencyConfig(BaseConfig):
    """Adapt the rollouts in flight to the servers (docs/orchestrator.md): once per step, up by one group while no
    server queues requests, down by a quarter when one does or its KV cache is nearly full; `min_inflight =
    max_inflight` pins it. Counted in rollouts, rounded up to whole groups."""

    min_inflight: int = Field(1, ge=1)
    """Fewest rollouts in flight."""

    max_inflight: int | None = Field(None, ge=1)
    """Most rollouts in flight (None: four batches)."""

    initial_inflight: int | None = Field(None, ge=1)
    """Rollouts in flight at the start (None: `batch_size x oversampling`)."""

    @model_validator(mode="after")
    def _check(self) -> "ConcurrencyConfig":
        if self.max_inflight is not None and self.min_inflight > self.max_inflight:
            raise ValueError(f"min_inflight ({self.min_inflight}) > max_inflight ({self.max_inflight})")
        return self


class OrchestratorConfig(EntrypointConfig):
    model: ClientModelConfig = ClientModelConfig()
    """The policy being trained, as the inference servers serve it."""

    adapter: AdapterConfig | None = None
    """Train a LoRA adapter instead of the full weights (the trainer reads this section from the run's resolved
    config, `configs/orchestrator.toml`)."""

    client: ClientConfig = ClientConfig()
    """Inference servers."""

    env: list[EnvConfig] = [EnvConfig()]
    """Environments to train on (`[[env]]` tables)."""

    sampling: TrainSamplingConfig = TrainSamplingConfig()
    """Sampling settings for training rollouts."""

    buffer: BufferConfig = BufferConfig()
    """Task sampling, difficulty filtering and retirement."""

    algo: AlgoConfig = GrpoAlgo()
    """Training algorithm of every environment that names none (docs/algorithms.md, "Training algorithms")."""

    advantage: AdvantageConfig = AdvantageConfig()
    """Advantage estimator of the `grpo` algorithm."""

    filter_zero_advantage: bool = False
    """Drop groups whose advantages are all zero (no learning signal) instead of training on them."""

    concurrency: ConcurrencyConfig | None = None
    """Adaptive in-flight control (`[concurrency]`); None: a fixed `batch_size x oversampling` rollouts in flight."""

    mask_truncated_completions: bool = False
    """Train on no token of a rollout cut off by `max_tokens` or `seq_len` (its reward still counts in its group's
    baseline): a half-written answer's tokens get no credit or blame."""

    ckpt: CheckpointConfig | None = None
    """Checkpoints of progress and buffer (`--ckpt` enables with defaults)."""

    wandb: WandbConfig | None = None
    """Also log to W&B, as run `<name>-orchestrator` (`--wandb` enables with defaults)."""

    tensorboard: bool = False
    """Also write TensorBoard event files (scalars, histograms) to `{output_dir}/tensorboard/orchestrator/`."""

    log_extras: LogExtrasConfig = LogExtrasConfig()
    """Samples and distributions logged every `interval` steps."""

    bench: BenchConfig | None = None
    """Benchmark the running servers without a trainer (`--bench` enables): `bench.steps` steps on the weights they
    serve (never waits for or loads others), no batches, no checkpoints; prints a throughput table at the end."""

    batch_size: int = Field(64, ge=1)
    """Rollouts trained on per step (traces with sampled tokens; a multi-agent episode has one per acting seat);
    a multiple of `rollouts_per_example`."""

    rollouts_per_example: int = Field(8, ge=1)
    """Rollouts per task: a group, the unit advantages are computed over."""

    oversampling: float = Field(1.0, ge=1.0)
    """Groups kept in flight = batch_size / rollouts_per_example * oversampling (more hides slow rollouts)."""

    max_async_level: int = Field(2, ge=0)
    """k: no rollout of batch n starts on a policy older than step n-1-k (0 = fully on-policy)."""

    max_off_policy_steps: int = Field(8, ge=0)
    """Drop a group generated by more than this many policy updates (counted on its tokens' policy versions)."""

    max_steps: int | None = Field(None, ge=1)
    """Stop after writing this step's batch (None: run until stopped)."""

    seq_len: int = Field(2048, ge=1)
    """Longest sample the trainer accepts; a longer rollout is trained on its first `seq_len` tokens, marked truncated."""

    workers: int = Field(2, ge=0)
    """Rollout worker processes (verifiers costs ~20 ms of CPU per model turn, so one process tops out ~45 turns/s);
    0 runs the rollouts on the orchestrator's own event loop (one process less: for small machines)."""

    max_retries: int = Field(3, ge=0)
    """Times a group whose rollouts failed on the inference server (connection, 5xx) is retried."""

    weights_poll_interval: float = Field(0.5, gt=0)
    """Seconds between looks for newly published trainer weights (with an in-memory broadcast, where the trainer waits
    until its policy is taken: at most 0.05, and 0.005 while a batch waits for them)."""

    stall_timeout: float = Field(1800.0, gt=0)
    """Seconds without progress (an accepted group, or weights the next batch needs) before the run fails, naming
    what it waited for."""

    weight_broadcast: WeightBroadcastConfig = WeightBroadcastConfig()
    """How new policies reach the servers: read from `broadcasts/`, or an in-memory broadcast from the trainer."""

    eval: OnlineEvalConfig | None = None
    """Online evals on held-out environments during the run (`[eval]`, `[[eval.env]]`; None: none)."""

    @model_validator(mode="after")
    def _check(self) -> "OrchestratorConfig":
        if self.bench is not None and self.ckpt is not None and self.ckpt.resuming:
            raise ValueError(
                "--bench measures the servers' current weights without a trainer and cannot resume from a checkpoint"
            )
        if self.batch_size % self.rollouts_per_example:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be a multiple of rollouts_per_example ({self.rollouts_per_example})"
            )
        names = [e.display_name for e in self.env]
        if not names:
            raise ValueError("env: configure at least one environment")
        if len(set(names)) != len(names):
            raise ValueError(f"env names must be unique, got {names}; set `name` to tell them apart")
        ratios = [e.ratio for e in self.env]
        if any(r is None for r in ratios) and any(r is not None for r in ratios):
            raise ValueError("env ratio: set it on every environment or on none")
        algos = {self.env_algo(e.display_name).type for e in self.env}
        if not algos & set(ESTIMATOR_ALGOS) and self.advantage != AdvantageConfig():
            raise ValueError(
                f"[advantage] sets the estimator of {ESTIMATOR_ALGOS}, but no environment runs one of them: {algos}"
            )
        estimator = self.advantage.estimator
        if estimator in ("rloo", "reinforce_pp_baseline", "gpg") and self.rollouts_per_example < 2:
            # A group of one is its own baseline: every advantage would be 0.
            raise ValueError(f"advantage.estimator {estimator} needs rollouts_per_example >= 2")
        distilled = sorted(algos & {"opd", "opsd"})
        if distilled and (self.sampling.temperature != 1 or self.sampling.temperature_scaling is not None):
            raise ValueError(
                f"{distilled[0]} compares the policy's log-probs with its teacher's plain softmax: sample at "
                "temperature 1 (sampling.temperature = 1, no temperature_scaling)"
            )
        gated_otherwise = [n for n in names if self.env_gate(n) and self.env_algo(n).type not in ESTIMATOR_ALGOS]
        if gated_otherwise:
            raise ValueError(
                f"an advantage_range gate on {gated_otherwise}, which run {self.env_algo(gated_otherwise[0]).type}: "
                "the gate judges the grpo algorithm's advantages"
            )
        if any(self.env_gate(n) for n in names) and estimator in ("reinforce_mean", "reinforce_pp"):
            raise ValueError(
                f"an advantage_range gate with advantage.estimator {estimator}: its baseline comes from the batch, so "
                "a group's advantages are not known when it arrives"
            )
        if self.filter_zero_advantage and estimator in ("reinforce_mean", "reinforce_pp"):
            raise ValueError(
                f"filter_zero_advantage with advantage.estimator {estimator}: its baseline comes from the batch, so no "
                "group is known to lack a signal when it arrives (a constant group gets a non-zero advantage)"
            )
        # The trainer scores every sampled token with the full softmax at the sampling temperature.
        if self.sampling.temperature <= 0:
            raise ValueError("sampling.temperature must be > 0 for training: greedy tokens have no usable logprobs")
        if self.adapter is not None and self.weight_broadcast.in_memory:
            raise ValueError(
                f"weight_broadcast.type = {self.weight_broadcast.type!r} with [adapter]: adapters reach the inference "
                "servers through the filesystem (broadcasts/step_n/, loaded with /load_lora_adapter); use "
                "weight_broadcast.type = 'filesystem'"
            )
        if self.sampling.top_p < 1:
            raise ValueError(
                f"sampling.top_p = {self.sampling.top_p}: training samples from the full distribution (top_p = 1); "
                "the trainer's logprobs would not match a truncated one"
            )
        if self.eval is not None:
            clash = sorted(set(names) & {EVAL_ENV_PREFIX + e.display_name for e in self.eval.env})
            if clash:
                raise ValueError(f"env names {clash} clash with the eval environments' worker names; rename them")
        return self

    def eval_sampling(self) -> SamplingConfig:
        """The online evals' sampling: the training sampling's fields, with those `eval.sampling` sets replaced."""
        base = SamplingConfig(**self.sampling.model_dump(include=set(SamplingConfig.model_fields)))
        override = self.eval.sampling if self.eval is not None else None
        if override is None:
            return base
        return base.model_copy(update=override.model_dump(include=override.model_fields_set))

    def rollout_envs(self) -> dict[str, RolloutEnv]:
        """Every environment the rollout workers serve, by the name groups give: the training environments, and the
        online evals' as `eval/<name>`."""
        envs = {e.display_name: RolloutEnv(e, self.sampling, True) for e in self.env}
        if self.eval is not None:
            sampling = self.eval_sampling()
            envs |= {EVAL_ENV_PREFIX + e.display_name: RolloutEnv(e, sampling, False) for e in self.eval.env}
        return envs

    @property
    def eval_rollouts_per_pass(self) -> int | None:
        """Rollouts of an online eval pass of every eval environment: 0 without evals, None where an environment
        evaluates all its tasks (`num_examples` unset: unknown until it is loaded)."""
        if self.eval is None:
            return 0
        if any(e.num_examples is None for e in self.eval.env):
            return None
        return sum(e.num_examples * e.rollouts_per_example for e in self.eval.env)

    def env_algo(self, env: str) -> AlgoConfig:
        """The training algorithm of environment `env` (its display name): its own, else the run's."""
        own = next((e.algo for e in self.env if e.display_name == env), None)
        return own if own is not None else self.algo

    def env_teacher(self, env: str) -> FrozenModelConfig:
        """The frozen teacher of environment `env`'s opd or sft algorithm; an error naming the fix where it has none
        (`rl` fills it from `[teacher]`)."""
        algo = self.env_algo(env)
        teacher = getattr(algo, "teacher", None)
        if teacher is None:
            raise ValueError(
                f"{env}: algo {algo.type} needs a teacher: `algo.teacher = {{name, base_url}}`, or `[teacher]` in rl"
            )
        return teacher

    def env_sampler(self, env: str) -> SamplerConfig:
        """The task sampler of environment `env` (its display name): its own, else `buffer.sampler`."""
        own = next((e.sampler for e in self.env if e.display_name == env), None)
        return own if own is not None else self.buffer.sampler

    def env_gate(self, env: str) -> GateConfig | None:
        """The admission gate of environment `env`: its own, else `buffer.gate` (None: none)."""
        own = next((e.gate for e in self.env if e.display_name == env), None)
        return own if own is not None else self.buffer.gate

    @property
    def groups_per_batch(self) -> int:
        return self.batch_size // self.rollouts_per_example

    @property
    def groups_in_flight(self) -> int:
        """Groups the scheduler keeps running at once (`oversampling`), or `concurrency`'s start."""
        fixed = max(1, round(self.groups_per_batch * self.oversampling))
        if self.concurrency is None or self.concurrency.initial_inflight is None:
            return fixed
        return self.groups(self.concurrency.initial_inflight)

    def groups(self, rollouts: int) -> int:
        """Whole groups holding `rollouts` rollouts."""
        return -(-rollouts // self.rollouts_per_example)

    def inflight_bounds(self) -> tuple[int, int]:
        """`concurrency`'s (low, high) in groups."""
        assert self.concurrency is not None
        c = self.concurrency
        high = self.groups(c.max_inflight) if c.max_inflight is not None else 4 * self.groups_per_batch
        return self.groups(c.min_inflight), high
