"""Training algorithms: `[orchestrator.algo]` for every environment, `algo` of one `[[orchestrator.env]]` for it.

An algorithm maps finished rollouts to their training signal; the orchestrator computes it (orchestrator/algorithms.py)
and ships it in the batch, and the trainer executes what it is shipped without knowing which algorithm made it. One
typed config per algorithm, told apart by `type` (upstream prime-rl's spelling: `[orchestrator.algo] type = ...`).
Formulas and worked examples: docs/algorithms.md, "Training algorithms".
"""

from typing import Annotated, Literal

from pydantic import Field

from prime_rl.config import BaseConfig


class GrpoAlgo(BaseConfig):
    """Reward minus a group baseline, per seat: the estimator and its settings are `[orchestrator.advantage]`."""

    type: Literal["grpo"] = "grpo"
    """`grpo`: the group-relative family (`advantage.estimator`: grpo, rloo, opo, reinforce..., gpg)."""


class MaxRLAlgo(BaseConfig):
    """Maximum-likelihood RL (arXiv 2602.02710): `A = (r - mean) / mean` per group and seat, 0 where the mean is not
    positive. For rewards >= 0 (canonically 0/1): a task solved with probability p weighs ~1/p, as in the gradient of
    log p, not p."""

    type: Literal["max_rl"] = "max_rl"
    """`max_rl`: group-centred reward divided by the group mean."""


class RaeAlgo(BaseConfig):
    """Self-play (SPIRAL, arXiv 2506.24119): `A = r - b`, b an exponential mean of the same agent's (seat's) earlier
    rewards in this environment, read before the new reward is folded in. In a zero-sum game the group mean is ~0
    whatever the policy does; each seat against its own expectation is not. Any group size, 1 included."""

    type: Literal["rae"] = "rae"
    """`rae`: reward minus the seat's running baseline (kept in the orchestrator checkpoint)."""

    decay: float = Field(0.95, ge=0, lt=1)
    """After each rollout: `b <- decay * b + (1 - decay) * r`; b starts at 0."""


class HierarchicalGrpoAlgo(BaseConfig):
    """Proposer-solver environments: a solver is compared only with the other attempts at the same proposed problem
    (its episode), a proposer with the other proposals for the same source task (its group). A comparison of one
    rollout gives 0."""

    type: Literal["hierarchical_grpo"] = "hierarchical_grpo"
    """`hierarchical_grpo`: group means over episodes for the solvers, over the group for the other seats."""

    episode_agents: list[str] = Field(["solver"], min_length=1)
    """Seats compared within one episode (seats `solver_1`, `solver_2`, ... count as agent `solver`)."""


class FrozenModelConfig(BaseConfig):
    """A model behind an OpenAI-compatible endpoint that training never updates (a teacher), with its own key."""

    name: str
    """Served model name, the `model` field of every request."""

    base_url: str
    """Its OpenAI API root, e.g. `http://teacher-host:8001/v1`."""

    api_key_var: str = "TEACHER_API_KEY"
    """Environment variable holding its bearer token (unset: requests carry none)."""

    timeout: float = Field(300.0, gt=0)
    """Seconds one request may take."""

    max_concurrency: int = Field(16, ge=1)
    """Requests in flight to it at once."""


class OpdAlgo(BaseConfig):
    """On-policy distillation: the policy samples; the frozen `teacher` scores each sample's own tokens by prefill
    (`prompt_logprobs`), and the trainer minimises the per-token reverse KL `log pi - log teacher` on the sampled
    tokens (the `ref_kl` loss component). No reward is needed; sampling runs at temperature 1, where both sides'
    log-probs are of the plain softmax."""

    type: Literal["opd"] = "opd"
    """`opd`: reverse KL to a frozen teacher on the policy's own samples."""

    teacher: FrozenModelConfig | None = None
    """The teacher, sharing the policy's tokenizer (checked when the orchestrator starts); None: the one `rl` serves
    from its `[teacher]` section."""


class SftAlgo(BaseConfig):
    """Hard distillation: the frozen `teacher` generates the rollouts (the policy samples nothing), and the policy
    trains with cross-entropy on the teacher's sampled tokens (the `ce` loss component). Rewards are computed and
    logged but do not train; a teacher's rollout never goes stale."""

    type: Literal["sft"] = "sft"
    """`sft`: cross-entropy on a frozen teacher's own rollouts."""

    teacher: FrozenModelConfig | None = None
    """The model that samples (upstream: `sampling.source`), sharing the policy's tokenizer; None: the one `rl`
    serves from its `[teacher]` section."""


class OpsdAlgo(BaseConfig):
    """On-policy self-distillation: the policy samples; the live policy, shown an expert demonstration of the task in
    a leading system message, scores each sample's tokens by prefill, and the trainer minimises the per-token reverse
    KL to that score (the `ref_kl` loss component). The teacher is the policy itself: no second model."""

    type: Literal["opsd"] = "opsd"
    """`opsd`: reverse KL to the demonstration-conditioned live policy."""

    demo_key: str = "demonstration"
    """Where the demonstration is: the task's `info[demo_key]`, else its top-level field `demo_key` (e.g. `answer`)."""

    template: str = "An expert's response to the task that follows:\n{demonstration}"
    """The system message prepended for scoring; `{demonstration}` is replaced by the demonstration's text."""


class EchoRole(BaseConfig):
    """Cross-entropy on one role's environment-provided tokens."""

    alpha: float = Field(0.1, gt=0)
    """The `ce` weight of each of the role's tokens (the rl tokens weigh 1 in their own term)."""


class EchoAlgo(BaseConfig):
    """ECHO: the grpo family's advantages on the policy's own tokens (`rl`, `[orchestrator.advantage]`), plus weighted
    cross-entropy on tokens the environment wrote in later turns (tool results, user replies), chosen by their
    message's role (`ce`). The policy learns to predict what its actions cause."""

    type: Literal["echo"] = "echo"
    """`echo`: grpo on actions plus ce on the chosen roles' environment tokens."""

    roles: dict[Literal["system", "user", "assistant", "tool"], EchoRole] = Field(
        default_factory=lambda: {"tool": EchoRole()}, min_length=1
    )
    """Roles whose environment-provided tokens train with ce, each at its `alpha` (default: tool results at 0.1)."""


AlgoConfig = Annotated[
    MaxRLAlgo | RaeAlgo | HierarchicalGrpoAlgo | OpdAlgo | SftAlgo | OpsdAlgo | EchoAlgo | GrpoAlgo,
    Field(discriminator="type"),
]
"""One of the algorithms, by `type` (grpo last: `--help` shows the last one's default)."""

ESTIMATOR_ALGOS = ("grpo", "echo")
"""Algorithms whose rollouts take the `[orchestrator.advantage]` estimator's advantages (the grpo family)."""

TEACHER_ALGOS = ("opd", "sft")
"""Algorithms that need a frozen `teacher` (`rl` serves one from `[teacher]` for those that name none)."""
