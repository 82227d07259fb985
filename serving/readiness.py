"""Waiting for a server this process started to be ready: one loop for every child that is polled until it
answers (`vllm serve` replicas, `mmrag serve` under the benchmark, redis-server in the tests).

A child that exits fails at once, with its log's tail, instead of after the whole timeout."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable

import httpx


class ServerStartError(RuntimeError):
    """A server process exited or did not become ready; the message carries its log tail."""


def answers_200(url: str, *, timeout_s: float = 2.0) -> Callable[[], bool]:
    """A readiness probe: ``GET url`` answers 200. Not listening yet, or any other status, is not ready."""

    def ready() -> bool:
        try:
            return httpx.get(url, timeout=timeout_s).status_code == 200
        except httpx.TransportError:
            return False

    return ready


def wait_until_ready(ready: Callable[[], bool], *, timeout_s: float, what: str,
                     proc: subprocess.Popen | None = None, log: Callable[[], str] | None = None,
                     interval_s: float = 0.5) -> None:
    """Poll ``ready`` every ``interval_s`` until it is true. Raises ServerStartError, naming ``what`` and ending
    with ``log()`` (where to look: the log's tail), when ``proc`` exits first or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise ServerStartError(f"{what} exited with code {proc.returncode} before it was ready.{_more(log)}")
        if ready():
            return
        if time.monotonic() > deadline:
            raise ServerStartError(f"{what} was not ready after {timeout_s:.0f} s.{_more(log)}")
        time.sleep(interval_s)


def _more(log: Callable[[], str] | None) -> str:
    return f" {log()}" if log is not None else ""
