"""`rl` with several runs (`[[runs]]`): each run's orchestrator config is `[orchestrator]` plus its own keys, the
trainer gets a slot per run and the server an adapter per run; contradictions are refused before anything starts."""

import pytest

from prime_rl.config.loader import load_config
from prime_rl.rl import RLConfig
from prime_rl.rl.processes import build_processes, orchestrators

BASE = """
max_steps = 5
seq_len = 64
[model]
name = "/models/tiny"
[trainer.model.lora]
rank = 4
[orchestrator]
batch_size = 8
[orchestrator.adapter]
name = "ignored"
[orchestrator.adapter.optim]
lr = 1e-4
[inference]
"""

TWO_RUNS = """
[[runs]]
name = "fast"
orchestrator = { adapter = { optim = { lr = 3e-3 } } }
[[runs]]
name = "slow"
config = "{slow}"
"""


def rl_config(tmp_path, toml: str, *flags: str) -> RLConfig:
    (tmp_path / "slow.toml").write_text("max_steps = 9\n[adapter.optim]\nlr = 1e-3\n")
    path = tmp_path / "rl.toml"
    path.write_text(f'output_dir = "{tmp_path / "out"}"\n{toml.replace("{slow}", str(tmp_path / "slow.toml"))}')
    config, _ = load_config(RLConfig, "rl", ["@", str(path), *flags])
    return config


def rl_error(tmp_path, capsys, toml: str, *flags: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        rl_config(tmp_path, toml, *flags)
    assert exit_.value.code == 2
    return capsys.readouterr().err


def test_each_run_is_the_shared_orchestrator_plus_its_own_keys(tmp_path):
    config = rl_config(tmp_path, BASE + TWO_RUNS)
    runs = config.run_orchestrators()
    assert list(runs) == ["fast", "slow"]
    fast, slow = runs["fast"], runs["slow"]
    assert fast.output_dir == tmp_path / "out" / "run_fast" and slow.output_dir == tmp_path / "out" / "run_slow"
    assert (fast.adapter.name, slow.adapter.name) == ("fast", "slow")
    assert (fast.adapter.optim.lr, slow.adapter.optim.lr) == (3e-3, 1e-3)  # own keys, then own file, over 1e-4
    assert (fast.max_steps, slow.max_steps) == (5, 9)  # the shared length unless the run's file sets its own
    assert fast.batch_size == slow.batch_size == 8 and fast.seq_len == slow.seq_len == 64
    assert fast.model.name == slow.model.name == "/models/tiny"
    assert config.trainer.max_concurrent_runs == 3  # a spare slot for a run added while it trains
    assert (config.inference.lora.max_loras, config.inference.lora.max_lora_rank) == (8, 8)  # rank 4 -> vLLM's 8


def test_rl_starts_one_orchestrator_per_run_on_its_directory_and_one_trainer(tmp_path):
    config = rl_config(tmp_path, BASE + TWO_RUNS)
    processes = build_processes(config, orchestrators(config), tmp_path / "logs", "")
    assert sorted(processes) == ["inference", "orchestrator/fast", "orchestrator/slow", "trainer"]
    written = tmp_path / "out" / "configs" / "rl" / "orchestrator.fast.toml"
    assert processes["orchestrator/fast"].cmd[-1] == str(written)
    assert f'output_dir = "{tmp_path / "out" / "run_fast"}"' in written.read_text()
    trainer_toml = (tmp_path / "out" / "configs" / "rl" / "trainer.toml").read_text()
    assert "max_concurrent_runs = 3" in trainer_toml
    assert "[lora]\nmax_loras = 8\nmax_lora_rank = 8\n" in (tmp_path / "out/configs/rl/inference.toml").read_text()


def test_one_lora_run_without_runs_gets_an_adapter_name(tmp_path):
    config = rl_config(tmp_path, '[model]\nname = "/m"\n[trainer.model.lora]\n[inference]\n')
    assert config.orchestrator.adapter.name == "lora" and config.trainer.max_concurrent_runs == 1
    assert config.inference.lora.max_lora_rank == 8


@pytest.mark.parametrize(
    "toml, flags, message",
    [
        ('[model]\nname = "/m"\n[[runs]]\nname = "a"\n', [], "set [trainer.model.lora]"),
        (BASE + '[[runs]]\nname = "a"\n[[runs]]\nname = "a"\n', [], "names must differ, got ['a', 'a']"),
        (BASE + TWO_RUNS, ["--trainer.max-concurrent-runs", "1"], "needs a slot for each of its 2 run(s)"),
        (BASE + '[[runs]]\nname = "a"\n', ["--trainer.max-concurrent-runs", "1"], "(and at least 2)"),
        (BASE + TWO_RUNS, ["--inference.lora.max-loras", "1"], "cannot serve 2 adapter(s) of rank 4"),
        (BASE + '[[runs]]\nname = "a"\norchestrator = { seq_len = 100 }\n', [], "< runs.a.seq_len (100)"),
        (BASE + '[[runs]]\nname = "a"\norchestrator = { batch_sise = 4 }\n', [], "runs[0] (a):"),
        (BASE + '[[runs]]\nname = "a"\norchestrator = { output_dir = "/x" }\n', [], "output_dir/run_<name>"),
        (BASE + '[[runs]]\nname = "a b"\n', [], "runs.0.name"),
    ],
)
def test_contradictory_runs_are_refused_naming_what(tmp_path, capsys, toml, flags, message):
    err = rl_error(tmp_path, capsys, toml, *flags)
    assert message in err, err
    if "batch_sise" in toml:
        assert "batch_sise" in err


def test_server_runs_as_many_sequences_as_the_orchestrators_keep_in_flight(tmp_path):
    """Each rollout makes one model call at a time, so vLLM never needs more sequences than the rollouts in flight
    (and on CPU the KV cache is sized for them): groups in flight x rollouts per group, summed over the runs."""
    single = RLConfig(model={"name": "m"}, inference={}, orchestrator={"batch_size": 64, "rollouts_per_example": 8})
    assert single.inference.max_num_seqs == 64 and single.inference.vllm_args()[-2:] == ["--max-num-seqs", "64"]
    # oversampling 1.5: round(8 groups x 1.5) = 12 groups of 8.
    over = RLConfig(model={"name": "m"}, inference={}, orchestrator={"batch_size": 64, "rollouts_per_example": 8,
                                                                      "oversampling": 1.5})  # fmt: skip
    assert over.inference.max_num_seqs == 96
    # Two runs of batch_size 8: 8 rollouts in flight each.
    runs = rl_config(tmp_path, BASE + TWO_RUNS)
    assert (
        runs.inference.max_num_seqs
        == sum(o.groups_in_flight * o.rollouts_per_example for o in runs.run_orchestrators().values())
        == 16
    )
    # A value the user set is kept.
    assert RLConfig(model={"name": "m"}, inference={"max_num_seqs": 5}).inference.max_num_seqs == 5
