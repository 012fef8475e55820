"""deploy/slurm/rl.sbatch without a cluster: `scontrol`, `srun`, `scancel` and the `rl` a step runs are stand-ins
on PATH (SLURM cannot run here); the script's node layout is checked for 1 and 3 nodes, every node's command is
parsed by `rl`'s own `--dry-run`, its job control is run for real against the stand-ins, hostile arguments must
reach `rl` literally without running, and every node must get the same PRIME_RL_SECRET, never shown."""

import os
import re
import shlex
import subprocess
import time
import tomllib
from pathlib import Path
from unittest import mock

import pytest

from prime_rl.rl import main as rl_main

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "deploy" / "slurm" / "rl.sbatch"
CONFIG = ROOT / "configs" / "reverse_text" / "rl.toml"

SCONTROL = """#!/usr/bin/env bash
# show hostnames n[1-3] -> n1 n2 n3
spec="$3"; prefix="${spec%%[*}"; range="${spec#*[}"; range="${range%]}"
if [[ "$spec" == "$prefix" ]]; then echo "$spec"; exit; fi
for i in $(seq "${range%-*}" "${range#*-}"); do echo "$prefix$i"; done
"""
# srun as SLURM runs a step: its options, then the program, executed on the node (here: locally, with the
# caller's environment and SLURMD_NODENAME set, as in a real step). It records its own argv (NUL-separated).
SRUN = """#!/usr/bin/env bash
args=("$@")
while [[ "$1" == --* ]]; do [[ "$1" == --nodelist=* ]] && node="${1#--nodelist=}"; shift; done
echo "$node" >> "$STUB_LOG"; printf '%s\\0' "${args[@]}" > "$STUB_DIR/srun.$node"
SLURMD_NODENAME="$node" exec "$@"
"""
# rl: records its argv and the PRIME_RL_SECRET it got; node FAIL_NODE fails, an inference-only node serves until
# stopped (scancel kills exactly those), the others finish at once.
RL = """#!/usr/bin/env bash
node="$SLURMD_NODENAME"
printf '%s\\0' "$@" > "$STUB_DIR/rl.$node"; printf '%s' "${PRIME_RL_SECRET-unset}" > "$STUB_DIR/secret.$node"
if [[ "$node" == "$FAIL_NODE" ]]; then sleep 1; exit 3; fi
for word in "$@"; do [[ "$word" == "[inference]" ]] && { echo $$ >> "$STUB_DIR/serving"; exec sleep 60; }; done
sleep 1
"""
SCANCEL = """#!/usr/bin/env bash
echo "scancel $1" >> "$STUB_LOG"
[[ -f "$STUB_DIR/serving" ]] && kill $(cat "$STUB_DIR/serving") 2>/dev/null || true
"""


@pytest.fixture
def slurm_env(tmp_path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", SCONTROL), ("srun", SRUN), ("rl", RL), ("scancel", SCANCEL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    stub_dir = tmp_path / "stub"
    stub_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PRIME_RL_SECRET"}
    return {
        **env,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "42",
        "STUB_LOG": str(tmp_path / "log"),
        "STUB_DIR": str(stub_dir),
    }


def print_only(env: dict[str, str], nodelist: str, *args: str, **extra: str) -> subprocess.CompletedProcess:
    out = subprocess.run(
        ["bash", str(SBATCH), *(args or (str(CONFIG), "--max-steps", "7"))],
        env={**env, "SLURM_JOB_NODELIST": nodelist, "PRINT_ONLY": "1", **extra},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    return out


def node_commands(env: dict[str, str], nodelist: str, *args: str, **extra: str) -> list[tuple[str, list[str]]]:
    out = print_only(env, nodelist, *args, **extra)
    return [(line.split("|")[0], shlex.split(line.split("|", 1)[1])) for line in out.stdout.splitlines()]


STAND_IN_SECRET = "5e" * 32  # a multi-host `rl` may insist on PRIME_RL_SECRET; every node of a job gets one


def dry_run(argv: list[str], capsys) -> dict:
    assert argv[0] == "rl"
    with pytest.raises(SystemExit) as exit_:
        # rl maps the seed's variables into os.environ; the job's PRIME_RL_SECRET, which a multi-host rl may need
        with mock.patch.dict(os.environ, {"PRIME_RL_SECRET": STAND_IN_SECRET}):
            rl_main([*argv[1:], "--dry-run"])
    out = capsys.readouterr()
    assert exit_.value.code == 0, out.err
    return tomllib.loads(out.out)


def test_one_node_runs_plain_rl(slurm_env, capsys):
    ((host, argv),) = node_commands(slurm_env, "gpu7")
    assert host == "gpu7" and argv == ["rl", "@", str(CONFIG), "--max-steps", "7"]
    resolved = dry_run(argv, capsys)
    assert resolved["deployment"]["roles"] == ["inference", "orchestrator", "trainer"]
    assert resolved["max_steps"] == 7


def test_three_nodes_one_inference_two_trainer_nodes(slurm_env, capsys):
    commands = node_commands(slurm_env, "n[1-3]")
    assert [host for host, _ in commands] == ["n1", "n2", "n3"]
    resolved = [dry_run(argv, capsys) for _, argv in commands]
    deploy = [r["deployment"] for r in resolved]
    assert [d["roles"] for d in deploy] == [["inference", "orchestrator"], ["trainer"], ["trainer"]]
    assert [d["trainer_node_rank"] for d in deploy[1:]] == [0, 1]
    assert all(d["trainer_nodes"] == 2 for d in deploy[1:])
    assert all(d["master_addr"] == "n2" for d in deploy)  # every host knows trainer node 0 (broadcast store too)
    assert all(d["run_id"] == "slurm-42" and d["inference_hosts"] == ["n1"] for d in deploy)
    assert resolved[0]["orchestrator"]["client"]["base_url"] == ["http://n1:8000/v1"]
    assert resolved[0]["inference_gpu_ids"] == list(range(8)) and resolved[1]["trainer_gpu_ids"] == list(range(8))
    assert resolved[0]["inference"]["server"]["host"] == "0.0.0.0"


def test_too_many_inference_nodes_is_an_error(slurm_env):
    out = subprocess.run(
        ["bash", str(SBATCH), str(CONFIG)],
        env={**slurm_env, "SLURM_JOB_NODELIST": "n[1-2]", "PRINT_ONLY": "1", "INFERENCE_NODES": "2"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2 and "INFERENCE_NODES=2 needs 1 <= INFERENCE_NODES < nodes (2)" in out.stderr


def run_job(env: dict[str, str], *args: str, **extra: str) -> tuple[int, float, list[str]]:
    code, seconds, log, _ = run_job_output(env, *args, **extra)
    return code, seconds, log


def run_job_output(env: dict[str, str], *args: str, **extra: str) -> tuple[int, float, list[str], str]:
    """Runs the job on n1..n4 (2 inference nodes) against the stand-ins; also returns the job's output."""
    started = time.monotonic()
    out = subprocess.run(
        ["bash", str(SBATCH), *(args or (str(CONFIG),))],
        env={**env, "SLURM_JOB_NODELIST": "n[1-4]", "INFERENCE_NODES": "2", **extra},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "inference node n2 failed (3)" in out.stderr or extra.get("FAIL_NODE") != "n2", out.stderr
    log = Path(env["STUB_LOG"]).read_text().splitlines()
    return out.returncode, time.monotonic() - started, log, out.stdout + out.stderr


def recorded(env: dict[str, str], what: str, node: str) -> list[str]:
    """The NUL-separated argv a stand-in recorded on a node (`srun` its own, `rl` what the step ran)."""
    return (Path(env["STUB_DIR"]) / f"{what}.{node}").read_text().split("\0")[:-1]


def test_the_job_ends_when_orchestrator_and_trainers_finish_not_waiting_for_servers(slurm_env):
    code, seconds, log = run_job(slurm_env, FAIL_NODE="none")
    assert code == 0 and seconds < 30  # n2 serves for 60 s: the job did not wait for it
    assert sorted(log[:4]) == ["n1", "n2", "n3", "n4"] and log[-1] == "scancel 42"


def test_a_failing_trainer_node_ends_the_job_with_its_status(slurm_env):
    code, seconds, log = run_job(slurm_env, FAIL_NODE="n4")
    assert code == 3 and seconds < 30 and log[-1] == "scancel 42"


def test_a_failing_inference_node_is_reported_and_the_run_goes_on(slurm_env):
    code, seconds, log = run_job(slurm_env, FAIL_NODE="n2")
    assert code == 0 and log[-1] == "scancel 42"


# ---------------------------------------------------------------------------------------------------------
# Hostile arguments: every argument reaches `rl` as exactly one literal word; nothing is run as shell code.


def hostile_args(tmp_path: Path, quotes: bool = True) -> tuple[str, list[str]]:
    """A config path and extra flags that run `touch pwned*` if any shell parses them. Without quotes the old
    `bash -c "rl @ $config $*"` ran them; with a quote it failed on a syntax error instead."""
    config = f"{tmp_path}/my runs/$(touch {tmp_path}/pwned)/rl `touch {tmp_path}/pwned2`.toml"
    extra = [
        "--wandb.name",
        f"x; touch {tmp_path}/pwned3 #",
        "--model.name",
        f"$HOME && touch {tmp_path}/pwned4 | ${{IFS}} * [x] \\ >{tmp_path}/pwned5",
    ]
    if quotes:
        extra += ["--wandb.project", f"it's \"quoted\" '' $(touch {tmp_path}/pwned6)", ""]  # "": one word too
    return config, extra


def nothing_ran(tmp_path: Path) -> None:
    pwned = sorted(p.name for p in tmp_path.glob("pwned*"))
    assert not pwned, f"an argument ran as shell code: {pwned}"


def test_print_only_shows_hostile_arguments_as_single_literal_words(slurm_env, tmp_path):
    config, extra = hostile_args(tmp_path)
    for nodelist, hosts in (("gpu7", ["gpu7"]), ("n[1-3]", ["n1", "n2", "n3"])):
        commands = node_commands(slurm_env, nodelist, config, *extra)
        assert [host for host, _ in commands] == hosts
        for _, argv in commands:
            assert argv[:3] == ["rl", "@", config] and argv[-len(extra) :] == extra, argv
    nothing_ran(tmp_path)


@pytest.mark.parametrize("quotes", [False, True])
def test_hostile_arguments_reach_every_nodes_rl_literally_and_run_nothing(slurm_env, tmp_path, quotes):
    config, extra = hostile_args(tmp_path, quotes)
    if quotes:
        extra.append("two\nlines")  # not shown by PRINT_ONLY's one line per node, but still one word for `rl`
    code, _, log, _ = run_job_output(slurm_env, config, *extra, FAIL_NODE="none")
    assert code == 0 and sorted(log[:4]) == ["n1", "n2", "n3", "n4"]
    nothing_ran(tmp_path)
    printed = dict(node_commands(slurm_env, "n[1-4]", str(CONFIG), INFERENCE_NODES="2"))
    for node in ("n1", "n2", "n3", "n4"):
        # what `rl` got: PRINT_ONLY's words for the node, the config and the extra words replaced by the hostile ones
        assert recorded(slurm_env, "rl", node) == [*printed[node][1:2], config, *printed[node][3:], *extra], node
        srun = recorded(slurm_env, "srun", node)
        assert "bash" not in srun and "-c" not in srun  # srun runs `rl` itself: no shell parses the words
        assert srun[srun.index("rl") :] == ["rl", *recorded(slurm_env, "rl", node)]
    assert recorded(slurm_env, "rl", "n1")[:3] == ["@", config, "--deployment.run-id"]


# ---------------------------------------------------------------------------------------------------------
# The run secret: every node's `rl` gets the same PRIME_RL_SECRET through the environment, never a command line.


@pytest.mark.parametrize("source", ["python3", "urandom"])
def test_every_node_gets_the_same_generated_secret(slurm_env, tmp_path, source):
    if source == "urandom":  # no usable python3 on the batch host: the fallback reads /dev/urandom
        stub = tmp_path / "bin" / "python3"
        stub.write_text("#!/usr/bin/env bash\nexit 127\n")
        stub.chmod(0o755)
    code, _, _, output = run_job_output(slurm_env, FAIL_NODE="none")
    assert code == 0, output
    secrets = {node: (Path(slurm_env["STUB_DIR"]) / f"secret.{node}").read_text() for node in ("n1", "n2", "n3", "n4")}
    (secret,) = set(secrets.values())
    assert re.fullmatch(r"[0-9a-f]{64}", secret), secrets
    assert secret not in output  # not in the job's output
    for node in secrets:
        assert not any(secret in word for word in recorded(slurm_env, "srun", node))  # nor on a command line

    code, _, _, output = run_job_output(slurm_env, FAIL_NODE="none")  # the next job: a secret of its own
    assert (Path(slurm_env["STUB_DIR"]) / "secret.n1").read_text() != secret


def test_a_given_secret_is_passed_unchanged_and_never_printed(slurm_env):
    given = "given secret, with spaces & $(not code)"
    code, _, _, output = run_job_output(slurm_env, FAIL_NODE="none", PRIME_RL_SECRET=given)
    assert code == 0, output
    for node in ("n1", "n2", "n3", "n4"):
        assert (Path(slurm_env["STUB_DIR"]) / f"secret.{node}").read_text() == given
        assert not any(given in word for word in recorded(slurm_env, "srun", node))
    assert given not in output


@pytest.mark.parametrize("nodelist", ["gpu7", "n[1-3]"])
def test_print_only_never_shows_the_secret(slurm_env, nodelist):
    out = print_only(slurm_env, nodelist, PRIME_RL_SECRET=STAND_IN_SECRET)
    assert out.stdout and STAND_IN_SECRET not in out.stdout + out.stderr
    out = print_only(slurm_env, nodelist)  # none given: PRINT_ONLY neither generates nor shows one
    assert not re.search(r"[0-9a-f]{64}", out.stdout + out.stderr)


SBATCH_STAND_IN = """#!/usr/bin/env bash
# sbatch as the cluster has it, minus the queue: records what it was given and answers like sbatch does.
printf '%s\\n' "$@" > "$STUB_DIR/sbatch.argv"; cp "$1" "$STUB_DIR/sbatch.script"
echo "Submitted batch job 4242"
"""


def test_rl_with_a_slurm_section_renders_our_script_and_submits_it(slurm_env, tmp_path, capsys):
    """`[slurm]` in the run's config: `rl` queues the job instead of running here. The stand-in `sbatch` keeps the
    script and config it was given: the script is ours with the job's #SBATCH lines and node layout, its node
    commands are the ones `rl.sbatch` makes, and the config is the run's without `[slurm]` (no resubmission)."""
    stub = Path(slurm_env["STUB_DIR"])
    sbatch = tmp_path / "bin" / "sbatch"
    sbatch.write_text(SBATCH_STAND_IN)
    sbatch.chmod(0o755)
    out = tmp_path / "out"
    with mock.patch.dict(os.environ, slurm_env), pytest.raises(SystemExit) as exit_:
        rl_main(["@", str(CONFIG), "--output-dir", str(out), "--slurm.job-name", "rt", "--slurm.nodes", "3",
                 "--slurm.partition", "gpu", "--slurm.time", "2:00:00", "--slurm.gpus-per-node", "4"])  # fmt: skip
    assert exit_.value.code == 0 and "submitted SLURM job 4242 (3 node(s))" in capsys.readouterr().out
    script_path, config_path = (stub / "sbatch.argv").read_text().splitlines()
    script = (stub / "sbatch.script").read_text()
    assert script_path == str(out / "slurm" / "rt.sbatch") and config_path == str(out / "slurm" / "rt.toml")
    header = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert header == [
        "#SBATCH --job-name=rt",
        "#SBATCH --nodes=3",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=2:00:00",
        "#SBATCH --exclusive",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --output=slurm-%j.out",
    ]
    job_config = tomllib.loads(Path(config_path).read_text())
    assert "slurm" not in job_config and job_config["output_dir"] == str(out)
    # The rendered script lays out the job as rl.sbatch does: here 1 inference node and 2 trainer nodes of 4 GPUs.
    printed = subprocess.run(["bash", script_path, config_path], env={**slurm_env, "SLURM_JOB_NODELIST": "n[1-3]",
                             "PRINT_ONLY": "1"}, capture_output=True, text=True, timeout=30)  # fmt: skip
    assert printed.returncode == 0, printed.stderr
    commands = [shlex.split(line.split("|", 1)[1]) for line in printed.stdout.splitlines()]
    assert [c[:3] for c in commands] == [["rl", "@", config_path]] * 3
    resolved = [dry_run(argv, capsys) for argv in commands]
    assert [r["deployment"]["roles"] for r in resolved] == [["inference", "orchestrator"], ["trainer"], ["trainer"]]
    assert resolved[1]["trainer_gpu_ids"] == [0, 1, 2, 3] and resolved[0]["max_steps"] == job_config["max_steps"]


def test_a_slurm_value_that_would_reach_the_script_as_code_is_refused(slurm_env, capsys):
    with mock.patch.dict(os.environ, slurm_env), pytest.raises(SystemExit) as exit_:
        rl_main(["@", str(CONFIG), "--slurm.partition", "gpu\n#SBATCH --uid=0"])
    assert exit_.value.code == 2 and "slurm.partition" in capsys.readouterr().err
    assert not (Path(slurm_env["STUB_DIR"]) / "sbatch.argv").exists()
