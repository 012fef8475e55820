"""A server that outlives a run: `inference --server.attachable` leaves a card; `rl --attach` and `eval --attach`
use the server it names instead of starting one, reset it to their base weights, and leave it running.

The card (`~/.cache/prime-rl/servers/<host>-<port>.json`, or under `$XDG_CACHE_HOME`) says what the server serves
and holds its keys: the bearer token and, where it receives weights in memory, the store key the trainer's store
must use. It is written atomically, readable by its owner only, and removed when the server exits; a card whose
server is gone (killed) is recognised by its pid and by the token the server no longer takes. Attaching checks that
the server serves the run's model with the run's tokenizer and context length before anything starts, and holds a
lock beside the card for the run's length, so two runs never share one server. Every check is one line naming
both sides; nothing about the server changes until they all pass.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import stat
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

import httpx

from prime_rl.utils.fs import write_atomic
from prime_rl.utils.health import serves_base_weights
from prime_rl.utils.net import client_host
from prime_rl.utils.secret import RunKeys

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
"""The files that decide how a model directory tokenizes and renders chats."""

RESET_TIMEOUT = 300.0
"""Seconds the reset to the base weights may take (a large model reloads from disk)."""


class AttachError(RuntimeError):
    """The server cannot be attached to: no card, a dead server, another model, tokenizer or setting."""


@dataclass(frozen=True)
class ServerCard:
    """What an attachable server serves, where, and the keys to use it."""

    pid: int
    url: str
    model: str
    """`model.name` as the server was given it (a local directory is compared by its resolved path)."""
    tokenizer: str
    """`tokenizer_fingerprint` of the served model."""
    dtype: str
    max_model_len: int | None
    max_lora_rank: int | None
    """None: the server serves no adapters."""
    weight_broadcast: dict
    """`type`, `host`, `port` of the store it receives in-memory weights from (`type = filesystem`: none)."""
    weight_roots: list[str]
    """Directories `/update_weights` may load from (resolved)."""
    http: str | None
    store: str | None
    """The store key, hex (None: the server receives no in-memory weights)."""

    @property
    def keys(self) -> RunKeys:
        return RunKeys(bytes.fromhex(self.store) if self.store else None, self.http)


def servers_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "prime-rl" / "servers"


def card_path(host: str, port: int) -> Path:
    return servers_dir() / f"{host}-{port}.json"


def local_path(name: str) -> str | None:
    """`name` resolved, where it is a local directory (a hub id stays a name)."""
    path = Path(name).expanduser()
    return str(path.resolve()) if path.is_dir() else None


def tokenizer_fingerprint(name: str) -> str:
    """SHA-256 over the tokenizer and chat-template files of a local model directory; `name:<id>` for a hub id (the
    hub's files for one id are the same everywhere)."""
    path = local_path(name)
    if path is None:
        return f"name:{name}"
    digest = hashlib.sha256()
    for file in TOKENIZER_FILES:
        target = Path(path) / file
        if target.is_file():
            digest.update(file.encode() + b"\0" + target.read_bytes() + b"\0")
    return digest.hexdigest()


def write_card(config, keys: RunKeys) -> Path:
    """The card of this server (`config`: its `InferenceConfig`), owner-only."""
    server, model = config.server, config.model
    broadcast = config.weight_broadcast
    card = ServerCard(
        pid=os.getpid(),
        url=f"http://{client_host(server.host)}:{server.port}",
        model=model.name,
        tokenizer=tokenizer_fingerprint(model.name),
        dtype=model.dtype,
        max_model_len=model.max_model_len,
        max_lora_rank=config.lora.max_lora_rank if config.lora is not None else None,
        weight_broadcast=broadcast.model_dump(include={"type", "host", "port"}),
        weight_roots=[str(Path(p).resolve()) for p in config.weight_roots],
        http=keys.http,
        store=keys.store.hex() if keys.store and broadcast.in_memory else None,
    )
    path = card_path(server.host, server.port)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    write_atomic(path, json.dumps(asdict(card), indent=1).encode())  # mkstemp: mode 0600
    return path


def remove_card(path: Path) -> None:
    """The server is going: its card and its lock file go (only its own: a newer server on the port may have replaced
    them)."""
    try:
        if json.loads(path.read_text())["pid"] == os.getpid():
            path.unlink()
            path.with_suffix(".lock").unlink(missing_ok=True)
    except (OSError, ValueError, KeyError):
        pass


def read_card(host: str, port: int) -> ServerCard:
    """The card of the server on `host:port`, checked to be this user's and private, its server alive."""
    path = card_path(host, port)
    start = f"`inference ... --server.port {port} --server.attachable`"
    try:
        info = path.stat()
    except FileNotFoundError:
        raise AttachError(
            f"no attachable server on port {port} ({path} does not exist): start one with {start}"
        ) from None
    if info.st_uid != os.getuid() or info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise AttachError(f"{path} is not private to this user (owner {info.st_uid}, mode {oct(info.st_mode)})")
    try:
        card = ServerCard(**json.loads(path.read_text()))
    except (ValueError, TypeError) as e:
        raise AttachError(f"{path} is not a server card ({e}): remove it and restart the server") from None
    try:
        os.kill(card.pid, 0)
    except ProcessLookupError:
        raise AttachError(
            f"the attachable server on port {port} (pid {card.pid}) is gone: start one with {start}"
        ) from None
    except PermissionError:
        pass  # alive, another user's pid (the card's owner check already passed)
    return card


def mismatches(card: ServerCard, model: str, dtype: str, max_model_len: int | None, lora_rank: int | None) -> list[str]:
    """What the run needs that the server does not serve, one line each (empty: it fits)."""
    problems = []
    same_model = (local_path(model) or model) == (local_path(card.model) or card.model)
    if not same_model:
        problems.append(f"the server serves {card.model!r}, this run's model is {model!r}")
    elif tokenizer_fingerprint(model) != card.tokenizer:
        problems.append(f"{model!r} tokenizes differently now than when the server loaded it (its tokenizer files)")
    if dtype != card.dtype:
        problems.append(f"the server computes in {card.dtype}, this run asks for {dtype} (inference.model.dtype)")
    if max_model_len is not None and card.max_model_len is not None and card.max_model_len < max_model_len:
        problems.append(f"the server's max_model_len is {card.max_model_len}, this run needs {max_model_len}")
    if lora_rank is not None and (card.max_lora_rank or 0) < lora_rank:
        served = "no adapters" if card.max_lora_rank is None else f"adapters up to rank {card.max_lora_rank}"
        problems.append(f"the server serves {served}, this run trains a rank-{lora_rank} adapter")
    return problems


def outside_roots(card: ServerCard, paths: list[Path]) -> list[Path]:
    """Those of `paths` the server may not load from (its `allowed_weight_roots`)."""
    roots = [Path(r) for r in card.weight_roots]
    return [p for p in paths if not any(Path(p).resolve().is_relative_to(r) for r in roots)]


def claim(server, model, lora_rank: int | None, weight_paths: list[Path]) -> tuple[ServerCard, IO]:
    """The card of the attachable server on `server`'s host and port (an `InferenceConfig.server`), checked to serve
    `model` (an `InferenceConfig.model`) with adapters of `lora_rank` and to be allowed to load `weight_paths`, and the
    attachment lock, held. Nothing on the server changes; what does not fit is one `AttachError`."""
    card = read_card(server.host, server.port)
    problems = mismatches(card, model.name, model.dtype, model.max_model_len, lora_rank)
    if outside := outside_roots(card, weight_paths):
        problems.append(
            f"it may load weights only under {', '.join(card.weight_roots)}, not from {outside[0]} (start it with "
            "`--allowed-weight-roots` naming that directory or one above it)"
        )
    if problems:
        raise AttachError(f"the server on port {server.port} cannot serve this run: " + "; ".join(problems))
    return card, hold(card, server.host, server.port)


def hold(card: ServerCard, host: str, port: int) -> IO:
    """The attachment lock (held until the returned file is closed or the process ends); another run holding it is
    an `AttachError`."""
    lock = open(card_path(host, port).with_suffix(".lock"), "a")  # noqa: SIM115 - held for the run's length
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise AttachError(f"another run is attached to the server on port {port}: wait for it or stop it") from None
    return lock


def reset(card: ServerCard) -> str:
    """Unload every adapter and reload the base weights (`/reload_weights`): the server serves what a fresh one would.
    Returns what it served before."""
    headers = {"Authorization": f"Bearer {card.http}"} if card.http else {}
    try:
        with httpx.Client(base_url=card.url, headers=headers, timeout=RESET_TIMEOUT, trust_env=False) as client:
            health = client.get("/health", timeout=5.0)
            if health.status_code != 200:
                raise AttachError(f"the server at {card.url} is not serving (/health {health.status_code})")
            state = client.get("/weights")
            if state.status_code == 401:
                raise AttachError(f"the server at {card.url} does not take its card's token: the card is stale")
            state.raise_for_status()
            before = state.json()
            for name in before.get("adapters") or {}:
                client.post("/unload_lora_adapter", json={"lora_name": name}).raise_for_status()
            if not serves_base_weights(before):
                reply = client.post("/reload_weights", json={})
                if reply.status_code != 200:
                    raise AttachError(f"resetting the server to its base weights failed: {reply.text[:500]}")
    except httpx.HTTPError as e:
        raise AttachError(f"the server at {card.url} did not answer as expected ({e})") from None
    adapters = ", ".join(before.get("adapters") or {}) or "none"
    return f"policy {before.get('version')}, adapters {adapters}"
