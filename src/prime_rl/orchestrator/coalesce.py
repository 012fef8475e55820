"""Identical model calls in flight together go to the server as one request for n samples.

GRPO samples each prompt `rollouts_per_example` times and verifiers makes one model call per rollout, so a group's
first turns reach the server as n identical requests, released together by the policy gate (`patches.PolicyGate`).
vLLM takes one request for n samples with one parse, one admission of the prompt and one reply, where n requests cost
n of each: on the 2-core CPU server, the demo's step (8 prompts x 8 samples of 16 tokens) takes 0.31 s a round as 8
requests with n = 8 against 0.38 s as 64 requests, 0.41 server CPU-seconds against 0.48
(`benchmarks/bench_merged_samples.py`). The samples are the same independent draws.

Calls merge only where the server could not tell them apart: the same URL, timeout and headers (but for the trace's
`X-Session-ID`, which vLLM only carries into KV-cache events), the same body, and sampling at a temperature above 0
with neither a `seed` nor an `n` of its own (n greedy requests, or n with one seed, sample the same tokens, one request
for n does not; vLLM refuses n > 1 when greedy). A call waits one
pass of the event loop for others to join: calls woken together (by the gate, or a batch of turns) arrive in that
pass. Each caller gets the reply it would have got alone: its own choice, its completion's usage, a request id of
its own; an error, the same error.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

GREEDY_BELOW = 1e-5  # vLLM samples greedily below this temperature

Reply = tuple[int, Any, bytes]  # status, headers, body
Send = Callable[[str, str, dict[str, str], Any], Awaitable[Reply]]  # url, JSON body, headers, timeout


def merge_key(url: str, body: dict, headers: dict[str, str], timeout: Any, ignored_header: str) -> tuple | None:
    """What calls that may share a request have in common (the body's JSON second), or None for a call that must go
    alone. `ignored_header` is the trace's session header, which may differ."""
    sampling = body.get("sampling_params")
    if not isinstance(sampling, dict) or "seed" in sampling or "n" in sampling or body.get("stream"):
        return None
    temperature = sampling.get("temperature")
    if not isinstance(temperature, int | float) or temperature < GREEDY_BELOW:
        return None  # greedy, or the server's default: vLLM refuses n > 1 when greedy
    same_headers = tuple(sorted((k, v) for k, v in headers.items() if k.lower() != ignored_header.lower()))
    return url, json.dumps(body, sort_keys=True), same_headers, timeout


def for_n(body: dict, n: int) -> dict:
    """The body of one request for the `n` samples of `n` identical calls."""
    return body if n == 1 else {**body, "sampling_params": {**body["sampling_params"], "n": n}}


def split_reply(data: dict, n: int) -> list[dict]:
    """One request's reply for n samples -> the n replies its calls would have got one by one: choice i alone (as
    index 0), usage counting its own completion, request id `<id>-i`."""
    choices = data.get("choices")
    if not isinstance(choices, list) or len(choices) != n:
        raise ValueError(f"asked for {n} samples, the reply has {len(choices) if isinstance(choices, list) else 0}")
    usage = data.get("usage")
    replies = []
    for i, choice in enumerate(sorted(choices, key=lambda c: c.get("index", 0))):
        reply = {**data, "choices": [{**choice, "index": 0}], "request_id": f"{data.get('request_id') or 'merged'}-{i}"}
        if isinstance(usage, dict):
            completion = len(choice.get("token_ids") or [])
            prompt = usage.get("prompt_tokens") or 0
            reply["usage"] = {**usage, "completion_tokens": completion, "total_tokens": prompt + completion}
        replies.append(reply)
    return replies


@dataclass
class _Batch:
    url: str
    body: dict
    body_json: str  # the key's serialization, sent as is when the call goes alone
    headers: dict[str, str]
    timeout: Any
    waiters: list[asyncio.Future] = field(default_factory=list)


class Coalescer:
    """Merges the mergeable calls of one event loop that arrive in the same pass of it (see the module)."""

    def __init__(self, send: Send, session_header: str) -> None:
        self.send = send
        self.session_header = session_header  # the one header merged calls may differ in
        self.open: dict[tuple, _Batch] = {}
        self.sending: set[asyncio.Task] = set()  # referenced until done, so none is collected mid-flight

    async def post(self, url: str, body: dict, headers: dict[str, str], timeout: Any) -> Reply:
        key = merge_key(url, body, headers, timeout, self.session_header)
        if key is None:
            return await self.send(url, json.dumps(body), headers, timeout)
        loop = asyncio.get_running_loop()
        batch = self.open.get(key)
        if batch is None:
            batch = self.open[key] = _Batch(url, body, key[1], headers, timeout)
            loop.call_soon(self._dispatch, key)  # after the callbacks already due in this pass: the calls woken with it
        waiter = loop.create_future()
        batch.waiters.append(waiter)
        return await waiter

    async def close(self) -> None:
        """Cancel the requests still in flight (their callers get `CancelledError`) and wait for them to end."""
        for task in list(self.sending):
            task.cancel()
        await asyncio.gather(*self.sending, return_exceptions=True)

    def _dispatch(self, key: tuple) -> None:
        task = asyncio.ensure_future(self._send_batch(self.open.pop(key)))
        self.sending.add(task)
        task.add_done_callback(self.sending.discard)

    async def _send_batch(self, batch: _Batch) -> None:
        waiters = [waiter for waiter in batch.waiters if not waiter.done()]  # callers cancelled by now ask for nothing
        n = len(waiters)
        if n == 0:
            return
        try:
            data = batch.body_json if n == 1 else json.dumps(for_n(batch.body, n))
            status, headers, content = await self.send(batch.url, data, batch.headers, batch.timeout)
            if n == 1 or status >= 400:
                replies = [(status, headers, content)] * n
            else:
                replies = [(status, headers, json.dumps(r).encode()) for r in split_reply(json.loads(content), n)]
        except BaseException as e:  # noqa: BLE001 - every caller gets what its own request would have raised
            for waiter in waiters:
                if waiter.done():
                    continue
                if isinstance(e, Exception):
                    waiter.set_exception(e)
                else:  # this task cancelled (`close`): its callers with it
                    waiter.cancel()
            if not isinstance(e, Exception):
                raise
            return
        for waiter, reply in zip(waiters, replies, strict=True):
            if not waiter.done():  # a caller cancelled meanwhile: its sample is dropped
                waiter.set_result(reply)
