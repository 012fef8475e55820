"""`rl`: moved from `prime_rl/rl.py` into this package; split by job in the next commit."""

from prime_rl.rl.config import (
    API_KEY_VAR,
    RLConfig,
    bench_rows,
    bench_table,
    build_processes,
    host_tag,
    main,
    orchestrators,
    provide_secret,
    publish_run,
    seed_environment,
    trainer_command,
    wait_for_run,
)

__all__ = [
    "API_KEY_VAR",
    "RLConfig",
    "bench_rows",
    "bench_table",
    "build_processes",
    "host_tag",
    "main",
    "orchestrators",
    "provide_secret",
    "publish_run",
    "seed_environment",
    "trainer_command",
    "wait_for_run",
]
