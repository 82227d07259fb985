"""tests/waiting.py: the one polling helper of the suite. Fast: no process, no server, no engine; the timeouts
that must pass are a few tens of milliseconds of a check that can never hold."""

from __future__ import annotations

import asyncio
import itertools
import threading

import pytest

from tests import waiting
from tests.waiting import eventually, eventually_sync, ingest_finished


def counting(results):
    """A check returning ``results`` one call after another (the last one from then on), and its call count."""
    calls = []

    def check():
        calls.append(None)
        value = results[min(len(calls), len(results)) - 1]
        if isinstance(value, BaseException):
            raise value
        return value

    return check, calls


# --- the synchronous form ----------------------------------------------------------------------------------------


def test_returns_the_first_truthy_value_after_the_falsy_ones():
    check, calls = counting([0, None, [], "ready", "later"])
    assert eventually_sync(check, timeout=30, what="ready") == "ready"
    assert len(calls) == 4


def test_an_assertion_in_the_check_is_not_yet_and_its_message_is_kept():
    check, calls = counting([AssertionError("queued"), AssertionError("running"), {"status": "done"}])
    assert eventually_sync(check, timeout=30, what="the job") == {"status": "done"}
    assert len(calls) == 3


def test_on_timeout_it_names_what_the_timeout_and_the_last_value():
    with pytest.raises(AssertionError, match=r"^the job: not within 0\.02 s \(\d+ checks; a hang guard\); "
                                             r"last value: \{\}$") as raised:
        eventually_sync(counting([None, 0, {}])[0], timeout=0.02, what="the job")
    assert raised.value.__cause__ is None


def test_on_timeout_the_last_falsy_value_is_reported():
    with pytest.raises(AssertionError, match=r"^the count: not within 0\.02 s .*last value: 0$"):
        eventually_sync(lambda: 0, timeout=0.02, what="the count")


def test_on_timeout_the_last_assertion_is_reported_and_chained():
    seen = itertools.count()

    def check():
        raise AssertionError(f"status queued (check {next(seen)})")

    with pytest.raises(AssertionError, match=r"^the job: not within 0\.02 s .*last check raised AssertionError: "
                                             r"status queued \(check \d+\)$") as raised:
        eventually_sync(check, timeout=0.02, what="the job")
    assert isinstance(raised.value.__cause__, AssertionError) and "status queued" in str(raised.value.__cause__)


def test_any_other_exception_ends_the_wait_at_once():
    check, calls = counting([None, ValueError("a bug in the check")])
    with pytest.raises(ValueError, match="a bug in the check"):
        eventually_sync(check, timeout=600, what="x")
    assert len(calls) == 2


def test_pytest_fail_in_the_check_ends_the_wait_at_once():
    check, calls = counting([None, pytest.fail.Exception("the server exited with 1", pytrace=False)])
    with pytest.raises(pytest.fail.Exception, match="the server exited"):
        eventually_sync(check, timeout=600, what="the server ready")
    assert len(calls) == 2


def test_exceptions_it_is_told_to_ignore_are_not_yet_too():
    check, calls = counting([ConnectionRefusedError("not listening"), ConnectionResetError("reset"), 200])
    assert eventually_sync(check, timeout=30, what="the server", ignoring=(ConnectionError,)) == 200
    assert len(calls) == 3
    with pytest.raises(AssertionError, match=r"last check raised ConnectionRefusedError: not listening$"):
        eventually_sync(counting([ConnectionRefusedError("not listening")])[0], timeout=0.02, what="the server",
                        ignoring=(ConnectionError,))


def test_it_ends_when_another_thread_makes_the_condition_true():
    go, done = threading.Event(), []

    def worker():
        go.wait()
        done.append("written")

    thread = threading.Thread(target=worker)
    thread.start()
    go.set()
    try:
        assert eventually_sync(lambda: done, timeout=60, what="the worker's write") == ["written"]
    finally:
        thread.join()


def test_the_sync_form_refuses_a_check_that_returns_an_awaitable():
    async def check():
        return True

    with pytest.raises(TypeError, match="await eventually"):
        eventually_sync(check, timeout=1, what="async check")


@pytest.mark.parametrize("timeout", [0, -1])
def test_a_timeout_must_be_positive(timeout):
    with pytest.raises(ValueError, match="positive"):
        eventually_sync(lambda: True, timeout=timeout, what="x")
    with pytest.raises(ValueError, match="positive"):
        asyncio.run(eventually(lambda: True, timeout=timeout, what="x"))


def test_the_interval_is_short_and_its_own():
    poll = waiting._Poll(3600, "the intervals", ())
    intervals = [poll.pause() for _ in range(12)]
    assert intervals[0] <= 0.001 and max(intervals) == waiting.MAX_INTERVAL_S <= 0.05
    assert intervals == sorted(intervals)


# --- the async form ----------------------------------------------------------------------------------------------


async def test_async_returns_the_first_truthy_value_of_a_plain_check():
    check, calls = counting([False, AssertionError("not yet"), 7])
    assert await eventually(check, timeout=30, what="seven") == 7
    assert len(calls) == 3


async def test_async_awaits_a_check_that_is_a_coroutine_function():
    calls = []

    async def check():
        calls.append(None)
        await asyncio.sleep(0)
        assert len(calls) >= 3, f"{len(calls)} calls"
        return {"calls": len(calls)}

    assert await eventually(check, timeout=30, what="three calls") == {"calls": 3}


async def test_async_waits_for_another_task_without_holding_the_loop():
    event = asyncio.Event()
    setter = asyncio.get_running_loop().call_soon(event.set)
    try:
        assert await eventually(event.is_set, timeout=60, what="the event") is True
    finally:
        setter.cancel()


async def test_async_on_timeout_names_what_and_chains_the_last_assertion():
    async def check():
        assert False, "still queued"

    with pytest.raises(AssertionError, match=r"^the job: not within 0\.02 s .*last check raised AssertionError: "
                                             r"still queued") as raised:
        await eventually(check, timeout=0.02, what="the job")
    assert isinstance(raised.value.__cause__, AssertionError)


async def test_async_the_deadline_holds_for_a_check_that_never_returns():
    never = asyncio.Event()

    async def check():
        await never.wait()
        return True

    with pytest.raises(AssertionError, match=r"^a stuck check: not within 0\.02 s \(1 checks"):
        await eventually(check, timeout=0.02, what="a stuck check")


async def test_async_other_exceptions_end_the_wait_at_once_a_timeout_error_of_the_check_too():
    check, calls = counting([None, KeyError("status")])
    with pytest.raises(KeyError):
        await eventually(check, timeout=600, what="x")
    assert len(calls) == 2

    async def times_out():
        raise TimeoutError("the check's own")

    with pytest.raises(TimeoutError, match="the check's own"):
        await eventually(times_out, timeout=600, what="y")


async def test_ingest_finished_asks_the_api_until_the_job_has_finished():
    statuses = iter(["queued", "running", "running", "done"])
    asked = []

    class Response:
        def __init__(self, body):
            self.body = body

        def json(self):
            return self.body

    class Http:
        async def get(self, path, headers=None):
            asked.append((path, headers))
            return Response({"id": "job-1", "status": next(statuses)})

    job = await ingest_finished(Http(), "job-1", timeout=30, headers={"Authorization": "Bearer k"})
    assert job == {"id": "job-1", "status": "done"}
    assert asked == [("/v1/ingest/job-1", {"Authorization": "Bearer k"})] * 4
    cancelling = iter(["running", "cancelling", "cancelled"])

    class Cancelling(Http):
        async def get(self, path, headers=None):
            return Response({"status": next(cancelling)})

    assert await ingest_finished(Cancelling(), "job-2", timeout=30) == {"status": "cancelled"}
    pages = iter(["queued", "running", "running"])

    class Running(Http):
        async def get(self, path, headers=None):
            return Response({"status": next(pages, "running"), "progress": {"pages_done": 3}})

    assert await ingest_finished(Running(), "job-3", timeout=30, unfinished=("queued",)) == {
        "status": "running", "progress": {"pages_done": 3}}
    with pytest.raises(AssertionError, match=r"^ingest job job-4 finished: not within 0\.02 s .*'status': 'running'"):
        await ingest_finished(Running(), "job-4", timeout=0.02)
