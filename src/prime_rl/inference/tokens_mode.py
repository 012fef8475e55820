"""The generate route's token mode without detokenizing.

`/inference/v1/generate` with `output_mode = "tokens"` (its default, and what the verifiers train client sends)
replies with token ids and placeholder strings only, yet vLLM 0.32 still detokenizes in the API server every token
it samples and every logprob token, text that no reply carries (~11% of the demo server's API-process CPU under
py-spy). Such a request is told not to detokenize, as vLLM's `--tokens-only` servers tell every request, unless it
carries stop strings, which only the detokenized text can match.
"""

from __future__ import annotations

import functools
from typing import Any


def skip_detokenizing(request: Any) -> None:
    """Turn off detokenizing for a token-mode generate request without stop strings (its reply is unchanged)."""
    params = request.sampling_params
    if request.output_mode == "tokens" and not params.stop:
        params.detokenize = False


def skip_detokenizing_token_replies() -> None:
    """Apply `skip_detokenizing` to every generate request of this API server (idempotent)."""
    from vllm.entrypoints.scale_out.token_in_token_out.serving import ServingTokens

    serve = ServingTokens.serve_tokens
    if getattr(serve, "_prime_rl", False):
        return

    @functools.wraps(serve)
    async def serve_tokens(self, request, *args, **kwargs):
        skip_detokenizing(request)
        return await serve(self, request, *args, **kwargs)

    serve_tokens._prime_rl = True
    ServingTokens.serve_tokens = serve_tokens
