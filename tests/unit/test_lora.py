"""LoRA adapters of the trainer (`trainer/lora.py`) on the tiny model, one process: the export is a peft adapter that
peft loads to the trainer's logits, and each token goes through its own run's adapter; what `model.lora` refuses;
`sft --bench` of an adapter."""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from loguru import logger
from peft import PeftModel
from pydantic import ValidationError
from transformers import AutoModelForCausalLM

from prime_rl.models.tiny import TinyModelConfig, build_tiny_model
from prime_rl.trainer.config import LoRAConfig, TrainerConfig
from prime_rl.trainer.model.lora import LoRAAdapters
from prime_rl.trainer.parallel.distributed import init_distributed
from prime_rl.trainer.sft.config import SFTConfig
from prime_rl.trainer.sft.train import fine_tune
from prime_rl.utils.monitor import Monitor
from prime_rl.utils.net import free_port


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(TinyModelConfig(output=tmp_path_factory.mktemp("model") / "tiny", dtype="float32"))


def base_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def trained_like(adapters: LoRAAdapters, slot: int, seed: int) -> None:
    """A fresh adapter, then B made nonzero (as training would), so the adapter changes the logits."""
    adapters.reset_slot(slot, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for key in adapters.B:
            b = adapters.B[key][slot]
            b.copy_(torch.randn(b.shape, generator=generator) * 0.5)


def test_export_loads_in_peft_with_the_trainer_logits_and_tokens_use_their_own_adapter(model_dir, tmp_path):
    config = LoRAConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    model = base_model(model_dir)
    adapters = LoRAAdapters(model, config, slots=2, device=torch.device("cpu"))
    assert len(adapters.targets) == 3 * model.config.num_hidden_layers
    trained_like(adapters, 0, seed=1)
    trained_like(adapters, 1, seed=2)
    ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = base_model(model_dir)(ids).logits
        per_slot = {}
        for slot in (0, 1):
            with adapters.tokens(torch.full_like(ids, slot), carrier=slot):
                per_slot[slot] = model(ids).logits
        with adapters.tokens(torch.tensor([[0] * 12, [1] * 12]), carrier=0):
            mixed = model(ids).logits

    for slot in (0, 1):
        target = adapters.save(slot, tmp_path / f"adapter_{slot}", str(model_dir), torch.float32)
        peft_model = PeftModel.from_pretrained(base_model(model_dir), target).eval()
        with torch.no_grad():
            reference = peft_model(ids).logits
        # The same fp32 products in peft's order (lora_B(lora_A(x)) * scaling) and ours: rounding only.
        torch.testing.assert_close(per_slot[slot], reference, rtol=1e-5, atol=1e-5)
        assert (per_slot[slot] - base).abs().max() > 1e-2  # the adapter matters
    # A micro-batch of two runs: each row exactly as if it ran alone (the rows do not attend to each other).
    torch.testing.assert_close(mixed[0], per_slot[0][0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(mixed[1], per_slot[1][1], rtol=1e-6, atol=1e-6)


def test_a_fresh_adapter_is_the_base_model_and_its_draw_depends_on_the_seed_only(model_dir):
    model = base_model(model_dir)
    adapters = LoRAAdapters(model, LoRAConfig(rank=2), slots=3, device=torch.device("cpu"))
    adapters.reset_slot(0, seed=7)
    adapters.reset_slot(2, seed=7)
    adapters.reset_slot(1, seed=8)
    a0, a1, a2 = (adapters.state(slot) for slot in range(3))
    assert all(torch.equal(a0[k], a2[k]) for k in a0)  # the slot does not matter
    assert not all(torch.equal(a0[k], a1[k]) for k in a0 if "lora_A" in k)
    ids = torch.randint(0, 200, (1, 9))
    with torch.no_grad(), adapters.tokens(torch.full_like(ids, 1), carrier=1):
        logits = model(ids).logits
    assert torch.equal(logits, base_model(model_dir)(ids).logits)  # B = 0 adds exactly 0


def test_unknown_target_modules_are_named(model_dir):
    with pytest.raises(ValueError, match="qkv_proj"):
        LoRAAdapters(base_model(model_dir), LoRAConfig(target_modules=["q_proj", "qkv_proj"]), 1, torch.device("cpu"))


def test_a_run_whose_orchestrator_exits_leaves_once_its_batches_are_trained(model_dir, tmp_path):
    """The trainer tells a live orchestrator from a gone one by its output-dir lock: a run whose orchestrator exited
    leaves as soon as no batch of it is left (not after `batch_timeout`), a directory whose orchestrator is gone is
    never waited for, and the trainer is done when every run has ended."""
    from prime_rl.trainer.rl.runs import Runs
    from prime_rl.utils.fs import write_atomic
    from prime_rl.utils.locks import OutputDirLock

    def run_dir(name: str) -> Path:
        path = tmp_path / f"run_{name}"
        write_atomic(path / "configs" / "orchestrator.toml", f'max_steps = 5\n[adapter]\nname = "{name}"\n'.encode())
        return path

    config = TrainerConfig(output_dir=tmp_path, model={"name": str(model_dir), "lora": {}}, max_concurrent_runs=2)
    runs = Runs(config, LoRAAdapters(base_model(model_dir), config.model.lora, 2, torch.device("cpu")), True, None)
    live = OutputDirLock(run_dir("a"), "orchestrator")
    OutputDirLock(run_dir("old"), "orchestrator").release()  # an earlier launch's run: its orchestrator is gone

    changes = runs.changes(timeout=3600)
    assert [j.name for j in changes.joining] == ["run_a"] and not changes.done
    runs.apply(changes)
    assert runs.changes(timeout=3600).leaving == {}  # alive, waiting for its first batch

    batch = tmp_path / "run_a" / "rollouts" / "step_1" / "batch.bin"
    write_atomic(batch, b"written before the orchestrator exited")
    live.release()
    changes = runs.changes(timeout=3600)
    assert changes.ready == ["run_a"] and changes.leaving == {}  # its last batch is still trained

    batch.unlink()
    changes = runs.changes(timeout=3600)
    assert changes.leaving == {"run_a": f"failed: its orchestrator exited before writing {batch}"}
    assert changes.done  # run_old is not waited for


@pytest.mark.parametrize("config_type", [SFTConfig, TrainerConfig])
def test_lora_refuses_context_parallelism_and_a_random_base(config_type):
    config_type(model={"lora": {}})
    with pytest.raises(ValidationError, match=r"model.lora does not support context parallelism \(model.cp > 1\)"):
        config_type(model={"lora": {}, "cp": 2})
    with pytest.raises(ValidationError, match="model.lora trains an adapter of the weights in model.name; with "
                                              "model.random_init"):  # fmt: skip
        config_type(model={"lora": {}, "random_init": True})


def test_sft_bench_trains_an_adapter_and_writes_nothing(model_dir, tmp_path, monkeypatch, capsys):
    """In this process, as a plain one-rank `sft --bench --model.lora` runs (the 2-rank LoRA run is an
    integration test)."""
    env = {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config = SFTConfig(model={"name": str(model_dir), "dtype": "float32", "lora": {"rank": 4}}, output_dir=tmp_path,
                       bench={"steps": 3, "samples": 2}, seq_len=32, ckpt={"interval": 1})  # fmt: skip
    messages = []
    sink = logger.add(messages.append, format="{message}")
    world = init_distributed()
    try:
        fine_tune(config, world, Monitor(tmp_path, "sft"))
    finally:
        dist.destroy_process_group()
        logger.remove(sink)
    assert any("a LoRA adapter of rank 4 on 14 layers trains" in m for m in messages)
    table = capsys.readouterr().out
    assert "summary over 2 steps after the first" in table and len(table.strip().splitlines()) == 1 + 3 + 1
    assert not (tmp_path / "weights").exists() and not (tmp_path / "checkpoints").exists()
