"""The suite's waits that can race (issue 42): scripts/test_waits.py finds every fixed sleep, hand-written polling
loop and comparison of two timings in tests/*.py, and this test fails on any that is not on its lists (each allowed
one says why it is no race). Fast: it reads source, it runs nothing. Then the scanner itself, on small sources."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("mmrag_test_waits", REPO / "scripts" / "test_waits.py")
waits = sys.modules.setdefault(_spec.name, importlib.util.module_from_spec(_spec))  # dataclasses look it up
_spec.loader.exec_module(waits)


def test_every_wait_in_the_suite_that_can_race_is_event_driven_or_listed_with_its_reason(capsys):
    code = waits.main([])
    report = capsys.readouterr().out
    print(report)  # what CI shows: every finding, listed or not, and the counts
    assert code == 0, report
    assert "\n  tests/waiting.py:" not in report  # the one module that polls is not scanned


def test_each_allowed_wait_says_why_it_is_no_race():
    for key, why in {**waits.ALLOWED, **waits.PENDING}.items():
        path, function, kind = key
        assert (REPO / path).is_file() and function and kind in ("sleep", "poll", "timing"), key
        assert len(why.split()) >= 3, (key, why)


def scan(source: str) -> list[tuple[str, str, str]]:
    """(kind, function, detail) of each finding in ``source``."""
    return [(f.kind, f.function, f.detail) for f in waits.scan_source(textwrap.dedent(source), "tests/test_x.py")]


def kinds(source: str) -> list[tuple[str, str]]:
    return [(kind, function) for kind, function, _ in scan(source)]


# --- sleeps ---------------------------------------------------------------------------------------------------------


def test_a_constant_sleep_is_found_however_it_is_imported_and_a_yield_or_a_string_is_not():
    found = kinds('''
        import asyncio, time
        import time as clock
        from time import sleep as nap
        from asyncio import sleep
        GUARD_S = 0.5
        CODE = "import time; time.sleep(5)"  # a child's script: not this module's sleep

        async def test_a():
            await asyncio.sleep(0.1)
            await asyncio.sleep(0)  # a yield to the loop
            await sleep(delay=2 * GUARD_S)

        def test_b(x):
            time.sleep(x)  # not a constant: the loops below catch it where it polls
            clock.sleep(-(-1))
            nap(GUARD_S)
    ''')
    assert found == [("sleep", "test_a"), ("sleep", "test_a"), ("sleep", "test_b"), ("sleep", "test_b")]


# --- polling loops --------------------------------------------------------------------------------------------------


def test_polling_loops_are_found_with_what_bounds_them():
    found = scan('''
        import asyncio, threading, time

        async def no_deadline(server):
            while not server.started:
                await asyncio.sleep(0.05)

        def with_deadline(path):
            deadline = time.monotonic() + 30
            while not path.exists():
                assert time.monotonic() < deadline
                time.sleep(0.01)

        async def under_a_timeout(cond):
            async with asyncio.timeout(10):
                while not cond():
                    await asyncio.sleep(0)

        async def by_count(get):
            for _ in range(600):
                if (await get())["status"] == "done":
                    break
                await asyncio.sleep(0.1)

        def on_an_event(stop: threading.Event, check):
            while not stop.wait(0.5):
                check()

        class Server:
            def start(self, ping):
                while True:
                    try:
                        return ping()
                    except OSError:
                        time.sleep(self.interval)
    ''')
    polls = {function: detail for kind, function, detail in found if kind == "poll"}
    assert polls.keys() == {"no_deadline", "with_deadline", "under_a_timeout", "by_count", "on_an_event",
                            "Server.start"}
    assert "WITHOUT a deadline: while not server.started" in polls["no_deadline"]
    assert "with a deadline" in polls["with_deadline"] and "with a deadline" in polls["under_a_timeout"]
    assert "bounded by a count, not a deadline: for ... in range(600)" in polls["by_count"]
    assert "WITHOUT a deadline" in polls["on_an_event"] and "WITHOUT a deadline" in polls["Server.start"]


def test_a_loop_that_sleeps_without_polling_is_not_a_poll():
    assert kinds('''
        import asyncio

        async def settle():
            for _ in range(5):
                await asyncio.sleep(0)

        async def test_paced(send):
            for i in range(3):
                await send(i)
                await asyncio.sleep(1)
    ''') == [("sleep", "test_paced")]  # the fixed sleep, not a poll: nothing is waited for


def test_an_eventually_that_is_not_awaited_is_found():
    assert kinds('''
        from tests.waiting import eventually, eventually_sync, ingest_finished

        async def test_a(http, ready):
            eventually(ready, timeout=5, what="ready")
            ingest_finished(http, "job-1", timeout=5)
            await eventually(ready, timeout=5, what="ready")
            eventually_sync(ready, timeout=5, what="ready")
    ''') == [("unawaited", "test_a"), ("unawaited", "test_a")]


# --- timings --------------------------------------------------------------------------------------------------------


def test_two_timings_compared_are_found_and_a_bound_against_a_constant_is_a_speed_bound():
    found = kinds('''
        import statistics, time

        def timed(request):
            t0 = time.perf_counter()
            response = request()
            return response, time.perf_counter() - t0

        def test_a(ask, other):
            took, alone = [], []
            for _ in range(3):
                took.append(ask().elapsed.total_seconds())
            response, seconds = timed(other)
            assert statistics.median(took) < 2 * seconds
            assert seconds < 5
            assert response.status_code == 200  # the response of a timed call is no timing

        def test_b(work):
            started = time.monotonic()
            work()
            deadline = started + 30
            assert time.monotonic() < deadline  # a hang guard
            assert time.monotonic() - started >= 0.05
    ''')
    assert found == [("timing", "test_a"), ("speed", "test_a"), ("speed", "test_b")]


# --- the verdict ----------------------------------------------------------------------------------------------------


def finding(kind: str, function: str = "test_a", path: str = "tests/test_x.py") -> object:
    return waits.Finding(path, 1, function, kind, "detail")


def test_the_verdict_fails_on_an_unlisted_finding_and_on_a_list_entry_that_matches_nothing():
    allowed = {("tests/test_x.py", "test_a", "sleep"): "a slow client on purpose"}
    pending = {("tests/test_y.py", "test_b", "poll"): "converted by other work"}
    verdict = waits.judge([finding("sleep"), finding("poll", "test_b", "tests/test_y.py"), finding("speed")],
                          allowed, pending)
    assert verdict.ok and len(verdict.allowed) == len(verdict.pending) == len(verdict.speed) == 1
    verdict = waits.judge([finding("sleep"), finding("poll")], allowed, pending)
    assert not verdict.ok and verdict.new == [finding("poll")]
    assert verdict.stale == [("PENDING", ("tests/test_y.py", "test_b", "poll"))]
    assert "STALE: PENDING entry" in verdict.report() and "1 not allowed" in verdict.report()
    # Scanning one file judges only that file's entries.
    assert waits.judge([finding("sleep")], allowed, pending, scanned=["tests/test_x.py"]).ok


@pytest.mark.parametrize("kind", ["unawaited"])
def test_an_unawaited_eventually_cannot_be_allowed(kind):
    verdict = waits.judge([finding(kind)], {("tests/test_x.py", "test_a", kind): "no"}, {})
    assert not verdict.ok and verdict.new == [finding(kind)]


def test_the_scan_covers_the_test_modules_but_the_helper():
    modules = [p.relative_to(REPO).as_posix() for p in waits.suite_modules()]
    assert "tests/conftest.py" in modules and "tests/test_waits_inventory.py" in modules
    assert "tests/waiting.py" not in modules
