"""`inference` entry point: the real vLLM OpenAI server plus our admin routes.

    uv run inference @ cfg.toml [--model.name DIR] [--server.port P] [any vLLM flag ...]

Flags that are not prime-rl config keys are handed to vLLM's own argument parser unchanged, and
checked by it before the engine loads.
"""

from __future__ import annotations

import atexit
import logging
import os
import time

from prime_rl.config.loader import ConfigError, load_config, write_resolved_config
from prime_rl.inference import cpu_engine
from prime_rl.inference.config import InferenceConfig
from prime_rl.utils.net import port_in_use
from prime_rl.utils.processes import exit_when_orphaned
from prime_rl.utils.secret import RunKeys, SecretError, adopt_keys, derive_keys, new_secret, store_key, take_keys

PLUGIN_NAME = "prime_rl"

SAMPLING_ROUTES = ("/v1/", "/inference/v1/")
"""Path prefixes of the per-model-call traffic: vLLM's OpenAI routes (`/v1/models` too) and its token-in, token-out
`generate`."""


class QuietSampling(logging.Filter):
    """Drops uvicorn's access line of a sampling request that succeeded. There is one per model call, 64 a step in the
    demo, burying the lines that matter; formatting them and copying them into two log files took ~10% of the API
    server process's CPU samples (py-spy, demo RL stage). Failed requests (4xx, 5xx) and every other route (admin,
    health, metrics) still log."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args  # uvicorn's access record: client, method, path, HTTP version, status
        if not (isinstance(args, tuple) and len(args) == 5):
            return True
        path, status = args[2], args[4]
        return not (isinstance(status, int) and status < 400 and str(path).startswith(SAMPLING_ROUTES))


def build_vllm_args(config: InferenceConfig, extra: list[str]):
    """Parse our fields + the pass-through flags with vLLM's parser; raises ConfigError on unknown flags."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="inference"))
    args, unknown = parser.parse_known_args(config.vllm_args() + extra)
    if unknown:
        raise ConfigError(
            f"unknown option(s) {' '.join(unknown)}: neither a prime-rl key (see `inference --help`) "
            "nor a vLLM argument (see `vllm serve --help`)"
        )
    try:
        validate_parsed_serve_args(args)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"invalid vLLM arguments: {e}") from None
    # Read by our endpoint plugin (prime_rl.inference.plugin) when the app state is built.
    args.prime_weight_roots = [str(p) for p in config.weight_roots]
    broadcast = config.weight_broadcast
    args.prime_weight_broadcast = (
        broadcast.model_dump(include={"type", "host", "port", "timeout"}) if broadcast.in_memory else None
    )
    args.prime_allow_unauthenticated = config.server.allow_unauthenticated
    return args


def _check_passthrough(config: InferenceConfig, extra: list[str]) -> None:
    build_vllm_args(config, extra)


def masked(args: list[str]) -> list[str]:
    """`args` with the value of every `--api-key` hidden, for the log."""
    return ["***" if i and args[i - 1] == "--api-key" else a.split("=")[0] + "=***" if a.startswith("--api-key=") else a
            for i, a in enumerate(args)]  # fmt: skip


def _enable_plugin() -> None:
    plugins = [p for p in os.environ.get("VLLM_PLUGINS", "").split(",") if p]
    if PLUGIN_NAME not in plugins:
        os.environ["VLLM_PLUGINS"] = ",".join(plugins + [PLUGIN_NAME])


def _size_kv_cache(config: InferenceConfig, args) -> str:
    """CPU: the KV cache for what this server can run at once, unless set (`kv_cache_gib`, `VLLM_CPU_KVCACHE_SPACE`,
    `--kv-cache-memory-bytes`); sets it in `args` or the environment and says what it chose, for the log."""
    if config.kv_cache_gib is not None:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(config.kv_cache_gib)
        return f"{config.kv_cache_gib} GiB (kv_cache_gib)"
    if os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        return f"{os.environ['VLLM_CPU_KVCACHE_SPACE']} GiB (VLLM_CPU_KVCACHE_SPACE)"
    if args.kv_cache_memory_bytes is not None:
        return f"{args.kv_cache_memory_bytes} bytes (--kv-cache-memory-bytes)"
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    seqs = args.max_num_seqs or cpu_engine.VLLM_CPU_MAX_NUM_SEQS
    text = getattr(hf_config, "text_config", None) or hf_config
    length = args.max_model_len or text.max_position_embeddings
    per_token = cpu_engine.kv_bytes_per_token(hf_config, args.dtype)
    args.kv_cache_memory_bytes = cpu_engine.kv_cache_bytes(seqs, length, per_token, cpu_engine.available_memory())
    return f"{args.kv_cache_memory_bytes / cpu_engine.MIB:.0f} MiB for {seqs} sequences of {length} tokens"


def main(argv: list[str] | None = None) -> None:
    start = time.perf_counter()
    exit_when_orphaned()
    cpu = cpu_engine.is_cpu_build()
    if cpu:
        # Read by OpenMP when torch loads, so before the first vLLM import; a forked engine inherits it.
        os.environ.setdefault("OMP_NUM_THREADS", str(cpu_engine.engine_threads(len(os.sched_getaffinity(0)))))
    config, extra = load_config(InferenceConfig, "inference", argv, check_passthrough=_check_passthrough)
    if port_in_use(config.server.host, config.server.port):
        raise SystemExit(
            f"inference: error: port {config.server.port} on {config.server.host} is already in use (another server?); "
            "a second vLLM on it would share its connections with the first: pick another with --server.port"
        )
    from prime_rl.inference.access import open_access_problem, server_tokens
    from prime_rl.inference.attach import remove_card, write_card

    try:
        keys = take_keys()  # before vLLM starts any process: none of them inherits the secret
        if config.server.attachable and keys.store is None:  # its own keys: the runs that attach read them
            fresh = derive_keys(new_secret())
            keys = adopt_keys(RunKeys(fresh.store, keys.http or fresh.http))
        tokens = server_tokens(build_vllm_args(config, extra))
        problem = open_access_problem(config.server.host, tokens, config.server.allow_unauthenticated)
        if problem is None and config.weight_broadcast.in_memory and keys.store is None:
            store_key("receiving the trainer's weight broadcast (weight_broadcast.type gloo/nccl)")
    except SecretError as e:
        problem = str(e)
    if problem is not None:
        raise SystemExit(f"inference: error: {problem}")
    # Environment for vLLM, set before it reads its settings (and inherited by its engine processes).
    _enable_plugin()
    # Adapters are loaded through our /load_lora_adapter. VLLM_ALLOW_RUNTIME_LORA_UPDATING stays off: it would add
    # vLLM's own /v1/load_lora_adapter, which loads any path or hub id without our root and shape checks.

    import uvloop
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup

    from prime_rl.utils.logging import setup_logging

    setup_logging("inference", config.log.level, config.output_dir / "logs", tee_fds=True, file_name=config.log.file)
    if config.log.level != "debug":  # uvicorn's log config keeps a logger's filters
        logging.getLogger("uvicorn.access").addFilter(QuietSampling())
    from loguru import logger

    path = write_resolved_config(config, "inference")
    logger.info(f"resolved config written to {path}; vLLM args: {' '.join(masked(config.vllm_args() + extra))}")
    cli_env_setup()
    args = build_vllm_args(config, extra)
    if cpu:
        cpu_engine.inspect_models_in_process()
        kv = _size_kv_cache(config, args)
        blocks = cpu_engine.share_prompt_blocks(args)
        # Several workers (tp/pp/dp > 1) keep vLLM-CPU's own processes: each needs its own OpenMP binding.
        one = cpu_engine.single_worker(args)
        if one:
            cpu_engine.use_one_engine_process()
            cpu_engine.rank_tokens_eagerly()
        logger.info(
            f"CPU engine: KV cache {kv}, {blocks}; {os.environ['OMP_NUM_THREADS']} OpenMP thread(s); "
            + ("worker inside EngineCore, forked" if one else "vLLM's worker processes")
        )
    if config.server.attachable:
        card = write_card(config, RunKeys(keys.store, tokens[0]))
        atexit.register(remove_card, card)
        logger.info(f"attachable: `rl --attach` and `eval --attach` use this server (its card: {card})")
    logger.info(f"config parsed and vLLM imported in {time.perf_counter() - start:.1f}s; starting the engine")
    del uvloop  # ServeSubcommand runs its own event loop
    ServeSubcommand.cmd(args)


if __name__ == "__main__":
    main()
