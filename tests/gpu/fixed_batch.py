"""Five optimizer steps of the real trainer on one fixed batch (GRPO, fake samples); prints `LOSSES [...]`.

    torchrun --nproc-per-node 1 tests/gpu/fixed_batch.py MODEL_DIR OFFLOAD(0|1) SEQ_LEN

The GPU test (NCCL, the Qwen3-0.6B-shaped model) and its CPU twin in CI (gloo, a tiny model) both call `losses`, so
a change of the trainer's API breaks CI, not a rare GPU window (the first GPU run found this test two refactors old).
"""

import json
import subprocess
import sys
from pathlib import Path


def losses(model: Path, offload: bool, seq_len: int) -> list[float]:
    """This file on one torchrun rank: the loss of each of its five steps."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", __file__]
    proc = subprocess.run(
        [*cmd, str(model), "1" if offload else "0", str(seq_len)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(proc.stdout.split("LOSSES", 1)[1].splitlines()[0])


def main() -> None:
    from prime_rl.trainer.config import TrainerConfig
    from prime_rl.trainer.packing import pack_samples
    from prime_rl.trainer.parallel.distributed import init_distributed
    from prime_rl.trainer.rl.step import train_step
    from prime_rl.trainer.rl.train import fake_samples
    from prime_rl.trainer.scaffold import build_run

    model, offload, seq_len = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])
    config = TrainerConfig(
        model={"name": model},
        seq_len=seq_len,
        loss={"objective": "grpo"},
        bench={"samples": 2},
        optim={"type": "adamw", "lr": 1e-4, "cpu_offload": offload},
    )
    world = init_distributed()
    run = build_run(config, world, "trainer", 5, "testing")
    rows = pack_samples(fake_samples(config, run.model.config.vocab_size, 1), config.seq_len)
    step_losses = []
    for _ in range(5):
        totals = train_step(run.model, rows, {0: float(sum(r.num_loss_tokens for r in rows))}, config, world)[0]
        run.optimizer_step(1.0)
        step_losses.append(totals["loss"])
    print("LOSSES", json.dumps(step_losses))


if __name__ == "__main__":
    main()
