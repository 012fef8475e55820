"""The trainer: the RL loop (`rl/`, entry point `trainer`) and supervised fine-tuning (`sft/`, entry point `sft`).

    rl/        the RL loops (full weights; LoRA adapters of several runs), their loss, critic, KL reference and
               the in-memory weight broadcast
    sft/       the SFT loop, its config and its chat data
    model/     the policy model: building and sharding it, loading its weights, the log-prob head, LoRA adapters
    parallel/  processes and device meshes, context parallelism
    config.py, ckpt.py, optim.py, packing.py, perf.py, scaffold.py, weights.py: what both loops share

Nothing here imports the orchestrator, the inference server or eval (tests/unit/test_trainer_layout.py).
"""
