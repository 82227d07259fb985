"""Faults and cancellation on the remote path, with real `vllm serve` processes of the tiny model (fp32).

A second, short-lived replica (``doomed``, started once for this module with the session's engine config) is
SIGKILLed while it streams long answers: every request fails over to the session replica (``vllm_server``) or,
where no replica is left, ends in EngineUnavailableError; none hangs. Cancellation is read from the replica's
own /metrics: cancelling ``generate`` must abort the request inside vLLM.

The kill is an event, not a race: it is sent from the callback in which this process reads the last of the
requests' first tokens from the doomed replica, nothing running in between, while that replica runs behind this
process (on its CPU, below it: ``behind_this_process``), so it cannot have written an answer ahead of what this
process read, however loaded the machine or long this process is kept from reading. The cancel is timed by what
reaches the client (the first streamed tokens); a cancel round in which this process itself stalled for a second
or more is inconclusive and is run again (at most 5 rounds).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import json
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import httpx
import pytest

from mmrag.core.engine import Completion, PromptPlan, SamplingSpec
from mmrag.core.keys import ImageKey
from mmrag.wiring import engine_config, feature_store, resolve_model
from serving.engine.features import FeatureProvider
from serving.engine.remote import EngineUnavailableError, RemoteEngine
from serving.metrics import parse_samples, sample_total
from serving.routing import rendezvous_order
from serving.vllm_launch import ServerHandle, start_server
from tests.conftest import free_port
from tests.waiting import eventually
from tests.gcpauses import GcPauses

# The tiny model's greedy answers hit EOS after 2-250 tokens; a grammar for 1,000 integers (>= 2 tokens each)
# keeps every answer going to max_tokens (~6 s for four at once here). Prompt ~370 tokens + 1,500 fit in 2,048.
LONG = SamplingSpec(max_tokens=1500,
                    json_schema=json.dumps({"type": "array", "items": {"type": "integer"}, "minItems": 1000}))
N = 4  # concurrent long requests per engine
HANG_GUARD_S = 600.0  # a bound on waiting, not a timing assertion


@pytest.fixture(scope="module")
def doomed(engine_settings, ingested, tmp_path_factory) -> Iterator[ServerHandle]:
    """A second replica, same model and engine config as ``vllm_server``; a test kills it."""
    handle = start_server(resolve_model(engine_settings).path, engine_config(engine_settings), port=free_port(),
                          log_path=tmp_path_factory.mktemp("doomed-replica") / "server.log")
    try:
        handle.wait_ready(timeout=300)
        yield handle
    finally:
        kill(handle)


def kill(replica: ServerHandle) -> None:
    """SIGKILL the replica's API server and engine core (their own process group), as a dying host would."""
    if replica.proc.poll() is None:
        os.killpg(replica.proc.pid, signal.SIGKILL)
    replica.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def keys(engine_settings, ingested) -> list[ImageKey]:
    return sorted(feature_store(engine_settings).keys())


def remote(engine_settings, urls: list[str], **kwargs) -> RemoteEngine:
    return RemoteEngine(urls, resolve_model(engine_settings), FeatureProvider.unscoped(feature_store(engine_settings)),
                        **kwargs)


def long_plans(keys: list[ImageKey], home: str, urls: list[str], tag: str) -> list[PromptPlan]:
    """N long plans whose route key (their first image) ranks ``home`` first among ``urls``; ``tag`` keeps the
    prompts of one test apart from another's (a repeated prompt would start ahead of the rest on a warm cache)."""
    homed = [k for k in keys if rendezvous_order(str(k), urls)[0] == home]
    assert homed, f"no sample page routes to {home} first"
    return [PromptPlan(images=(homed[i % len(homed)],), text=f"List the numbers in part {i} of this page ({tag}).",
                       sampling=LONG) for i in range(N)]


class Streaming:
    """``on_first_token`` for a batch of requests; ``wait(tasks)`` returns once ``n`` of them stream tokens (or one
    has ended)."""

    def __init__(self, n: int) -> None:
        self.left = n
        self.enough = asyncio.Event()

    def __call__(self) -> None:
        self.left -= 1
        if self.left <= 0:
            self.enough.set()

    async def wait(self, tasks: list[asyncio.Task]) -> None:
        waiter = asyncio.ensure_future(self.enough.wait())
        await asyncio.wait([waiter, *tasks], timeout=120, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        assert any(t.done() for t in tasks) or self.enough.is_set(), "no request streamed a token within 120 s"


class Counters(NamedTuple):
    """The replica's own view, from its /metrics."""

    busy: int  # requests running + waiting
    generated: int  # tokens generated
    at_max: int  # requests that ended at max_tokens
    queried: int  # prompt tokens looked up in the prefix cache: one lookup per request the scheduler took


async def replica_counters(client: httpx.AsyncClient, url: str) -> Counters:
    samples = parse_samples((await client.get(f"{url}/metrics")).text)

    def total(name: str, **labels: str) -> int:
        return int(sample_total(samples, name, **labels))

    return Counters(total("vllm:num_requests_running") + total("vllm:num_requests_waiting"),
                    total("vllm:generation_tokens_total"),
                    total("vllm:request_success_total", finished_reason="length"),
                    total("vllm:prefix_cache_queries_total"))


async def wait_until(probe, condition, what: str, limit_s: float = 120.0):
    """``probe()``'s value (awaited if need be) once ``condition`` holds on it (tests/waiting.py's eventually; a
    hang guard)."""

    async def check():
        value = probe()
        value = await value if inspect.isawaitable(value) else value
        assert condition(value), f"last seen {value}"  # not yet
        return value

    return await eventually(check, timeout=limit_s, what=what)


async def ended_at(coro) -> tuple[Completion | BaseException, float]:
    """What a request ended with (its completion or its error) and when."""
    try:
        result: Completion | BaseException = await coro
    except Exception as exc:
        result = exc
    return result, time.perf_counter()


# --- (a) a replica that stalls, one killed mid-request, all dead -----------------------------------------


async def test_a_stalled_replica_is_given_up_after_the_read_timeout_for_the_next(
        engine_settings, keys, doomed, vllm_server):
    # SIGSTOP: the kernel still accepts connections for it, but nothing answers (a hung host, a GC-frozen server).
    pair = [doomed.url, vllm_server]
    engine = RemoteEngine(pair, resolve_model(engine_settings),
                          FeatureProvider.unscoped(feature_store(engine_settings)), timeout_s=10.0)
    plan = replace(long_plans(keys, doomed.url, pair, "stall")[0], sampling=SamplingSpec(max_tokens=8))
    os.killpg(doomed.proc.pid, signal.SIGSTOP)
    try:
        completion = await asyncio.wait_for(engine.generate(plan), HANG_GUARD_S)
    finally:
        os.killpg(doomed.proc.pid, signal.SIGCONT)
        await engine.close()
    assert completion.replica == vllm_server and completion.token_ids
    assert engine.failovers == {doomed.url: 1} and not engine.connect_failures


class KillAtFirstTokens:
    """``on_first_token`` for each of ``n`` requests sent to ``replica``: SIGKILLs it in the callback in which the
    last of them reads its first token (nothing runs between that read and the kill), and keeps which requests
    had read a token from it by then."""

    def __init__(self, replica: ServerHandle, n: int, engines: list[RemoteEngine]) -> None:
        self.replica, self.n, self.engines = replica, n, engines
        self.streamed: set[int] = set()  # requests that read a token from the replica before it was killed
        self.killed_at: float | None = None
        self.failed_before: list[Counter[str]] = []  # each engine's failures when the kill came: none
        self.killed = asyncio.Event()

    def on_first_token(self, request: int) -> Callable[[], None]:
        def first() -> None:
            if self.killed_at is None:
                self.streamed.add(request)
                if len(self.streamed) == self.n:
                    self.kill()

        return first

    def kill(self) -> None:
        if self.killed_at is None:
            os.killpg(self.replica.proc.pid, signal.SIGKILL)  # its API server and engine core: mid-answer
            self.killed_at = time.perf_counter()
            self.failed_before = [e.failovers + e.connect_failures for e in self.engines]
            self.killed.set()


def _threads(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:
        return []


def _group_threads(pgid: int) -> list[int]:
    """Every thread of every process in process group ``pgid`` (a replica: API server, engine core, workers)."""
    tids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[2]) == pgid:  # after the command: state, ppid, pgrp
                tids += _threads(int(entry))
    return tids


@contextlib.contextmanager
def behind_this_process(replica: ServerHandle) -> Iterator[None]:
    """Inside: the replica runs only on time this process leaves unused. Every thread of both runs on one CPU
    (threads they start inherit it), the replica's at the lowest priority there: SCHED_IDLE, and nice 19 for its
    session's autogroup (with autogroups, the kernel shares the CPU between sessions first, and the replica has
    a session of its own). So a chunk the replica writes wakes this process, which runs ahead of it until it has
    read it and waits again; and while this process is kept from reading (its event loop busy, a thread holding
    the GIL, other processes on the CPU), the replica is kept still too, but for a crumb (at most ~1.5% of the
    CPU). What this process reads is where the replica is. (Without it, a thread of this process holding the GIL
    for 12 s from the first token on let the replica write all 8 answers whole before the kill: none broke off,
    the CI failure.) Linux."""
    cpu = min(os.sched_getaffinity(0))
    mine = {threading.get_native_id(): os.sched_getaffinity(0)}
    os.sched_setaffinity(0, {cpu})  # this thread first: the threads it starts from now on inherit it
    for tid in _threads(os.getpid()):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            mine.setdefault(tid, os.sched_getaffinity(tid))
            os.sched_setaffinity(tid, {cpu})
    with contextlib.suppress(FileNotFoundError):  # a kernel without autogroups
        Path(f"/proc/{replica.proc.pid}/autogroup").write_text("19")
    for tid in _group_threads(replica.proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            os.sched_setaffinity(tid, {cpu})
    try:
        yield
    finally:
        everywhere = mine[threading.get_native_id()]
        for tid in _threads(os.getpid()):
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(tid, mine.get(tid, everywhere))


async def test_a_replica_killed_mid_answer_fails_over_or_raises_unavailable_and_none_hangs(
        engine_settings, keys, doomed, vllm_server):
    pair = [doomed.url, vllm_server]
    # A replica kept still by other processes on this CPU is waited for (the hang guard), never given up on.
    both = remote(engine_settings, pair, timeout_s=HANG_GUARD_S)  # the session replica is the fall-back
    alone = remote(engine_settings, [doomed.url], timeout_s=HANG_GUARD_S)  # no replica left once it dies
    plans = long_plans(keys, doomed.url, pair, "fail-over")
    killer = KillAtFirstTokens(doomed, 2 * N, [both, alone])
    requests = [(e, p) for e in (both, alone) for p in plans]  # both's first: 0..N-1, then alone's
    tasks: list[asyncio.Task] = []
    try:
        with behind_this_process(doomed):
            tasks = [asyncio.create_task(ended_at(e.generate(p, on_first_token=killer.on_first_token(i))))
                     for i, (e, p) in enumerate(requests)]
            # Killed once every request has read a token from it; or, should one end before that, then.
            killed = asyncio.ensure_future(killer.killed.wait())
            await asyncio.wait([killed, *tasks], timeout=HANG_GUARD_S, return_when=asyncio.FIRST_COMPLETED)
            killed.cancel()
            assert killer.killed.is_set() or any(t.done() for t in tasks), \
                f"no request ended, and {len(killer.streamed)} of {2 * N} streamed, within {HANG_GUARD_S:.0f} s"
            killer.kill()
        results = await asyncio.wait_for(asyncio.gather(*tasks), HANG_GUARD_S)
    finally:
        for t in tasks:
            t.cancel()
        await both.close()
        await alone.close()
    kill(doomed)  # reaped
    killed_at, streamed = killer.killed_at, killer.streamed

    # Nothing had failed when the kill came: every token read before it was the doomed replica's.
    assert killer.failed_before == [Counter(), Counter()]
    served, alone_ended = [r for r, _ in results[:N]], [r for r, _ in results[N:]]
    for completion in served:
        assert isinstance(completion, Completion), repr(completion)
        # Only one replica's stream is in an answer: the doomed replica's partial tokens were dropped.
        assert len(completion.token_ids) == completion.usage.completion_tokens == LONG.max_tokens
        assert completion.finish_reason == "length"
    on_survivor = {i for i, c in enumerate(served) if c.replica == vllm_server}  # the rest ended on the doomed one
    assert both.failovers + both.connect_failures == Counter({doomed.url: len(on_survivor)})
    # A request that had read tokens from the doomed replica and was answered by the survivor broke off
    # mid-answer: a failover and a broken stream, never a connect failure. (One that had read none yet may have
    # been taken or not: either.)
    moved = on_survivor & streamed
    assert len(moved) <= both.broken_streams[doomed.url] <= both.failovers[doomed.url]
    assert both.connect_failures[doomed.url] <= len(on_survivor - moved)
    errors = {N + i: r for i, r in enumerate(alone_ended) if not isinstance(r, Completion)}  # a Completion: whole
    for i, error in errors.items():
        assert isinstance(error, EngineUnavailableError), repr(error)
        message = str(error)
        assert doomed.url in message and "MMRAG_ENGINE_URLS" in message
        if i in streamed:  # its stream broke: reported as such, never as a connection that could not be made
            assert "broke off mid-answer after" in message and "could not connect" not in message, message
        else:
            assert any(cause in message for cause in ("broke off mid-answer", "failed mid-request",
                                                      "could not connect")), message
    assert len(errors) == alone.failovers[doomed.url] + alone.connect_failures[doomed.url]
    assert alone.broken_streams[doomed.url] == sum("broke off mid-answer" in str(e) for e in errors.values())
    dropped = both.broken_streams[doomed.url] + alone.broken_streams[doomed.url]
    assert dropped >= 1, "the kill was to catch requests mid-answer"
    assert dropped >= len(moved) + len(errors.keys() & streamed)
    to_answers = max(t for _, t in results[:N]) - killed_at
    to_503 = max((t for r, t in results[N:] if isinstance(r, EngineUnavailableError)), default=killed_at) - killed_at
    print(f"\nreplica SIGKILL as the last of {2 * N} long requests read its first token ({len(streamed)} had read "
          f"one), {dropped} broke off mid-answer: {len(on_survivor)} re-sent to the survivor (all answered "
          f"{to_answers:.1f} s after the kill); {len(errors)} with no replica left raised EngineUnavailableError "
          f"after {to_503 * 1000:.0f} ms")


async def test_when_every_replica_is_dead_a_request_raises_unavailable_at_once(engine_settings, keys, doomed):
    kill(doomed)  # done already when the test above ran; its port is closed
    never = f"http://127.0.0.1:{free_port()}"  # and one that was never started
    dead = remote(engine_settings, [doomed.url, never])
    try:
        started = time.perf_counter()
        with pytest.raises(EngineUnavailableError) as info:
            await asyncio.wait_for(dead.generate(PromptPlan(images=(keys[0],), text="hi", sampling=LONG)), 60)
        took = time.perf_counter() - started
    finally:
        await dead.close()
    message = str(info.value)
    assert doomed.url in message and never in message and "could not connect: ConnectError" in message
    assert "mmrag engine serve" in message and "MMRAG_ENGINE_URLS" in message
    assert dead.connect_failures == {doomed.url: 1, never: 1} and not dead.failovers
    print(f"\nall replicas dead: EngineUnavailableError after {took * 1000:.0f} ms")


# --- (b) cancellation aborts the request in the replica ----------------------------------------------------


class LoopLag:
    """The longest this event loop went without running a 10 ms timer inside the block: a starved test process
    (other jobs on the 2 cores, a GC pause) shows up here, and the collector's own pauses beside it."""

    async def __aenter__(self) -> LoopLag:
        self.max_s = 0.0
        self.gc = GcPauses().__enter__()
        self._watch = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._watch.cancel()
        self.gc.__exit__()

    def __str__(self) -> str:
        return f"this process lagged {self.max_s:.1f} s; {self.gc}"

    async def _run(self) -> None:
        while True:
            start = time.perf_counter()
            await asyncio.sleep(0.01)
            self.max_s = max(self.max_s, time.perf_counter() - start - 0.01)


@dataclass(slots=True)
class CancelRound:
    outcomes: list[object]
    before: Counters
    idle: Counters  # when the replica's running + waiting first read 0
    after: Counters  # once a probe request sent after that had ended
    probe_tokens: int  # what the probe generated
    idle_after_s: float
    lag_s: float
    lag: str  # the lag and the collector's pauses, in words


async def cancel_round(engine: RemoteEngine, plans: list[PromptPlan], scrape: httpx.AsyncClient,
                       url: str) -> CancelRound:
    """Send the plans at once; cancel them all as soon as one answer streams, as when the HTTP clients of mmrag
    disconnect; read the replica's counters until it is idle, and a second after.

    From the send to the cancelled tasks' end the collector is off: a full collection of this session's heap
    would stop the loop for seconds at a point no test chooses (tests/gcpauses.py), while the replica decodes on.
    What it leaves for later is a few seconds' allocations."""
    before = await replica_counters(scrape, url)
    assert before.busy == 0, "the session replica should be idle before this test"
    streaming = Streaming(1)
    gc.disable()
    tasks = [asyncio.create_task(engine.generate(p, on_first_token=streaming)) for p in plans]
    try:
        async with LoopLag() as lag:
            await streaming.wait(tasks)
            for t in tasks:
                t.cancel()
            cancelled = time.perf_counter()
            outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        gc.enable()
        idle = await wait_until(lambda: replica_counters(scrape, url), lambda c: c.busy == 0,
                                "the replica's running + waiting requests at 0")
        idle_after = time.perf_counter() - cancelled
        # Not a sleep: a short probe request, run to its end. Had a cancelled request gone on, the replica would
        # have decoded it in the probe's steps, and its tokens would show beyond the probe's own.
        probe = await engine.generate(replace(plans[0], text="probe", sampling=SamplingSpec(max_tokens=8)))
        made = probe.usage.completion_tokens
        after = await wait_until(lambda: replica_counters(scrape, url),
                                 lambda c: c.generated >= idle.generated + made and c.busy == 0,
                                 "the probe's tokens in the replica's counters")
        after = after._replace(at_max=after.at_max - (probe.finish_reason == "length"),  # the plans' alone
                               queried=idle.queried)
        return CancelRound(outcomes, before, idle, after, made, idle_after, lag.max_s, str(lag))
    finally:
        gc.enable()
        for t in tasks:
            t.cancel()


async def test_cancelling_generate_aborts_the_request_in_the_replica(engine_settings, keys, vllm_server):
    engine = remote(engine_settings, [vllm_server])
    async with httpx.AsyncClient(timeout=30) as scrape:
        try:
            # A round in which this process itself stalled for over a second (a session thread holding the GIL)
            # may let the replica decode on, or finish an answer, before the disconnect reaches it; such a round
            # proves nothing either way and is run again.
            for attempt in range(5):
                plans = long_plans(keys, vllm_server, [vllm_server], f"cancel {attempt}")
                r = await cancel_round(engine, plans, scrape, vllm_server)
                if r.lag_s < 1.0:
                    break
            prompt_tokens = [engine.renderer.tokens(engine.renderer.render(p), [f.num_tokens for f in await
                                                    engine.features.load(p.images)]).prompt_tokens for p in plans]
        finally:
            await engine.close()
    assert all(isinstance(o, asyncio.CancelledError) for o in r.outcomes), r.outcomes
    assert r.after.busy == 0 and r.after.generated == r.idle.generated + r.probe_tokens, \
        "the replica went on after the cancel"
    # None ran to max_tokens (the grammar lets no answer end sooner): each one the replica took was aborted.
    assert r.after.at_max == r.before.at_max, f"an answer ran to its end ({r.lag})"
    reached = round((r.after.queried - r.before.queried) / (sum(prompt_tokens) / N))  # the rest: cancelled sooner
    spent = r.idle.generated - r.before.generated
    assert reached >= 1 and 0 < spent < N * LONG.max_tokens / 2, (reached, spent, r.lag)
    print(f"\ncancel of {N} long requests once one streamed (round {attempt + 1}; {reached} had reached the "
          f"replica's scheduler): its running + waiting read 0 {r.idle_after_s * 1000:.0f} ms after the cancel; "
          f"{spent} tokens made in all, of {N * LONG.max_tokens}")
