"""The trainer's side of the in-memory weight broadcast (`weight_broadcast.type = "nccl"` or `"gloo"`).

Rank 0 hosts the rendezvous store the orchestrator and the inference workers connect to, announces the policy step
it holds (`published`) and answers the orchestrator's requests (see `prime_rl.weight_broadcast` for the protocol).
Every rank takes part in a transfer: each layer's full tensors are gathered from the FSDP shards (a collective),
and rank 0 broadcasts them to the servers, one layer at a time.

A receiver that dies mid-transfer fails only that transfer: rank 0 reports the error to the orchestrator (which
takes the server out of rotation and sends the next policy to a new group) and training goes on.
"""

from __future__ import annotations

import time
import uuid
from datetime import timedelta

import torch
from loguru import logger
from torch.distributed import TCPStore
from torch.distributed.tensor import DTensor

from prime_rl.config import WeightBroadcastConfig
from prime_rl.trainer.distributed import World, broadcast_object
from prime_rl.trainer.model import SetupError
from prime_rl.weight_broadcast import (
    ORCHESTRATOR_DONE,
    PUBLISHED,
    SESSION,
    Header,
    ack_key,
    agree,
    buffer_device,
    get_json,
    join_group,
    layer_groups,
    request_key,
    send_header,
    send_tensors,
    served_key,
    set_json,
)


class WeightSender:
    def __init__(self, config: WeightBroadcastConfig, world: World):
        self.config, self.world = config, world
        self.device = buffer_device(config.type, world.device)
        self.store: TCPStore | None = None
        self.session = uuid.uuid4().hex
        self.step: int | None = None
        """The policy step the model's weights are, once published."""
        self.taken = -1
        """The newest step some server received."""
        self.next_request = 1
        self.group, self.group_key = None, None
        self.seconds = 0.0
        """Time spent sending since the loop last read it (`pop_seconds`)."""
        if world.is_main:
            try:
                self.store = TCPStore(
                    config.host, config.require_port(), is_master=True, wait_for_workers=False,
                    timeout=timedelta(seconds=config.timeout),
                )  # fmt: skip
            except ValueError as e:
                raise SetupError(str(e)) from None
            except Exception as e:
                raise SetupError(f"weight_broadcast: cannot listen on port {config.port}: {e}") from None
            self.store.set(SESSION, self.session)
            logger.info(f"weight broadcast ({config.type}) store listening on port {config.port}")

    def publish(self, step: int) -> None:
        """The model now holds policy `step`: the orchestrator may ask for it."""
        self.step = step
        if self.store is not None:
            self.store.set(PUBLISHED, str(step))

    def pending(self) -> bool:
        """Rank 0: the orchestrator asked for a transfer not yet served."""
        return self.store is not None and self.store.check([request_key(self.next_request)])

    def taken_or_unwanted(self, step: int) -> bool:
        """Rank 0: a server received `step` (or newer), or the orchestrator finished and wants nothing more."""
        return self.taken >= step or (self.store is not None and self.store.check([ORCHESTRATOR_DONE]))

    def close(self) -> None:
        """Drops the transfer group, then the store, while the interpreter is whole: a gloo group or store left to
        interpreter exit can be destroyed with its threads still running, which aborts the process."""
        self.group, self.group_key = None, None
        self.store = None

    def pop_seconds(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def serve(self, model: torch.nn.Module, dtype: torch.dtype) -> None:
        """Every rank: answer the next request by broadcasting the model's weights (cast to `dtype`) to its group."""
        start = time.perf_counter()
        request, outcome = None, None
        if self.world.is_main:
            i, self.next_request = self.next_request, self.next_request + 1
            request = get_json(self.store, request_key(i))
            set_json(self.store, ack_key(i), {"step": self.step})
            outcome = self._start(model, request, dtype)
        outcome = broadcast_object(outcome, self.world)
        error = self._send_layers(model, dtype) if outcome == "send" else outcome
        if self.world.is_main:
            set_json(self.store, served_key(i), {"step": self.step, "error": error})
            if error is None:
                self.taken = max(self.taken, self.step)
                logger.debug(f"sent policy step {self.step} to generation {request['generation']}")
            else:
                logger.warning(f"weight broadcast of policy step {self.step} failed: {error}")
        self.seconds += time.perf_counter() - start

    def _start(self, model: torch.nn.Module, request: dict, dtype: torch.dtype) -> str:
        """Rank 0: join the request's group, send the header; "send" if every receiver accepted it, else why not."""
        try:
            key = (request["generation"], request["world_size"])
            if key != self.group_key:
                self.group, self.group_key = None, None  # the old generation's peers may be gone
                self.group = join_group(
                    self.store, self.session, request["generation"], 0, request["world_size"], self.config.type,
                    self.config.timeout,
                )  # fmt: skip
                self.group_key = key
            send_header(self.group, header(model, self.step, dtype), self.device)
            if not agree(self.group, True, self.device):
                return "a server refused the weights (its reply to the orchestrator says why)"
            return "send"
        except Exception as e:
            self.group, self.group_key = None, None
            return f"{type(e).__name__}: {e}"

    def _send_layers(self, model: torch.nn.Module, dtype: torch.dtype) -> str | None:
        """Every rank gathers each layer's full tensors; rank 0 broadcasts them. After a failed broadcast the other
        ranks still need rank 0 in every gather, so it keeps gathering and only stops sending."""
        params = dict(model.named_parameters())
        error = None
        for names in layer_groups(list(params)):
            tensors = [full_tensor(params[name], self.world.device) for name in names]
            if self.world.is_main and error is None:
                try:
                    send_tensors(self.group, tensors, dtype, self.device)
                except Exception as e:
                    error = f"{type(e).__name__}: {e}"
                    self.group, self.group_key = None, None
            del tensors
        return error


def header(model: torch.nn.Module, step: int, dtype: torch.dtype) -> Header:
    """What a transfer of the model's parameters holds: their names and full shapes, per layer (a tied output layer
    is the embedding's parameter, so it is listed and sent once, as the checkpoint stores it)."""
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    groups = [[(name, shapes[name]) for name in names] for names in layer_groups(list(shapes))]
    return Header(step, str(dtype).removeprefix("torch."), groups)


def full_tensor(param: torch.nn.Parameter, device: torch.device) -> torch.Tensor:
    """The whole tensor of an FSDP-sharded parameter (a collective over the trainer's ranks)."""
    if not isinstance(param, DTensor):
        return param.detach()
    if param.device != device:  # sharded on the host (cpu_offload): gather on the device the group runs on
        local = param.to_local().to(device)
        param = DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())
    return param.full_tensor()
