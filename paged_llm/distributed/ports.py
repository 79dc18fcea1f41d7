"""A free TCP port on this machine, for scripts that launch processes of their own."""

from __future__ import annotations

import socket


def get_open_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago (vLLM's ``get_open_port``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port
