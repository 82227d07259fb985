"""A free TCP port on 127.0.0.1, for the servers the tests and the benchmarks start (never product code: a
service listens where its settings say)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nothing listens on now. The OS picks it and the socket is closed again, so another process could
    take it before the caller binds: good enough for servers started at once on a test or bench machine."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
