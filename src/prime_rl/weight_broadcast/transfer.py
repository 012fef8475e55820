"""The in-memory weight transfer's torch side: a transfer group's rendezvous on the store (`GroupStore`), joining
the group, and the collectives that move one transfer's header and tensors (the wire format is `protocol.py`'s)."""

from __future__ import annotations

import math
import os
import time
import weakref
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from prime_rl.weight_broadcast.client import StoreClient
from prime_rl.weight_broadcast.protocol import Header, HeaderError, group_prefix
from prime_rl.weight_broadcast.store import Table


class GroupStore(dist.Store):
    """One transfer group's rendezvous under `prefix` of a `Table` (trainer rank 0) or a `StoreClient` (a receiver):
    gloo and NCCL exchange their members' addresses through it, calling these methods from C++."""

    def __init__(self, kv: Table | StoreClient, prefix: str, timeout: float):
        super().__init__()
        self.kv, self.prefix, self.seconds = kv, prefix, timeout  # (`timeout` is a read-only property of Store)

    def set(self, key: str, value) -> None:
        self.kv.set(self.prefix + key, value.encode() if isinstance(value, str) else bytes(value))

    def get(self, key: str) -> bytes:
        return self.kv.get(self.prefix + key, self.seconds)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        deadline = time.monotonic() + (timeout.total_seconds() if timeout else self.seconds)
        for key in keys:
            self.kv.get(self.prefix + key, max(0.0, deadline - time.monotonic()))

    def check(self, keys: list[str]) -> bool:
        return self.kv.check([self.prefix + k for k in keys])

    def add(self, key: str, amount: int) -> int:
        return self.kv.add(self.prefix + key, amount)

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self.kv.compare_set(self.prefix + key, bytes(expected), bytes(desired))

    def delete_key(self, key: str) -> bool:
        return self.kv.delete(self.prefix + key)

    def num_keys(self) -> int:
        return self.kv.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self.seconds = timeout.total_seconds()


_GROUP_STORES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Each transfer group's Python store, for as long as the group lives (`keep_store_alive`)."""


def keep_store_alive(group, store: GroupStore) -> None:
    """Hold `store` while `group` lives. NCCL connects lazily, at the group's first collective, and reaches the store
    from C++ then; a Python store whose Python object is gone fails every such call (pybind finds no method: 'fn
    INTERNAL ASSERT FAILED ... Not implemented'), which is how the first CUDA run of the broadcast failed."""
    _GROUP_STORES[group] = store


def join_group(kv: Table | StoreClient, group: str, rank: int, world_size: int, backend: str, timeout: float):
    """This process's member of one transfer group; blocks until every member joined (bounded by `timeout`).

    NCCL's watchdog tears down the whole process when a collective times out (its default error handling); a
    transfer group is built with error handling 2 (clean up only) instead, so a receiver that dies fails the transfer
    and not the trainer (`run_collective` also aborts the group itself at its deadline). Untested without GPUs."""
    store = GroupStore(kv, group_prefix(group), timeout)
    if backend == "gloo":
        from torch.distributed.distributed_c10d import ProcessGroupGloo

        group = ProcessGroupGloo(store, rank, world_size, timedelta(seconds=timeout))
        keep_store_alive(group, store)
        return group
    from torch.distributed.distributed_c10d import ProcessGroupNCCL

    options = ProcessGroupNCCL.Options()
    options._timeout = timedelta(seconds=timeout)
    previous = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"  # read when the group is built: this group only
    try:
        group = ProcessGroupNCCL(store, rank, world_size, options)
        keep_store_alive(group, store)
        return group
    finally:
        if previous is None:
            del os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"]
        else:
            os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = previous


def buffer_device(backend: str, device: torch.device) -> torch.device:
    """Where the transferred buffers live: gloo moves host memory, NCCL GPU memory."""
    return torch.device("cpu") if backend == "gloo" else device


def run_collective(group, work, timeout: float) -> None:
    """Wait for one collective of a transfer group, at most `timeout` seconds. Gloo enforces the op's timeout itself;
    an NCCL op only completes on the GPU, so it is polled, and the group aborted at the deadline (a dead peer must
    fail this transfer, not hang or kill the process)."""
    if type(group).__name__ != "ProcessGroupNCCL":
        work.wait()
        return
    deadline = time.monotonic() + timeout
    while not work.is_completed():
        if time.monotonic() > deadline:
            group.abort()
            raise TimeoutError(f"an NCCL transfer collective did not complete within {timeout:g} s")
        time.sleep(0.001)
    work.wait()


def _broadcast(group, tensor: torch.Tensor, timeout: float) -> None:
    options = torch.distributed.BroadcastOptions()
    options.rootRank, options.rootTensor = 0, 0
    options.timeout = timedelta(seconds=timeout)
    run_collective(group, group.broadcast([tensor], options), timeout)


def agree(group, ok: bool, device: torch.device, timeout: float) -> bool:
    """Whether every member said ok (one MIN all-reduce)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    options = torch.distributed.AllreduceOptions()
    options.reduceOp = torch.distributed.ReduceOp.MIN
    options.timeout = timedelta(seconds=timeout)
    run_collective(group, group.allreduce([flag], options), timeout)
    return bool(flag.item())


def send_header(group, header: Header, device: torch.device, timeout: float) -> None:
    raw = torch.frombuffer(bytearray(header.encode()), dtype=torch.uint8)
    _broadcast(group, torch.tensor([raw.numel()], dtype=torch.int64, device=device), timeout)
    _broadcast(group, raw.to(device), timeout)


def receive_header(group, device: torch.device, limit: int, timeout: float) -> Header:
    """The header rank 0 sends; `HeaderError` for a size outside 1..`limit` bytes or contents `Header.decode`
    refuses. After a bad size this member is out of step with the group: the caller drops the group."""
    size = torch.zeros(1, dtype=torch.int64, device=device)
    _broadcast(group, size, timeout)
    n = int(size.item())
    if not 0 < n <= limit:
        raise HeaderError(f"a transfer header of {n} bytes is outside 1..{limit}, what the served model can need")
    raw = torch.empty(n, dtype=torch.uint8, device=device)
    _broadcast(group, raw, timeout)
    return Header.decode(raw.cpu().numpy().tobytes())


def send_tensors(group, tensors: list[torch.Tensor], dtype: torch.dtype, device: torch.device, timeout: float) -> None:
    """One group's tensors as one flat buffer (cast to `dtype`), in the header's order."""
    flat = torch.cat([t.detach().reshape(-1).to(device=device, dtype=dtype) for t in tensors])
    _broadcast(group, flat, timeout)


class NonFiniteTensor(ValueError):
    """A received tensor holds a NaN or an infinity: the receiver stops before handing any of its group on."""


def receive_tensors(group, header: Header, device: torch.device, timeout: float) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the transfer, one group's buffer at a time (a fresh buffer per group: the
    consumer may keep views of a group until its layer is complete). Each buffer is checked before any of its tensors
    is yielded: `NonFiniteTensor` naming the first one with a NaN or an infinity (the trainer checks before sending;
    this is the receiver's own line, and the consumer's failed load then serves none of it)."""
    dtype = getattr(torch, header.dtype)
    for names_shapes in header.groups:
        numel = sum(math.prod(shape) for _, shape in names_shapes)
        flat = torch.empty(numel, dtype=dtype, device=device)
        _broadcast(group, flat, timeout)
        tensors, offset = [], 0
        for name, shape in names_shapes:
            n = math.prod(shape)
            tensors.append((name, flat[offset : offset + n].view(shape)))
            offset += n
        if not finite(flat):
            name = next(name for name, tensor in tensors if not finite(tensor))
            raise NonFiniteTensor(f"the broadcast's {name[:120]} (policy step {header.step}) has NaN or inf values")
        yield from tensors


def finite(tensor: torch.Tensor) -> bool:
    """No NaN or infinity in `tensor` (a finite sum settles it in one pass; otherwise checked exactly)."""
    return math.isfinite(tensor.sum(dtype=torch.float32).item()) or bool(torch.isfinite(tensor).all())
