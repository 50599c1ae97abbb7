"""Sockets at the rendezvous endpoint: is something listening, and a free port (admission.py
decides who may join)."""

from __future__ import annotations

import socket


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    """Whether something listens at host:port (a plain connect: refused at once when nothing does)."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def free_port(host: str) -> int:
    """A port free on ``host`` now (the OS's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host if host not in ("localhost",) else "127.0.0.1", 0))
        return s.getsockname()[1]
