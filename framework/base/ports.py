"""A free TCP port for a local rendezvous (`tessera launch local`'s MASTER_PORT, the test kit's process groups)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port that was free a moment ago on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
