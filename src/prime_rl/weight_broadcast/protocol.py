"""The in-memory weight transfer's protocol: the store keys, the requests, and the wire format of one transfer.

Shared by the trainer (`trainer/rl/broadcast.py`), the orchestrator (`orchestrator/broadcast.py`) and the inference
workers (`inference/worker.py`); no torch (the orchestrator imports none): the groups and the collectives that move
the header and the tensors are `transfer.py`. Who writes, reads and deletes each key, and when it stops being valid,
is the table in docs/architecture.md ("The transfer protocol"). In short:

- **Store.** Trainer rank 0 hosts an authenticated store (`store.py`) for its whole life and writes `session`: a fresh
  id per trainer process, and the backend, so that nobody joins a group of an earlier trainer.
- **Requests.** The orchestrator writes one `request` at a time: its own id plus a counter, the group to use (a
  random id, new whenever the members change or a transfer failed), and the group's size. The trainer takes it
  (deletes it), answers `ack/<id>` with the policy step it is about to send, sends, then writes `served/<id>`; the
  orchestrator deletes both once read. Ids carry the orchestrator's random id, so an answer meant for an earlier
  orchestrator is never read as ours.
- **Groups.** Trainer rank 0 is rank 0; the workers of server i come after those of servers 0..i-1. Members find
  each other through `group/<id>/`, which trainer rank 0 deletes once everyone joined.
- **Wire format** of one transfer, all over the group from rank 0: a JSON header (step, dtype, every tensor's name
  and shape, in groups of one decoder layer each, the rest first); one MIN all-reduce in which every receiver says
  whether the header fits its model (a misfit stops every member before any weight changes); then one flat buffer per
  group, which a receiver streams into vLLM's layer-wise reload: neither end holds more than about a layer extra.
  A trainer whose policy holds a NaN or an infinity sends the header with `refused` saying which tensor, and says
  no in the all-reduce itself: every receiver refuses with that reason (a 422 naming the tensor), and no buffer
  follows. (A header without `refused` is byte for byte what it was before the field existed.)
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from prime_rl.weight_broadcast.client import StoreClient
from prime_rl.weight_broadcast.store import Table

SESSION = "session"
"""{"id": hex, "backend": "gloo" | "nccl"}: the trainer process and its group backend; written once by rank 0."""
PUBLISHED = "published"
"""The policy step trainer rank 0 holds and sends when asked."""
REQUEST = "request"
"""The orchestrator's pending transfer request; the trainer takes (deletes) it when it starts serving it."""
ORCHESTRATOR_DONE = "orchestrator_done"
"""Written by an orchestrator that finished its last step (not by one that crashed): the trainer stops waiting for it.
The next orchestrator to connect deletes it."""

ID = re.compile(r"^[0-9a-f]{32}$")
REQUEST_ID = re.compile(r"^[0-9a-f]{32}-[0-9]{1,18}$")
MAX_MEMBERS = 1 << 16
"""Most members a transfer group may have (the trainer and every worker of every server)."""
MAX_STEP = (1 << 63) - 1
DTYPES = ("float32", "bfloat16", "float16")
"""The dtypes a trainer sends (its model's, or the export dtype)."""
LAYER = re.compile(r"\.layers\.(\d+)\.")
MAX_REFUSAL = 2000
"""The longest `Header.refused` a receiver accepts (characters)."""


def ack_key(request_id: str) -> str:
    return f"ack/{request_id}"


def served_key(request_id: str) -> str:
    return f"served/{request_id}"


def group_prefix(group: str) -> str:
    return f"group/{group}/"


def json_object(raw: bytes, key: str) -> dict:
    """A store value as the JSON object it must be (ValueError otherwise)."""
    value = json.loads(raw)
    if not isinstance(value, dict):
        raise ValueError(f"{key} does not hold a JSON object")
    return value


def get_json(kv: Table | StoreClient, key: str, timeout: float = 0.0) -> dict:
    return json_object(kv.get(key, timeout), key)


def set_json(kv: Table | StoreClient, key: str, value: dict) -> None:
    kv.set(key, json.dumps(value))


def _bounded_int(value, low: int, high: int, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"{what} must be an integer in [{low}, {high}]")
    return value


@dataclass(frozen=True)
class Request:
    """One transfer the orchestrator asks for."""

    id: str
    """`<orchestrator id>-<counter>`: names the trainer's `ack/` and `served/` answers."""
    group: str
    """Random id of the transfer group (its rendezvous is `group/<id>/`)."""
    world_size: int
    """Members of the group: the trainer and every worker of every receiving server."""

    def encode(self) -> str:
        return json.dumps({"id": self.id, "group": self.group, "world_size": self.world_size})

    @classmethod
    def decode(cls, raw: bytes) -> Request:
        """Raises ValueError for anything but a well-formed request (the trainer drops it with a warning)."""
        data = json.loads(raw)
        if not isinstance(data, dict) or set(data) != {"id", "group", "world_size"}:
            raise ValueError("a request is a JSON object with exactly id, group and world_size")
        if not isinstance(data["id"], str) or not REQUEST_ID.match(data["id"]):
            raise ValueError("request id must be <32 hex digits>-<counter>")
        if not isinstance(data["group"], str) or not ID.match(data["group"]):
            raise ValueError("group must be 32 hex digits")
        return cls(data["id"], data["group"], _bounded_int(data["world_size"], 2, MAX_MEMBERS, "world_size"))


def read_session(kv: Table | StoreClient, timeout: float) -> dict:
    """The trainer's `session` ({"id", "backend"}), checked."""
    session = get_json(kv, SESSION, timeout)
    well_formed = isinstance(session.get("id"), str) and ID.match(session["id"])
    if not well_formed or session.get("backend") not in ("gloo", "nccl"):
        raise ValueError("the store's session is malformed")
    return session


class HeaderError(ValueError):
    """A transfer header a receiver refuses before any weight changes."""


@dataclass
class Header:
    step: int
    """The policy step the weights are (served as version `step_<step>`)."""
    dtype: str
    """torch dtype name of every tensor (the trainer sends in the model's stored dtype)."""
    groups: list[list[tuple[str, tuple[int, ...]]]]
    """Tensor names and full shapes, one list per flat buffer that follows (the non-layer tensors, then each layer)."""
    refused: str | None = None
    """Why the trainer will not send these weights (a tensor with a NaN or an infinity); None: the buffers follow.
    Set, the trainer says no in the all-reduce, so every receiver stops and reports this."""

    def specs(self) -> dict[str, tuple[int, ...]]:
        return {name: shape for group in self.groups for name, shape in group}

    def encode(self) -> bytes:
        fields = {"step": self.step, "dtype": self.dtype, "groups": self.groups}
        return json.dumps(fields | ({"refused": self.refused} if self.refused is not None else {})).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Header:
        """Parse and bound a header; `HeaderError` says what is wrong (nothing of it is trusted: a bad one is refused
        before any buffer is allocated from it)."""
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError):
            raise HeaderError("the transfer header is not JSON") from None
        if not isinstance(data, dict) or set(data) - {"refused"} != {"step", "dtype", "groups"}:
            raise HeaderError("the transfer header must be an object with exactly step, dtype, groups (and refused)")
        refused = data.get("refused")
        if refused is not None and not (isinstance(refused, str) and 0 < len(refused) <= MAX_REFUSAL):
            raise HeaderError(f"the transfer header's refused must be a string of 1 to {MAX_REFUSAL} characters")
        try:
            step = _bounded_int(data["step"], 0, MAX_STEP, "step")
        except ValueError as e:
            raise HeaderError(f"the transfer header's {e}") from None
        if data["dtype"] not in DTYPES:
            raise HeaderError(f"the transfer header's dtype must be one of {', '.join(DTYPES)}")
        groups = data["groups"]
        if not isinstance(groups, list) or not all(isinstance(g, list) and g for g in groups):
            raise HeaderError("the transfer header's groups must be a list of non-empty lists")
        parsed = []
        for group in groups:
            entries = []
            for entry in group:
                ok = isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)
                ok = ok and isinstance(entry[1], list) and len(entry[1]) <= 8
                ok = ok and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 40 for d in entry[1])
                if not ok:
                    raise HeaderError("each tensor of the transfer header is [name, [dims...]] with 0 <= dim < 2^40")
                entries.append((entry[0], tuple(entry[1])))
            parsed.append(entries)
        return cls(step, data["dtype"], parsed, refused)


def max_header_bytes(expected: dict) -> int:
    """The largest header that can describe the served model (`expected`: name -> spec): every name and shape, twice
    over, plus room for the fields. A receiver refuses a larger size before allocating it."""
    return 2 * len(json.dumps(expected)) + 4096


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
