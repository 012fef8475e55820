"""One rank of the context-parallel test (tests/unit/test_context_parallel.py), under torch.distributed.run with gloo.

`python cp_worker.py SPEC.json`: runs the collectives on known inputs and every model case of the spec on its chunk
of the row, and saves what it computed under the spec's `out` directory for the test to check.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from prime_rl.trainer.parallel.context_parallel import (
    all_to_all,
    cp_context,
    enable_context_parallel,
    gather_row,
    heads_to_sequence,
    sequence_to_heads,
    shard_row,
)


def collectives(rank: int, cp: int) -> dict[str, torch.Tensor]:
    """Inputs that name where each element came from, and seeded upstream gradients that differ per rank."""
    generator = torch.Generator().manual_seed(rank)
    result = {}

    x = (torch.arange(cp * 3, dtype=torch.float64).reshape(cp, 3) + 100 * rank).requires_grad_()
    y = torch.randn(cp, 3, generator=generator, dtype=torch.float64)
    out = all_to_all(x)
    (out * y).sum().backward()
    result.update(a2a_x=x.detach(), a2a_y=y, a2a_out=out.detach(), a2a_grad=x.grad)

    heads, local, d = 4, 3, 2
    h, s, e = torch.meshgrid(torch.arange(heads), torch.arange(local), torch.arange(d), indexing="ij")
    q = (1000 * h + 10 * (rank * local + s) + e).double().requires_grad_()  # head, global token, channel
    seq = heads_to_sequence(q)
    g = torch.randn(heads, local, d, generator=generator, dtype=torch.float64)
    (sequence_to_heads(seq) * g).sum().backward()
    result.update(h2s_out=seq.detach(), roundtrip_grad=q.grad, roundtrip_g=g)

    local_row = (torch.arange(5, dtype=torch.float64) + 10 * rank).requires_grad_()
    w = torch.arange(5 * cp, dtype=torch.float64) * 0.5 - 3  # the same on every rank, like a loss on the full row
    full = gather_row(local_row)
    (full * w).sum().backward()
    result.update(gather_full=full.detach(), gather_grad=local_row.grad)
    return result


def run_case(case: dict, row: dict, rank: int, cp: int) -> dict:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(case["model"], dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False
    enable_context_parallel(model, cp)
    if case["ac"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # activation checkpointing only acts in training mode; the tiny models have no dropout

    ids, pos = shard_row(row["input_ids"], rank, cp), shard_row(row["position_ids"], rank, cp)
    targets = shard_row(row["targets"], rank, cp)
    errors = {}
    try:
        model(input_ids=ids[None], position_ids=pos[None])
    except RuntimeError as e:
        errors["outside_context"] = str(e)
    with cp_context(None, row["position_ids"]):
        try:
            model(input_ids=ids[None], position_ids=shard_row(row["position_ids"], 1 - rank, cp)[None])
        except ValueError as e:
            errors["wrong_chunk"] = str(e)
    with cp_context(None, row["position_ids"]):
        logits = model(input_ids=ids[None], position_ids=pos[None]).logits[0]
        logp_local = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[:, None])[:, 0]
        logp = gather_row(logp_local)
        loss = (logp * row["weights"]).sum()
        loss.backward()  # inside the context: activation checkpointing recomputes attention here
    grads = {}
    for name, param in model.named_parameters():
        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)  # what FSDP's reduce-scatter (divide factor 1) sums
        grads[name] = param.grad
    return {"logp": logp.detach(), "grads": grads, "errors": errors}


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group("gloo")
    rank, cp = dist.get_rank(), dist.get_world_size()
    out = Path(spec["out"])
    torch.save(collectives(rank, cp), out / f"collectives_rank{rank}.pt")
    row = torch.load(spec["row"])
    for case in spec["cases"]:
        result = run_case(case, row, rank, cp)
        if rank == 0:
            torch.save(result, out / f"case_{case['name']}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
