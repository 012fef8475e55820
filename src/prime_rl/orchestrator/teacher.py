"""A frozen teacher endpoint (`opd`): the log-probability it gives each token of a sample, by prefill.

One `/v1/completions` request per sample with the token ids as the prompt, `max_tokens = 1` and `prompt_logprobs = 0`:
vLLM then returns, for every prompt position after the first, the log-probability of the token that is there. No
sampling, no chat template, no re-tokenisation: the teacher scores exactly the tokens the policy saw and wrote, which
is why it must share the policy's tokenizer (`check_tokenizer`). Requests carry the teacher's own key (its
`api_key_var`), or the run's token for a teacher `rl` serves (`[teacher]`).
"""

from __future__ import annotations

import asyncio
import os

import httpx

from prime_rl.config.algorithm import FrozenModelConfig
from prime_rl.utils import net
from prime_rl.utils.health import wait_healthy
from prime_rl.utils.secret import client_token

PROBE = "Reverse the text: The quick brown fox jumps over 13 lazy dogs!\n<|im_start|>assistant"
"""Text whose token ids the policy's tokenizer and the teacher's must agree on (words, digits, punctuation, a
special token of the chat template)."""


def samples_by_key(groups: list, envs) -> list[tuple[tuple[int, int, int], object, object]]:
    """`((group, rollout, sample) index, group, sample)` of every sample of the groups of `envs`, in batch order: the
    keys `batch_samples` takes a reference's log-probs by (`refs`)."""
    return [
        ((g, r, i), group, sample)
        for g, group in enumerate(groups)
        if group.env in envs
        for r, rollout in enumerate(group.rollouts)
        for i, sample in enumerate(rollout.samples)
    ]


class TeacherError(RuntimeError):
    """The teacher refused, failed or does not fit the policy (its tokenizer): retrying cannot help."""


def parse_prompt_logprobs(token_ids: list[int], prompt_logprobs: list) -> list[float]:
    """Per-token log-probs from vLLM's `prompt_logprobs` (one entry per prompt token: None for the first, else a map
    token id -> {logprob, ...} holding at least the token at that position). The first token has no context: 0.0."""
    if len(prompt_logprobs) != len(token_ids):
        raise TeacherError(f"the teacher scored {len(prompt_logprobs)} positions of a {len(token_ids)}-token sample")
    values = [0.0]
    for position, (token, entry) in enumerate(zip(token_ids[1:], prompt_logprobs[1:], strict=True), start=1):
        found = entry.get(str(token)) if isinstance(entry, dict) else None
        if found is None:
            raise TeacherError(f"the teacher's prompt_logprobs at position {position} lack token {token}")
        values.append(float(found["logprob"]))
    return values


def teacher_token(teacher: FrozenModelConfig, client_var: str) -> str | None:
    """The bearer token for `teacher`: its `api_key_var`'s value. Only a teacher that shares the policy servers'
    variable (`client_var`: the one `rl` serves, which holds the run's token) falls back to the run's token: the run's
    token is never sent to an endpoint of someone else's."""
    if teacher.api_key_var == client_var:
        return client_token(client_var)
    return os.environ.get(teacher.api_key_var) or None


class TeacherClient:
    """Requests to one teacher, at most `max_concurrency` at once; `client_var`: the policy servers' key variable."""

    def __init__(self, config: FrozenModelConfig, client_var: str):
        self.config = config
        key = teacher_token(config, client_var)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        limits = httpx.Limits(
            max_connections=config.max_concurrency,
            max_keepalive_connections=config.max_concurrency,
            keepalive_expiry=net.KEEPALIVE_EXPIRY,
        )
        self.http = httpx.AsyncClient(
            base_url=config.base_url.rstrip("/"), headers=headers, timeout=config.timeout, limits=limits
        )
        self.slots = asyncio.Semaphore(config.max_concurrency)

    async def _post(self, url: str, body: dict) -> dict:
        try:
            response = await self.http.post(url, json=body)
        except httpx.HTTPError as e:
            raise TeacherError(f"teacher {self.config.name} at {self.config.base_url}: {e!r}") from e
        if response.status_code != 200:
            raise TeacherError(
                f"teacher {self.config.name} at {self.config.base_url}{url} answered {response.status_code}: "
                f"{response.text[:300]}"
            )
        return response.json()

    async def wait_healthy(self) -> None:
        """Until the teacher answers `/health` (at most its `timeout`): one `rl` serves starts beside the policy's."""
        root = self.config.base_url.rstrip("/").removesuffix("/v1")
        try:
            await wait_healthy([root], self.config.timeout, client=self.http)
        except TimeoutError as e:
            raise TeacherError(
                f"teacher {self.config.name} at {root} not healthy after {self.config.timeout:.0f}s"
            ) from e

    async def check_tokenizer(self, tokenizer) -> None:
        """Refuse a teacher whose tokenizer splits `PROBE` otherwise than the policy's: its log-probs would score other
        tokens than the sampled ones. vLLM's `/tokenize` sits beside `/v1`."""
        root = self.config.base_url.rstrip("/").removesuffix("/v1")
        reply = await self._post(f"{root}/tokenize", {"model": self.config.name, "prompt": PROBE})
        ours = tokenizer.encode(PROBE, add_special_tokens=False)
        theirs = reply.get("tokens")
        if theirs != ours:
            raise TeacherError(
                f"teacher {self.config.name} does not share the policy's tokenizer: it reads {PROBE!r} as "
                f"{theirs}, the policy as {ours}; opd needs the same token ids on both sides"
            )

    async def logprobs(self, token_ids: list[int]) -> list[float]:
        """The teacher's log-probability of each token given the ones before it (0.0 for the first)."""
        body = {"model": self.config.name, "prompt": token_ids, "max_tokens": 1, "prompt_logprobs": 0}
        body |= {"temperature": 1.0, "add_special_tokens": False}
        async with self.slots:
            reply = await self._post("/completions", body)
        return parse_prompt_logprobs(token_ids, reply["choices"][0]["prompt_logprobs"])

    async def close(self) -> None:
        await self.http.aclose()
