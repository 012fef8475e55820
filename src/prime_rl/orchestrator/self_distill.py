"""On-policy self-distillation (`opsd`): the live policy, shown the task's demonstration, scores its own samples.

For each sample of an opsd group the orchestrator builds the hint block (the policy tokenizer's chat template rendering
of one system message, `algo.template` filled with the task's demonstration), puts it in front of the sample's token
ids and prefills the result on the policy's own inference servers (`/v1/completions`, `prompt_logprobs = 0`, through
`TeacherClient`). The sample's tokens are scored verbatim, never re-rendered; the hint's positions are dropped, so
each sample token keeps one log-prob, now conditioned on the demonstration, and the first one gets a real value. A
tokenizer whose template starts with a BOS that the sample starts with too keeps that one BOS in front: the hint goes
after it (`splice`). The scorer is the policy the servers serve when the batch is built (between two `collect`s no
weights move): at `max_async_level = 0` the policy that sampled the batch.

The policy servers must run without LoRA: vLLM computes prompt log-probs with the per-request LoRA mapping of the
sampler, so a prefill batched with any other request kills a LoRA-enabled engine (vllm-project/vllm#29955; seen here
with vLLM 0.32 on CPU: `einsum(): subscript b has size 7 ... 170`). Adapter training (`orchestrator.adapter`) is
therefore refused; an attached or external server started with `--lora.*` cannot be told apart from here.
"""

from __future__ import annotations

import asyncio
import json

from prime_rl.config.algorithm import FrozenModelConfig, OpsdAlgo
from prime_rl.models.tokenizers import load_tokenizer
from prime_rl.orchestrator.teacher import TeacherClient, samples_by_key

CHECKED_TASKS = 8
"""Tasks of each opsd environment whose demonstration is looked up when the orchestrator starts (a task without one
fails there, before any server is touched; later ones fail when their group is scored)."""


class DemonstrationError(ValueError):
    """A task of an opsd environment has no demonstration under the configured key, or the template cannot be
    filled."""


def demonstration(task: dict, key: str, env: str) -> str:
    """The task's demonstration: `info[key]` first, else its top-level field `key` (e.g. `answer`). A non-string
    value (a number, a list of messages) is given as JSON. Missing or null: an error naming the environment, the key
    and the fields the task has."""
    info = task.get("info")
    if isinstance(info, dict) and info.get(key) is not None:
        value = info[key]
    elif task.get(key) is not None:
        value = task[key]
    else:
        info_keys = f", info's: {sorted(info)}" if isinstance(info, dict) else ""
        raise DemonstrationError(
            f"{env}: algo opsd needs a demonstration at the task's info[{key!r}] or field {key!r}, and task "
            f"{task.get('idx')} has neither; its fields: {sorted(task)}{info_keys} (set `algo.demo_key`)"
        )
    return value if isinstance(value, str) else json.dumps(value)


def hint_text(template: str, demo: str, env: str) -> str:
    """`template` with `{demonstration}` filled in (str.format: write literal braces as `{{` and `}}`)."""
    try:
        return template.format(demonstration=demo)
    except (KeyError, IndexError, ValueError) as e:
        raise DemonstrationError(
            f"{env}: algo.template {template!r} cannot be filled ({type(e).__name__}: {e}): its only field is "
            "{demonstration}; write other braces doubled"
        ) from None


def hint_ids(tokenizer, text: str) -> list[int]:
    """The hint block's token ids: the chat template's rendering of one system message holding `text` (no generation
    prompt), tokenised without adding special tokens (the template writes any it wants)."""
    rendered = tokenizer.apply_chat_template([{"role": "system", "content": text}], tokenize=False)
    return tokenizer.encode(rendered, add_special_tokens=False)


def splice(hint: list[int], sample: list[int], bos: int | None) -> tuple[list[int], list[int]]:
    """The prefill's token ids and, for each sample token, its position in them. The hint block goes in front of
    the sample; where both start with the tokenizer's `bos`, that token stays once, first, and the hint follows it.
    E.g. hint [7, 8], sample [1, 2, 3], no BOS: ([7, 8, 1, 2, 3], [2, 3, 4]); hint [0, 7], sample [0, 2], bos 0:
    ([0, 7, 2], [0, 2])."""
    keep = 1 if bos is not None and hint[:1] == [bos] and sample[:1] == [bos] else 0
    shift = len(hint) - keep
    positions = list(range(keep)) + list(range(keep + shift, len(sample) + shift))
    return sample[:keep] + hint[keep:] + sample[keep:], positions


def sample_logprobs(prefill: list[float], positions: list[int]) -> list[float]:
    """The sample tokens' log-probs out of the whole prefill's (one per prefill token): the hint positions dropped."""
    return [prefill[p] for p in positions]


class SelfDistiller:
    """The opsd environments of a run, their hint settings, and one prefill client per policy server (the
    orchestrator's own URLs, its API key)."""

    def __init__(self, config, algos: dict[str, OpsdAlgo], tokenizer, max_concurrency: int = 16):
        self.algos = algos
        self.tokenizer = tokenizer
        self.bos = tokenizer.bos_token_id
        self.base_name = config.model.api_name
        client = config.client
        self.clients = {
            url: TeacherClient(
                FrozenModelConfig(
                    name=self.base_name,
                    base_url=url,
                    api_key_var=client.api_key_var,
                    timeout=client.timeout,
                    max_concurrency=max_concurrency,
                ),
                client.api_key_var,  # the policy servers' own key (the run's token under `rl`)
            )
            for url in client.base_url
        }

    @classmethod
    def for_run(cls, config, tasks: dict) -> SelfDistiller | None:
        """The run's self-distiller, None without an opsd environment. Checks the first tasks of each opsd
        environment for a demonstration and the template, so a missing one fails at start."""
        algos = {env: algo for env in tasks if (algo := config.env_algo(env)).type == "opsd"}
        if not algos:
            return None
        if config.adapter is not None:
            raise ValueError(
                f"{sorted(algos)[0]}: algo opsd cannot train a LoRA adapter (orchestrator.adapter, the trainer's "
                "model.lora): it needs prompt log-probs from the policy's servers, which vLLM cannot compute with LoRA "
                "enabled (vllm-project/vllm#29955); train the full weights"
            )
        for env, algo in algos.items():
            for task in tasks[env].first(CHECKED_TASKS):
                hint_text(algo.template, demonstration(task, algo.demo_key, env), env)
        tokenizer = load_tokenizer(config.model.name, trust_remote_code=config.model.trust_remote_code)
        return cls(config, algos, tokenizer)

    def hint(self, env: str, task: dict) -> list[int]:
        """The hint block of one task of `env`."""
        algo = self.algos[env]
        return hint_ids(self.tokenizer, hint_text(algo.template, demonstration(task, algo.demo_key, env), env))

    async def score(self, groups: list, servers) -> dict[tuple[int, int, int], list[float]]:
        """Each sample of each opsd group scored by the live policy under its task's hint, by (group, rollout, sample)
        index as `batch_samples` takes `refs`, spread over the healthy policy servers."""
        urls = servers.healthy() or list(self.clients)
        found = samples_by_key(groups, self.algos)
        hints = {id(group): self.hint(group.env, group.task) for _, group, _ in found}  # one per group
        calls = (
            self._score(self.clients[urls[n % len(urls)]], hints[id(group)], sample.token_ids)
            for n, (_, group, sample) in enumerate(found)
        )
        scored = await asyncio.gather(*calls)
        return {key: logprobs for (key, _, _), logprobs in zip(found, scored, strict=True)}

    async def _score(self, client: TeacherClient, hint: list[int], sample: list[int]) -> list[float]:
        prompt, positions = splice(hint, sample, self.bos)
        return sample_logprobs(await client.logprobs(prompt), positions)

    async def close(self) -> None:
        for client in self.clients.values():
            await client.close()
