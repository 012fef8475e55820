"""Which config class each entry point reads, by name: for tools that load any entry point's config file (the upstream
config tests and benchmark). Named by module path, so importing this imports no entry point."""

from importlib import import_module

from pydantic import BaseModel

CONFIG_CLASSES = {
    "rl": "prime_rl.rl.config:RLConfig",
    "trainer": "prime_rl.trainer.config:TrainerConfig",
    "orchestrator": "prime_rl.orchestrator.config:OrchestratorConfig",
    "inference": "prime_rl.inference.config:InferenceConfig",
    "sft": "prime_rl.trainer.sft.config:SFTConfig",
    "eval": "prime_rl.eval.config:EvalConfig",
    "synthesize": "prime_rl.eval.config:SynthesizeConfig",
}


def config_class(entrypoint: str) -> type[BaseModel]:
    module, name = CONFIG_CLASSES[entrypoint].split(":")
    return getattr(import_module(module), name)
