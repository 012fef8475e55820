"""`report`: PNGs and a self-contained HTML page from a hand-written metrics.jsonl."""

import json

import pytest

from prime_rl.utils.report import main


def write_metrics(path, lines):
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def rl_lines(steps):
    for step in range(1, steps + 1):
        yield {
            "process": "orchestrator",
            "step": step,
            "reward/mean": 0.1 * step,
            "reward/std": 0.05,
            "async_lag/mean": 1.0,
            "async_lag/max": 2,
            "tokens_per_s": 1000.0,
            "time/step": 3.0,
            "time/wait_for_weights": 1.0,
            "time/update_weights": 0.5,
        }
        yield {
            "process": "trainer",
            "step": step,
            "loss": 0.5 / step,
            "entropy": 2.0,
            "mismatch_kl": 1e-4,
            "tokens_per_s": 800.0,
            "mfu": None,
            "time_data": 0.5,
            "time_train": 2.0,
            "time_publish": 0.1,
        }
        yield {"process": "orchestrator", "step": step, "distribution/reward/mean": 0.1}  # a second line per step


def test_report_plots_every_logged_metric_into_one_page(tmp_path, capsys):
    write_metrics(tmp_path / "metrics.jsonl", rl_lines(5))
    main([str(tmp_path)])
    report = tmp_path / "report"
    assert capsys.readouterr().out.strip() == str(report / "index.html")
    names = [
        "reward", "loss", "entropy", "mismatch_kl", "async_lag", "throughput", "weight_update",
        "step_time_orchestrator", "step_time_trainer",
    ]  # fmt: skip
    assert sorted(p.stem for p in report.glob("*.png")) == sorted(names)
    page = (report / "index.html").read_text()
    assert page.count('src="data:image/png;base64,') == len(names)  # self-contained: no links to the PNGs
    for name in names:
        assert f'<section id="{name}"><h2>' in page
    for title in ["Reward", "Loss", "Entropy", "Mismatch KL", "Async lag", "Throughput", "Weight update time"]:
        assert f"<h2>{title}" in page
    assert "Step time of the orchestrator: 33% waiting" in page  # 1 s of 3 s waiting for weights
    assert "Step time of the trainer: 19% waiting" in page  # 0.5 s of 2.6 s waiting for the batch


def test_only_logged_metrics_are_plotted(tmp_path, capsys):
    lines = [{"process": "sft", "step": s, "loss": 1.0 / s, "time_data": 0.1, "time_train": 1.0} for s in (1, 2)]
    write_metrics(tmp_path / "metrics.jsonl", lines)
    main([str(tmp_path)])
    assert sorted(p.stem for p in (tmp_path / "report").glob("*.png")) == ["loss", "step_time_sft"]


def test_missing_metrics_file_is_one_line_and_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "nowhere")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "metrics.jsonl does not exist" in err
    assert not (tmp_path / "nowhere").exists()
