"""`rl` entry point: inference, orchestrator and trainer from one config, supervised as one run.

    uv run rl @ configs/reverse_text/rl.toml
    uv run rl --trainer @ t.toml --orchestrator @ o.toml --inference @ i.toml --max-steps 20
    uv run rl @ run.toml --bench [--bench.steps N]     # a short real run, then one throughput table

Before anything starts, the shared top-level fields (model, max_steps, max_async_level, seq_len, tensorboard,
output_dir, ckpt, wandb) are copied into the three sections and contradictions are refused. Then: clean stale
rollouts and weights (or those after the resumed step), start inference and wait until it is healthy, start the
orchestrator and the `torchrun` trainer. Every process runs in its own process group and logs to
`{output_dir}/logs/`; the console follows the orchestrator's and trainer's step lines. When any process
fails, or on Ctrl-C, every process group is terminated (then killed after a grace period) and `rl` exits
non-zero naming the process, its exit code and the end of its output. With `--bench` the run is `bench.steps`
long, without checkpoints and W&B, and ends with one table of both processes' step metrics (`bench_table`).

The package, by job (each module's docstring says more):
    config      `RLConfig` and its sub-configs: shared fields copied into the sections, contradictions refused
    preflight   checks that end `rl` with one line before anything starts; the run secret
    resume      the checkpoint step a run resumes from; stale rollouts and weights dropped
    deploy      several hosts: the seed's variables, per-host file names, the run marker
    processes   each process's command, environment and config file (built, not started)
    supervise   starting them, watching them, stopping them all; following their logs on the console
    bench       `--bench`'s table of both processes' step metrics
    cli         `main`: the steps above in order
"""

from prime_rl.rl.cli import main
from prime_rl.rl.config import RLConfig

__all__ = ["RLConfig", "main"]
