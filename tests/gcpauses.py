"""The test process's garbage collector (issue 42): it pauses the whole process, event loop included, and by how
much a test can see.

A pytest process that imported torch, transformers, vLLM, Qdrant and Ray tracks about a million objects, and a
full collection walks them all: 0.5 s at import, seconds once the session's engines, indexes and responses are
alive. Python runs one whenever enough objects have survived, at a point no test chooses, e.g. while a test cancels
requests it sent to a replica, which then decodes on (tests/test_faults_replica.py). What was imported before
the first test lives until the end: once collection has imported every test module it is collected once and
frozen (``gc.freeze()``, the permanent generation the collector skips; vLLM's own servers do the same after
start-up), so a full collection walks what the session itself made. :class:`GcPauses` measures the pauses in a
block; the session's total is printed after the durations.
"""

from __future__ import annotations

import gc
import time

import pytest


class GcPauses:
    """The collector's pauses while the block runs: the longest, their sum, and how many full collections."""

    def __init__(self) -> None:
        self.longest_s = 0.0
        self.total_s = 0.0
        self.full = 0
        self._start = 0.0

    def _tally(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        pause = time.perf_counter() - self._start
        self.longest_s, self.total_s = max(self.longest_s, pause), self.total_s + pause
        self.full += info.get("generation") == 2

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._tally)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._tally)

    def __str__(self) -> str:
        return f"GC paused {self.total_s:.2f} s in all, {self.longest_s:.2f} s at most, {self.full} full collections"


_SESSION = GcPauses()


def pytest_collection_finish(session: pytest.Session) -> None:
    gc.collect()
    gc.freeze()  # every module the tests import, and what they built at import, stays until the end anyway
    _SESSION.__enter__()


def pytest_terminal_summary(terminalreporter) -> None:
    if _SESSION._tally in gc.callbacks:  # collection finished (not a run that stopped before)
        terminalreporter.write_line(f"test process: {_SESSION} (after freezing {gc.get_freeze_count():,} objects "
                                    "at collection)")
