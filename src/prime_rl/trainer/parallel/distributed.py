"""Process group and device setup for torchrun (or a plain single process)."""

import ctypes
import os
import signal
import sys
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
    cp: int = 1
    """Context-parallel degree: consecutive groups of `cp` ranks share each packed row (`model.cp`)."""
    cp_group: dist.ProcessGroup | None = None
    """This rank's context-parallel group (None without context parallelism)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def cp_rank(self) -> int:
        return self.rank % self.cp

    @property
    def dp_size(self) -> int:
        """Data-parallel groups: each trains its own rows (a group of `cp` ranks shares them)."""
        return self.world_size // self.cp


def init_distributed(cp: int = 1) -> World:
    """`nccl` on GPU, `gloo` on CPU. Without torchrun's environment, a one-process group is created. With `cp` > 1,
    also the context-parallel groups (every rank creates all of them, as torch.distributed requires)."""
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
    world = World(rank, world_size, local_rank, device, mesh, cp)
    if cp > 1 and world_size % cp == 0:  # (the caller refuses a cp that does not divide the world)
        for first in range(0, world_size, cp):
            group = dist.new_group(list(range(first, first + cp)))
            if first <= rank < first + cp:
                world.cp_group = group
    return world


def broadcast_object(obj, world: World):
    """Rank 0's `obj` on every rank (pickled over the process group)."""
    box = [obj if world.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


PR_SET_PDEATHSIG = 1


def _could_be_agent(pid: int) -> bool:
    """Whether process `pid` can be the torchrun agent that started this rank: it runs the same interpreter.

    The agent runs as this user, so its executable is readable; when it is not (init, owned by root), `pid`
    is taken for the agent unless it is 1, so that an unusual /proc never stops a healthy rank.
    """
    try:
        return os.readlink(f"/proc/{pid}/exe") == os.readlink("/proc/self/exe")
    except OSError:
        return pid != 1


def die_with_torchrun_agent() -> None:
    """Under torchrun, have the kernel SIGKILL this rank the moment its agent (the parent) dies, however it dies.

    torchrun starts every rank in a session of its own, so neither a signal to the agent's process group nor a
    `kill -9` of the agent reaches the ranks: they would train on and consume the batches of a later run on the
    same output_dir. The parent-death signal is armed only here, seconds after the rank started; an agent that
    died before that has already handed the rank to a reaper (init or a subreaper), a process that does not run
    the agent's Python: then exit at once. (The signal follows the parent *thread*: torchrun starts ranks from
    its main thread, which lives as long as the agent.)
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return  # not a torchrun rank (a plain `trainer` process stops with its own terminal)
    parent = os.getppid()
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent or not _could_be_agent(parent):
        print(
            f"rank {os.environ.get('RANK')}: its torchrun agent is gone (parent now pid {os.getppid()}); exiting",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)
