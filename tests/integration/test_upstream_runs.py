"""A config in upstream prime-rl's layout runs here as it is, with only the model pointed at a local one: the current
one-file layout (`group_size`, `[[orchestrator.train.env]]` with a taskset and a null harness, an empty `[ckpt]`,
`[orchestrator.renderer]`, `[orchestrator.concurrency]`) and the earlier split set (`rl --trainer @ --orchestrator @ --inference @`). Both
attach to the session's server (`rl --attach`, as a user who brings a config to debug it on a laptop does; each run
starting its own cost ~2 server starts of CI time). The test adds what isolates it: 3 steps, W&B offline, an output
dir under the server's weight roots, and the server's port and context length."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_rl import orchestrator_metrics, trainer_steps

from prime_rl.utils.secret import SECRET_VAR

pytestmark = pytest.mark.slow

RL = str(Path(sys.executable).parent / "rl")

CURRENT = """
max_steps = 20
seq_len = 512

[model]
name = "my-org/some-hub-model"

[wandb]
project = "upstream-layout"

[orchestrator]
batch_size = 16
group_size = 4

[orchestrator.train.sampling]
max_completion_tokens = 16

[orchestrator.concurrency]
initial_inflight = 8
max_inflight = 16

[[orchestrator.train.env]]
name = "reverse-text"
env.taskset = { id = "reverse-text-v1" }  # upstream names the hub's; ours is bundled as reverse-text
env.agent.harness = { id = "null", runtime = { type = "subprocess" } }

[trainer.optim]
lr = 1e-4

[ckpt]  # at the end of training

[inference]

[orchestrator.renderer]
name = "qwen3"
enable_thinking = false
"""

EARLIER = {
    "train.toml": 'max_steps = 20\n\n[model]\nname = "my-org/some-hub-model"\n\n[optim]\nlr = 1e-4\n',
    "orch.toml": (
        "batch_size = 16\nrollouts_per_example = 4\nseq_len = 512\nmax_steps = 20\nmask_truncated_completions = false\n\n"
        '[model]\nname = "my-org/some-hub-model"\nrenderer = { name = "qwen3", enable_thinking = false }\n\n'
        '[sampling]\nmax_tokens = 16\n\n[[env]]\nid = "reverse-text"\n\n[[env]]\nid = "reverse-text"\nname = "rt-2"\n'
    ),
    "infer.toml": '[model]\nname = "my-org/some-hub-model"\n',
}


def run_rl(args: list[str], out: Path, srv) -> subprocess.CompletedProcess:
    """`rl` attached to the shared server `srv`, with the keys its card holds (none of the environment's)."""
    isolation = ["--attach", "--model.name", str(srv.base), "--max-steps", "3", "--output-dir", str(out),
                 "--inference.server.port", str(srv.port), "--inference.model.max-model-len", "512"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != SECRET_VAR}
    return subprocess.run([RL, *args, *isolation], capture_output=True, text=True, timeout=600, env=env)


def test_upstream_layouts_run_three_steps_with_only_the_model_pointed_at_a_local_one(tied_server, tmp_path):
    runs = tied_server.root / "upstream"  # the server loads our policies from under its weight roots
    (tmp_path / "rl.toml").write_text(CURRENT)
    out = runs / "current"
    proc = run_rl(["@", str(tmp_path / "rl.toml"), "--wandb.offline"], out, tied_server)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "is in upstream prime-rl's spelling, read as:" in proc.stderr
    assert trainer_steps(out) == [1, 2, 3]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_3"]  # `[ckpt]`: at the end only
    # Adaptive in-flight control read the server's gauges each step: between 2 groups (8 rollouts) and 4 (16).
    peaks = [m["groups_in_flight/peak"] for m in orchestrator_metrics(out)]
    assert len(peaks) == 3 and all(1 <= p <= 4 for p in peaks), peaks

    for name, text in EARLIER.items():
        (tmp_path / name).write_text(text)
    split = ["--trainer", "@", str(tmp_path / "train.toml"), "--orchestrator", "@", str(tmp_path / "orch.toml"),
             "--inference", "@", str(tmp_path / "infer.toml")]  # fmt: skip
    out = runs / "earlier"
    proc = run_rl(split, out, tied_server)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--model.name overrides `trainer.model.name`" in proc.stderr
    assert trainer_steps(out) == [1, 2, 3]
