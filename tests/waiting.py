"""Waiting in tests: one helper, :func:`eventually`, instead of hand-written polling loops (issue 42).

A test that must wait for something another thread, task or process does checks it again and again until it
holds. ``timeout`` is a hang guard, never a speed check: set it to what a loaded 2-core machine may need, many
times what the wait usually takes. The poll interval is the helper's own and short (1 ms, doubling to 20 ms), so
a wait ends within one interval of its condition and costs no fixed sleep.

    job = await eventually(finished, timeout=120, what="the ingest job finished")   # in an async test
    eventually_sync(lambda: path.exists(), timeout=30, what="the lock file")        # in a synchronous one

The check returns a value: the first truthy one is returned. An ``AssertionError`` it raises (or one of
``ignoring``) counts as "not yet", so a check may assert with a message; on timeout the AssertionError raised
names ``what``, the timeout, and the last value or exception, chained to that exception. Anything else the check
raises ends the wait at once: ``pytest.fail(...)`` when what is awaited can no longer come (the process it
waits on exited, say).

``scripts/test_waits.py`` lists every fixed sleep and hand-written polling loop left in tests/: this module is
the one place that polls.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")

FIRST_INTERVAL_S = 0.001
MAX_INTERVAL_S = 0.02


class _Poll:
    """What both forms share: the intervals (1 ms doubling to 20 ms, never past the deadline), what each check
    gave, and the error a timeout raises."""

    def __init__(self, timeout: float, what: str, ignoring: tuple[type[BaseException], ...]) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, not {timeout}")
        self.timeout, self.what = timeout, what
        self.not_yet = (AssertionError, *ignoring)
        self.deadline = time.monotonic() + timeout
        self.checks, self.last, self.error = 0, None, None
        self._interval = FIRST_INTERVAL_S

    def saw(self, value: Any = None, error: BaseException | None = None) -> bool:
        """Records one check's value (or its not-yet exception); True when the wait is over (a truthy value)."""
        self.last, self.error = (None, error) if error is not None else (value, None)
        return error is None and bool(value)

    def pause(self) -> float | None:
        """How long to sleep before the next check; None once the deadline has passed."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            return None
        interval, self._interval = self._interval, min(self._interval * 2, MAX_INTERVAL_S)
        return min(interval, left)

    def timed_out(self) -> AssertionError:
        seen = (f"last check raised {type(self.error).__name__}: {self.error}" if self.error is not None
                else f"last value: {self.last!r}")
        return AssertionError(f"{self.what}: not within {self.timeout:g} s ({self.checks} checks; a hang guard); "
                              f"{seen}")


async def eventually(check: Callable[[], T | Awaitable[T]], *, timeout: float, what: str,
                     ignoring: tuple[type[BaseException], ...] = ()) -> T:
    """``check()`` (awaited when it returns an awaitable) until it returns a truthy value, which is returned; an
    AssertionError naming ``what`` and the last value or exception after ``timeout`` seconds. The deadline holds
    for a check that is itself slow: one still running then is cancelled."""
    poll = _Poll(timeout, what, ignoring)
    guard = asyncio.timeout(timeout)
    try:
        async with guard:
            while True:
                poll.checks += 1
                try:
                    value = check()
                    if inspect.isawaitable(value):
                        value = await value
                except poll.not_yet as exc:
                    poll.saw(error=exc)
                else:
                    if poll.saw(value):
                        return value
                if (pause := poll.pause()) is None:
                    break
                await asyncio.sleep(pause)
    except TimeoutError:
        if not guard.expired():  # the check's own TimeoutError, not the deadline's
            raise
    raise poll.timed_out() from poll.error


def eventually_sync(check: Callable[[], T], *, timeout: float, what: str,
                    ignoring: tuple[type[BaseException], ...] = ()) -> T:
    """:func:`eventually` for synchronous code (a synchronous test, a fixture, a thread). On an event loop it
    holds the loop while it waits: only for what runs elsewhere (another process); for anything the loop runs
    (a server of the test's own), await :func:`eventually`. A check is not interrupted: keep each one short."""
    poll = _Poll(timeout, what, ignoring)
    while True:
        poll.checks += 1
        try:
            value = check()
        except poll.not_yet as exc:
            poll.saw(error=exc)
        else:
            if inspect.isawaitable(value):
                if inspect.iscoroutine(value):
                    value.close()
                raise TypeError(f"the check of {what!r} returned an awaitable: await eventually() instead")
            if poll.saw(value):
                return value
        if (pause := poll.pause()) is None:
            break
        time.sleep(pause)
    raise poll.timed_out() from poll.error


async def ingest_finished(http: Any, job_id: str, *, timeout: float, headers: dict[str, str] | None = None,
                          unfinished: tuple[str, ...] = ("queued", "running", "cancelling")) -> dict:
    """The ingest job as ``GET /v1/ingest/{job_id}`` answers once its status is none of ``unfinished`` (by
    default: once it is done, failed or cancelled); ``http``: an httpx.AsyncClient on the API. A client's view
    of a job, waited for with :func:`eventually`."""

    async def finished() -> dict:
        job = (await http.get(f"/v1/ingest/{job_id}", headers=headers)).json()
        assert job.get("status") not in unfinished, job
        return job

    return await eventually(finished, timeout=timeout, what=f"ingest job {job_id} finished")
