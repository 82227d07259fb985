"""A free TCP port on 127.0.0.1, for the servers the tests and the benchmarks start (never product code: a
service listens where its settings say)."""

from __future__ import annotations

from mmrag.adapters.ports import unused_ports


def free_port() -> int:
    """A port nothing listens on now, outside the kernel's ephemeral range, so no client connection on the host
    takes it before the server the caller starts binds it (mmrag/adapters/ports.py)."""
    return unused_ports(1)
