"""Load shedding by expected wait: a bound on questions in flight, shared fairly between tenants, a short queue
behind it (first come first served within a tenant), and a client that leaves cancels its question.

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
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import Protocol, TypeVar

from mmrag.core.settings import DEFAULT_TENANT
from serving.http.errors import ApiError

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
    tenant: str = DEFAULT_TENANT

    @property
    def admitted(self) -> bool:
        return self.admitted_at is not None


@dataclass(slots=True, frozen=True)
class Refusal:
    """Why a question was refused, and when trying again is worth it."""
    reason: str
    retry_after_s: int


@dataclass(slots=True, frozen=True)
class Share:
    """A tenant's claim on the slots (the tenants file, serving/api/tenants.TenantQuota): its ``weight`` against
    the other active tenants', and at most ``cap`` questions in flight (None: the bound's)."""
    weight: float = 1.0
    cap: int | None = None


class AdmissionQueue:
    """The rules, without asyncio: who gets a slot now, who waits, who is refused and until when.

    **Fair share between tenants.** A tenant is active while it has questions in flight or waiting. Its fair
    share of the ``limit`` slots is ``limit * weight / (sum of the active tenants' weights, its own included)``.
    Each tenant waits in a queue of its own; a freed slot goes to the waiting tenant furthest below its share
    (fewest in flight per weight; between equals, the oldest waiter), so a tenant with many questions never
    queues another's behind its own. A free slot is taken at once by a tenant under its guaranteed share (its
    weight over every known tenant's, :meth:`guaranteed`); beyond it (borrowing what idle tenants do not use) a
    tenant leaves a few slots free, one for each tenant of ``tenants`` with nothing in flight (at most a quarter
    of the slots), so another tenant's first question finds a slot at once instead of waiting for one of the
    borrower's to finish. A tenant never has more than
    its ``cap`` in flight. The waiting room is shared the same way: a tenant may hold ``queue`` times its share
    of the weights in waiters (one at least). One tenant (no tenants file): one FIFO queue, no slot kept free.

    The expected wait. From the measured rate ``R`` (questions leaving per second), a question's time in the
    server is ``S = limit / R`` (Little's law on a full server, the only one with a queue). Each slot frees when
    its question's ``S`` is up (``max(0, S - age)``), then serves the next waiter for ``S`` more: the k-th waiter
    gets the k-th slot to free. Why not simply ``(k + 1) / R``: that spreads departures evenly, true in a steady
    stream, but in a burst every question in flight started together, none leaves for about ``S``, and the
    first waiters would be promised a wait ``limit`` times too short. In a steady stream the two agree. A
    tenant's waiter counts ahead of it its own earlier waiters and, of each other tenant's, those the fair order
    serves first (:meth:`ahead_of`).
    """

    def __init__(self, limit: int, *, queue: int, max_wait_s: float, rate: ServiceRate,
                 clock: Clock = time.monotonic, shares: Mapping[str, Share] | None = None,
                 tenants: Sequence[str] = ()) -> None:
        if limit < 1:
            raise ValueError(f"max_questions_in_flight must be at least 1, not {limit}")
        if queue < 0 or max_wait_s < 0:
            raise ValueError(f"admission_queue and admission_max_wait_s must be at least 0, not {queue}, {max_wait_s}")
        self.limit, self.queue, self.max_wait_s = limit, queue, max_wait_s
        self.rate, self._clock = rate, clock
        self.shares = dict(shares or {})
        self.tenants = tuple(dict.fromkeys([*tenants, *self.shares]))  # the ones a slot is kept free for
        self.running: list[Ticket] = []
        self._queues: dict[str, deque[Ticket]] = {}
        self._in_flight: dict[str, int] = {}

    @property
    def in_flight(self) -> int:
        return len(self.running)

    @property
    def waiting(self) -> list[Ticket]:
        """Every waiter, oldest first."""
        return sorted((t for q in self._queues.values() for t in q), key=lambda t: t.arrived)

    def in_flight_of(self, tenant: str) -> int:
        return self._in_flight.get(tenant, 0)

    def waiting_of(self, tenant: str) -> int:
        return len(self._queues.get(tenant, ()))

    def share(self, tenant: str) -> float:
        """``tenant``'s fair share of the slots, now: its weight over the active tenants' (itself among them)."""
        return self._share_among(tenant, self._active())

    def guaranteed(self, tenant: str) -> float:
        """Slots ``tenant`` takes whoever else is busy: its weight over every known tenant's and active one's."""
        return self._share_among(tenant, self._active() | set(self.tenants))

    def kept_free(self, tenant: str) -> int:
        """Slots a tenant at or over its share leaves free: one per other tenant with nothing in flight or
        waiting, at most a quarter of the slots."""
        idle = set(self.tenants) - self._active() - {tenant}
        return min(len(idle), self.limit // 4)

    def arrive(self, tenant: str = DEFAULT_TENANT) -> Ticket | Refusal:
        now = self._clock()
        if not self.waiting_of(tenant) and self._may_start(tenant):
            return self._start(Ticket(now, now, tenant=tenant))
        mine, room = self.waiting_of(tenant), self.queue_room(tenant)
        ahead = self.ahead_of(tenant)
        if mine < room and self.expected_wait_s(ahead) <= self.max_wait_s:
            ticket = Ticket(now, now + self.max_wait_s, tenant=tenant)
            self._queues.setdefault(tenant, deque()).append(ticket)
            return ticket
        if self._capped(tenant):
            held = (f"tenant {tenant!r} has {self.in_flight_of(tenant)} questions being answered, the most its "
                    "questions_in_flight in the tenants file allows")
        elif len(self.tenants) > 1 and self.in_flight_of(tenant) >= self.share(tenant):
            held = (f"tenant {tenant!r} has {self.in_flight_of(tenant)} questions being answered, its fair share "
                    f"of the {self.limit} this server takes at once")
        else:
            held = f"{self.in_flight} questions are being answered, the most this server takes at once"
        why = (f"the queue holds {mine}, the most MMRAG_ADMISSION_QUEUE allows"
               + ("" if room == self.queue else f" for this tenant ({room} of {self.queue}, its share)")
               if mine >= room else
               f"the expected wait, {self.expected_wait_s(ahead):.1f} s ({ahead} queued ahead, a question "
               f"taking {self.question_s():.1f} s), is over MMRAG_ADMISSION_MAX_WAIT_S ({self.max_wait_s:g} s)")
        return Refusal(f"{held}, and {why}", self.retry_after_s(tenant))

    def release(self, ticket: Ticket) -> list[Ticket]:
        """``ticket``'s question left its slot: the slot passes to the waiter the fair order picks, or is freed.
        The waiters started (returned) are usually one or none; more when the tenant leaving raised the others'
        shares."""
        self.running.remove(ticket)
        self._in_flight[ticket.tenant] -= 1
        self.rate.finish()
        started = []
        while (turn := self._next()) is not None:
            started.append(turn)
        return started

    def leave(self, ticket: Ticket) -> None:
        """A waiter gives up its place (its client left, or its deadline came)."""
        self._queues[ticket.tenant].remove(ticket)

    def queue_room(self, tenant: str) -> int:
        """Waiters ``tenant`` may hold: all of MMRAG_ADMISSION_QUEUE alone, its share of the weights with others."""
        if not self.queue:
            return 0
        return max(1, math.floor(self.queue * self.share(tenant) / self.limit))

    def ahead_of(self, tenant: str, mine: int | None = None) -> int:
        """Waiters served before ``tenant``'s next one (or its ``mine``-th, 0-based), the fair order holding:
        its own before it, and of each other tenant's the ones their weight gives them meanwhile."""
        mine = self.waiting_of(tenant) if mine is None else mine
        own = self._weight(tenant)
        others = sum(min(len(q), math.ceil((mine + 1) * self._weight(t) / own))
                     for t, q in self._queues.items() if t != tenant)
        return mine + others

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

    def retry_after_s(self, tenant: str = DEFAULT_TENANT) -> int:
        """Whole seconds until one more would be queued, questions leaving as estimated and nobody new arriving:
        the queue is shorter than the tenant's room once the waiter ``room`` places from its end has a slot,
        and the newcomer's slot frees when it would have now, so its wait shrinks by the time it stayed away.
        Waiting it out, a client finds a place if the estimate holds."""
        mine, room = self.waiting_of(tenant), self.queue_room(tenant)
        head = self.ahead_of(tenant, mine - room) if mine - room >= 0 else -1
        until = max(self.expected_wait_s(self.ahead_of(tenant)) - self.max_wait_s, self.expected_wait_s(head))
        return max(1, math.ceil(until))

    def _active(self) -> set[str]:
        """The tenants with questions in flight or waiting."""
        return {t for t, n in self._in_flight.items() if n} | {t for t, q in self._queues.items() if q}

    def _share_among(self, tenant: str, others: set[str]) -> float:
        return self.limit * self._weight(tenant) / sum(self._weight(t) for t in others | {tenant})

    def _weight(self, tenant: str) -> float:
        return self.shares.get(tenant, _EQUAL).weight

    def _capped(self, tenant: str) -> bool:
        cap = self.shares.get(tenant, _EQUAL).cap
        return cap is not None and self.in_flight_of(tenant) >= cap

    def _may_start(self, tenant: str) -> bool:
        free = self.limit - self.in_flight
        if free <= 0 or self._capped(tenant):
            return False
        return self.in_flight_of(tenant) < self.guaranteed(tenant) or free > self.kept_free(tenant)

    def _next(self) -> Ticket | None:
        """Start the waiter the fair order picks among the tenants that may start one, if any."""
        ready = [t for t, q in self._queues.items() if q and self._may_start(t)]
        if not ready:
            return None
        # Fewest in flight per weight once started (so weights 3:1 settle at 6:2 of 8, not swing between 5:3 and
        # 6:2); between equals, the oldest waiter.
        tenant = min(ready, key=lambda t: ((self.in_flight_of(t) + 1) / self._weight(t), self._queues[t][0].arrived))
        return self._start(self._queues[tenant].popleft())

    def _start(self, ticket: Ticket) -> Ticket:
        ticket.admitted_at = self._clock()
        self.running.append(ticket)
        self._in_flight[ticket.tenant] = self.in_flight_of(ticket.tenant) + 1
        self.rate.start()
        return ticket


_EQUAL = Share()


@dataclass(slots=True)
class AdmissionStats:
    # Counted as each question asks for a place, in the same step that places or refuses it: the others lag it
    # (a waiter handed a slot counts as admitted only once its task runs again), so their sum is no count of
    # arrivals.
    arrived: int = 0
    admitted: int = 0
    refused: int = 0  # at once, or at the deadline (expired)
    expired: int = 0  # queued, refused at the deadline: the estimate was wrong
    disconnected: int = 0  # queued or in flight


class Watched(Protocol):
    """A request, or anything whose next ASGI message is the client's disconnect (answering's ``_Leaving``)."""

    async def receive(self) -> dict: ...


class Admission:
    """:class:`AdmissionQueue` on the event loop: waiting for a turn, the deadline, and clients that leave.

    ``record(outcome, seconds, tenant)`` is told how each question ended: ok | error (with its time in the
    server, queueing included), refused | cancelled (without): the answers metric. ``record_wait(seconds,
    tenant)``: how long each admitted question waited for its slot (0 when one was free). ``shares`` and
    ``tenants``: the fair share between tenants (:class:`AdmissionQueue`)."""

    def __init__(self, limit: int, *, queue: int = 0, max_wait_s: float = 0.0, rate: ServiceRate | None = None,
                 clock: Clock = time.monotonic,
                 record: Callable[[str, float | None, str], None] = lambda outcome, s, tenant: None,
                 record_wait: Callable[[float, str], None] = lambda s, tenant: None,
                 shares: Mapping[str, Share] | None = None, tenants: Sequence[str] = ()) -> None:
        rate = rate or ServiceRate(prior_per_s=max(limit, 1) / PRIOR_QUESTION_S, clock=clock)
        self.rules = AdmissionQueue(limit, queue=queue, max_wait_s=max_wait_s, rate=rate, clock=clock,
                                    shares=shares, tenants=tenants)
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
    async def admit(self, watched: Watched | None = None, tenant: str = DEFAULT_TENANT) -> AsyncIterator[float]:
        """A slot for the question: at once, after its turn in the queue, or a 429; yields the seconds it waited.
        ``watched`` tells when its client leaves while it waits (then it leaves the queue and ClientGone is
        raised)."""
        self.stats.arrived += 1
        place = self.rules.arrive(tenant)
        if isinstance(place, Refusal):
            raise self._refuse(place, tenant)
        if not place.admitted:
            await self._turn(place, watched)
        waited = self._clock() - place.arrived
        self._record_wait(waited, tenant)
        self.stats.admitted += 1
        outcome = "error"
        try:
            yield waited
            outcome = "ok"
        except ClientGone:
            outcome = "cancelled"  # recorded by until_disconnect
            raise
        finally:
            self._release(place)
            if outcome != "cancelled":
                self._record(outcome, self._clock() - place.arrived, tenant)

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
            self._record("cancelled", None, ticket.tenant)
            raise ClientGone(CLIENT_CLOSED, "client_closed_request",
                             "the client disconnected while its question waited; it left the queue")
        self.stats.expired += 1
        waited = self._clock() - ticket.arrived
        raise self._refuse(Refusal(
            f"the question waited {waited:.1f} s for one of the {self.limit} places, the most "
            "MMRAG_ADMISSION_MAX_WAIT_S allows: questions left slower than estimated",
            self.rules.retry_after_s(ticket.tenant)), ticket.tenant)

    def _give_up(self, ticket: Ticket, turn: asyncio.Future[None]) -> None:
        self._turns.pop(ticket, None)
        if turn.done():  # the slot was handed over as the waiter gave up: pass it on
            self._release(ticket)
        else:
            self.rules.leave(ticket)

    def _release(self, ticket: Ticket) -> None:
        for turn in self.rules.release(ticket):
            self._turns.pop(turn).set_result(None)

    def _refuse(self, refusal: Refusal, tenant: str) -> ApiError:
        self.stats.refused += 1
        self._record("refused", None, tenant)
        return ApiError(
            429, "overloaded", refusal.reason,
            "retry after the Retry-After seconds; operators: add engine replicas, or raise "
            "MMRAG_MAX_QUESTIONS_IN_FLIGHT (answered at once), MMRAG_ADMISSION_QUEUE (waiting) or "
            "MMRAG_ADMISSION_MAX_WAIT_S (the longest wait), or a tenant's weight or questions_in_flight "
            "(`mmrag tenant quota`)",
            headers={"Retry-After": str(refusal.retry_after_s)},
        )

    async def until_disconnect(self, request: Watched, work: Awaitable[T], tenant: str = DEFAULT_TENANT) -> T:
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
            self._record("cancelled", None, tenant)
            raise ClientGone(CLIENT_CLOSED, "client_closed_request",
                             "the client disconnected; its question was cancelled")
        return task.result()


class ClientGone(ApiError):
    """The client left; the response is for logs and metrics only."""


async def _disconnected(request: Watched) -> None:
    """Return when the client is gone. The body is already read, so the next ASGI message is the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
