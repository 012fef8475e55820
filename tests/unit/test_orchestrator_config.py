"""OrchestratorConfig: contradictions are refused with a message that names the problem."""

import pytest
from pydantic import ValidationError

from prime_rl.orchestrator.config import OrchestratorConfig


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        ({"batch_size": 10, "rollouts_per_example": 4}, "multiple of rollouts_per_example"),
        ({"env": [{"id": "a"}, {"id": "a"}]}, "env names must be unique"),
        ({"env": [{"id": "a", "ratio": 3}, {"id": "b"}]}, "on every environment or on none"),
        ({"env": []}, "at least one environment"),
        ({"advantage": {"estimator": "rloo"}, "rollouts_per_example": 1, "batch_size": 4}, "rloo needs"),
        ({"advantage": {"estimator": "gpg"}, "rollouts_per_example": 1, "batch_size": 4}, "gpg needs"),
        (
            {"advantage": {"estimator": "reinforce_pp_baseline"}, "rollouts_per_example": 1, "batch_size": 4},
            "reinforce_pp_baseline needs rollouts_per_example >= 2",
        ),
        ({"advantage": {"estimator": "reinforce_pp"}, "filter_zero_advantage": True}, "no group is known to lack"),
        ({"advantage": {"estimator": "reinforce_mean"}, "filter_zero_advantage": True}, "estimator reinforce_mean"),
        ({"sampling": {"temperature": 0.7, "temperature_scaling": {"max_temperature": 0.5}}}, "max_temperature"),
        ({"client": {"base_url": ["http://host:8000"]}}, "must end in /v1"),
        ({"oversampling": 0.5}, "oversampling"),
        ({"adapter": {"name": "a"}, "weight_broadcast": {"type": "gloo", "port": 29501}}, "through the filesystem"),
        ({"adapter": {"name": "../a"}}, "adapter.name"),
    ],
)
def test_bad_values_are_refused(values, needle):
    with pytest.raises(ValidationError, match=needle):
        OrchestratorConfig(**values)


def test_defaults_and_derived_values():
    config = OrchestratorConfig(env=[{"id": "reverse-text", "name": "rt"}, {"id": "arithmetic"}])
    assert config.groups_per_batch == 8  # 64 / 8
    assert [e.display_name for e in config.env] == ["rt", "arithmetic"]
    assert config.client.base_url == ["http://localhost:8000/v1"]


def test_renderer_is_validated_when_used():
    config = OrchestratorConfig(model={"renderer": {"name": "no-such-renderer"}})
    with pytest.raises(ValueError, match="not a valid renderers config"):
        config.model.renderer_config()
    assert OrchestratorConfig(model={"renderer": {"name": "qwen3"}}).model.renderer_config().name == "qwen3"


def test_base_url_takes_one_url_or_several(tmp_path, capsys):
    from prime_rl.config.loader import load_config

    def urls(*argv):
        return load_config(OrchestratorConfig, "orchestrator", list(argv))[0].client.base_url

    assert urls("--client.base-url", "http://a:8000/v1/") == ["http://a:8000/v1"]
    assert urls("--client.base-url", "http://a:8000/v1,http://b:8000/v1") == ["http://a:8000/v1", "http://b:8000/v1"]
    assert urls("--client.base-url", '["http://a:8000/v1", "http://b:8000/v1"]') == [
        "http://a:8000/v1",
        "http://b:8000/v1",
    ]
    toml = tmp_path / "o.toml"
    toml.write_text('[client]\nbase_url = "http://c:8000/v1"\n')
    assert urls("@", str(toml)) == ["http://c:8000/v1"]


def test_one_model_definition_serves_every_process():
    """The orchestrator's `name` is the model (its tokenizer), like everyone else's; what requests ask for is
    `served_name`, which rl takes from the inference section."""
    from prime_rl.rl import RLConfig

    config = RLConfig(
        model={"name": "/models/qwen", "trust_remote_code": True}, inference={"model": {"served_name": "policy"}}
    )
    orch, inf, trainer = config.orchestrator.model, config.inference.model, config.trainer.model
    assert orch.name == inf.name == trainer.name == "/models/qwen"
    assert orch.api_name == inf.api_name == "policy" and inf.served_name == "policy"
    assert orch.trust_remote_code and inf.trust_remote_code and trainer.trust_remote_code
    assert RLConfig(model={"name": "m"}).orchestrator.model.api_name == "m"  # no alias: the name itself
