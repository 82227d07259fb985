"""Waiting for a server this process started to be ready: one loop for every child that is polled until it
answers (`vllm serve` replicas, `mmrag serve` under the benchmark, redis-server in the tests).

A child that exits fails at once, with its log's tail, instead of after the whole timeout. The probe keeps one
HTTP client for all its polls: a client per poll (``httpx.get``) builds a TLS context each time, some 30 ms of CPU
taken from the very server it waits for, twice a second for the tens of seconds a start takes."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable

import httpx


class ServerStartError(RuntimeError):
    """A server process exited or did not become ready; the message carries its log tail."""


class Answers200:
    """A readiness probe: ``GET url`` answers 200. Not listening yet, or any other status, is not ready. One client
    serves every poll; :func:`wait_until_ready` closes it when the waiting ends."""

    def __init__(self, url: str, *, timeout_s: float = 2.0) -> None:
        self.url = url
        self.client = httpx.Client(timeout=timeout_s)

    def __call__(self) -> bool:
        try:
            return self.client.get(self.url).status_code == 200
        except httpx.TransportError:
            return False

    def close(self) -> None:
        self.client.close()


def answers_200(url: str, *, timeout_s: float = 2.0) -> Answers200:
    """A probe that is ready once ``GET url`` answers 200 (:class:`Answers200`)."""
    return Answers200(url, timeout_s=timeout_s)


def wait_until_ready(ready: Callable[[], bool], *, timeout_s: float, what: str,
                     proc: subprocess.Popen | None = None, log: Callable[[], str] | None = None,
                     interval_s: float = 0.5) -> None:
    """Poll ``ready`` every ``interval_s`` until it is true. Raises ServerStartError, naming ``what`` and ending
    with ``log()`` (where to look: the log's tail), when ``proc`` exits first or ``timeout_s`` passes. A probe with a
    ``close()`` (:class:`Answers200`) is closed when the waiting ends, ready or not."""
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            if proc is not None and proc.poll() is not None:
                raise ServerStartError(f"{what} exited with code {proc.returncode} before it was ready.{_more(log)}")
            if ready():
                return
            if time.monotonic() > deadline:
                raise ServerStartError(f"{what} was not ready after {timeout_s:.0f} s.{_more(log)}")
            time.sleep(interval_s)
    finally:
        close = getattr(ready, "close", None)
        if close is not None:
            close()


def _more(log: Callable[[], str] | None) -> str:
    return f" {log()}" if log is not None else ""
