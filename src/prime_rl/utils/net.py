"""Small networking helpers shared by the launchers."""

import ipaddress
import socket


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


def is_loopback(host: str) -> bool:
    """Whether `host` itself names loopback (a hostname, "", "0.0.0.0" or "::" does not: others may reach them)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
