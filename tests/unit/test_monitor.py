"""Monitor sinks (metrics.jsonl always, W&B offline when configured) and the monitoring config sections."""

import glob
import json
import os

import pytest
from wandb_offline import wandb_records

from prime_rl.config.loader import load_config
from prime_rl.orchestrator.config import OrchestratorConfig
from prime_rl.trainer.config import TrainerConfig
from prime_rl.utils.monitor import Monitor
from prime_rl.utils.monitor_config import WandbConfig


def read_lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_without_wandb_everything_goes_to_local_files(tmp_path):
    monitor = Monitor(tmp_path, "trainer")
    assert monitor.run is None
    monitor.log(1, {"loss": 0.5, "mfu": None})
    dist = monitor.log_distribution(1, "distribution/reward", [0.0, 1.0, 2.0, 3.0, 4.0])
    assert monitor.log_distribution(1, "distribution/empty", []) == {}
    monitor.log_table(1, "samples", ["prompt", "reward"], [["hi", 1.0]])
    monitor.close()
    # One line per process and step: a distribution's summary is returned for the step's metrics, not written.
    assert read_lines(tmp_path / "metrics.jsonl") == [{"process": "trainer", "step": 1, "loss": 0.5, "mfu": None}]
    assert dist["distribution/reward/mean"] == 2.0 and dist["distribution/reward/p50"] == 2.0
    assert dist["distribution/reward/min"] == 0.0 and dist["distribution/reward/max"] == 4.0
    assert dist["distribution/reward/std"] == pytest.approx(2**0.5)
    assert {"distribution/reward/p10", "distribution/reward/p90"} <= dist.keys()
    assert read_lines(tmp_path / "tables.jsonl") == [
        {"process": "trainer", "step": 1, "table": "samples", "columns": ["prompt", "reward"], "rows": [["hi", 1.0]]}
    ]


def test_trainer_and_orchestrator_become_two_offline_runs_in_one_group(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wandb").mkdir()
    out = tmp_path / "out"
    config = WandbConfig(project="tests", name="exp")
    monitors = {p: Monitor(out, p, config, {"process": p, "lr": 1e-6}) for p in ("trainer", "orchestrator")}
    for process, monitor in monitors.items():
        assert (monitor.run.name, monitor.run.group, monitor.run.offline) == (f"exp-{process}", "exp", True)
        monitor.log(1, {f"{process}/loss": 0.25, "mfu": None})
        monitor.log(2, {f"{process}/loss": 0.125})
    summary = monitors["orchestrator"].log_distribution(2, "distribution/reward", [0.0, 0.5, 1.0])
    monitors["orchestrator"].log_table(2, "samples", ["prompt", "completion", "reward"], [["a", "b", 1.0]])
    for monitor in monitors.values():
        monitor.close()
    # finish() can return before wandb-core has closed the run's transaction log: records reach the .wandb file only
    # when a 32 KiB block fills or the stream closes (a loaded CI machine read a file that held the header alone).
    # Shutting the service down waits for every stream to close, as a process exit does.
    import wandb

    wandb.teardown()

    runs = {}
    for path in glob.glob(str(tmp_path / "wandb" / "wandb" / "offline-run-*" / "run-*.wandb")):
        records = list(wandb_records(path))
        kinds = [r.WhichOneof("record_type") for r in records]
        assert "run" in kinds and kinds[-1] == "exit", (path, os.path.getsize(path), kinds)
        run = records[kinds.index("run")].run
        history = {}
        for r in records:
            if r.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
                history[items["_step"]] = items
        runs[run.display_name] = (run, history)
    assert set(runs) == {"exp-trainer", "exp-orchestrator"}
    for process in ("trainer", "orchestrator"):
        run, history = runs[f"exp-{process}"]
        assert (run.project, run.run_group, run.job_type) == ("tests", "exp", process)
        assert sorted(history) == [1, 2]  # the step axis is the training step
        assert history[1][f"{process}/loss"] == 0.25 and history[2][f"{process}/loss"] == 0.125
        assert "mfu" not in history[1]  # None values are left out
    orchestrator = runs["exp-orchestrator"][1][2]
    assert orchestrator["samples/_type"] == "table-file" and orchestrator["samples/nrows"] == 1
    assert orchestrator["distribution/reward/_type"] == "histogram"
    tables = glob.glob(str(tmp_path / "wandb" / "wandb" / "offline-run-*" / "files" / "media" / "table" / "*.json"))
    assert len(tables) == 1 and json.load(open(tables[0]))["data"] == [["a", "b", 1.0]]

    lines = read_lines(out / "metrics.jsonl")  # the local file is written with W&B on too
    assert [(line["process"], line["step"]) for line in lines] == [
        ("trainer", 1), ("trainer", 2), ("orchestrator", 1), ("orchestrator", 2)
    ]  # fmt: skip
    assert summary["distribution/reward/mean"] == 0.5
    # WANDB_DIR wins over the output directory, which keeps only the run ids a resume continues
    assert sorted(p.name for p in (out / "wandb").iterdir()) == ["orchestrator.run-id", "trainer.run-id"]


def test_wandb_section_flags(capsys):
    assert load_config(TrainerConfig, "trainer", [])[0].wandb is None
    config, _ = load_config(TrainerConfig, "trainer", ["--wandb.name", "x", "--wandb.offline"])
    assert config.wandb == WandbConfig(name="x", offline=True)
    assert load_config(TrainerConfig, "trainer", ["--wandb"])[0].wandb == WandbConfig()
    assert load_config(TrainerConfig, "trainer", ["--wandb.name", "x", "--no-wandb"])[0].wandb is None


def test_log_extras_flags(capsys):
    defaults = load_config(OrchestratorConfig, "orchestrator", [])[0].log_extras
    assert (defaults.interval, defaults.samples, defaults.distributions) == (10, True, True)
    config, _ = load_config(
        OrchestratorConfig, "orchestrator", ["--no-log-extras.samples", "--log-extras.interval", "5"]
    )
    assert (config.log_extras.interval, config.log_extras.samples, config.log_extras.distributions) == (5, False, True)


def test_rl_shares_wandb_with_trainer_and_orchestrator(tmp_path, capsys):
    from prime_rl.rl import RLConfig

    toml = tmp_path / "rl.toml"
    toml.write_text('[wandb]\nname = "x"\n\n[orchestrator.wandb]\ngroup = "g"\n')
    config, _ = load_config(RLConfig, "rl", ["@", str(toml)])
    assert config.trainer.wandb == WandbConfig(name="x")
    assert config.orchestrator.wandb == WandbConfig(name="x", group="g")  # a section keeps what the shared one lacks
    assert load_config(RLConfig, "rl", [])[0].trainer.wandb is None

    toml.write_text('[wandb]\nname = "x"\n\n[trainer.wandb]\nname = "y"\n')
    with pytest.raises(SystemExit) as exit_info:
        load_config(RLConfig, "rl", ["@", str(toml)])
    assert exit_info.value.code == 2
    assert "wandb.name = 'x' contradicts trainer.wandb.name = 'y'" in capsys.readouterr().err


def test_orchestrator_log_extras(tmp_path):
    from prime_rl.orchestrator.config import LogExtrasConfig
    from prime_rl.orchestrator.messages import RolloutResult
    from prime_rl.orchestrator.orchestrator import batch_samples, log_extras
    from prime_rl.orchestrator.samples import SampleTokens
    from prime_rl.orchestrator.scheduler import Group

    groups = []
    for g in range(4):
        group = Group(id=g, env="reverse-text", task_idx=g, task={}, start_version=0, url="u")
        for i in range(4):
            n = 3 + i
            sample = SampleTokens(list(range(n)), [False] + [True] * (n - 1), [0.0] * n, [0] * n)
            group.rollouts.append(RolloutResult(reward=i / 3, samples=[sample], prompt=f"p{g}", completion=f"c{i}"))
        groups.append(group)
    config = OrchestratorConfig()
    advantages = batch_samples(groups, config)[1]
    monitor = Monitor(tmp_path, "orchestrator")
    dists = log_extras(10, groups, advantages, monitor, LogExtrasConfig())
    (table,) = read_lines(tmp_path / "tables.jsonl")
    assert table["columns"] == ["env", "prompt", "completion", "reward", "advantage"]
    assert len(table["rows"]) == 8 and {row[1] for row in table["rows"]} == {"p0", "p1", "p2", "p3"}  # spread out
    assert [row[4] for row in table["rows"][:2]] == pytest.approx([-0.5, 1 / 6])  # reward - group mean
    assert not (tmp_path / "metrics.jsonl").exists()  # the summaries go into the step's own metrics line
    assert dists["distribution/reward/max"] == 1.0 and dists["distribution/advantage/mean"] == pytest.approx(0.0)
    assert dists["distribution/seq_len/min"] == 3 and dists["distribution/seq_len/max"] == 6

    assert log_extras(20, groups, advantages, monitor, LogExtrasConfig(samples=False, distributions=False)) == {}
    assert len(read_lines(tmp_path / "tables.jsonl")) == 1


def test_a_resumed_process_continues_its_run_and_a_failed_one_is_marked(tmp_path, monkeypatch):
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wandb").mkdir()
    out, config = tmp_path / "out", WandbConfig(project="tests", name="exp")
    ids = []
    for resume, step, exit_code in ((False, 1, 1), (True, 2, 0), (False, 1, 0)):  # crash, resume, new run
        monitor = Monitor(out, "trainer", config, resume=resume)
        ids.append(monitor.run.id)
        monitor.log(step, {"loss": 0.5})
        monitor.close(exit_code)
    wandb.teardown()  # see above: the run files are complete once the service is down

    assert ids[0] == ids[1] != ids[2]
    assert (out / "wandb" / "trainer.run-id").read_text() == ids[2]  # the next resume continues the new run
    files = []
    for path in glob.glob(str(tmp_path / "wandb" / "wandb" / "offline-run-*" / "run-*.wandb")):
        records = list(wandb_records(path))
        last = {r.WhichOneof("record_type"): r for r in records}  # the last record of each kind
        steps = [r.history.step.num for r in records if r.WhichOneof("record_type") == "history"]
        files.append((last["run"].run.run_id, steps, last["exit"].exit.exit_code))
    assert sorted(files) == sorted([(ids[0], [1], 1), (ids[0], [2], 0), (ids[2], [1], 0)])


def test_tensorboard_gets_numeric_metrics_as_scalars_and_distributions_as_histograms(tmp_path):
    """Read back with TensorBoard's own reader: what `tensorboard --logdir {output_dir}/tensorboard` shows."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monitor = Monitor(tmp_path, "orchestrator", tensorboard=True)
    monitor.log(1, {"reward/mean": 0.25, "samples": 64, "mfu": None, "env": "reverse-text", "done": True})
    monitor.log(2, {"reward/mean": 0.75, "samples": 32})
    monitor.log_distribution(2, "distribution/reward", [0.0, 0.5, 1.0, 1.0])
    monitor.close()

    events = EventAccumulator(str(tmp_path / "tensorboard" / "orchestrator"), size_guidance={"scalars": 0})
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["reward/mean", "samples"]  # None, strings and flags are not scalars
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [(1, 0.25), (2, 0.75)]
    assert [(e.step, e.value) for e in events.Scalars("samples")] == [(1, 64.0), (2, 32.0)]
    (histogram,) = events.Histograms("distribution/reward")
    assert histogram.step == 2
    values = histogram.histogram_value
    assert (values.num, values.min, values.max, values.sum) == (4, 0.0, 1.0, 2.5)
    assert read_lines(tmp_path / "metrics.jsonl")[1] == {"process": "orchestrator", "step": 2, "reward/mean": 0.75,
                                                         "samples": 32}  # fmt: skip


def test_rl_shares_tensorboard_with_trainer_and_orchestrator(tmp_path):
    from prime_rl.rl import RLConfig

    config, _ = load_config(RLConfig, "rl", ["--tensorboard"])
    assert config.trainer.tensorboard and config.orchestrator.tensorboard
    assert not load_config(RLConfig, "rl", [])[0].trainer.tensorboard
