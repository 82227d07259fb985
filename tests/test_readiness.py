"""serving/readiness: the one loop that waits for a child server, used by every server mmrag or its tests start."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from serving.readiness import ServerStartError, answers_200, wait_until_ready


def test_a_server_that_exits_fails_at_once_with_its_exit_code_and_log():
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    t = time.monotonic()
    with pytest.raises(ServerStartError, match=r"toy exited with code 3 before it was ready\. see toy\.log"):
        wait_until_ready(lambda: False, timeout_s=60, what="toy", proc=proc, log=lambda: "see toy.log",
                         interval_s=0.01)
    assert time.monotonic() - t < 30  # not the whole timeout


def test_waiting_ends_when_the_probe_answers_and_fails_after_the_timeout_otherwise():
    answers = iter([False, False, True])
    wait_until_ready(lambda: next(answers), timeout_s=5, what="toy", interval_s=0.01)
    with pytest.raises(ServerStartError, match="toy was not ready after 0 s"):
        wait_until_ready(lambda: False, timeout_s=0.05, what="toy", interval_s=0.01)


def test_nothing_listening_is_not_ready_yet_and_the_polls_share_one_client_closed_when_waiting_ends(monkeypatch):
    import httpx

    from mmrag.devkit.ports import free_port

    built = []
    real_init = httpx.Client.__init__

    def init(self, *args, **kwargs):
        built.append(self)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(httpx.Client, "__init__", init)
    probe = answers_200(f"http://127.0.0.1:{free_port()}/health", timeout_s=1)
    assert [probe() for _ in range(3)] == [False, False, False]
    with pytest.raises(ServerStartError, match="not ready"):
        wait_until_ready(probe, timeout_s=0.05, what="toy", interval_s=0.01)
    # One client (one TLS context: ~30 ms of CPU each) for every poll, closed once the waiting ended.
    assert len(built) == 1 and built[0].is_closed
