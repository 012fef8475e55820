import pytest
import torch.distributed as dist

from prime_rl.trainer.distributed import init_distributed


@pytest.fixture
def one_rank():
    """A one-process world (gloo), as a plain `trainer` without torchrun runs; destroyed after the test whatever
    happened, so the next test can start its own."""
    world = init_distributed()
    yield world
    dist.destroy_process_group()
