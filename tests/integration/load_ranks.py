"""One rank of `test_trainer_loading.py` (run under torchrun): build each model as the trainer does, gather it
and, on rank 0, compare every tensor with what `from_pretrained` (or a seeded `from_config`) gives.

    torchrun --nproc-per-node 3 tests/integration/load_ranks.py REPORT.json DIR [DIR ...]

Each rank also records the rows of the embedding it holds, so the test can see the split was uneven.
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoModelForCausalLM

from prime_rl.trainer.config import TrainerModelConfig
from prime_rl.trainer.distributed import init_distributed
from prime_rl.trainer.model import build_model, load_arch

SEED = 7


def main(report_path: str, *dirs: str) -> None:
    world = init_distributed()
    report = {}
    cases = [(d, False) for d in dirs] + [(dirs[0], True)]  # every checkpoint, then random weights
    for directory, random_init in cases:
        config = TrainerModelConfig(name=directory, dtype="float32", random_init=random_init)
        model = build_model(config, load_arch(config), world, SEED)
        rows = [None] * world.world_size
        dist.all_gather_object(rows, model.get_input_embeddings().weight.to_local().shape[0])
        tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if world.is_main:
            kwargs = dict(dtype=torch.float32)
            if random_init:
                torch.manual_seed(SEED)
                reference = AutoModelForCausalLM.from_config(load_arch(config), **kwargs).state_dict()
            else:
                reference = AutoModelForCausalLM.from_pretrained(directory, **kwargs).state_dict()
            report[f"{Path(directory).name}{'-random' if random_init else ''}"] = {
                "names_match": sorted(full) == sorted(reference),
                "unequal": [name for name in reference if not torch.equal(full[name], reference[name])],
                "tied": tied,
                "embedding_rows_per_rank": rows,
            }
        del model, full
    if world.is_main:
        Path(report_path).write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()
    # With torch 2.13 and gloo, a rank sometimes aborts while the interpreter shuts down after FSDP collectives
    # ("terminate called without an active exception"; the loading code before this change did too, in ~1 of
    # 3 runs of 3 ranks). Everything is reported by now: leave without the interpreter's teardown.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:])
