"""`--bench`: the shared table, `rl`'s join of both processes' metrics lines, and the bench options of the configs."""

import json

import pytest
from pydantic import ValidationError

from prime_rl.config.loader import load_config
from prime_rl.orchestrator.config import OrchestratorConfig
from prime_rl.rl import RLConfig
from prime_rl.rl.bench import bench_rows, bench_table
from prime_rl.utils.bench import Column, format_bench_table


def test_table_cells_widths_and_summary():
    columns = [
        Column("step", "step", "d"),
        Column("seconds", "s", ".2f", summary=True),
        Column("pct", "f", ".1f", scale=100),
        Column("x", "x", ".1f", summary=True),
        Column("y", "y", ".1f", summary=True),
    ]
    rows = [
        {"step": 1, "s": 10.0, "f": 0.5, "x": None, "y": None},
        {"step": 2, "s": 2.0, "f": 0.25, "x": 3.0, "y": None},
        {"step": 3, "s": 4.0, "f": float("nan"), "x": 5.0},  # NaN and a missing key are both "-"
        {"step": 4, "s": 6.0, "x": 4.0},
    ]
    # Steps 2-4, written like the cells: seconds 2, 4, 6 -> mean 4, sample stdev 2; x 3, 5, 4 -> mean 4, stdev 1;
    # y has no value.
    assert format_bench_table(rows, columns).splitlines() == [
        "step  seconds   pct    x  y",
        "   1    10.00  50.0    -  -",
        "   2     2.00  25.0  3.0  -",
        "   3     4.00     -  5.0  -",
        "   4     6.00     -  4.0  -",
        "summary over 3 steps after the first: seconds 4.00 ± 2.00, x 4.0 ± 1.0, y -",
    ]
    assert format_bench_table(rows[:1], columns).splitlines()[-1] == "summary: no steps after the warm-up step"
    with pytest.raises(ValueError, match="'n': a mean is not an integer"):
        Column("n", "n", "d", summary=True)


def line(process: str, step: int, **metrics) -> str:
    return json.dumps({"process": process, "step": step, **metrics})


def orch(step: int, seconds: float, rollouts_per_s: float, tokens_per_s: float, wait: float, swap: float) -> str:
    return line(
        "orchestrator", step, **{"time/step": seconds, "rollouts_per_s": rollouts_per_s, "tokens_per_s": tokens_per_s,
        "time/wait_for_weights": wait, "time/update_weights": swap, "reward/mean": 0.5},
    )  # fmt: skip


def trainer(
    step: int, data: float, train: float, publish: float, tokens: int, window_tps: float, mfu, mem: float, **more
):
    return line(
        "trainer", step, time_data=data, time_train=train, time_publish=publish, tokens=tokens,
        tokens_per_s=window_tps, mfu=mfu, peak_memory_gib=mem, loss=0.1, **more,
    )  # fmt: skip


# The trainer logs tokens/s and MFU over its recent steps (step 1 left out): step 2's window is step 2 alone
# (200 tokens / 1 s), step 3's is steps 2-3 ((200 + 400) / (1 + 4) = 120 tok/s). MFU is 0.05 % per tok/s here.
LINES = [
    orch(1, 4.0, 2.0, 100.0, 0.0, 0.0),
    trainer(1, 1.0, 2.0, 0.5, 300, 150.0, None, 1.25),
    orch(2, 9.0, 9.0, 900.0, 9.0, 9.0),  # logged twice (a redone step): the later line counts
    line("sft", 2, loss=1.0),  # another process in the same file: ignored
    "",
    orch(2, 2.0, 4.0, 200.0, 0.5, 0.25),
    trainer(2, 0.5, 1.0, 0.5, 200, 200.0, 10.0, 1.5),
    orch(3, 4.0, 2.0, 100.0, 1.0, 0.25),
    trainer(3, 1.5, 4.0, 0.5, 400, 120.0, 6.0, 1.5, time_wait_taken=0.5),  # in-memory broadcast: waited 0.5 s
    orch(4, 2.0, 4.0, 200.0, 0.0, 0.5),  # no trainer line for step 4
]


def test_rl_bench_rows_join_both_processes_per_step():
    rows = bench_rows(LINES)
    keys = ["orchestrator_seconds", "rollouts_per_s", "inference_tokens_per_s", "wait_for_weights", "update_weights"]
    keys += ["trainer_seconds", "wait_for_batch", "train_seconds", "publish_seconds", "wait_for_taken"]
    keys += ["train_tokens_per_s", "mfu", "peak_memory_gib"]
    assert [[row["step"], *(row[k] for k in keys)] for row in rows] == [
        # trainer s = wait + train + publish; train tok/s = tokens / train s (300 / 2); MFU unknown at step 1
        [1, 4.0, 2.0, 100.0, 0.0, 0.0, 3.5, 1.0, 2.0, 0.5, None, 150.0, None, 1.25],
        # 200 / 1 = 200 tok/s; MFU 10 * 200 / 200
        [2, 2.0, 4.0, 200.0, 0.5, 0.25, 2.0, 0.5, 1.0, 0.5, None, 200.0, 10.0, 1.5],
        # trainer s = 1.5 + 4 + 0.5 + 0.5 waiting for the orchestrator to take the policy; 400 / 4 = 100 tok/s,
        # not the window's 120; MFU 6 * 100 / 120 = 5
        [3, 4.0, 2.0, 100.0, 1.0, 0.25, 6.5, 1.5, 4.0, 0.5, 0.5, 100.0, 5.0, 1.5],
        [4, 2.0, 4.0, 200.0, 0.0, 0.5, None, None, None, None, None, None, None, None],
    ]


def test_rl_bench_table():
    lines = bench_table(LINES).splitlines()
    assert lines[0].split() == [
        "step", "orch", "s", "rollouts/s", "inf", "tok/s", "weights", "wait", "s", "swap", "s", "trainer", "s",
        "batch", "wait", "s", "train", "s", "publish", "s", "taken", "wait", "s", "train", "tok/s", "MFU", "%",
        "peak", "GiB",
    ]  # fmt: skip
    row_1 = ["1", "4.00", "2.0", "100", "0.00", "0.000", "3.50", "1.00", "2.00", "0.50", "-", "150", "-", "1.25"]
    assert lines[1].split() == row_1
    assert lines[4].split() == ["4", "2.00", "4.0", "200", "0.00", "0.500"] + ["-"] * 8
    # Steps 2-4. orch s 2, 4, 2: mean 2.667, stdev sqrt(((-2/3)^2 * 2 + (4/3)^2) / 2) = 1.155; rollouts/s 4, 2, 4:
    # 3.333 ± 1.155; inf tok/s 200, 100, 200: 166.7 ± 57.7. Trainer (steps 2, 3): seconds 2, 6.5: 4.25 ± 3.182; tok/s
    # 200, 100: 150 ± 70.71; MFU 10, 5: 7.5 ± 3.536. Each written like its column's cells.
    assert lines[5] == (
        "summary over 3 steps after the first: orch s 2.67 ± 1.15, rollouts/s 3.3 ± 1.2, inf tok/s 167 ± 58, "
        "trainer s 4.25 ± 3.18, train tok/s 150 ± 71, MFU % 7.50 ± 3.54"
    )
    assert len(lines) == 6


def test_orchestrator_bench_refuses_to_resume():
    assert OrchestratorConfig(bench={}).bench.steps == 5
    with pytest.raises(ValidationError, match="--bench .* cannot resume from a checkpoint"):
        OrchestratorConfig(bench={}, ckpt={"resume_step": -1})
    with pytest.raises(ValidationError, match="bench.steps"):
        OrchestratorConfig(bench={"steps": 1})  # no step after the warm-up one to summarise


def rl_config(tmp_path, *flags: str) -> RLConfig:
    path = tmp_path / "rl.toml"
    path.write_text(f'output_dir = "{tmp_path / "out"}"\nmax_steps = 30\n[ckpt]\ninterval = 10\n[wandb]\nname = "x"\n')
    return load_config(RLConfig, "rl", ["@", str(path), *flags])[0]


def test_rl_bench_is_a_short_run_without_checkpoints_or_wandb(tmp_path, capsys):
    config = rl_config(tmp_path, "--bench", "--bench.steps", "3")
    assert (config.max_steps, config.trainer.max_steps, config.orchestrator.max_steps) == (3, 3, 3)
    assert (config.ckpt, config.trainer.ckpt, config.orchestrator.ckpt) == (None, None, None)
    assert (config.wandb, config.trainer.wandb, config.orchestrator.wandb) == (None, None, None)
    assert config.trainer.bench is None and config.orchestrator.bench is None  # real batches, real weights
    assert rl_config(tmp_path).trainer.max_steps == 30 and rl_config(tmp_path).trainer.ckpt.interval == 10


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--ckpt.resume-step", "-1"], "--bench is a short fresh run and cannot resume from a checkpoint"),
        (["--trainer.bench"], "trainer.bench benchmarks the trainer alone"),
        (["--orchestrator.bench"], "orchestrator.bench benchmarks the orchestrator alone"),
    ],
)
def test_rl_bench_refuses_what_it_cannot_measure(tmp_path, capsys, flags, needle):
    with pytest.raises(SystemExit) as exit_:
        rl_config(tmp_path, "--bench", *flags)
    assert exit_.value.code == 2
    assert needle in capsys.readouterr().err
