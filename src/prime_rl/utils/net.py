"""Small networking helpers shared by the launchers."""

import ipaddress
import socket

KEEPALIVE_EXPIRY = 2.0
"""Seconds a pooled HTTP connection to an inference server may idle before the client closes it: less than the 5 s
after which vLLM's uvicorn closes an idle one (`VLLM_HTTP_TIMEOUT_KEEP_ALIVE`). With httpx's default, also 5 s, a
connection idle that long could be reused just as the server closed it. Model calls that wait at the policy gate for
seconds (the 135M runs, at k = 1) met that: one call failed right after a weight swap, with "Request timed out"
(aiohttp's "Server disconnected", which `httpx_aiohttp` maps to `httpx.ConnectTimeout`), and the orchestrator paused
the server as failing for 10-13 s (twice in ~45 steps, 2026-11-28). The same error comes back from a uvicorn server
whose loop is busy when a connection's keep-alive runs out and a pool that keeps connections longer than the server
does. The orchestrator's sampling clients (`orchestrator.patches`) and admin clients (`orchestrator.servers`) use it."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_in_use(host: str, port: int) -> bool:
    """Whether another socket holds `host:port`, found by binding it ourselves without SO_REUSEPORT.

    vLLM binds its API port with SO_REUSEPORT when it runs several API processes, and so does a second vLLM on the
    same port: the kernel then splits the connections between the two servers, and a client silently talks to
    both. Binding without the option fails while any other socket holds the port (listening or only bound)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free for a server
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def client_host(host: str) -> str:
    """Where this host reaches a server bound to `host`: a wildcard bind is reached on loopback."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def is_loopback(host: str) -> bool:
    """Whether `host` itself names loopback (a hostname, "", "0.0.0.0" or "::" does not: others may reach them)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
