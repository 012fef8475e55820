"""The RL training loops (`trainer` entry point: `train.py`; LoRA runs: `train_lora.py`) and what only RL needs."""
