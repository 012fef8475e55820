"""`main`: the order of an `rl` run, from loading the config to the exit code.

Seed variables, config, the run's keys (or, with `--attach`, the running server's: `rl/attach.py`), model
directories, the output-dir lock, logging; then the inference server starts (unless attached), so that vLLM imports
while the slower checks run (environments, resume; a failed one stops it again); the resolved config, cleaning stale
outputs (or waiting for the host that does), then `launch`; with `--bench`, the table last.
"""

from __future__ import annotations

import os
import sys

from loguru import logger

from prime_rl.config.loader import given_values, load_config, write_resolved_config
from prime_rl.rl.attach import attach_server
from prime_rl.rl.bench import metrics_size, print_bench_table
from prime_rl.rl.config import RLConfig
from prime_rl.rl.deploy import host_tag, publish_run, seed_environment, wait_for_run
from prime_rl.rl.preflight import (
    check_environments,
    check_model_exists,
    check_server_ports,
    claim_output_dir,
    fail,
    provide_keys,
)
from prime_rl.rl.processes import inference_process, orchestrators
from prime_rl.rl.resume import clean_stale_outputs, resolve_resume, resolve_run_resumes
from prime_rl.rl.slurm import submit
from prime_rl.rl.supervise import launch
from prime_rl.utils.locks import OutputDirBusy, check_free
from prime_rl.utils.logging import setup_logging
from prime_rl.utils.processes import Process, stop_all
from prime_rl.utils.secret import RunKeys


def main(argv: list[str] | None = None) -> None:
    """Exits with the run's code: 0 done, 1 a process failed, 2 refused before anything started, 130 interrupted."""
    seed_environment(os.environ)
    config, _ = load_config(RLConfig, "rl", argv)
    if config.slurm is not None:
        sys.exit(submit(config, given_values(RLConfig, "rl", sys.argv[1:] if argv is None else argv)))
    attached = None
    if config.attach:  # the server is running: its settings and keys are the run's
        config, keys, attached, line = attach_server(config, argv)
    else:
        keys = provide_keys(config)
    roles = config.deployment.roles
    names = {config.trainer.model.name} if "trainer" in roles else set()
    if config.inference is not None and "inference" in roles:
        names.add(config.inference.model.name)
    for name in names:
        check_model_exists(name)
    tag = host_tag(config)
    orchs = orchestrators(config) if "orchestrator" in roles else {}
    writers = ["orchestrator"] if "orchestrator" in roles and not config.runs else []
    writers += ["trainer"] if "trainer" in roles and config.deployment.trainer_node_rank == 0 else []
    lock = claim_output_dir(config.output_dir, f"rl{tag}", writers)  # first: "another rl writes there" says more
    check_server_ports(config)
    # vLLM takes longest to start: it imports while the checks below run (a failed check stops it).
    inference = inference_process(config, config.output_dir / "logs", tag, keys)
    if inference is not None or attached is not None:
        start_logging(config, tag)
    if inference is not None:
        inference.start()
    if attached is not None:
        logger.info(line)
    try:
        code = prepare_and_launch(config, orchs, inference, tag, keys)
    except BaseException:
        stop_all([inference] if inference is not None else [], config.stop_grace)
        raise
    lock.release()
    if attached is not None:
        attached.close()  # the server stays; the next run may attach
    sys.exit(code)


def start_logging(config: RLConfig, tag: str) -> None:
    setup_logging("rl", config.log.level, config.output_dir / "logs", file_name=config.log.file or f"rl{tag}.log")


def prepare_and_launch(config: RLConfig, orchs: dict, inference: Process | None, tag: str, keys: RunKeys) -> int:
    """The rest of the preflight (environments, resume, stale outputs), then `launch`; the run's exit code."""
    roles = config.deployment.roles
    for orch in orchs.values() if config.runs else []:
        try:
            check_free(orch.output_dir, ["orchestrator"])
        except OutputDirBusy as e:
            fail(str(e))
    if inference is None and not config.attach:  # nothing started yet: refuse a bad environment before anything is
        check_environments(list(orchs.values()))
    # With the server starting, the orchestrator loads the environments first thing and its error ends the run (exit
    # 1, its last lines shown): checking them here too cost every run ~4 s of CPU and held the orchestrator back ~6 s.
    resume_step = None
    if not config.runs and ("inference" not in roles or len(roles) > 1):
        resume_step = resolve_resume(config)
    if inference is None and not config.attach:  # nothing started yet: a refused run has written nothing
        start_logging(config, tag)
    write_resolved_config(config, f"rl{tag}")
    if config.runs:
        resolve_run_resumes(orchs)
    if "orchestrator" in roles:
        for orch in orchs.values():
            clean_stale_outputs(orch.output_dir, orch.ckpt.resume_step if orch.ckpt is not None else None)
        if not config.deployment.single_host:
            publish_run(config, resume_step)
    elif "trainer" in roles:
        wait_for_run(config)
    if resume_step is not None:
        resumed = [r for r in ("trainer", "orchestrator") if r in roles]  # the order the single-host log always had
        logger.info(f"resuming {' and '.join(resumed)} from step {resume_step}")
    if config.bench is not None:
        logger.info(f"bench: {config.bench.steps} steps, checkpoints and W&B off; a table follows the run")
    metrics_start = metrics_size(config.output_dir)
    code = launch(config, orchs, inference, keys)
    if code == 0 and config.bench is not None and {"orchestrator", "trainer"} & set(roles):
        print_bench_table(config.output_dir, metrics_start)
    return code
