"""Process group and device setup for torchrun (or a plain single process)."""

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from prime_rl.utils.net import free_port


@dataclass
class World:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: DeviceMesh

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed() -> World:
    """`nccl` on GPU, `gloo` on CPU. Without torchrun's environment, a one-process group is created."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp",))
    return World(rank, world_size, local_rank, device, mesh)


def broadcast_object(obj, world: World):
    """Rank 0's `obj` on every rank (pickled over the process group)."""
    box = [obj if world.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]
