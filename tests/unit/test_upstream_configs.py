"""Configs in upstream prime-rl's layouts (both generations; written here, after the layouts its `configs/` and
`examples/` use) load through our entry points' own loader, or are refused with a line naming the feature we lack.
Each file says which in its header (`# expect: loads`, `loads unchanged`, or `refused: <feature>`)."""

import re
from pathlib import Path

import pytest

from prime_rl.config.argv import ParsedArgv
from prime_rl.config.entrypoints import config_class
from prime_rl.config.keys import ConfigError, config_keys
from prime_rl.config.loader import build_config

CORPUS = Path(__file__).parent / "upstream_configs"
FILES = sorted(CORPUS.rglob("*.toml"))


def read(path: Path, entrypoint: str, scope: tuple = ()):
    cls = config_class(entrypoint)
    notes: list = []
    config = build_config(cls, config_keys(cls), ParsedArgv(toml_files=[(path, scope)]), {}, entrypoint, notes)
    return config, [n for _, translated in notes for n in translated]


def header(path: Path) -> tuple[str, str]:
    text = path.read_text()
    entrypoint = re.search(r"^# entrypoint: (\w+)$", text, re.M).group(1)
    expect = re.search(r"^# expect: (.+)$", text, re.M).group(1)
    return entrypoint, expect


def test_the_corpus_covers_both_generations_and_every_outcome():
    expects = [header(p)[1] for p in FILES]
    assert len(FILES) >= 40
    assert {p.parent.name for p in FILES} == {"current", "earlier"}
    assert sum(e.startswith("loads") for e in expects) >= 20 and sum(e.startswith("refused") for e in expects) >= 15


@pytest.mark.parametrize("path", FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_an_upstream_config_loads_or_names_the_missing_feature(path):
    entrypoint, expect = header(path)
    if expect.startswith("refused: "):
        with pytest.raises(ConfigError) as refused:
            read(path, entrypoint)
        message = str(refused.value)
        assert message.startswith("not supported here:") and expect.removeprefix("refused: ") in message, message
        assert str(path) in message  # names the file
    else:
        _, notes = read(path, entrypoint)
        assert (notes == []) == (expect == "loads unchanged"), notes


def test_the_current_reverse_text_layout_means_what_upstream_meant():
    config, notes = read(CORPUS / "current" / "rl_single_turn.toml", "rl")
    orch = config.orchestrator
    assert orch.rollouts_per_example == 8 and orch.batch_size == 64 and orch.sampling.max_tokens == 64
    assert [(e.id, e.name, e.harness, e.args) for e in orch.env] == [("reverse-text", "reverse", None, {})]
    assert config.trainer.ckpt.interval == 0 and config.trainer.ckpt.due(12, 12) and not config.trainer.ckpt.due(6, 12)
    assert config.trainer.optim.lr == 1e-6 and config.wandb.project == "demo"
    assert "`orchestrator.group_size` -> `orchestrator.rollouts_per_example`" in notes


def test_nested_sources_weights_devices_and_renderer():
    config, _ = read(CORPUS / "current" / "rl_source_nested.toml", "rl")
    assert config.wandb.name == "arith-run" and config.orchestrator.rollouts_per_example == 4
    assert config.orchestrator.sampling.temperature == 0.9 and config.orchestrator.env[0].id == "arithmetic"
    config, _ = read(CORPUS / "current" / "rl_two_sources.toml", "rl")
    envs = config.orchestrator.env
    assert [(e.id, e.args, e.ratio) for e in envs] == [
        ("reverse-text", {"num_tasks": 50}, 1.0),
        ("arithmetic", {}, 3.0),
    ]
    config, _ = read(CORPUS / "current" / "rl_deployment_counts.toml", "rl")
    assert config.inference_gpu_ids == [0, 1, 2, 3, 4, 5] and config.trainer_gpu_ids == [6, 7]
    config, _ = read(CORPUS / "current" / "rl_renderer.toml", "rl")
    assert config.orchestrator.model.renderer == {"name": "qwen3", "enable_thinking": False}


def test_trainer_sft_eval_and_inference_spellings():
    config, _ = read(CORPUS / "current" / "rl_trainer_model_options.toml", "rl")
    model = config.trainer.model
    assert model.ac and model.compile and model.cpu_offload and model.logprob_chunk == 2048
    config, _ = read(CORPUS / "current" / "sft_micro_batch.toml", "sft")
    assert (config.seq_len, config.batch_size, config.micro_batch_tokens) == (1024, 32, 4 * 1024)
    assert config.data.renderer == {"name": "qwen3"}
    config, _ = read(CORPUS / "earlier" / "sft_fake.toml", "sft")
    assert config.data.type == "fake" and config.batch_size == 2 and config.seq_len == 1024
    config, _ = read(CORPUS / "current" / "eval_two_sources.toml", "eval")
    assert [(e.id, e.num_examples, e.rollouts_per_example) for e in config.env] == [
        ("reverse-text", 5, 4),
        ("arithmetic", None, 4),
    ]
    config, _ = read(CORPUS / "earlier" / "eval.toml", "eval")
    assert [(e.id, e.num_examples, e.rollouts_per_example) for e in config.env] == [("reverse-text", 20, 3)]
    config, _ = read(CORPUS / "earlier" / "infer.toml", "inference")
    assert config.lora.max_loras == 4 and config.lora.max_lora_rank == 16 and config.model.enforce_eager
    config, _ = read(CORPUS / "current" / "inference_vllm.toml", "inference")
    assert (config.model.name, config.model.max_model_len, config.parallel.tp) == ("Qwen/Qwen3-0.6B", 2048, 1)
    config, _ = read(CORPUS / "earlier" / "orch_buffer.toml", "orchestrator")
    assert config.oversampling == 2.0 and config.max_async_level == 2 and config.advantage.estimator == "opo"
    assert [e.ratio for e in config.env] == [1.0, 3.0]


def test_a_split_set_loads_through_rl_scoped_files(tmp_path):
    """The earlier generation's `rl --trainer @ train.toml --orchestrator @ orch.toml --inference @ infer.toml`."""
    cls = config_class("rl")
    files = [
        (CORPUS / "earlier" / "train.toml", ("trainer",)),
        (CORPUS / "earlier" / "orch.toml", ("orchestrator",)),
        (CORPUS / "earlier" / "infer.toml", ("inference",)),
    ]
    notes: list = []
    config = build_config(cls, config_keys(cls), ParsedArgv(toml_files=files), {}, "rl", notes)
    assert config.trainer.seq_len == 2048 and config.trainer.model.ac and config.orchestrator.rollouts_per_example == 8
    assert config.inference.lora is not None and config.orchestrator.mask_truncated_completions is False
    assert {str(p) for p, _ in notes} == {str(files[0][0]), str(files[2][0])}  # orch.toml is in our spelling


def test_one_setting_under_both_spellings_must_agree(tmp_path):
    path = tmp_path / "both.toml"
    path.write_text("[orchestrator]\ngroup_size = 4\nrollouts_per_example = 8\nbatch_size = 16\n")
    with pytest.raises(
        ConfigError, match="`orchestrator.group_size` .* `orchestrator.rollouts_per_example` are the same"
    ):
        read(path, "rl")
    path.write_text("[orchestrator]\ngroup_size = 4\nrollouts_per_example = 4\nbatch_size = 16\n")
    assert read(path, "rl")[0].orchestrator.rollouts_per_example == 4


def test_online_evals_and_validation_of_both_generations():
    config, _ = read(CORPUS / "current" / "rl_online_eval.toml", "rl")
    ev = config.orchestrator.eval
    assert ev.interval == 10 and ev.sampling.max_tokens == 32
    assert [(e.id, e.name, e.num_examples) for e in ev.env] == [("reverse-text", "rt", 8)]
    config, _ = read(CORPUS / "earlier" / "orch_eval.toml", "orchestrator")
    (env,) = config.eval.env
    assert (config.eval.interval, env.name, env.num_examples, env.rollouts_per_example, env.args) == (
        5,
        "rt-held-out",
        12,
        2,
        {"seed": 99},
    )
    config, notes = read(CORPUS / "earlier" / "orch_val.toml", "orchestrator")
    (env,) = config.eval.env
    assert (env.id, env.name, env.num_examples, config.eval.env_interval(env)) == (
        "reverse-text",
        "reverse-text-val",
        16,
        5,
    )
    assert any("upstream sampled its eval split" in n for n in notes)


def test_resume_of_the_current_layout():
    config, _ = read(CORPUS / "current" / "rl_resume.toml", "rl")
    assert config.trainer.ckpt.resume_step == -1 and config.orchestrator.ckpt.resume_step == -1
    assert config.trainer.ckpt.interval == 10  # a `[ckpt]` with keys keeps them
    config, _ = read(CORPUS / "current" / "sft_resume_step.toml", "sft")
    assert config.ckpt.resume_step == 20


def test_an_empty_ckpt_with_resume_still_saves_at_the_end_only(tmp_path):
    path = tmp_path / "rl.toml"
    path.write_text("max_steps = 9\n[orchestrator]\nbatch_size = 16\ngroup_size = 4\n[ckpt]\n[resume]\n")
    config, notes = read(path, "rl")
    assert (config.trainer.ckpt.interval, config.trainer.ckpt.resume_step) == (0, -1)
    assert any("saved after the last step only" in n for n in notes)


def test_slurm_and_a_multi_node_deployment():
    config, _ = read(CORPUS / "current" / "rl_slurm.toml", "rl")
    assert (config.slurm.job_name, config.slurm.partition, config.slurm.account, config.slurm.time) == (
        "my-run",
        "gpu",
        "team-a",
        "24:00:00",
    )
    assert config.slurm.nodes == 1
    config, _ = read(CORPUS / "current" / "rl_slurm_multi_node.toml", "rl")
    assert (config.slurm.nodes, config.slurm.inference_nodes, config.slurm.gpus_per_node) == (3, 1, 4)


def test_the_env_table_is_verifiers_env_config_in_env_args():
    """2026's `env` holds verifiers' env config: the taskset becomes `id`/`args`, every seat and option goes to
    `env_args` (verifiers reads it the same way), minus a `null` harness and a local runtime (our defaults)."""
    config, _ = read(CORPUS / "current" / "eval_seats.toml", "eval")
    wordle, judged = config.env
    assert (wordle.id, wordle.env_args, wordle.num_examples, wordle.rollouts_per_example) == (
        "wordle",
        {"player": {"max_turns": 6}},
        20,
        3,
    )
    assert (judged.id, judged.env_args) == ("arithmetic", {"id": "judge-env", "judge": {"model": "some-judge"}})
    config, _ = read(CORPUS / "current" / "rl_harness_options.toml", "rl")
    (env,) = config.orchestrator.env
    assert env.env_args == {"agent": {"harness": {"id": "bash", "max_turns": 4}}} and env.harness is None


def test_seq_len_set_for_the_orchestrator_alone_sizes_the_trainer_too(tmp_path):
    """The earlier split sets often set `seq_len` in orch.toml only; the trainer's rows must hold those samples."""
    orch = tmp_path / "orch.toml"
    orch.write_text("batch_size = 16\nrollouts_per_example = 4\nseq_len = 4096\n")
    cls = config_class("rl")
    config = build_config(cls, config_keys(cls), ParsedArgv(toml_files=[(orch, ("orchestrator",))]), {}, "rl", [])
    assert config.trainer.seq_len == config.orchestrator.seq_len == 4096
    path = tmp_path / "rl.toml"
    path.write_text("seq_len = 1024\n[trainer]\nseq_len = 2048\n[orchestrator]\ngroup_size = 4\nbatch_size = 16\n")
    config, notes = read(path, "rl")  # upstream: a section's own value wins over the shared one
    assert (config.trainer.seq_len, config.orchestrator.seq_len) == (2048, 1024)


def test_concurrency_datasets_and_process_options():
    config, _ = read(CORPUS / "current" / "eval_concurrency.toml", "eval")
    assert config.max_concurrent == 2 and config.env[0].rollouts_per_example == 2  # 4 rollouts = 2 groups of 2
    config, _ = read(CORPUS / "current" / "sft_data_source.toml", "sft")
    assert (config.data.name, config.batch_size, config.seq_len) == ("my-org/reverse-sft", 32, 2048)
    config, _ = read(CORPUS / "earlier" / "sft_fake_fixed.toml", "sft")
    assert config.data.type == "fake" and config.micro_batch_tokens == 8 * 128
    config, notes = read(CORPUS / "current" / "rl_long_broadcast_timeout.toml", "rl")
    assert config.trainer.weight_broadcast.timeout == 300 and any("at most 300 s" in n for n in notes)
    assert config.trainer.optim.cpu_offload and config.trainer.model.cp == 1
    pinned = config.orchestrator.concurrency
    assert (pinned.min_inflight, pinned.max_inflight, pinned.initial_inflight) == (32, 32, 32)


def test_max_off_policy_steps_keeps_each_generations_meaning(tmp_path):
    """2026: the bound on a trained rollout's age (batch n trains none dispatched before policy n-1-m), which is our
    `max_async_level`; the earlier layout's: how many policies one rollout spans, which is ours."""
    path = tmp_path / "rl.toml"
    path.write_text("[orchestrator]\nbatch_size = 16\ngroup_size = 4\nmax_off_policy_steps = 3\n")
    config, notes = read(path, "rl")
    assert (config.orchestrator.max_async_level, config.orchestrator.max_off_policy_steps) == (3, 8)
    assert any(n.startswith("`orchestrator.max_off_policy_steps` -> `max_async_level`") for n in notes)
    path.write_text(path.read_text() + "max_async_level = 2\n")
    with pytest.raises(ConfigError, match="a staleness bound apart from the async level"):
        read(path, "rl")
    orch = tmp_path / "orch.toml"  # the earlier generation's split set
    orch.write_text("batch_size = 16\nrollouts_per_example = 4\nmax_off_policy_steps = 3\nmax_async_level = 2\n")
    cls = config_class("rl")
    config = build_config(cls, config_keys(cls), ParsedArgv(toml_files=[(orch, ("orchestrator",))]), {}, "rl", [])
    assert (config.orchestrator.max_async_level, config.orchestrator.max_off_policy_steps) == (2, 3)


def test_our_own_orchestrator_file_with_concurrency_and_both_bounds_loads_unchanged(tmp_path):
    """What `rl` writes for its orchestrator has `[concurrency]` (ours too) beside both bounds: it is not upstream's
    2026 layout, and its `max_off_policy_steps` is not moved (CI caught this on the upstream reverse-text run)."""
    path = tmp_path / "orchestrator.toml"
    path.write_text(
        "max_async_level = 1\nmax_off_policy_steps = 3\n[concurrency]\nmin_inflight = 8\nmax_inflight = 16\n"
    )
    config, notes = read(path, "orchestrator")
    assert notes == [] and (config.max_async_level, config.max_off_policy_steps) == (1, 3)


def test_a_versioned_hub_taskset_that_is_not_installed_runs_the_bundled_one(tmp_path):
    """Upstream's reverse-text example names the hub's `reverse-text-v1`; here `reverse-text` is bundled. An id that is
    installed, or has no bundled sibling, is left as it is (and fails to load, naming it, if it is missing)."""
    path = tmp_path / "rl.toml"
    envs = '[[orchestrator.train.env]]\nname = "{}"\ntaskset = {{ id = "{}" }}\n'
    text = "[orchestrator]\nbatch_size = 16\ngroup_size = 4\n" + envs.format("rt", "reverse-text-v1")
    path.write_text(text + envs.format("other", "no-such-env-v1"))
    config, notes = read(path, "rl")
    assert [e.id for e in config.orchestrator.env] == ["reverse-text", "no-such-env-v1"]
    assert any("taskset `reverse-text-v1` (not installed) -> `reverse-text`" in n for n in notes)


def test_upstream_training_algorithms_load_as_ours(tmp_path):
    """`[orchestrator.train.algo]` (2026) is our `[orchestrator.algo]`; grpo's length-weighted baseline is our `opo`
    estimator; the defaults of what we do not have are left out with a note, anything else is refused."""
    config, notes = read(CORPUS / "current" / "rl_algo_rae.toml", "rl")
    assert (config.orchestrator.algo.type, config.orchestrator.algo.decay) == ("rae", 0.9)
    assert "`orchestrator.train.algo` -> `orchestrator.algo`" in notes
    path = tmp_path / "rl.toml"
    path.write_text(
        '[orchestrator]\ngroup_size = 4\nbatch_size = 16\n[orchestrator.algo]\ntype = "grpo"\n'
        'length_weighted_baseline = true\nloss_aggregation = "token"\nsampling = { source = "policy" }\n'
    )
    config, notes = read(path, "rl")
    assert config.orchestrator.algo.type == "grpo" and config.orchestrator.advantage.estimator == "opo"
    assert any("loss_aggregation` = 'token' left out" in n for n in notes)
    path.write_text('[orchestrator.algo]\ntype = "grpo"\nloss_aggregation = "prompt"\n')
    with pytest.raises(ConfigError, match="prompt-mean loss aggregation"):
        read(path, "rl")
    path.write_text('[orchestrator.algo]\ntype = "max_rl"\nsampling = { source = { name = "t", base_url = "u" } }\n')
    with pytest.raises(ConfigError, match="sampling from another model than the policy"):
        read(path, "rl")


def test_upstream_distillation_and_echo_load_as_ours(tmp_path):
    """sft's `sampling.source` is our sft `teacher` (its one-URL list a URL); opsd's and echo's fields are ours as
    spelled, opsd's auto renderer is left out (the policy's chat template renders the demonstration); what we lack
    is refused."""
    config, notes = read(CORPUS / "current" / "rl_algo_sft.toml", "rl")
    teacher = config.orchestrator.algo.teacher
    assert (config.orchestrator.algo.type, teacher.name, teacher.base_url) == (
        "sft",
        "Qwen/Qwen3-8B",
        "http://teacher:8000/v1",
    )
    assert any("`orchestrator.algo.sampling.source` -> `orchestrator.algo.teacher`" in n for n in notes)
    path = tmp_path / "rl.toml"
    path.write_text('[orchestrator.algo]\ntype = "opsd"\ndemo_key = "answer"\ntemplate = "Expert: {demonstration}"\n'
                    'renderer = "auto"\n[orchestrator.sampling]\ntemperature = 1.0\n')  # fmt: skip
    config, notes = read(path, "rl")
    algo = config.orchestrator.algo
    assert (algo.type, algo.demo_key, algo.template) == ("opsd", "answer", "Expert: {demonstration}")
    assert any("renderer` = 'auto' left out" in n for n in notes)
    path.write_text('[orchestrator.algo]\ntype = "echo"\nroles = { tool = { alpha = 0.2 }, user = { alpha = 0.05 } }\n')
    algo = read(path, "rl")[0].orchestrator.algo
    assert algo.type == "echo" and {role: r.alpha for role, r in algo.roles.items()} == {"tool": 0.2, "user": 0.05}
    path.write_text('[orchestrator.algo]\ntype = "echo"\nfilter = { import_path = "m.f" }\n')
    with pytest.raises(ConfigError, match="a user filter on echo's tokens"):
        read(path, "rl")
    path.write_text('[orchestrator.algo]\ntype = "echo"\nlength_weighted_baseline = true\n')
    assert read(path, "rl")[0].orchestrator.advantage.estimator == "opo"  # echo's rl part is grpo's
    path.write_text('[orchestrator.algo]\ntype = "debug"\n')
    with pytest.raises(ConfigError, match="the `debug` algorithm is not supported"):
        read(path, "rl")
