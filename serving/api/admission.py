"""Load shedding by expected wait: a bound on questions in flight, a short FIFO queue behind it, and a client
that leaves cancels its question.

Up to ``max_questions_in_flight`` questions are answered at once. One more waits its turn, first come first
served, in a queue of at most ``admission_queue`` — but only while its expected wait is at most
``admission_max_wait_s``: a server that queues everything answers nobody in time (every client times out while
the server goes on computing answers nobody reads). Beyond, it is refused at once with 429 and a
``Retry-After`` from the same estimate. A refused question costs nothing: it is refused before decomposition.

The estimate (:class:`AdmissionQueue`) starts from the measured rate at which questions leave
(:class:`ServiceRate`). It can be wrong (a burst of long answers); a waiter still waiting at its deadline is
refused then, with 429, never left waiting. A waiter whose client leaves gives up its place.

A question whose client disconnects once admitted is cancelled: its task is cancelled, which takes its plans out
of the scheduler's queue and aborts the ones running in the engine (vLLM aborts a request whose generator is
cancelled, in-process; the remote engine's HTTP request is closed, which a `vllm serve` replica aborts).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import Protocol, TypeVar

from serving.api.errors import ApiError

T = TypeVar("T")
Clock = Callable[[], float]

CLIENT_CLOSED = 499  # nginx's status for "client closed the request"; nobody reads it, logs and metrics do

# A question's time in the server assumed until MIN_SAMPLES have left: seconds of a 2B VLM's prefill and a short
# answer on a few CPU cores, longer than on a GPU or with the tiny model. Longer errs on refusing a cold burst
# (with a Retry-After after which the rate is measured); shorter, on queueing questions only for their deadline
# to refuse them.
PRIOR_QUESTION_S = 10.0
MIN_SAMPLES = 8


class ServiceRate:
    """Questions leaving per second of busy time (time with at least one question in flight), over the last
    ``window`` to leave; ``prior_per_s`` until ``min_samples`` have.

    Every way of leaving counts (answered, failed, cancelled): each frees a slot. Idle time does not count, or a
    quiet hour would read as a slow server. Busy time since the last departure counts once it is longer than
    the window took, so an engine that stalls reads as slowing down, while the pause of a burst (every question
    started together, none leaves for a question's time) does not. Under light load the rate measured is that
    of few questions at once, below what a full server does: conservative, which errs on refusing early, not
    on queueing past the deadline.
    """

    def __init__(self, *, prior_per_s: float, window: int = 128, min_samples: int = MIN_SAMPLES,
                 clock: Clock = time.monotonic) -> None:
        if prior_per_s <= 0 or window < 1 or min_samples < 1:
            raise ValueError(f"ServiceRate: prior_per_s > 0, window and min_samples >= 1 "
                             f"(got {prior_per_s}, {window}, {min_samples})")
        self.prior_per_s, self.min_samples, self._clock = prior_per_s, min_samples, clock
        self._active = 0
        self._busy_before = 0.0  # busy seconds before the current busy period
        self._busy_since: float | None = None  # when the current busy period began
        self._left = deque([0.0], maxlen=window + 1)  # busy-clock time of each departure, the window's start first

    def start(self) -> None:
        if self._active == 0:
            self._busy_since = self._clock()
        self._active += 1

    def finish(self) -> None:
        self._left.append(self._busy_now())
        self._active -= 1
        if self._active == 0:
            self._busy_before, self._busy_since = self._busy_now(), None

    def per_s(self) -> float:
        n = len(self._left) - 1
        span, silence = self._left[-1] - self._left[0], self._busy_now() - self._left[-1]
        if silence > span:  # nobody left for longer than the window took: a stalling engine reads as slowing
            span += silence
        if n < self.min_samples or span <= 0:
            return self.prior_per_s
        return n / span

    @property
    def measured(self) -> bool:
        return len(self._left) - 1 >= self.min_samples

    def _busy_now(self) -> float:
        running = self._clock() - self._busy_since if self._busy_since is not None else 0.0
        return self._busy_before + running


@dataclass(slots=True, eq=False)  # compared by identity: each is one question
class Ticket:
    arrived: float
    deadline: float
    admitted_at: float | None = None  # when it got its slot

    @property
    def admitted(self) -> bool:
        return self.admitted_at is not None


@dataclass(slots=True, frozen=True)
class Refusal:
    """Why a question was refused, and when trying again is worth it."""
    reason: str
    retry_after_s: int


class AdmissionQueue:
    """The rules, without asyncio: who gets a slot now, who waits (FIFO), who is refused and until when.

    A freed slot passes straight to the queue's head, so the queue is non-empty only while every slot is taken,
    and a newcomer never overtakes a waiter.

    The expected wait. From the measured rate ``R`` (questions leaving per second), a question's time in the
    server is ``S = limit / R`` (Little's law on a full server, the only one with a queue). Each slot frees when
    its question's ``S`` is up (``max(0, S - age)``), then serves the next waiter for ``S`` more: the k-th waiter
    gets the k-th slot to free. Why not simply ``(k + 1) / R``: that spreads departures evenly, true in a steady
    stream, but in a burst every question in flight started together, none leaves for about ``S``, and the
    first waiters would be promised a wait ``limit`` times too short. In a steady stream the two agree.
    """

    def __init__(self, limit: int, *, queue: int, max_wait_s: float, rate: ServiceRate,
                 clock: Clock = time.monotonic) -> None:
        if limit < 1:
            raise ValueError(f"max_questions_in_flight must be at least 1, not {limit}")
        if queue < 0 or max_wait_s < 0:
            raise ValueError(f"admission_queue and admission_max_wait_s must be at least 0, not {queue}, {max_wait_s}")
        self.limit, self.queue, self.max_wait_s = limit, queue, max_wait_s
        self.rate, self._clock = rate, clock
        self.running: list[Ticket] = []
        self.waiting: deque[Ticket] = deque()

    @property
    def in_flight(self) -> int:
        return len(self.running)

    def arrive(self) -> Ticket | Refusal:
        now = self._clock()
        if self.in_flight < self.limit:
            return self._start(Ticket(now, now))
        ahead = len(self.waiting)
        if ahead < self.queue and self.expected_wait_s(ahead) <= self.max_wait_s:
            ticket = Ticket(now, now + self.max_wait_s)
            self.waiting.append(ticket)
            return ticket
        why = (f"the queue holds {ahead}, the most MMRAG_ADMISSION_QUEUE allows" if ahead >= self.queue else
               f"the expected wait, {self.expected_wait_s(ahead):.1f} s ({ahead} queued ahead, a question "
               f"taking {self.question_s():.1f} s), is over MMRAG_ADMISSION_MAX_WAIT_S ({self.max_wait_s:g} s)")
        return Refusal(f"{self.in_flight} questions are being answered, the most this server takes at once, and "
                       f"{why}", self.retry_after_s())

    def release(self, ticket: Ticket) -> Ticket | None:
        """``ticket``'s question left its slot: the slot passes to the queue's head (returned), or is freed."""
        self.running.remove(ticket)
        self.rate.finish()
        return self._start(self.waiting.popleft()) if self.waiting else None

    def leave(self, ticket: Ticket) -> None:
        """A waiter gives up its place (its client left, or its deadline came)."""
        self.waiting.remove(ticket)

    def question_s(self) -> float:
        """A question's time in the server, full: ``limit`` in flight, ``R`` leaving per second."""
        return self.limit / self.rate.per_s()

    def expected_wait_s(self, ahead: int) -> float:
        """Seconds until a question with ``ahead`` waiters before it gets a slot, nobody else arriving: when the
        ``ahead``-th slot to free does (0-based; every slot chains its waiters ``S`` apart)."""
        if ahead < 0:
            return 0.0
        now, each = self._clock(), self.question_s()
        frees = sorted([0.0] * (self.limit - self.in_flight) +
                       [max(0.0, each - (now - t.admitted_at)) for t in self.running])
        return frees[ahead % self.limit] + (ahead // self.limit) * each

    def retry_after_s(self) -> int:
        """Whole seconds until one more would be queued, questions leaving as estimated and nobody new arriving:
        the queue is shorter than MMRAG_ADMISSION_QUEUE once the waiter ``queue`` places from its end has a
        slot, and the newcomer's slot frees when it would have now, so its wait shrinks by the time it stayed
        away. Waiting it out, a client finds a place if the estimate holds."""
        ahead = len(self.waiting)
        until = max(self.expected_wait_s(ahead) - self.max_wait_s, self.expected_wait_s(ahead - self.queue))
        return max(1, math.ceil(until))

    def _start(self, ticket: Ticket) -> Ticket:
        ticket.admitted_at = self._clock()
        self.running.append(ticket)
        self.rate.start()
        return ticket


@dataclass(slots=True)
class AdmissionStats:
    admitted: int = 0
    refused: int = 0  # at once, or at the deadline (expired)
    expired: int = 0  # queued, refused at the deadline: the estimate was wrong
    disconnected: int = 0  # queued or in flight


class Watched(Protocol):
    """A request, or anything whose next ASGI message is the client's disconnect (answering's ``_Leaving``)."""

    async def receive(self) -> dict: ...


class Admission:
    """:class:`AdmissionQueue` on the event loop: waiting for a turn, the deadline, and clients that leave.

    ``record(outcome, seconds)`` is told how each question ended: ok | error (with its time in the server,
    queueing included), refused | cancelled (without): the answers metric. ``record_wait(seconds)``: how long
    each admitted question waited for its slot (0 when one was free)."""

    def __init__(self, limit: int, *, queue: int = 0, max_wait_s: float = 0.0, rate: ServiceRate | None = None,
                 clock: Clock = time.monotonic,
                 record: Callable[[str, float | None], None] = lambda outcome, s: None,
                 record_wait: Callable[[float], None] = lambda s: None) -> None:
        rate = rate or ServiceRate(prior_per_s=max(limit, 1) / PRIOR_QUESTION_S, clock=clock)
        self.rules = AdmissionQueue(limit, queue=queue, max_wait_s=max_wait_s, rate=rate, clock=clock)
        self._clock, self._record, self._record_wait = clock, record, record_wait
        self._turns: dict[Ticket, asyncio.Future[None]] = {}
        self.stats = AdmissionStats()

    @property
    def limit(self) -> int:
        return self.rules.limit

    @property
    def in_flight(self) -> int:
        return self.rules.in_flight

    @property
    def queued(self) -> int:
        return len(self.rules.waiting)

    @asynccontextmanager
    async def admit(self, watched: Watched | None = None) -> AsyncIterator[None]:
        """A slot for the question: at once, after its turn in the queue, or a 429. ``watched`` tells when its
        client leaves while it waits (then it leaves the queue and ClientGone is raised)."""
        place = self.rules.arrive()
        if isinstance(place, Refusal):
            raise self._refuse(place)
        if not place.admitted:
            await self._turn(place, watched)
        self._record_wait(self._clock() - place.arrived)
        self.stats.admitted += 1
        outcome = "error"
        try:
            yield
            outcome = "ok"
        except ClientGone:
            outcome = "cancelled"  # recorded by until_disconnect
            raise
        finally:
            self._release(place)
            if outcome != "cancelled":
                self._record(outcome, self._clock() - place.arrived)

    async def _turn(self, ticket: Ticket, watched: Watched | None) -> None:
        """Until the ticket is handed a slot; ClientGone if its client leaves first, 429 at its deadline."""
        turn = asyncio.get_running_loop().create_future()
        self._turns[ticket] = turn
        gone = asyncio.ensure_future(_disconnected(watched)) if watched is not None else None
        try:
            await asyncio.wait([turn] if gone is None else [turn, gone],
                               timeout=max(0.0, ticket.deadline - self._clock()), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # our own cancellation (server shutdown)
            self._give_up(ticket, turn)
            raise
        finally:
            if gone is not None:
                gone.cancel()
        if turn.done():
            return
        self._give_up(ticket, turn)
        if gone is not None and gone.done():
            gone.exception()  # read; a receive that failed means the client is gone too
            self.stats.disconnected += 1
            self._record("cancelled", None)
            raise ClientGone(CLIENT_CLOSED, "client_closed_request",
                             "the client disconnected while its question waited; it left the queue")
        self.stats.expired += 1
        waited = self._clock() - ticket.arrived
        raise self._refuse(Refusal(
            f"the question waited {waited:.1f} s for one of the {self.limit} places, the most "
            "MMRAG_ADMISSION_MAX_WAIT_S allows: questions left slower than estimated", self.rules.retry_after_s()))

    def _give_up(self, ticket: Ticket, turn: asyncio.Future[None]) -> None:
        self._turns.pop(ticket, None)
        if turn.done():  # the slot was handed over as the waiter gave up: pass it on
            self._release(ticket)
        else:
            self.rules.leave(ticket)

    def _release(self, ticket: Ticket) -> None:
        turn = self.rules.release(ticket)
        if turn is not None:
            self._turns.pop(turn).set_result(None)

    def _refuse(self, refusal: Refusal) -> ApiError:
        self.stats.refused += 1
        self._record("refused", None)
        return ApiError(
            429, "overloaded", refusal.reason,
            "retry after the Retry-After seconds; operators: add engine replicas, or raise "
            "MMRAG_MAX_QUESTIONS_IN_FLIGHT (answered at once), MMRAG_ADMISSION_QUEUE (waiting) or "
            "MMRAG_ADMISSION_MAX_WAIT_S (the longest wait)",
            headers={"Retry-After": str(refusal.retry_after_s)},
        )

    async def until_disconnect(self, request: Watched, work: Awaitable[T]) -> T:
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


async def _disconnected(request: Watched) -> None:
    """Return when the client is gone. The body is already read, so the next ASGI message is the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
