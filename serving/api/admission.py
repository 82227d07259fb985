"""Load shedding: a bound on questions in flight, and a client that leaves cancels its question.

Beyond ``max_questions_in_flight`` a question is refused at once with 429 and ``Retry-After``: a server that
queues everything answers nobody in time (every client times out while the server goes on computing answers
nobody reads). A refused question costs nothing — it is refused before decomposition.

A question whose client disconnects is cancelled: its task is cancelled, which takes its plans out of the
scheduler's queue and aborts the ones running in the engine (vLLM aborts a request whose generator is
cancelled, in-process; the remote engine's HTTP request is closed, which a `vllm serve` replica aborts).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import TypeVar

from starlette.requests import Request

from serving.api.errors import ApiError

T = TypeVar("T")

CLIENT_CLOSED = 499  # nginx's status for "client closed the request"; nobody reads it, logs and metrics do


@dataclass(slots=True)
class AdmissionStats:
    admitted: int = 0
    refused: int = 0
    disconnected: int = 0


class Admission:
    def __init__(self, limit: int, *, record: Callable[[str, float | None], None] = lambda outcome, s: None) -> None:
        """``record(outcome, seconds)`` is told how each question ended: ok | error (with its time in the
        server), refused | cancelled (without): the answers metric."""
        if limit < 1:
            raise ValueError(f"max_questions_in_flight must be at least 1, not {limit}")
        self.limit = limit
        self._record = record
        self.in_flight = 0
        self.stats = AdmissionStats()
        self._latency_s = 1.0  # moving average of an admitted question's time in the server

    def retry_after_s(self) -> int:
        """Whole seconds until trying again is worth it: about one question's time in the server."""
        return max(1, math.ceil(self._latency_s))

    @asynccontextmanager
    async def admit(self) -> AsyncIterator[None]:
        if self.in_flight >= self.limit:
            self.stats.refused += 1
            self._record("refused", None)
            raise ApiError(
                429, "overloaded",
                f"{self.in_flight} questions are being answered, the most this server takes at once",
                "retry after the Retry-After seconds; operators: add engine replicas or raise "
                "MMRAG_MAX_QUESTIONS_IN_FLIGHT",
                headers={"Retry-After": str(self.retry_after_s())},
            )
        self.in_flight += 1
        self.stats.admitted += 1
        started, outcome = time.monotonic(), "error"
        try:
            yield
            outcome = "ok"
        except ClientGone:
            outcome = "cancelled"  # recorded by until_disconnect
            raise
        finally:
            self.in_flight -= 1
            spent = time.monotonic() - started
            self._latency_s += 0.2 * (spent - self._latency_s)
            if outcome != "cancelled":
                self._record(outcome, spent)

    async def until_disconnect(self, request: Request, work: Awaitable[T]) -> T:
        """``await work``, cancelled if the client disconnects first (then a 499 nobody reads)."""
        task = asyncio.ensure_future(work)
        watcher = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # our own cancellation (server shutdown) cancels both too
            watcher.cancel()
            if not task.done():
                task.cancel()
                with suppress(asyncio.CancelledError):
                    await task
        if task.cancelled():
            self.stats.disconnected += 1
            self._record("cancelled", None)
            raise ClientGone(CLIENT_CLOSED, "client_closed_request",
                             "the client disconnected; its question was cancelled")
        return task.result()


class ClientGone(ApiError):
    """The client left; the response is for logs and metrics only."""


async def _disconnected(request: Request) -> None:
    """Return when the client is gone. The body is already read, so the next ASGI message is the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
