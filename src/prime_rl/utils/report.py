"""`report`: a run's `metrics.jsonl` as PNG plots and one self-contained HTML page, no W&B needed.

    uv run report outputs/reverse-text/rl      # -> outputs/reverse-text/rl/report/index.html (+ one PNG per plot)

Only the metrics the run logged are plotted (an `sft` run has no reward, a trainer without an orchestrator no lag).
When a step was logged twice (a resumed run repeats the steps after its checkpoint), the later line wins.
"""

from __future__ import annotations

import argparse
import base64
import html
import sys
from dataclasses import dataclass
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")  # files only, never a window
from matplotlib.figure import Figure  # noqa: E402

from prime_rl.utils.metrics import Metrics, load_metrics, series  # noqa: E402


@dataclass
class LinePlot:
    name: str
    """File name (without .png)."""
    title: str
    ylabel: str
    series: list[tuple[str, str]]
    """(process, metric key) of each line, drawn when the run logged it."""
    log_y: bool = False


LINE_PLOTS = [
    LinePlot("loss", "Loss", "loss", [("trainer", "loss"), ("sft", "loss")]),
    LinePlot("entropy", "Entropy of the trained tokens", "nats / token", [("trainer", "entropy")]),
    LinePlot(
        "mismatch_kl", "Mismatch KL (trainer vs inference logprobs)", "KL / token", [("trainer", "mismatch_kl")], True
    ),
    LinePlot(
        "async_lag",
        "Async lag (policy steps behind)",
        "steps",
        [("orchestrator", "async_lag/mean"), ("orchestrator", "async_lag/max")],
    ),
    LinePlot(
        "throughput",
        "Throughput",
        "tokens / s",
        [("orchestrator", "tokens_per_s"), ("trainer", "tokens_per_s"), ("sft", "tokens_per_s")],
    ),
    LinePlot(
        "weight_update",
        "Weight update time",
        "seconds",
        [("trainer", "time_publish"), ("orchestrator", "time/update_weights")],
    ),
]

STEP_TIME = {
    # process: (total key or None = sum of parts, waiting parts, working parts); a None key is the rest of the total.
    "orchestrator": ("time/step", [
        ("time/wait_for_weights", "waiting for weights"), ("time/wait_for_evals", "waiting for an eval pass"),
    ], [
        ("time/update_weights", "updating weights"), (None, "rollouts"),
    ]),
    "trainer": (None, [("time_data", "waiting for the batch")], [
        ("time_train", "training"), ("time_publish", "publishing weights"),
    ]),
    "sft": (None, [("time_data", "loading data")], [("time_train", "training"), ("time_save", "saving")]),
}  # fmt: skip


def new_figure(title: str, ylabel: str) -> tuple[Figure, object]:
    fig = Figure(figsize=(8, 3.6), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def line_plot(data: Metrics, plot: LinePlot) -> Figure | None:
    lines = [(p, k, *series(data, p, k)) for p, k in plot.series]
    lines = [line for line in lines if line[2]]
    if not lines:
        return None
    fig, ax = new_figure(plot.title, plot.ylabel)
    for process, key, steps, values in lines:
        ax.plot(steps, values, marker="." if len(steps) < 50 else None, label=f"{process}: {key}")
    if plot.log_y and all(v > 0 for *_, values in lines for v in values):
        ax.set_yscale("log")
    ax.legend(fontsize="small")
    return fig


def reward_plot(data: Metrics) -> Figure | None:
    """Mean reward with a +-1 std band, and per environment when the run mixed several."""
    steps, mean = series(data, "orchestrator", "reward/mean")
    if not steps:
        return None
    fig, ax = new_figure("Reward", "reward")
    ax.plot(steps, mean, marker="." if len(steps) < 50 else None, label="mean")
    std_steps, std = series(data, "orchestrator", "reward/std")
    if std_steps == steps:
        mean_, std_ = np.array(mean), np.array(std)
        ax.fill_between(steps, mean_ - std_, mean_ + std_, alpha=0.2, label="+-1 std")
    keys = {k for row in data["orchestrator"].values() for k in row}
    envs = sorted(
        k.split("/")[1] for k in keys if k.startswith("reward/") and k.endswith("/mean") and k.count("/") == 2
    )
    if len(envs) > 1:
        for env in envs:
            ax.plot(*series(data, "orchestrator", f"reward/{env}/mean"), linestyle="--", label=env)
    ax.legend(fontsize="small")
    return fig


def eval_envs(data: Metrics, process: str) -> list[str]:
    """The environments whose evals `process` logged (`eval/<env>/reward_mean`): the orchestrator's online evals,
    `sft`'s evals of its exported weights."""
    keys = {k for row in data.get(process, {}).values() for k in row}
    return sorted(
        k.split("/")[1] for k in keys if k.startswith("eval/") and k.endswith("/reward_mean") and k.count("/") == 2
    )


def eval_plot(data: Metrics) -> Figure | None:
    """The held-out curve during training: each eval environment's avg@k (its mean reward) and pass@k at the policy
    step each eval measured; during RL beside the training batches' mean reward."""
    process = next((p for p in ("orchestrator", "sft") if eval_envs(data, p)), None)
    if process is None:
        return None
    kind = "RL (online evals)" if process == "orchestrator" else "SFT (exported weights)"
    fig, ax = new_figure(f"Held-out reward during {kind}", "reward")
    steps, train = series(data, process, "reward/mean")
    if steps:
        ax.plot(steps, train, color="#9e9e9e", linewidth=1, label="training batches: reward/mean")
    keys = {k for row in data[process].values() for k in row}
    for env in eval_envs(data, process):
        ks = sorted(int(k.rsplit("@", 1)[1]) for k in keys if k.startswith(f"eval/{env}/pass@"))
        avg = next((f"eval/{env}/avg@{k}" for k in reversed(ks) if f"eval/{env}/avg@{k}" in keys), None)
        for key, style in [(avg or f"eval/{env}/reward_mean", "-"), (f"eval/{env}/pass@{ks[-1]}" if ks else None, ":")]:
            if key is not None:
                ax.plot(*series(data, process, key), linestyle=style, marker="o", label=key)
    ax.legend(fontsize="small")
    return fig


def step_time_plot(data: Metrics, process: str) -> Figure | None:
    """Where a process's step time went: waiting (grey) vs working (colours), stacked."""
    total_key, waiting, working = STEP_TIME[process]
    rows = data.get(process, {})
    logged = {k for row in rows.values() for k in row}
    parts = [(k, label, True) for k, label in waiting] + [(k, label, False) for k, label in working]
    parts = [(k, label, wait) for k, label, wait in parts if k in logged or (k is None and total_key in logged)]
    if not any(k is not None for k, _, _ in parts):
        return None
    steps = sorted(rows)
    stacks = []
    for key, label, wait in parts:
        if key is None:  # the rest of the total
            values = [max(0.0, (rows[s].get(total_key) or 0.0) - _known_time(rows[s], parts)) for s in steps]
        else:
            values = [float(rows[s].get(key) or 0.0) for s in steps]
        stacks.append((label, wait, values))
    waited = sum(sum(v) for _, wait, v in stacks if wait)
    total = sum(sum(v) for _, _, v in stacks) or 1.0
    fig, ax = new_figure(f"Step time of the {process}: {100 * waited / total:.0f}% waiting", "seconds")
    greys = iter(["#9e9e9e", "#cfcfcf"])
    colours = iter(["#1f77b4", "#ff7f0e", "#2ca02c"])
    ax.stackplot(
        steps,
        *[v for _, _, v in stacks],
        labels=[f"{label} ({'waiting' if wait else 'working'})" for label, wait, _ in stacks],
        colors=[next(greys) if wait else next(colours) for _, wait, _ in stacks],
    )
    ax.legend(fontsize="small", loc="upper right")
    return fig


def _known_time(row: dict, parts: list) -> float:
    return sum(row.get(key) or 0.0 for key, _, _ in parts if key is not None)


def build_plots(data: Metrics) -> list[tuple[str, str, Figure]]:
    """(file name, title, figure) of every plot the data supports, in page order."""
    candidates = [("reward", reward_plot(data)), ("eval", eval_plot(data))]
    candidates += [(p.name, line_plot(data, p)) for p in LINE_PLOTS]
    candidates += [(f"step_time_{p}", step_time_plot(data, p)) for p in STEP_TIME]
    return [(name, fig.axes[0].get_title(), fig) for name, fig in candidates if fig is not None]


def write_report(output_dir: Path) -> Path:
    data = load_metrics(output_dir / "metrics.jsonl")
    report_dir = output_dir / "report"
    report_dir.mkdir(parents=True, exist_ok=True)
    sections = []
    for name, title, fig in build_plots(data):
        path = report_dir / f"{name}.png"
        fig.savefig(path)
        image = base64.b64encode(path.read_bytes()).decode()
        sections.append(
            f'<section id="{name}"><h2>{html.escape(title)}</h2>'
            f'<img alt="{html.escape(title)}" src="data:image/png;base64,{image}"></section>'
        )
    runs = ", ".join(f"{p}: steps {min(s)}-{max(s)}" for p, s in sorted(data.items()) if s) or "no steps"
    page = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>prime-rl report: {html.escape(str(output_dir))}</title>
<style>body {{ font-family: sans-serif; max-width: 860px; margin: auto; }} img {{ max-width: 100%; }}</style>
</head><body>
<h1>prime-rl report</h1>
<p>{html.escape(str(output_dir.resolve()))} &mdash; {html.escape(runs)}</p>
{chr(10).join(sections) or "<p>No plottable metrics.</p>"}
</body></html>
"""
    index = report_dir / "index.html"
    index.write_text(page)
    return index


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="report", description=__doc__.split("\n")[0])
    parser.add_argument("output_dir", type=Path, help="a run's output directory (holds metrics.jsonl)")
    args = parser.parse_args(argv)
    path = args.output_dir / "metrics.jsonl"
    if not path.is_file():
        print(f"report: error: {path} does not exist (is {args.output_dir} a run's output_dir?)", file=sys.stderr)
        sys.exit(2)
    try:
        index = write_report(args.output_dir)
    except ValueError as e:
        print(f"report: error: {e}", file=sys.stderr)
        sys.exit(2)
    print(index)


if __name__ == "__main__":
    main()
