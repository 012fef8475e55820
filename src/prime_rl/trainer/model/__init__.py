"""The policy model: built and sharded (`build.py`), its weights loaded (`loading.py`), its log-prob head and LoRA."""
