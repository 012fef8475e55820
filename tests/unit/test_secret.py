"""The run secret and its derived keys (`utils.secret`): how they reach a process, and that they go no further.

The probes are real child processes started as `rl` starts its own (`Process`), which print what they and their own
children can see: their environment, the block `/proc/<pid>/environ` shows, and their stdin."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import TEST_KEY, TEST_SECRET

from prime_rl.utils.processes import Process
from prime_rl.utils.secret import (
    HTTP_PURPOSE,
    KEYS_VAR,
    SECRET_VAR,
    STORE_PURPOSE,
    RunKeys,
    SecretError,
    check_secret,
    derive,
    derive_keys,
)
from prime_rl.weight_broadcast.client import StoreClient
from prime_rl.weight_broadcast.store import StoreServer
from prime_rl.weight_broadcast.wire import StoreAuthError

PROBE = """
import json, os, subprocess, sys
from prime_rl.utils.secret import take_keys
keys = take_keys()
child = subprocess.run(
    ["sh", "-c", "env; echo; tr '\\\\0' '\\\\n' < /proc/$PPID/environ; echo; cat"], capture_output=True, text=True
)
print(json.dumps({
    "store": keys.store.hex() if keys.store else None,
    "http": keys.http,
    "environ": dict(os.environ),
    "proc_environ": open("/proc/self/environ", "rb").read().decode(errors="replace"),
    "child_saw": child.stdout,
}))
"""


def run_probe(tmp_path: Path, keys: RunKeys | None, env: dict[str, str]) -> dict:
    out = tmp_path / "probe.out"
    probe = Process("probe", [sys.executable, "-c", PROBE], {**os.environ, **env}, out, keys)
    probe.start()
    assert probe.proc.wait(60) == 0, out.read_text()[-2000:]
    return json.loads(out.read_text().splitlines()[-1])


def everything_seen(seen: dict) -> str:
    return json.dumps(seen["environ"]) + seen["proc_environ"] + seen["child_saw"]


def test_a_child_gets_its_keys_on_stdin_and_nothing_it_starts_can_find_them(tmp_path):
    keys = derive_keys(TEST_SECRET)
    seen = run_probe(tmp_path, keys, {})
    assert (seen["store"], seen["http"]) == (keys.store.hex(), keys.http)
    leaked = everything_seen(seen)
    assert keys.store.hex() not in leaked and keys.http not in leaked and TEST_SECRET not in leaked
    assert KEYS_VAR not in seen["environ"]  # the marker is gone too: a grandchild reads no keys from its stdin


def test_a_secret_given_by_environment_is_derived_taken_out_and_wiped_from_proc_environ(tmp_path):
    """Started by hand with `PRIME_RL_SECRET` (a multi-host `rl`, or a process run by hand): after `take_keys` the
    variable is in neither the environment nor the block `/proc/<pid>/environ` shows (which any process of the same
    user can read), nor in what the process starts."""
    seen = run_probe(tmp_path, None, {SECRET_VAR: TEST_SECRET})
    keys = derive_keys(TEST_SECRET)
    assert (seen["store"], seen["http"]) == (keys.store.hex(), keys.http)
    assert f"{SECRET_VAR}=" in seen["proc_environ"]  # the entry is still there, its value zeroed
    assert TEST_SECRET not in everything_seen(seen)


def test_stdin_keys_win_and_the_secret_fills_in_the_rest(tmp_path):
    """A server given an API key on stdin and the run secret by environment: the key is its token, the store key is
    derived from the secret."""
    seen = run_probe(tmp_path, RunKeys(http="api-key-1"), {SECRET_VAR: TEST_SECRET})
    assert (seen["store"], seen["http"]) == (TEST_KEY.hex(), "api-key-1")


def test_only_global_rank_0_reads_the_keys_a_torchrun_agent_shares_with_its_ranks():
    """torchrun's ranks inherit its stdin: the one that hosts the store (global rank 0) takes the keys line, the
    others must not race it for the line."""
    line = derive_keys(TEST_SECRET).encode()
    read, write = os.pipe()
    os.write(write, line)
    os.close(write)
    probe = "from prime_rl.utils.secret import take_keys; k = take_keys(); print(k.store.hex() if k.store else None)"
    ranks = {}
    for rank in ("1", "0"):  # rank 1 first: it would consume the line if it read
        env = {**os.environ, KEYS_VAR: "1", "RANK": rank}
        done = subprocess.run([sys.executable, "-c", probe], stdin=read, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        ranks[rank] = done.stdout.strip()
    os.close(read)
    assert ranks == {"1": "None", "0": TEST_KEY.hex()}


def test_a_missing_or_garbled_keys_line_is_a_clear_error_not_a_hang():
    probe = "from prime_rl.utils.secret import take_keys_at_start; take_keys_at_start('probe')"
    env = {**os.environ, KEYS_VAR: "1"}
    for stdin in (b"", b"not json\n"):
        start = time.monotonic()
        done = subprocess.run([sys.executable, "-c", probe], input=stdin, env=env, capture_output=True, timeout=60)
        assert done.returncode == 2 and b"probe: error:" in done.stderr and KEYS_VAR.encode() in done.stderr
        assert time.monotonic() - start < 20  # EOF or a bad line ends it at once; only a silent pipe waits (30 s)


@pytest.mark.parametrize(
    "weak", ["", "short", "passwordpassword", "x" * 40, "0123456789abcdef" * 2 + "z", "ab" * 15, "a b" * 20]
)
def test_weak_or_malformed_secrets_are_refused_with_the_format_named(weak):
    with pytest.raises(SecretError, match=r"hexadecimal, at least 32 digits \(128 bits\)"):
        check_secret(weak)


def test_strong_secrets_are_taken_in_the_format_every_launcher_generates():
    for good in ("0f" * 16, "A1" * 32, "0123456789abcdef" * 4):
        assert check_secret(good) == good


def test_the_servers_bearer_token_opens_no_store():
    """Finding 2: with the bearer token alone a client opened the store and received the whole policy. The token is
    now a key of its own: neither as a store key nor as a secret to derive one from does it pass the handshake."""
    keys = derive_keys(TEST_SECRET)
    assert keys.http == derive(TEST_SECRET, HTTP_PURPOSE).hex() and keys.store == derive(TEST_SECRET, STORE_PURPOSE)
    server = StoreServer("127.0.0.1", 0, keys.store)
    try:
        for guess in (bytes.fromhex(keys.http), derive(keys.http, STORE_PURPOSE), keys.http.encode()[:32]):
            with pytest.raises(StoreAuthError):
                StoreClient("127.0.0.1", server.port, guess, 5)
        StoreClient("127.0.0.1", server.port, keys.store, 5).close()  # the store key does
    finally:
        server.close()
