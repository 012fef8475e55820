"""`rl` end to end on the tiny model: async levels, failures of each process, resume, bad configs.

Every run attaches to the session's inference server (`rl --attach`, as a user's debug loop does) to save vLLM's
start; `test_attach.py` has a run that starts its own."""

import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
from conftest import API_KEY, RUN_SECRET
from rl_run import started_pid, write_rl_config

from prime_rl.batch import batch_path
from prime_rl.utils.secret import SECRET_VAR

RL = str(Path(sys.executable).parent / "rl")
KEY_VAR = "PRIME_TEST_API_KEY"


REVERSE_TEXT = '[[orchestrator.env]]\nid = "reverse-text"\n'


def write_config(
    path: Path, srv, out: Path, k: int, steps: int, extra: str = "", envs: str = REVERSE_TEXT, attach: bool = True
) -> Path:
    """`attach`: `[inference]` names the shared server and the run attaches to it (`start_rl(..., attach=True)`), as a
    user's debug loop does; a run that says nothing of its weight broadcast keeps the filesystem (attached, it would
    take the server's in-memory store). Else the server is an external one of `orchestrator.client`, with the run
    secret it was started with (`[[runs]]`, which cannot attach)."""
    if not attach:
        client = f'[orchestrator.client]\nbase_url = ["{srv.url}/v1"]\napi_key_var = "{KEY_VAR}"\n'
        return write_rl_config(path, srv.base, out, k, steps, top=extra, bottom=envs + client)
    server = f"\n[inference.server]\nport = {srv.port}\n[inference.model]\nmax_model_len = 512\n"
    if "[weight_broadcast]" not in extra:
        server += '[weight_broadcast]\ntype = "filesystem"\n'
    return write_rl_config(path, srv.base, out, k, steps, top=extra + server, bottom=envs)


def start_rl(config: Path, *args: str, log: Path, attach: bool = True) -> subprocess.Popen:
    """`rl` on `config`; attached to the shared server with the keys its card holds, or as an external server's
    client with its API key and run secret."""
    if attach:
        env = {k: v for k, v in os.environ.items() if k not in (KEY_VAR, SECRET_VAR)}
        args = ("--attach", *args)
    else:
        env = {**os.environ, KEY_VAR: API_KEY, SECRET_VAR: RUN_SECRET}  # the shared server's run secret
    return subprocess.Popen([RL, "@", str(config), *args], stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)


def wait_rl(proc: subprocess.Popen, timeout: float) -> int | None:
    """rl's exit code; None once an rl still running after `timeout` is killed (a hung run must not outlive its
    test: it would load the machine and the shared server for the tests after it)."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()  # its processes die with it
        proc.wait(30)
        return None


def process_metrics(out: Path, process: str, skip_lines: int = 0) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()[skip_lines:]
    return [m for m in map(json.loads, lines) if m["process"] == process]


def trainer_metrics(out: Path, skip_lines: int = 0) -> list[dict]:
    return process_metrics(out, "trainer", skip_lines)


def orchestrator_metrics(out: Path) -> list[dict]:
    return process_metrics(out, "orchestrator")


def trainer_steps(out: Path, skip_lines: int = 0) -> list[int]:
    return [m["step"] for m in trainer_metrics(out, skip_lines)]


# The two-seat nim environment beside reverse-text (self-play; some episodes end before the second seat acts).
NIM_MIX = REVERSE_TEXT.replace('"reverse-text"\n', '"reverse-text"\nratio = 1\n') + (
    '[[orchestrator.env]]\nid = "nim"\nratio = 1\nargs = { max_sticks = 5 }\n'
)


def broadcast(srv) -> str:
    """The in-memory broadcast on the store address the shared server is configured with (a server takes it from
    its own config, never from a request)."""
    return f'[weight_broadcast]\ntype = "gloo"\nport = {srv.broadcast_port}\n'


"""The in-memory weight broadcast (the filesystem path: `rl dies[orchestrator]`, the orchestrator's and trainer's
tests)."""


@pytest.mark.slow
def test_rl_respects_the_async_level_and_trains_every_batch_once(tied_server):
    """k = 2, k + 5 steps: the bound n-1-k > 0 is active on 4 batches. New weights reach the server by the in-memory
    broadcast. The same run trains the multi-agent nim environment beside reverse-text, logs to W&B offline, and
    keeps one checkpoint, to check that disk use stays bounded. (k = 0 and 1, with short groups, are the
    orchestrator's stand-in-trainer test.)"""
    srv, k = tied_server, 2
    out = srv.root / "rl" / f"k{k}"
    out.mkdir(parents=True)
    steps = k + 5
    extra = "[ckpt]\ninterval = 2\nkeep_last = 1\n" + broadcast(srv)
    config = write_config(out.parent / f"k{k}.toml", srv, out, k=k, steps=steps, extra=extra, envs=NIM_MIX)
    wandb = ["--wandb.name", "exp", "--wandb.offline", "--orchestrator.log-extras.interval", "2"]  # no network
    wandb.append("--tensorboard")
    proc = start_rl(config, *wandb, log=out.parent / f"k{k}.log")
    assert wait_rl(proc, 600) == 0, (out.parent / f"k{k}.log").read_text()[-4000:]
    console = (out.parent / f"k{k}.log").read_text()
    assert f"[trainer] step {steps} |" in console and f"[orchestrator] step {steps} |" in console
    trained = trainer_metrics(out)
    assert [m["step"] for m in trained] == list(range(1, steps + 1))  # every batch consumed once, in order
    for m in trained:
        n = m["step"]
        assert m["policy_version/min"] >= n - 1 - k, m  # realised lag never exceeds k
        assert m["policy_version/max"] <= n - 1, m  # and nothing claims a policy not yet published
    rows = [m for m in orchestrator_metrics(out) if "rollouts/nim" in m]
    assert rows and all("reward/nim/first/mean" in m for m in rows)
    check_offline_wandb_runs(out, steps)
    check_tensorboard(out, steps)
    # The policies went by broadcast, each to the server as soon as the trainer held it (it waits until taken), so
    # none was skipped; the last ones may come after the orchestrator's last batch (nobody needs them then).
    swaps = re.findall(r"policy step \d+ -> (\d+) on 1 server", (out / "logs" / "orchestrator.log").read_text())
    taken = [int(step) for step in swaps]
    assert taken == list(range(1, len(taken) + 1)) and len(taken) >= steps - 1 - k, swaps
    # Bounded disk: consumed batches are gone; only checkpoint steps and the last step were written (2, 4, 6, 7), and
    # of those only what the async bound may still need (>= steps - k) or a kept checkpoint (the last step's) stays.
    assert not list((out / "rollouts").glob("step_*")), list((out / "rollouts").glob("step_*"))
    kept = sorted(int(p.name.removeprefix("step_")) for p in (out / "broadcasts").glob("step_*"))
    assert kept == [steps - 1, steps], kept
    checkpoints = sorted(p.name for p in (out / "checkpoints").glob("step_*"))
    assert checkpoints == [f"step_{steps}"], checkpoints


EVALS = (
    '[orchestrator.eval]\ninterval = 2\npass_threshold = 0.2\n[[orchestrator.eval.env]]\nid = "reverse-text"\n'
    'name = "held-out"\nargs = { seed = 1 }\nnum_examples = 4\nrollouts_per_example = 2\n'
)


@pytest.mark.slow
def test_rl_online_evals_measure_one_policy_each(tied_server, tmp_path):
    """3 steps at k = 0 with evals every 2 steps: passes of policies 0, 2 and 3 (the final one), each logged at the
    step it measured, and every token of every eval rollout sampled by exactly that policy (vLLM's per-token
    versions). pass@k and avg@k are recomputed by hand from the pass's own rollouts. Metrics reach metrics.jsonl,
    the console, TensorBoard and W&B (offline)."""
    from itertools import combinations

    srv = tied_server
    out = srv.root / "rl" / "evals"
    out.mkdir(parents=True)
    config = write_config(tmp_path / "rl.toml", srv, out, k=0, steps=3, extra=broadcast(srv), envs=REVERSE_TEXT + EVALS)
    log = tmp_path / "rl.log"
    proc = start_rl(config, "--tensorboard", "--wandb.name", "ev", "--wandb.offline", log=log)
    try:
        assert wait_rl(proc, 600) == 0, log.read_text()[-4000:]
    finally:  # the next test starts from the server's own weights
        httpx.post(f"{srv.url}/reload_weights", headers=srv.headers, json={}, timeout=60).raise_for_status()
    rows = [m for m in orchestrator_metrics(out) if "eval/step" in m]
    assert [(m["step"], m["eval/step"]) for m in rows] == [(0, 0), (2, 2), (3, 3)], rows
    console = log.read_text()
    for step in (0, 2, 3):
        assert f"[orchestrator] eval step {step} | held-out avg@2 " in console, console[-3000:]
        records = [json.loads(line) for line in (out / "evals" / f"step_{step}" / "results.jsonl").open()]
        assert len(records) == 8 and all(r["error"] is None for r in records)
        # One policy per pass: every sampled token of the pass came from the policy it is logged at.
        assert all(r["step"] == step and r["policy_versions"] == [step] for r in records), records
        (row,) = [m for m in rows if m["step"] == step]
        by_example = {}
        for r in records:
            by_example.setdefault(r["example_id"], []).append(r["reward"])
        assert sorted(by_example) == [0, 1, 2, 3] and all(len(v) == 2 for v in by_example.values())
        # pass@k by hand: the share of k-subsets of an example's 2 rollouts with one solved (reward >= 0.2).
        for k in (1, 2):
            by_hand = [
                sum(any(x >= 0.2 for x in c) for c in combinations(v, k)) / len(list(combinations(v, k)))
                for v in by_example.values()
            ]
            assert row[f"eval/held-out/pass@{k}"] == pytest.approx(sum(by_hand) / 4)
        assert row["eval/held-out/avg@2"] == pytest.approx(sum(sum(v) / 2 for v in by_example.values()) / 4)
        assert row["eval/held-out/reward_mean"] == pytest.approx(sum(r["reward"] for r in records) / 8)
        assert row["eval/held-out/completion_len"] == pytest.approx(sum(r["completion_tokens"] for r in records) / 8)
    # The same pass in TensorBoard (at the measured steps) and W&B (every eval key, plotted against eval/step).
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from wandb_offline import wandb_records

    events = EventAccumulator(str(out / "tensorboard" / "orchestrator"), size_guidance={"scalars": 0})
    events.Reload()
    assert [e.step for e in events.Scalars("eval/held-out/avg@2")] == [0, 2, 3]
    keys = set()
    for path in out.glob("wandb/offline-run-*/run-*.wandb"):
        records = list(wandb_records(path))
        if [r.run.display_name for r in records if r.WhichOneof("record_type") == "run"] == ["ev-orchestrator"]:
            history = [r.history for r in records if r.WhichOneof("record_type") == "history"]
            keys = {item.key or "/".join(item.nested_key) for h in history for item in h.item}
    assert {"eval/step", "eval/held-out/pass@2", "eval/held-out/avg@2", "reward/mean"} <= keys, keys


def check_tensorboard(out: Path, steps: int) -> None:
    """Both processes' step metrics as TensorBoard scalars, the orchestrator's reward histograms (every 2 steps)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logged = {}
    for process in ("trainer", "orchestrator"):
        events = EventAccumulator(str(out / "tensorboard" / process), size_guidance={"scalars": 0, "histograms": 0})
        events.Reload()
        logged[process] = events
    assert [e.step for e in logged["trainer"].Scalars("loss")] == list(range(1, steps + 1))
    assert [e.step for e in logged["orchestrator"].Scalars("reward/mean")] == list(range(1, steps + 1))
    assert logged["orchestrator"].Histograms("distribution/reward")


def check_offline_wandb_runs(out: Path, steps: int) -> None:
    """Two offline runs, `exp-trainer` and `exp-orchestrator`, in group `exp`, with their step metrics (every step)
    and, from the orchestrator, the samples table and the reward histogram (log extras every 2 steps)."""
    from wandb_offline import wandb_records

    runs = {}
    for path in out.glob("wandb/offline-run-*/run-*.wandb"):
        records = list(wandb_records(path))
        (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
        history = [r.history for r in records if r.WhichOneof("record_type") == "history"]
        keys = {item.key or "/".join(item.nested_key) for h in history for item in h.item}
        runs[run.display_name] = (run.run_group, keys, sorted({h.step.num for h in history}))
    assert set(runs) == {"exp-trainer", "exp-orchestrator"}, runs.keys()
    group, keys, logged = runs["exp-trainer"]
    assert group == "exp" and {"loss", "entropy", "mismatch_kl"} <= keys and logged == list(range(1, steps + 1))
    group, keys, logged = runs["exp-orchestrator"]
    assert group == "exp" and {"reward/mean", "async_lag/max", "samples/_type", "distribution/reward/_type"} <= keys
    assert logged == list(range(1, steps + 1))


def is_rank(cmdline: list[str]) -> bool:
    """A training rank's process (not the torchrun agent that may have started it)."""
    return "prime_rl.trainer.rl.train" in cmdline and "torch.distributed.run" not in cmdline


def run_pids(rl: psutil.Process) -> list[psutil.Process]:
    return [rl, *rl.children(recursive=True)]


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["trainer-rank", "orchestrator"])
def test_rl_stops_everything_when_a_process_dies(tied_server, tmp_path, victim):
    """kill -9 one process mid-run: rl exits non-zero within 30 s naming it, and nothing of the run survives.
    `trainer-rank` is a training rank, as the OOM killer would pick it (here the one rank, which runs without a torchrun
    agent; with several, the agent exits and rl sees the trainer fail). The torchrun agent's own death (its ranks must die with it) is the trainer's test, the inference
    server's the multi-host test's (an inference host's rl exits the same way)."""
    srv = tied_server
    out = srv.root / "rl" / f"kill_{victim}"
    out.mkdir(parents=True)
    # A trainer rank killed while the in-memory broadcast is on (it may be sending); the orchestrator's run reads files.
    extra = broadcast(srv) if victim == "trainer-rank" else ""
    config = write_config(tmp_path / "rl.toml", srv, out, k=1, steps=1000, extra=extra)
    log = tmp_path / "rl.log"
    proc = start_rl(config, log=log)
    try:
        started_pid(log, "trainer")
        # Mid-run: a couple of steps in. (Not "batch 2 exists": the trainer may consume it within a poll's interval.)
        while "[orchestrator] step 2 |" not in log.read_text(errors="replace"):
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)
        tree = run_pids(psutil.Process(proc.pid))
        if victim == "orchestrator":  # a second run on the same output dir is refused, and deletes nothing
            stale = out / "rollouts" / "step_999999"  # what a new run's clean-up would delete; the live run never does
            stale.mkdir()
            second = subprocess.run([RL, "@", str(config)], capture_output=True, text=True, timeout=120)
            assert second.returncode == 2 and "another rl writes to" in second.stderr, second.stderr
            assert stale.exists() and proc.poll() is None
        name = victim.removesuffix("-rank")
        target = psutil.Process(started_pid(log, name))
        if victim == "trainer-rank":  # one rank runs as rl's child itself; several run under a torchrun agent
            ranks = [p for p in [target, *target.children(recursive=True)] if is_rank(p.cmdline())]
            target = ranks[0]
        killed_at = time.monotonic()
        target.kill()
        code = proc.wait(60)
        elapsed = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert code != 0 and elapsed < 30, (code, elapsed, text[-3000:])
    assert re.search(rf"{name} (failed with exit code|exited)", text), text[-3000:]
    time.sleep(1)
    alive = [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [(p.pid, p.cmdline()) for p in alive]
    # A server caught receiving (or connecting to the dead trainer's store) fails that transfer within seconds and
    # loads weights again (it once stayed paused for 200 s, retrying the store).
    r = httpx.post(f"{srv.url}/reload_weights", headers=srv.headers, json={}, timeout=30)
    assert r.status_code == 200, r.text


@pytest.mark.slow
def test_rl_trains_a_proposer_solver_env_under_hierarchical_grpo(tied_server, tmp_path):
    """propose-solve (a proposer seat and one solver role run twice per episode) under hierarchical_grpo, 2 steps. The
    tiny model's proposals are not valid problems, so the solvers never run (nothing of theirs to train) and every
    proposer scores 0: the proposers' comparison across the group gives 0 each, exactly (the arithmetic of other
    rewards is test_algorithms.py's)."""
    srv = tied_server
    out = srv.root / "rl" / "propose-solve"
    out.mkdir(parents=True)
    envs = '[[orchestrator.env]]\nid = "propose-solve"\nalgo = { type = "hierarchical_grpo" }\nenv_args = { num_solvers = 2 }\n'
    config = write_config(tmp_path / "rl.toml", srv, out, k=0, steps=2, envs=envs)
    proc = start_rl(config, log=tmp_path / "rl.log")
    assert wait_rl(proc, 600) == 0, (tmp_path / "rl.log").read_text()[-4000:]
    assert trainer_steps(out) == [1, 2]
    rows = orchestrator_metrics(out)
    assert [m["step"] for m in rows] == [1, 2]
    for m in rows:
        assert m["reward/propose-solve/proposer/mean"] == 0.0 and m["advantage/mean_abs"] == 0.0
        assert m["rollouts/untrained"] > 0  # the solvers of invalid proposals


@pytest.mark.slow
def test_rl_distils_from_a_teacher_it_serves_under_opd_and_sft(tied_server, tmp_path):
    """`[teacher]` makes `rl` serve a very different model with the same tokenizer (the base perturbed 8x) as the
    frozen teacher of two environments, a second server holding the run's token, stopped with the run. 3 steps at
    k = 0, two reverse-text environments:
    - `reverse-text` (opd): the policy (the session's server, base weights) samples. At step 1 the trainer's policy is
      the one that sampled, so its reverse KL to the teacher over the sampled tokens (`ref_kl_stream`: log pi from
      the trainer's forward, minus the shipped teacher log-probs) equals the orchestrator's (`teacher_kl/sampler`:
      vLLM's sampling log-probs minus the same) up to their mismatch (~1e-12 in fp32): within 1e-3.
    - `imitate` (sft): the teacher samples (through the token route, with the run's token), the policy trains ce on
      its tokens. Its groups were never the policy's: the policy server served none of them.
    No rl token: ref_kl and ce train alone."""
    srv = tied_server
    out = srv.root / "rl" / "opd"
    out.mkdir(parents=True)
    envs = REVERSE_TEXT + 'algo = { type = "opd" }\n'
    envs += '[[orchestrator.env]]\nid = "reverse-text"\nname = "imitate"\nalgo = { type = "sft" }\n'
    extra = f'[teacher]\nmodel = "{srv.step_1}"\n'
    config = write_config(tmp_path / "rl.toml", srv, out, k=0, steps=3, extra=extra, envs=envs)
    proc = start_rl(config, log=tmp_path / "rl.log")
    assert wait_rl(proc, 600) == 0, (tmp_path / "rl.log").read_text()[-4000:]
    assert not [
        p for p in psutil.process_iter(["cmdline"]) if any("teacher.toml" in a for a in p.info["cmdline"] or [])
    ]
    assert "reverse-text: teacher" in (out / "logs" / "orchestrator.log").read_text()  # its tokenizer was checked
    trained, orch = trainer_metrics(out), orchestrator_metrics(out)
    assert [m["step"] for m in trained] == [1, 2, 3] and [m["step"] for m in orch] == [1, 2, 3]
    # Which environment's groups fill a step varies (the two servers race); the seeded draws mix them (imitate,
    # imitate, reverse-text, reverse-text, imitate, ...), so over the 3 steps both train. A step without a stream
    # logs none of its metrics.
    distilled = [(t, o) for t, o in zip(trained, orch, strict=True) if "ref_kl_stream" in t]
    imitated = [t for t in trained if "ce_loss" in t]
    assert distilled and imitated and all(t.get("ref_kl_tokens", 0) + t.get("ce_tokens", 0) > 0 for t in trained)
    assert sum(m.get("groups_started/teacher", 0) for m in orch) > 0  # the teacher sampled them, the policy did not
    assert all(0 < t["ce_loss"] < 50 for t in imitated)  # -log pi of the teacher's tokens, per token
    for t, o in distilled:  # at k = 0 the trainer's policy is the one that sampled, at every step
        assert t["mismatch_kl"] < 1e-6 and o["time/teacher"] > 0
        assert t["ref_kl_stream"] == pytest.approx(o["teacher_kl/sampler"], abs=1e-3)
        assert o["teacher_kl/sampler"] > 0.1  # 8x perturbed weights: far from the policy


@pytest.mark.slow
def test_rl_resume_after_a_crash(tied_server, tmp_path):
    """6 steps, checkpoints every 2, the run killed during step 5; resumed with -1 it continues from step 4:
    the trainer trains 5 and 6 (nothing twice, nothing skipped) and the server serves pi_4 before new rollouts.
    Weights go by the in-memory broadcast; the resumed run reads pi_4 from the checkpoint step's directory (the
    trainer writes checkpoint steps to disk too). Each environment has its own algorithm: nim self-play under rae,
    whose baselines the resumed run restores from the checkpoint, reverse-text under the run's max_rl, its 6 tasks
    drawn by the default difficulty pools, which the resumed run restores too."""
    srv = tied_server
    out = srv.root / "rl" / "resume"
    out.mkdir(parents=True)
    envs = NIM_MIX.replace(
        "args = { max_sticks = 5 }", 'args = { max_sticks = 5 }\nalgo = { type = "rae", decay = 0.9 }'
    ).replace('"reverse-text"\nratio = 1\n', f'"reverse-text"\nratio = 1\n{DIFFICULTY_POOLS_OF_6}')
    extra = '[ckpt]\ninterval = 2\n[orchestrator.algo]\ntype = "max_rl"\n' + broadcast(srv)
    config = write_config(tmp_path / "rl.toml", srv, out, k=1, steps=6, extra=extra, envs=envs)
    log1 = tmp_path / "run1.log"
    proc = start_rl(config, log=log1)
    try:
        while not (out / "checkpoints" / "step_4" / "trainer" / "COMPLETE").exists() or not batch_path(out, 5).exists():
            assert proc.poll() is None, log1.read_text()[-3000:]
            time.sleep(0.02)  # batch 5 is deleted once trained, a fraction of a second after it appears
        tree = run_pids(psutil.Process(proc.pid))
        for p in tree:  # a crash of the whole machine/job: everything dies at once
            p.kill()
    finally:
        proc.wait(30)
    before = len((out / "metrics.jsonl").read_text().splitlines())
    first_run = trainer_steps(out)
    assert first_run[:4] == [1, 2, 3, 4] and max(first_run) <= 5

    log2 = tmp_path / "run2.log"
    proc = start_rl(config, "--ckpt.resume-step", "-1", log=log2)
    assert wait_rl(proc, 600) == 0, log2.read_text()[-4000:]
    console = log2.read_text()
    assert "resuming trainer and orchestrator from step 4" in console
    assert "[trainer] step 1 |" not in console  # the killed run's step lines are not shown again
    assert re.findall(r"\[trainer\] step (\d+) \|", console) == ["5", "6"]
    resumed = trainer_metrics(out, skip_lines=before)
    assert [m["step"] for m in resumed] == [5, 6]
    assert all(m["policy_version/min"] >= 4 for m in resumed)  # batches 5 and 6 came from pi_4 or newer
    orch_log = (out / "logs" / "orchestrator.log").read_text().split("resuming from step 4")[-1]
    assert orch_log.index("serve policy step 4") < orch_log.index("step 5 |")
    # The baselines after batch 4, as the first run logged them and its checkpoint kept them, are the resumed run's.
    saved = json.loads((out / "checkpoints" / "step_4" / "orchestrator" / "rae_baselines.json").read_text())["nim"]
    step_4 = next(m for m in orchestrator_metrics(out) if m["step"] == 4)
    logged = {k.split("/")[2]: v for k, v in step_4.items() if k.startswith("rae/nim/")}
    assert saved["decay"] == 0.9 and set(saved["values"]) == {"first", "second"} == set(logged)
    assert logged == pytest.approx(saved["values"], abs=0)
    restored = ", ".join(f"{seat} {b!r}" for seat, b in sorted(saved["values"].items()))
    assert f"RAE baselines of nim restored: {restored}" in (out / "logs" / "orchestrator.log").read_text()
    check_pools_restored(out, 4, step_4, first_run=orchestrator_metrics(out)[:4])


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from prime_rl.models.tiny import TinyModelConfig, build_tiny_model

    return build_tiny_model(TinyModelConfig(output=tmp_path_factory.mktemp("rl-config") / "tiny"))


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--trainer.max-steps", "7"], "max_steps = 3 contradicts trainer.max_steps = 7"),
        (["--orchestrator.bogus", "1"], "unknown option --orchestrator.bogus"),
        (["--model.name", "/nonexistent/tiny-model"], "does not exist"),
        (["--trainer.seq-len", "100"], "trainer.seq_len (100) < orchestrator.seq_len (512)"),
        (["--orchestrator.sampling.temperature", "0"], "temperature must be > 0"),
        (["--orchestrator.sampling.top-p", "0.9"], "top_p = 0.9"),
        (["--orchestrator.seq-len", "16"], "fills seq_len=16 before the model writes a token"),
        (["--orchestrator.env", '[{"id": "no-such-env"}]'], "environment 'no-such-env' (id 'no-such-env') failed"),
        (["--orchestrator.env", '[{"id": "nim", "env_args": {"first": {"bogus": 1}}}]'], "first.bogus"),
    ],
)
def test_bad_config_fails_before_anything_starts(tiny_model, tmp_path, args, needle):
    """Also what only loading the environments can tell: a missing environment, a bad environment option, prompts
    longer than seq_len (they used to start all three processes and drop every rollout, forever)."""
    out = tmp_path / "out"
    config = tmp_path / "rl.toml"
    config.write_text(
        f'output_dir = "{out}"\nmax_steps = 3\n[model]\nname = "{tiny_model}"\n[orchestrator]\nseq_len = 512\n'
    )
    start = time.monotonic()
    result = subprocess.run([RL, "@", str(config), *args], capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - start
    assert result.returncode == 2, result.stderr
    assert needle in result.stderr, result.stderr
    assert not (out / "logs").exists()  # nothing was started, nothing written
    print(f"{args}: failed in {elapsed:.1f}s")


def test_rl_refuses_a_server_port_another_process_holds(tiny_model, tmp_path):
    """A server already on the port (another run's) would answer rl's health check before rl's own server fails to
    bind, and the run would talk to it: rl refuses first, naming the port, and starts nothing."""
    out = tmp_path / "out"
    config = tmp_path / "rl.toml"
    config.write_text(f'output_dir = "{out}"\nmax_steps = 3\n[model]\nname = "{tiny_model}"\n')
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        result = subprocess.run(
            [RL, "@", str(config), "--inference.server.port", str(port)], capture_output=True, text=True, timeout=120
        )
    assert result.returncode == 2 and f"[inference.server] port {port} on 127.0.0.1 is in use" in result.stderr
    assert not (out / "logs").exists()  # nothing was started, nothing written


DIFFICULTY_POOLS_OF_6 = 'sampler = { type = "difficulty_pool" }\nargs = { num_tasks = 6 }\n'


def check_pools_restored(out: Path, step: int, logged: dict, first_run: list[dict]) -> None:
    """reverse-text's difficulty pools in checkpoint `step`: the pool sizes the first run logged at that step (`logged`)
    are the checkpoint's, and the resumed run restored exactly that state: its line names the sizes and the SHA-256 of
    the saved state as JSON with sorted keys (every task's latest mean and each pool's member order; the line's format:
    test_curriculum.py). A reverse-text group trained in `first_run` (steps 1..step) has taken its task out of
    `unseen`: no retirement is configured, and a task never goes back."""
    buffer = json.loads((out / "checkpoints" / f"step_{step}" / "orchestrator" / "buffer.json").read_text())
    pools = buffer["envs"]["reverse-text"]["difficulty_pools"]
    sizes = {name: len(members) for name, members in pools["pools"].items()}
    assert list(sizes) == ["unseen", "hard", "normal", "easy"] and sum(sizes.values()) == 6
    prefix = "curriculum/reverse-text/pool/"
    assert {k.removeprefix(prefix): v for k, v in logged.items() if k.startswith(prefix)} == sizes
    if any("rollouts/reverse-text" in m for m in first_run):
        assert sizes["unseen"] < 6
    digest = hashlib.sha256(json.dumps(pools, sort_keys=True).encode()).hexdigest()[:12]
    line = ", ".join(f"{name} {n}" for name, n in sizes.items())
    orch_log = (out / "logs" / "orchestrator.log").read_text()
    assert f"difficulty pools of reverse-text restored: {line} (state {digest})" in orch_log
