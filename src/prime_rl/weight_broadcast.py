"""Weights from trainer rank 0 to every inference worker over a torch.distributed group, without the filesystem.

The pieces both ends share (torch only: the trainer, the inference workers and the orchestrator import this):

- **Rendezvous.** Trainer rank 0 hosts a `TCPStore` at `weight_broadcast.host:port` for the whole run and writes a
  fresh `session` id into it. Each transfer group is a generation of that session: trainer rank 0 is rank 0, the
  workers of server i come after those of servers 0..i-1. The orchestrator picks the members (the healthy servers) and
  starts a new generation whenever they change, so a server that restarted joins the next transfer; members keep
  their group between transfers (NCCL communicators are slow to build).
- **Requests** (orchestrator -> trainer, through the store): `request/i` names the generation; the trainer answers
  `ack/i` with the policy step it is about to send, sends, then writes `served/i`. The trainer announces the step
  it holds in `published` and waits until the orchestrator has taken it (or written `orchestrator_done`).
- **Wire format** of one transfer, all over the group from rank 0: a JSON header (step, dtype, every tensor's name
  and shape, in groups of one decoder layer each, the rest first); one MIN all-reduce in which every receiver says
  whether the header matches its model (a mismatch stops every member before any weight changes); then one flat
  buffer per group. A receiver streams each group into vLLM's layer-wise reload as it arrives, so neither end holds
  more than about one layer extra.
"""

from __future__ import annotations

import json
import math
import re
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
from torch.distributed import PrefixStore, Store, TCPStore

SESSION = "session"
"""Store key: a fresh id per trainer process, so servers never reuse a group of an earlier run."""
PUBLISHED = "published"
"""Store key: the policy step trainer rank 0 holds and sends when asked."""
ORCHESTRATOR_DONE = "orchestrator_done"
"""Store key: the orchestrator will ask for nothing more; the trainer stops waiting for it."""

LAYER = re.compile(r"\.layers\.(\d+)\.")


def request_key(i: int) -> str:
    return f"request/{i}"


def ack_key(i: int) -> str:
    return f"ack/{i}"


def served_key(i: int) -> str:
    return f"served/{i}"


def reachable(host: str, port: int, timeout: float = 1.0) -> bool:
    """Whether something listens at host:port (a TCPStore client that cannot connect retries and logs at length)."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def connect_store(host: str, port: int, timeout: float) -> TCPStore:
    """A client of the trainer's store; raises `ConnectionError` naming the address when nothing listens there.

    The client connects within 5 s, then waits up to `timeout` for keys: TCPStore retries a connection that dies
    while it validates (a trainer killed just then) until its timeout runs out, and again after a backoff, which
    kept a server paused for 200 s with the transfer timeout of 120 s; 5 s bounds that at about 10 s."""
    connect = min(timeout, 5.0)
    if not reachable(host, port, connect):
        raise ConnectionError(f"no weight-broadcast store at {host}:{port} (trainer rank 0 hosts it)")
    store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=connect))
    store.set_timeout(timedelta(seconds=timeout))
    return store


def get_json(store: Store, key: str) -> dict:
    return json.loads(store.get(key).decode())


def set_json(store: Store, key: str, value: dict) -> None:
    store.set(key, json.dumps(value))


def join_group(store: Store, session: str, generation: int, rank: int, world_size: int, backend: str, timeout: float):
    """This process's member of one transfer group; blocks until every member joined (bounded by `timeout`)."""
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    prefixed = PrefixStore(f"{session}/generation/{generation}", store)
    if backend == "gloo":
        return ProcessGroupGloo(prefixed, rank, world_size, timedelta(seconds=timeout))
    from torch.distributed.distributed_c10d import ProcessGroupNCCL

    options = ProcessGroupNCCL.Options()
    options._timeout = timedelta(seconds=timeout)
    return ProcessGroupNCCL(prefixed, rank, world_size, options)  # untested here (no GPU): see the README


def buffer_device(backend: str, device: torch.device) -> torch.device:
    """Where the transferred buffers live: gloo moves host memory, NCCL GPU memory."""
    return torch.device("cpu") if backend == "gloo" else device


def _broadcast(group, tensor: torch.Tensor) -> None:
    options = torch.distributed.BroadcastOptions()
    options.rootRank, options.rootTensor = 0, 0
    group.broadcast([tensor], options).wait()


def agree(group, ok: bool, device: torch.device) -> bool:
    """Whether every member said ok (one MIN all-reduce)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    options = torch.distributed.AllreduceOptions()
    options.reduceOp = torch.distributed.ReduceOp.MIN
    group.allreduce([flag], options).wait()
    return bool(flag.item())


@dataclass
class Header:
    step: int
    """The policy step the weights are (served as version `step_<step>`)."""
    dtype: str
    """torch dtype name of every tensor (the trainer sends in the model's stored dtype)."""
    groups: list[list[tuple[str, tuple[int, ...]]]]
    """Tensor names and full shapes, one list per flat buffer that follows (the non-layer tensors, then each layer)."""

    def specs(self) -> dict[str, tuple[int, ...]]:
        return {name: shape for group in self.groups for name, shape in group}

    def encode(self) -> bytes:
        return json.dumps({"step": self.step, "dtype": self.dtype, "groups": self.groups}).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Header:
        data = json.loads(raw)
        groups = [[(name, tuple(shape)) for name, shape in group] for group in data["groups"]]
        return cls(int(data["step"]), str(data["dtype"]), groups)


def layer_groups(names: list[str]) -> list[list[str]]:
    """Names grouped per decoder layer (`...layers.<i>....`), the names of no layer first, order kept within a group."""
    rest, layers = [], {}
    for name in names:
        m = LAYER.search(name)
        if m is None:
            rest.append(name)
        else:
            layers.setdefault(int(m.group(1)), []).append(name)
    return ([rest] if rest else []) + [layers[i] for i in sorted(layers)]


def send_header(group, header: Header, device: torch.device) -> None:
    raw = torch.frombuffer(bytearray(header.encode()), dtype=torch.uint8)
    _broadcast(group, torch.tensor([raw.numel()], dtype=torch.int64, device=device))
    _broadcast(group, raw.to(device))


def receive_header(group, device: torch.device) -> Header:
    size = torch.zeros(1, dtype=torch.int64, device=device)
    _broadcast(group, size)
    raw = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    _broadcast(group, raw)
    return Header.decode(raw.cpu().numpy().tobytes())


def send_tensors(group, tensors: list[torch.Tensor], dtype: torch.dtype, device: torch.device) -> None:
    """One group's tensors as one flat buffer (cast to `dtype`), in the header's order."""
    flat = torch.cat([t.detach().reshape(-1).to(device=device, dtype=dtype) for t in tensors])
    _broadcast(group, flat)


def receive_tensors(group, header: Header, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the transfer, one group's buffer at a time (a fresh buffer per group: the
    consumer may keep views of a group until its layer is complete)."""
    dtype = getattr(torch, header.dtype)
    for names_shapes in header.groups:
        numel = sum(math.prod(shape) for _, shape in names_shapes)
        flat = torch.empty(numel, dtype=dtype, device=device)
        _broadcast(group, flat)
        offset = 0
        for name, shape in names_shapes:
            n = math.prod(shape)
            yield name, flat[offset : offset + n].view(shape)
            offset += n
