import os

import pytest

# No model hub at test time: everything is built locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")


@pytest.fixture(autouse=True)
def no_run_secret(monkeypatch):
    """Every test starts without a run secret in its environment (an in-process `rl` makes one, which would otherwise
    leak into later tests): those that need one set it themselves."""
    from prime_rl.utils.secret import SECRET_VAR, forget_keys

    monkeypatch.delenv(SECRET_VAR, raising=False)
    forget_keys()  # keys a test took in this process are not the next test's
    yield
    forget_keys()
