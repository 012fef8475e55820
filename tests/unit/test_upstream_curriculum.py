"""Upstream's per-source `curriculum` (a task `sampler`, named admission `gates`) read as our `sampler` and `gate`."""

from pathlib import Path

import pytest

from prime_rl.config.argv import ParsedArgv
from prime_rl.config.entrypoints import config_class
from prime_rl.config.keys import ConfigError, config_keys
from prime_rl.config.loader import build_config

CORPUS = Path(__file__).parent / "upstream_configs" / "current"


def read(path: Path):
    cls = config_class("rl")
    notes: list = []
    config = build_config(cls, config_keys(cls), ParsedArgv(toml_files=[(path, ())]), {}, "rl", notes)
    return config, [n for _, translated in notes for n in translated]


def test_difficulty_pools_and_an_advantage_range_gate_map_onto_ours():
    config, notes = read(CORPUS / "rl_curriculum_gate.toml")
    orch = config.orchestrator
    env = orch.env[0]
    assert env.sampler.type == "difficulty_pool" and env.sampler.ordered() == [("hard", 0.25), ("normal", 0.75)]
    assert (env.sampler.pools["hard"].weight, env.sampler.unseen_weight) == (0.2, 1.0)  # upstream's unseen: 1
    assert (env.gate.type, env.gate.low, env.gate.high) == ("advantage_range", -0.05, 0.05)
    assert orch.buffer.seed == 7  # the sampler's seed: one RNG draws every environment's tasks here
    assert "`orchestrator.train.source.0`: `curriculum.sampler` -> `sampler`" in notes
    assert any("`curriculum.gates.low_signal` -> `gate`" in n for n in notes)
    assert any(n.startswith("`orchestrator.train.source.0.curriculum.sampler.seed` -> `orchestrator.buffer.seed`")
               for n in notes)  # fmt: skip


def write(tmp_path: Path, source: str) -> Path:
    path = tmp_path / "rl.toml"
    path.write_text(
        "[orchestrator]\ngroup_size = 4\nbatch_size = 16\n"
        + "".join(
            f'[[orchestrator.train.source]]\nname = "{n}"\nenv.taskset.id = "reverse-text"\n{s}\n'
            for n, s in enumerate(source)
        )  # fmt: skip
    )
    return path


def test_standard_sampler_no_gates_and_what_does_not_map(tmp_path):
    config, notes = read(write(tmp_path, ['curriculum = { sampler = { type = "standard" }, gates = {} }']))
    assert config.orchestrator.env[0].sampler.type == "standard" and config.orchestrator.env[0].gate is None
    assert any("upstream cycles in source order" in n for n in notes) and any("no gate" in n for n in notes)
    seeds = [f"curriculum = {{ sampler = {{ type = 'difficulty_pool', seed = {s} }} }}" for s in (1, 2)]
    with pytest.raises(ConfigError, match="task sampler seeds that differ between environments"):
        read(write(tmp_path, seeds))
    with pytest.raises(ConfigError, match=r"orchestrator\.env\.0\.sampler\.difficulty_pool\.ema_alpha"):
        read(write(tmp_path, ["curriculum = { sampler = { type = 'difficulty_pool', ema_alpha = 0.5 } }"]))
    with pytest.raises(ConfigError, match="a curriculum for the whole orchestrator"):
        path = tmp_path / "o.toml"
        path.write_text("[orchestrator]\ngroup_size = 4\nbatch_size = 16\n[orchestrator.curriculum]\n")
        read(path)
