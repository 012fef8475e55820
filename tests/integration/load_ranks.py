"""One rank of `test_trainer_loading.py` (run under torchrun): build each model as the trainer does, gather it
and, on rank 0, compare every tensor with what `from_pretrained` (or a seeded `from_config`) gives.

    torchrun --nproc-per-node 3 tests/integration/load_ranks.py REPORT.json DIR [DIR ...]

Each rank also records the rows of the embedding it holds, so the test can see the split was uneven, and which
path it loaded by (shard reads or rank 0's scatter), so the test can see that all ranks took the same.

LOAD_RANKS_UNREADABLE=RANK:DIR hides DIR from the loader on rank RANK only, as on a node that does not have the
directory rank 0 found.
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
from prime_rl.trainer.model import build as model_module
from prime_rl.trainer.model import loading
from prime_rl.trainer.model.build import build_model, load_arch
from prime_rl.trainer.parallel.distributed import die_with_torchrun_agent, init_distributed

SEED = 7


def hide_from_this_rank(directory: Path) -> None:
    """To the loader on this rank, `directory` is not there (a node without it): it is no directory, and its
    safetensors files do not open. (As such a name is no hub id either, rank 0's plan cannot be read here.)"""
    hidden = directory.resolve()
    real_is_dir, real_open = Path.is_dir, loading.safe_open

    def is_dir(path: Path) -> bool:
        return not path.resolve().is_relative_to(hidden) and real_is_dir(path)

    def safe_open(path, *args, **kwargs):
        if Path(path).resolve().is_relative_to(hidden):
            raise FileNotFoundError(2, "No such file or directory (hidden from this rank by the test)", str(path))
        return real_open(path, *args, **kwargs)

    Path.is_dir, loading.safe_open = is_dir, safe_open


def record_paths(taken: list[str]) -> None:
    """Note in `taken` each loading path this rank enters."""

    def recording(path: str, load):
        def wrapper(*args):
            taken.append(path)
            return load(*args)

        return wrapper

    model_module.load_shards = recording("shards", model_module.load_shards)
    model_module.scatter_from_rank0 = recording("scatter", model_module.scatter_from_rank0)


def main(report_path: str, *dirs: str) -> None:
    die_with_torchrun_agent()  # a hung rank goes when the test kills torchrun at its timeout
    world = init_distributed()
    if unreadable := os.environ.get("LOAD_RANKS_UNREADABLE"):
        rank, directory = unreadable.split(":", 1)
        if int(rank) == world.rank:
            hide_from_this_rank(Path(directory))
    taken = []
    record_paths(taken)
    report = {}
    cases = [(d, False) for d in dirs] + [(dirs[0], True)]  # every checkpoint, then random weights
    for directory, random_init in cases:
        config = TrainerModelConfig(name=directory, dtype="float32", random_init=random_init)
        taken.clear()
        model = build_model(config, load_arch(config), world, SEED)
        rows, paths = [None] * world.world_size, [None] * world.world_size
        dist.all_gather_object(rows, model.get_input_embeddings().weight.to_local().shape[0])
        dist.all_gather_object(paths, "+".join(taken))
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
                "path_per_rank": paths,
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
