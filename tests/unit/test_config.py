"""The layered config system: precedence, merging, includes, sections, errors, dry-run."""

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from conftest import run_at_once

from prime_rl.config import BaseConfig, EntrypointConfig
from prime_rl.config.loader import load_config, write_resolved_config
from prime_rl.inference.config import InferenceConfig

INFERENCE = str(Path(sys.executable).parent / "inference")


class CkptConfig(BaseConfig):
    interval: int = 10
    """Steps between checkpoints."""
    keep_last: int | None = None
    """Checkpoints kept."""


class OptimConfig(BaseConfig):
    lr: float = 1e-6
    """Learning rate."""
    betas: list[float] = [0.9, 0.999]
    """Adam betas."""


class TrainerConfig(BaseConfig):
    optim: OptimConfig = OptimConfig()
    """Optimizer."""
    micro_batch_size: int = 1
    """Samples per micro batch."""


class ToyConfig(EntrypointConfig):
    trainer: TrainerConfig = TrainerConfig()
    """Trainer section."""
    ckpt: CkptConfig | None = None
    """Optional checkpointing."""
    gpu_ids: list[int] = [0]
    """Devices."""
    enable_thing: bool = False
    """A switch."""
    env_args: dict[str, int] = {}
    """Free-form arguments."""
    max_steps: int | None = None
    """Steps to run."""


def dry_run(cls, argv, capsys):
    with pytest.raises(SystemExit) as exc:
        load_config(cls, "test", argv + ["--dry-run"])
    out = capsys.readouterr()
    assert exc.value.code == 0, out.err
    return tomllib.loads(out.out)


def fails(cls, argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        load_config(cls, "test", argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "pydantic" not in err.lower()
    return err


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_precedence_each_source_wins_over_the_next(tmp_path, monkeypatch, capsys):
    """One value from default, env, two TOML files and CLI; removing each source in turn shows the next."""
    a = write(tmp_path / "a.toml", "[model]\nname = 'from-a'\n")
    b = write(tmp_path / "b.toml", "[model]\nname = 'from-b'\n")
    monkeypatch.setenv("PRIME_MODEL__NAME", "from-env")
    argv = ["@", str(a), "@", str(b), "--model.name", "from-cli"]
    assert dry_run(InferenceConfig, argv, capsys)["model"]["name"] == "from-cli"
    assert dry_run(InferenceConfig, argv[:4], capsys)["model"]["name"] == "from-b"
    assert dry_run(InferenceConfig, argv[:2], capsys)["model"]["name"] == "from-a"
    assert dry_run(InferenceConfig, [], capsys)["model"]["name"] == "from-env"
    monkeypatch.delenv("PRIME_MODEL__NAME")
    assert dry_run(InferenceConfig, [], capsys)["model"]["name"] == "Qwen/Qwen3-0.6B"


def test_deep_merge_keeps_keys_of_both_files(tmp_path, capsys):
    a = write(tmp_path / "a.toml", "[model]\nname = 'm'\nmax_model_len = 512\n[server]\nport = 9000\n")
    b = write(tmp_path / "b.toml", "[model]\nmax_model_len = 1024\nenforce_eager = true\n")
    cfg = dry_run(InferenceConfig, ["@", str(a), "@", str(b)], capsys)
    assert cfg["model"] == {**cfg["model"], "name": "m", "max_model_len": 1024, "enforce_eager": True}
    assert cfg["server"]["port"] == 9000


def test_env_layer_is_deep_merged_under_toml(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PRIME_SERVER__PORT", "8123")
    a = write(tmp_path / "a.toml", "[server]\nhost = '0.0.0.0'\n")
    cfg = dry_run(InferenceConfig, ["@", str(a)], capsys)
    assert cfg["server"] == {"host": "0.0.0.0", "port": 8123, "allow_unauthenticated": False, "attachable": False}


def test_cli_spellings(capsys):
    for flag in ("--model.name", "--model-name", "--model_name", "--model.name="):
        argv = [flag + "x"] if flag.endswith("=") else [flag, "x"]
        assert dry_run(InferenceConfig, argv, capsys)["model"]["name"] == "x", flag
    cfg = dry_run(ToyConfig, ["--trainer.micro-batch-size", "4", "--max_steps", "3"], capsys)
    assert cfg["trainer"]["micro_batch_size"] == 4 and cfg["max_steps"] == 3
    cfg = dry_run(ToyConfig, ["--trainer-optim-lr", "0.5"], capsys)
    assert cfg["trainer"]["optim"]["lr"] == 0.5


def test_booleans_lists_and_dicts(capsys):
    cfg = dry_run(ToyConfig, ["--enable-thing", "--gpu-ids", "0,1", "--env-args", '{"a": 1}'], capsys)
    assert cfg["enable_thing"] is True and cfg["gpu_ids"] == [0, 1] and cfg["env_args"] == {"a": 1}
    cfg = dry_run(ToyConfig, ["--enable-thing", "--no-enable-thing", "--gpu-ids", "[2, 3]"], capsys)
    assert cfg["enable_thing"] is False and cfg["gpu_ids"] == [2, 3]
    cfg = dry_run(ToyConfig, ["--trainer.optim.betas", "0.8,0.9"], capsys)
    assert cfg["trainer"]["optim"]["betas"] == [0.8, 0.9]
    cfg = dry_run(ToyConfig, ["--env-args.k", "5"], capsys)
    assert cfg["env_args"] == {"k": 5}


def test_optional_section_enabled_by_bare_flag_or_empty_table(tmp_path, capsys):
    assert "ckpt" not in dry_run(ToyConfig, [], capsys)
    assert dry_run(ToyConfig, ["--ckpt"], capsys)["ckpt"] == {"interval": 10}
    empty = write(tmp_path / "e.toml", "[ckpt]\n")
    assert dry_run(ToyConfig, ["@", str(empty)], capsys)["ckpt"] == {"interval": 10}
    # A bare flag keeps values set by a file; a sub-key enables the section too; --no-ckpt disables it.
    set5 = write(tmp_path / "s.toml", "[ckpt]\ninterval = 5\n")
    assert dry_run(ToyConfig, ["@", str(set5), "--ckpt"], capsys)["ckpt"] == {"interval": 5}
    assert dry_run(ToyConfig, ["--ckpt.keep-last", "2"], capsys)["ckpt"] == {"interval": 10, "keep_last": 2}
    assert "ckpt" not in dry_run(ToyConfig, ["@", str(set5), "--no-ckpt"], capsys)


def test_section_scoped_file(tmp_path, capsys):
    t = write(tmp_path / "t.toml", "micro_batch_size = 8\n[optim]\nlr = 0.25\n")
    cfg = dry_run(ToyConfig, ["--trainer", "@", str(t), "--trainer.optim.lr", "0.5"], capsys)
    assert cfg["trainer"]["micro_batch_size"] == 8 and cfg["trainer"]["optim"]["lr"] == 0.5


def test_includes_are_relative_and_overridden_by_the_includer(tmp_path, capsys):
    (tmp_path / "sub").mkdir()
    write(tmp_path / "sub" / "base.toml", "max_steps = 1\n[trainer]\nmicro_batch_size = 2\n")
    top = write(tmp_path / "top.toml", "toml_files = ['sub/base.toml']\nmax_steps = 7\n")
    cfg = dry_run(ToyConfig, ["@", str(top)], capsys)
    assert cfg["max_steps"] == 7 and cfg["trainer"]["micro_batch_size"] == 2
    assert "toml_files" not in cfg


def test_include_cycle_is_an_error(tmp_path, capsys):
    write(tmp_path / "a.toml", "toml_files = ['b.toml']\n")
    write(tmp_path / "b.toml", "toml_files = ['a.toml']\n")
    err = fails(ToyConfig, ["@", str(tmp_path / "a.toml")], capsys)
    assert "cycle" in err and "a.toml" in err and "b.toml" in err


def test_typo_on_cli_names_key_and_suggests(capsys):
    err = fails(InferenceConfig, ["--model.nmae", "x"], capsys)
    assert "--model.nmae" in err and "model.name" in err


def test_typo_in_toml_names_key_file_and_suggestion(tmp_path, capsys):
    f = write(tmp_path / "c.toml", "[trainer.optim]\nrl = 0.1\n")
    err = fails(ToyConfig, ["@", str(f)], capsys)
    assert "`trainer.optim.rl`" in err and str(f) in err and "trainer.optim.lr" in err


def test_bad_value_names_key_and_source(tmp_path, monkeypatch, capsys):
    err = fails(InferenceConfig, ["--server.port", "eighty"], capsys)
    assert "`server.port`" in err and "--server.port" in err and "eighty" in err
    monkeypatch.setenv("PRIME_SERVER__PORT", "99999")
    err = fails(InferenceConfig, [], capsys)
    assert "`server.port`" in err and "PRIME_SERVER__PORT" in err


def test_a_list_in_the_environment_not_written_as_json_names_the_variable(monkeypatch, capsys):
    from prime_rl.orchestrator.config import OrchestratorConfig

    monkeypatch.setenv("PRIME_CLIENT__BASE_URL", "http://a:8000/v1")  # the library parses lists as JSON only
    err = fails(OrchestratorConfig, [], capsys)
    assert "PRIME_CLIENT__BASE_URL" in err and "JSON" in err


def test_missing_file_names_the_path(tmp_path, capsys):
    missing = tmp_path / "nope.toml"
    err = fails(ToyConfig, ["@", str(missing)], capsys)
    assert str(missing) in err and "not found" in err


def test_unknown_flag_is_an_error_without_passthrough(capsys):
    err = fails(ToyConfig, ["--max-num-seqs", "8"], capsys)
    assert "--max-num-seqs" in err


def test_resolved_config_is_written_and_round_trips(tmp_path, capsys):
    cfg, _ = load_config(InferenceConfig, "inference", ["--output-dir", str(tmp_path), "--model.name", "m"])
    path = write_resolved_config(cfg, "inference")
    assert path == tmp_path / "configs" / "inference.toml"
    again, _ = load_config(InferenceConfig, "inference", ["@", str(path)])
    assert again == cfg


def test_servers_sharing_an_output_dir_write_one_resolved_config_each(tmp_path, capsys):
    """rl names each inference host's log file; the resolved config takes the same name instead of all servers
    overwriting `configs/inference.toml`."""
    paths = set()
    for port in (8000, 8001):
        argv = ["--output-dir", str(tmp_path), "--server.port", str(port), "--log.file", f"inference.h-{port}.log"]
        cfg, _ = load_config(InferenceConfig, "inference", argv)
        paths.add(write_resolved_config(cfg, "inference"))
    assert paths == {tmp_path / "configs" / "inference.h-8000.toml", tmp_path / "configs" / "inference.h-8001.toml"}
    assert "port = 8001" in (tmp_path / "configs" / "inference.h-8001.toml").read_text()


def test_api_key_is_masked_in_dumps(capsys):
    cfg = dry_run(InferenceConfig, ["--server.api-key", "s3cret"], capsys)
    assert "s3cret" not in str(cfg)


def test_inference_entry_point_exits_2_before_loading_vllm():
    """The real console script: a typo fails fast (no engine, no vLLM import) with one readable line."""
    proc = subprocess.run([INFERENCE, "--model.nmae", "x"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "inference: error: unknown option --model.nmae (did you mean `model.name`?)"
    ]


def test_inference_flags_vllm_knows_pass_and_others_fail():
    """`--max-num-batched-tokens` reaches vLLM's parser and is accepted; a flag neither knows fails before the
    engine."""
    flag = ["--max-num-batched-tokens", "512"]
    # Both at once: each spends ~20 s importing vLLM on one core.
    ok, bad = run_at_once([[INFERENCE, *flag, "--dry-run"], [INFERENCE, "--max-num-batched-tokns", "8"]], timeout=180)
    assert ok.returncode == 0, ok.stderr
    assert "# passed through: --max-num-batched-tokens 512" in ok.stdout
    assert bad.returncode == 2
    assert "unknown option(s) --max-num-batched-tokns" in bad.stderr and "Traceback" not in bad.stderr


def test_unrelated_prime_env_vars_are_ignored(monkeypatch, capsys):
    """Only variables naming one of our keys are read: PRIME_API_KEY (used by other tools) is not a key of ours."""
    monkeypatch.setenv("PRIME_API_KEY", "secret-of-another-tool")
    monkeypatch.setenv("MODEL__NAME", "no-prefix")
    assert dry_run(InferenceConfig, [], capsys)["model"]["name"] == "Qwen/Qwen3-0.6B"


def _shipped_configs():
    """Every TOML under configs/, with the config class its directory (or, in a recipe, its file name) implies."""
    from prime_rl.eval.config import EvalConfig
    from prime_rl.models.tiny import TinyModelConfig
    from prime_rl.orchestrator.config import OrchestratorConfig
    from prime_rl.rl import RLConfig
    from prime_rl.trainer.config import TrainerConfig
    from prime_rl.trainer.sft.config import SFTConfig

    root = Path(__file__).parents[2] / "configs"
    classes = {
        "inference": InferenceConfig,
        "trainer": TrainerConfig,
        "orchestrator": OrchestratorConfig,
        "sft": SFTConfig,
        "rl": RLConfig,
        "eval": EvalConfig,
        "model": TinyModelConfig,
    }
    found = []
    for path in sorted(root.rglob("*.toml")):
        kind = path.parent.name if path.parent.parent == root and path.parent.name in classes else path.stem
        found.append((path, classes[kind]))
    return found


def test_every_shipped_config_is_checked():
    names = {str(p.relative_to(Path(__file__).parents[2])) for p, _ in _shipped_configs()}
    assert {"configs/reverse_text/rl.toml", "configs/reverse_text/qwen3-0.6b/eval.toml"} <= names


@pytest.mark.parametrize(("path", "cls"), _shipped_configs(), ids=lambda x: getattr(x, "name", ""))
def test_shipped_configs_parse(path, cls, capsys):
    cfg = dry_run(cls, ["@", str(path)], capsys)
    assert cfg.get("model", {}).get("name") or cfg.get("output")


def test_partial_table_of_a_tagged_union_keeps_the_default_type(capsys):
    from prime_rl.trainer.config import TrainerConfig

    cfg = dry_run(TrainerConfig, ["--optim.lr", "0.5", "--scheduler.warmup-steps", "3"], capsys)
    assert cfg["optim"]["type"] == "adamw" and cfg["optim"]["lr"] == 0.5
    assert cfg["scheduler"] == {"type": "constant", "warmup_steps": 3}
    cfg = dry_run(TrainerConfig, ["--optim.type", "sgd", "--optim.momentum", "0.5"], capsys)
    assert cfg["optim"]["type"] == "sgd" and cfg["optim"]["momentum"] == 0.5
    err = fails(TrainerConfig, ["--optim.type", "sgd", "--optim.betas", "0.1,0.2"], capsys)
    assert "optim.betas" in err


def test_help_lists_every_key_with_its_doc_and_default(capsys):
    with pytest.raises(SystemExit) as exc:
        load_config(ToyConfig, "toy", ["--help"])
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps long lines
    assert out.startswith("usage: toy [@ config.toml ...]")
    for flag, doc, default in [
        ("--trainer.optim.lr", "Learning rate.", "1e-06"),
        ("--trainer.micro-batch-size", "Samples per micro batch.", "1"),
        ("--ckpt.interval", "Steps between checkpoints.", "10"),
        ("--enable-thing, --no-enable-thing", "A switch.", "False"),
    ]:
        assert f"{flag} " in out and f"{doc} (default: {default})" in out, flag
    assert "--ckpt [JSON]" in out and "Optional checkpointing." in out


def test_explicit_boolean_values_and_null(tmp_path, capsys):
    """`--flag false`, `--flag=yes`, `--flag=0` (scripts pass values); `none`/`null` unsets an optional key."""
    assert dry_run(ToyConfig, ["--enable-thing", "true", "--max-steps", "3"], capsys)["enable_thing"] is True
    assert dry_run(ToyConfig, ["--enable-thing=yes", "--enable_thing", "false"], capsys)["enable_thing"] is False
    assert dry_run(ToyConfig, ["--enable-thing=1"], capsys)["enable_thing"] is True
    assert "expects true or false" in fails(ToyConfig, ["--enable-thing=maybe"], capsys)
    set3 = write(tmp_path / "m.toml", "max_steps = 3\n[ckpt]\nkeep_last = 2\n")
    cfg = dry_run(ToyConfig, ["@", str(set3), "--max-steps", "None", "--ckpt.keep-last=null"], capsys)
    assert "max_steps" not in cfg and cfg["ckpt"] == {"interval": 10}


def test_a_repeated_flag_replaces_the_earlier_one(capsys):
    cfg = dry_run(ToyConfig, ["--gpu-ids", "0,1", "--gpu-ids", "2", "--max-steps", "1", "--max-steps", "2"], capsys)
    assert cfg["gpu_ids"] == [2] and cfg["max_steps"] == 2
    # Keys of a dict field add up, like TOML tables.
    assert dry_run(ToyConfig, ["--env-args.a", "1", "--env-args.b", "2"], capsys)["env_args"] == {"a": 1, "b": 2}
    assert dry_run(ToyConfig, ["--gpu-ids", ""], capsys)["gpu_ids"] == []


def test_values_may_start_with_a_dash(capsys):
    cfg = dry_run(ToyConfig, ["--trainer.optim.lr", "-1e-3", "--output-dir", "-odd"], capsys)
    assert cfg["trainer"]["optim"]["lr"] == -1e-3 and cfg["output_dir"] == "-odd"


class MicroConfig(BaseConfig):
    batch_size: int = 0
    """A key whose undotted spelling equals `model.micro_batch_size`'s."""


class ClashConfig(EntrypointConfig):
    model: TrainerConfig = TrainerConfig()
    """A section."""
    model_micro: MicroConfig = MicroConfig()
    """Another section."""


def test_ambiguous_undotted_spelling_lists_the_options(capsys):
    err = fails(ClashConfig, ["--model-micro-batch-size", "2"], capsys)
    assert "ambiguous" in err and "--model.micro_batch_size" in err and "--model_micro.batch_size" in err
    assert dry_run(ClashConfig, ["--model-micro.batch-size", "2"], capsys)["model_micro"]["batch_size"] == 2


def test_passthrough_collects_foreign_flags_with_their_values(capsys):
    seen = []
    argv = ["--max-logprobs", "8", "--model.name", "m", "--enforce-eager", "--swap-space=4", "-tp", "2"]
    cfg, extra = load_config(InferenceConfig, "inference", argv, check_passthrough=lambda c, e: seen.append(e))
    assert cfg.model.name == "m" and extra == seen[0] == [
        "--max-logprobs",
        "8",
        "--enforce-eager",
        "--swap-space=4",
        "-tp",
        "2",
    ]
    # A typo inside one of our sections is still ours: an error, not a flag for vLLM.
    with pytest.raises(SystemExit) as exc:
        load_config(InferenceConfig, "inference", ["--model.nmae", "x"], check_passthrough=lambda c, e: None)
    assert exc.value.code == 2 and "did you mean `model.name`" in capsys.readouterr().err
    assert "unexpected argument 'stray'" in fails(ToyConfig, ["--max-steps", "1", "stray"], capsys)


def test_union_member_key_of_another_type_names_the_flag(capsys):
    from prime_rl.trainer.config import TrainerConfig as RealTrainerConfig

    err = fails(RealTrainerConfig, ["--optim.type", "sgd", "--optim.betas", "0.1,0.2"], capsys)
    assert "unknown key `optim.betas` (from --optim.betas)" in err


def test_an_unknown_key_inside_a_typed_section_keeps_its_name(tmp_path, capsys):
    """`optim` and sft's `data` are unions tagged by `type`: the key's own name is reported, not its section's."""
    from prime_rl.rl.config import RLConfig
    from prime_rl.trainer.sft.config import SFTConfig

    err = fails(RLConfig, ["@", str(write(tmp_path / "rl.toml", "[trainer.optim]\nlrr = 1\n"))], capsys)
    assert "unknown key `trainer.optim.lrr`" in err and "did you mean `trainer.optim.lr`" in err
    err = fails(SFTConfig, ["@", str(write(tmp_path / "sft.toml", "[data]\nbach_size = 4\n"))], capsys)
    assert err.count("unknown key `data.bach_size`") == 1 and "another `type`" not in err


def test_did_you_mean_asks_by_meaning_before_spelling(capsys):
    """Upstream prime-rl's names of our settings, on the command line (files are translated): `group_size` once
    suggested `output_dir`, `lora_name` `wandb.name` and `impl` `cp`."""
    from prime_rl.rl.config import RLConfig

    err = fails(RLConfig, ["--orchestrator.group-size", "4"], capsys)
    assert "did you mean `orchestrator.rollouts_per_example`? upstream prime-rl's `group_size`" in err
    err = fails(RLConfig, ["--orchestrator.lora-name", "r8"], capsys)
    assert "did you mean `orchestrator.adapter.name`?" in err
    err = fails(RLConfig, ["--trainer.model.impl", "hf"], capsys)
    assert "trainer.model.cp" not in err and "the Hugging Face one always runs here" in err
    err = fails(RLConfig, ["--deployment.num-train-gpus", "2"], capsys)
    assert "did you mean `trainer_gpu_ids`?" in err
    err = fails(RLConfig, ["--orchestrator.val.interval", "5"], capsys)
    assert "did you mean `orchestrator.eval.interval`? upstream prime-rl's `val`" in err


def test_an_empty_table_where_a_boolean_is_taken_means_on(tmp_path, capsys):
    from prime_rl.trainer.config import TrainerConfig as RealTrainerConfig

    config, _ = load_config(
        RealTrainerConfig, "trainer", ["@", str(write(tmp_path / "t.toml", "[model.ac]\n[model.compile]\n"))]
    )
    assert config.model.ac is True and config.model.compile is True
