"""Free TCP ports for processes started on this host: picked outside the kernel's ephemeral range.

A port found with ``bind(port 0)`` is an ephemeral one, the range every outgoing connection takes its source port
from: between the pick and the server's own bind (the seconds a `vllm serve` or `mmrag serve` takes to start), any
client connection on the host may take it, and the server fails with "address already in use". A port below that
range is never handed to a connection by the kernel; only another picker could take it, and pickers here draw at
random from ~12,000 ports and never hand out the same one twice in a process.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LINUX_EPHEMERAL = (32768, 60999)  # Linux's default, where the file cannot be read
# Above Ray's worker ports (10002-19999 by default) and the ports services are usually configured on.
FIRST_PORT = 20000
_DRAWS = 500

_handed_out: set[int] = set()
_draw = random.Random()  # seeded from os.urandom: processes draw apart


def ephemeral_range(path: Path = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The kernel's ephemeral port range (first, last)."""
    try:
        first, last = (int(v) for v in path.read_text().split())
    except (OSError, ValueError):
        return LINUX_EPHEMERAL
    return first, last


def candidate_ports(ephemeral: tuple[int, int]) -> range:
    """Where to draw from: below the ephemeral range (from FIRST_PORT), else above it; empty if neither has room
    for a thousand ports."""
    first, last = ephemeral
    if first - FIRST_PORT >= 1000:
        return range(FIRST_PORT, first)
    if 65535 - last >= 1000:
        return range(last + 1, 65536)
    return range(0)


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def unused_ports(count: int = 1, host: str = "127.0.0.1") -> int:
    """The first of ``count`` consecutive ports nothing listens on now, outside the ephemeral range (module
    docstring). Where the range leaves no room, an ephemeral one as the OS picks it (the old race, said here)."""
    candidates = candidate_ports(ephemeral_range())
    for _ in range(_DRAWS if candidates else 0):
        port = _draw.randrange(candidates.start, candidates.stop - count + 1)
        block = range(port, port + count)
        if not _handed_out.intersection(block) and all(_bindable(host, p) for p in block):
            _handed_out.update(block)
            return port
    for _ in range(100):  # no room outside the ephemeral range, or all of it taken
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if all(_bindable(host, p) for p in range(port + 1, port + count)):
            return port
    raise RuntimeError(f"no {count} consecutive free ports on {host}")
