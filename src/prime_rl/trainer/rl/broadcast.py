"""The trainer's side of the in-memory weight broadcast (`weight_broadcast.type = "nccl"` or `"gloo"`).

Rank 0 hosts the authenticated store the orchestrator and the inference workers connect to, announces the policy
step it holds (`published`) and answers the orchestrator's requests (protocol: `prime_rl.weight_broadcast.protocol`).
Every rank takes part in a transfer: each layer's full tensors are gathered from the FSDP shards (a collective),
and rank 0 broadcasts them to the servers, one layer at a time.

A receiver that dies mid-transfer fails only that transfer: rank 0 reports the error to the orchestrator (which
takes the server out of rotation and sends the next policy to a new group) and training goes on. A policy with a NaN
or an infinity is never sent: asked for it, the trainer sends the header with the reason (the tensor) and says no in
the receivers' all-reduce, so every server refuses it before any weight changes (a 422 naming the tensor, which ends
the orchestrator's run), then every rank raises `NonFiniteWeights`: the training diverged. Rank 0 spends at
most `weight_broadcast.timeout` on starting a transfer and on each layer, which bounds how long the other ranks
wait for it in a collective (the config caps the timeout well under torch's collective timeouts).
"""

from __future__ import annotations

import time
import uuid

import torch
from loguru import logger
from torch.distributed.tensor import DTensor

from prime_rl.config import WeightBroadcastConfig
from prime_rl.trainer.model.build import SetupError
from prime_rl.trainer.parallel.distributed import World, broadcast_object
from prime_rl.trainer.weights import NonFiniteWeights, nonfinite_parameter
from prime_rl.utils.secret import SecretError, store_key
from prime_rl.weight_broadcast.protocol import (
    ORCHESTRATOR_DONE,
    PUBLISHED,
    REQUEST,
    SESSION,
    Header,
    Request,
    ack_key,
    group_prefix,
    layer_groups,
    served_key,
    set_json,
)
from prime_rl.weight_broadcast.store import StoreServer, Table
from prime_rl.weight_broadcast.transfer import agree, buffer_device, join_group, send_header, send_tensors


class WeightSender:
    def __init__(self, config: WeightBroadcastConfig, world: World):
        self.config, self.world = config, world
        self.device = buffer_device(config.type, world.device)
        self.table: Table | None = None
        """Rank 0: the store's contents (rank 0 reads and writes them directly, the others over the network)."""
        self.server: StoreServer | None = None
        self.session = uuid.uuid4().hex
        self.step: int | None = None
        """The policy step the model's weights are, once published."""
        self.taken = -1
        """The newest step some server received."""
        self.group, self.group_id = None, None
        self.seconds = 0.0
        """Time spent sending since the loop last read it (`pop_seconds`)."""
        self.checked: tuple[int | None, str | None] | None = None
        """(step, why its weights cannot be sent, or None): the finiteness check, made once per published step."""
        if world.is_main:
            try:
                key = store_key("the in-memory weight broadcast (weight_broadcast.type gloo/nccl)")
                port = config.require_port()
                self.table = Table()
                set_json(self.table, SESSION, {"id": self.session, "backend": config.type})  # there before anyone looks
                self.server = StoreServer(config.host, port, key, self.table)
            except (SecretError, ValueError) as e:
                raise SetupError(str(e)) from None
            except OSError as e:
                raise SetupError(
                    f"weight_broadcast: cannot listen on {config.host}:{config.port} ({e}); the host must be an "
                    "address of trainer rank 0's machine"
                ) from None
            logger.info(f"weight broadcast ({config.type}) store listening on {config.host}:{config.port}")

    def publish(self, step: int) -> None:
        """The model now holds policy `step`: the orchestrator may ask for it."""
        self.step = step
        if self.table is not None:
            self.table.set(PUBLISHED, str(step))

    def pending(self) -> bool:
        """Rank 0: the orchestrator asked for a transfer not yet served."""
        return self.table is not None and self.table.check([REQUEST])

    def taken_or_unwanted(self, step: int) -> bool:
        """Rank 0: a server received `step` (or newer), or the orchestrator finished and wants nothing more."""
        return self.taken >= step or (self.table is not None and self.table.check([ORCHESTRATOR_DONE]))

    def close(self) -> None:
        """Drops the transfer group, then the store, while the interpreter is whole: a gloo group left to interpreter
        exit can be destroyed with its threads still running, which aborts the process."""
        self.group, self.group_id = None, None
        if self.server is not None:
            self.server.close()
            self.server = None

    def pop_seconds(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def serve(self, model: torch.nn.Module, dtype: torch.dtype) -> None:
        """Every rank: answer the pending request by broadcasting the model's weights (cast to `dtype`) to its group."""
        start = time.perf_counter()
        refused = self._refused(model, dtype)
        request, outcome = None, None
        if self.world.is_main:
            request, outcome = self._take_request()
            if request is not None:
                set_json(self.table, ack_key(request.id), {"step": self.step})
                outcome = self._start(model, request, dtype, refused)
        outcome = broadcast_object(outcome, self.world)
        if outcome != "skip":
            error = self._send_layers(model, dtype) if outcome == "send" else outcome
            if self.world.is_main:
                set_json(self.table, served_key(request.id), {"step": self.step, "error": error})
                if error is None:
                    self.taken = max(self.taken, self.step)
                    logger.debug(f"sent policy step {self.step} to group {request.group}")
                else:
                    logger.warning(f"weight broadcast of policy step {self.step} failed: {error}")
        self.seconds += time.perf_counter() - start
        if refused is not None:  # every rank, once the servers and the orchestrator were told why
            if request is not None:
                self._wait_read(served_key(request.id))
            broadcast_object(None, self.world)  # the other ranks wait for rank 0 (a rank that exits ends them all)
            raise NonFiniteWeights(f"{refused}: the training diverged, nothing is sent")

    def _wait_read(self, key: str) -> None:
        """Rank 0: until the orchestrator has read (taken) `key`, at most `timeout` seconds: the store it reads from
        goes when this process does, and the orchestrator must learn why rather than find the trainer gone."""
        deadline = time.monotonic() + self.config.timeout
        while self.table.check([key]) and time.monotonic() < deadline:
            time.sleep(0.01)

    def _refused(self, model: torch.nn.Module, dtype: torch.dtype) -> str | None:
        """Every rank (a collective, once per published step): why the model's weights cannot be sent, or None."""
        if self.checked is None or self.checked[0] != self.step:
            name = nonfinite_parameter(model, dtype)
            problem = f"policy step {self.step} has non-finite values (NaN or inf) in {name[:200]}" if name else None
            self.checked = (self.step, problem)
        return self.checked[1]

    def _take_request(self) -> tuple[Request | None, str | None]:
        """Rank 0: the pending request, deleted from the store; ("skip") for one that does not parse (only a process
        holding the run secret can write one, but a bad one must never stop the trainer)."""
        raw = self.table.take(REQUEST)
        if raw is None:
            return None, "skip"
        try:
            return Request.decode(raw), None
        except (TypeError, ValueError) as e:
            logger.warning(f"ignored a malformed weight-transfer request ({e})")
            return None, "skip"

    def _start(self, model: torch.nn.Module, request: Request, dtype: torch.dtype, refused: str | None) -> str:
        """Rank 0: join the request's group, send the header; "send" if every receiver accepted it, else why not.
        `refused`: why these weights must not be sent (the header says so, and rank 0 says no in the all-reduce).
        Everything here shares one deadline: the other ranks wait for it in a collective."""
        deadline = time.monotonic() + self.config.timeout

        def left() -> float:
            return max(0.1, deadline - time.monotonic())

        try:
            if request.group != self.group_id:
                self.group, self.group_id = None, None  # the old group's peers may be gone
                self.group = join_group(self.table, request.group, 0, request.world_size, self.config.type, left())
                self.group_id = request.group
            send_header(self.group, header(model, self.step, dtype, refused), self.device, left())
            accepted = agree(self.group, refused is None, self.device, left())
            if refused is not None:
                return f"not sent: {refused}"
            return "send" if accepted else "a server refused the weights (its reply to the orchestrator says why)"
        except Exception as e:
            self.group, self.group_id = None, None
            return f"{type(e).__name__}: {e}"
        finally:
            # Past the all-reduce every member has joined (a failed group is given up): nobody reads these again.
            self.table.delete_prefix(group_prefix(request.group))

    def _send_layers(self, model: torch.nn.Module, dtype: torch.dtype) -> str | None:
        """Every rank gathers each layer's full tensors; rank 0 broadcasts them. After a failed broadcast the other
        ranks still need rank 0 in every gather, so it keeps gathering and only stops sending."""
        params = dict(model.named_parameters())
        error = None
        for names in layer_groups(list(params)):
            tensors = [full_tensor(params[name], self.world.device) for name in names]
            if self.world.is_main and error is None:
                try:
                    send_tensors(self.group, tensors, dtype, self.device, self.config.timeout)
                except Exception as e:
                    error = f"{type(e).__name__}: {e}"
                    self.group, self.group_id = None, None
            del tensors
        return error


def header(model: torch.nn.Module, step: int, dtype: torch.dtype, refused: str | None = None) -> Header:
    """What a transfer of the model's parameters holds: their names and full shapes, per layer (a tied output layer
    is the embedding's parameter, so it is listed and sent once, as the checkpoint stores it); `refused`: why it will
    not be sent after all (`Header.refused`)."""
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    groups = [[(name, shapes[name]) for name in names] for names in layer_groups(list(shapes))]
    return Header(step, str(dtype).removeprefix("torch."), groups, refused)


def full_tensor(param: torch.nn.Parameter, device: torch.device) -> torch.Tensor:
    """The whole tensor of an FSDP-sharded parameter (a collective over the trainer's ranks)."""
    if not isinstance(param, DTensor):
        return param.detach()
    if param.device != device:  # sharded on the host (cpu_offload): gather on the device the group runs on
        local = param.to_local().to(device)
        param = DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())
    return param.full_tensor()
