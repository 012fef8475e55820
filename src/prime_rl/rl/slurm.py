"""`rl` with `[slurm]`: render our SLURM script for this run and submit it, instead of running here.

The job is `deploy/slurm/rl.sbatch` with the run's `#SBATCH` options and node layout written into its header, and the
run's config as `rl` resolved it, minus `[slurm]` (the job's `rl` runs the run; it must not submit again). Both are
kept under `{output_dir}/slurm/` next to what the job writes, so `sbatch <script> <config>` submits the same job
again. The config holds what the files and flags gave, not every resolved default: each node's `rl` derives its
own (its host's addresses, GPU ids) from it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import tomli_w

from prime_rl.config.loader import without_nulls
from prime_rl.rl.config import RLConfig, SlurmConfig
from prime_rl.utils.fs import write_atomic

TEMPLATE = Path(__file__).resolve().parents[3] / "deploy" / "slurm" / "rl.sbatch"
HEADER_LINE = "#SBATCH --job-name=prime-rl\n"


def render_script(slurm: SlurmConfig, template: str) -> str:
    """The template with this job's `#SBATCH` lines and node layout in place of its default job name."""
    if HEADER_LINE not in template:
        raise RuntimeError(f"{TEMPLATE}: no `{HEADER_LINE.strip()}` line to put the job's options in")
    options = {
        "job-name": slurm.job_name,
        "nodes": str(slurm.nodes),
        "partition": slurm.partition,
        "account": slurm.account,
        "time": slurm.time,
        "nodelist": slurm.nodelist,
        "exclude": slurm.exclude,
    }
    lines = [f"#SBATCH --{name}={value}\n" for name, value in options.items() if value is not None]
    # After the #SBATCH block (sbatch reads options only before the first command): the layout, unless the
    # environment of `sbatch` overrides it.
    layout = f': "${{INFERENCE_NODES:={slurm.inference_nodes}}}" "${{GPUS_PER_NODE:={slurm.gpus_per_node}}}"\n'
    script = template.replace(HEADER_LINE, "".join(lines), 1)
    return script.replace("set -euo pipefail\n", "set -euo pipefail\n" + layout, 1)


def submit(config: RLConfig, given: dict) -> int:
    """Write the job's script and config (`given`: what the files and flags gave), call `sbatch`; its exit code (the
    job id is printed)."""
    slurm = config.slurm
    assert slurm is not None
    if not TEMPLATE.is_file():
        raise SystemExit(f"rl: [slurm] needs the job script {TEMPLATE} (run `rl` from a prime-rl checkout)")
    folder = Path(config.output_dir).resolve() / "slurm"
    script, job_config = folder / f"{slurm.job_name}.sbatch", folder / f"{slurm.job_name}.toml"
    write_atomic(script, render_script(slurm, TEMPLATE.read_text()).encode())
    script.chmod(0o755)
    given = {k: v for k, v in given.items() if k != "slurm"}
    write_atomic(job_config, tomli_w.dumps(without_nulls(given)).encode())
    try:
        done = subprocess.run([slurm.sbatch, str(script), str(job_config)], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"rl: could not run `{slurm.sbatch}`: {e}", flush=True)
        return 1
    if done.returncode != 0:
        print(f"rl: {slurm.sbatch} failed ({done.returncode}): {done.stderr.strip()[-2000:]}", flush=True)
        return 1
    job = m.group(1) if (m := re.search(r"(\d+)", done.stdout)) else "?"
    print(f"rl: submitted SLURM job {job} ({slurm.nodes} node(s)): {script} {job_config}", flush=True)
    return 0
