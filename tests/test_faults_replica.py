"""Faults and cancellation on the remote path, with real `vllm serve` processes of the tiny model (fp32).

A second, short-lived replica (``doomed``, started once for this module with the session's engine config) is
SIGKILLed while it streams long answers: every request fails over to the session replica (``vllm_server``) or,
where no replica is left, ends in EngineUnavailableError; none hangs. Cancellation is read from the replica's
own /metrics: cancelling ``generate`` must abort the request inside vLLM.

The kill and the cancel are timed by what reaches the client (the first streamed tokens), as early as they can
be: on a loaded 2-core machine (load average 17 was seen) this process and the replicas' went unscheduled for
seconds, long enough for a replica to finish answers that a later trigger was meant to interrupt. A cancel
round in which this process itself stalled that long is inconclusive and is run again (at most 3 rounds).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import NamedTuple

import httpx
import pytest

from core.engine import Completion, PromptPlan, SamplingSpec
from core.keys import ImageKey
from mmrag.wiring import engine_config, feature_store, resolve_model
from serving.engine.features import FeatureProvider
from serving.engine.remote import EngineUnavailableError, RemoteEngine
from serving.metrics import parse_samples, sample_total
from serving.routing import rendezvous_order
from serving.vllm_launch import ServerHandle, start_server
from tests.conftest import free_port

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


def remote(engine_settings, urls: list[str]) -> RemoteEngine:
    return RemoteEngine(urls, resolve_model(engine_settings), FeatureProvider.unscoped(feature_store(engine_settings)))


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
    """Poll ``probe()`` (sync or async) until ``condition`` holds on its value; the value. A hang guard."""
    value = None
    try:
        async with asyncio.timeout(limit_s):
            while True:
                value = probe()
                value = await value if asyncio.iscoroutine(value) else value
                if condition(value):
                    return value
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"{what}: not reached within {limit_s:.0f} s (last seen {value})") from None


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


async def test_a_replica_killed_mid_answer_fails_over_or_raises_unavailable_and_none_hangs(
        engine_settings, keys, doomed, vllm_server):
    pair = [doomed.url, vllm_server]
    for round_ in range(3):  # a round whose kill would come too late is inconclusive and is run again
        both = remote(engine_settings, pair)  # the session replica is the fall-back
        alone = remote(engine_settings, [doomed.url])  # no replica left once it dies
        plans = long_plans(keys, doomed.url, pair, f"fail-over {round_}")
        streaming = Streaming(1)
        tasks = [asyncio.create_task(ended_at(e.generate(p, on_first_token=streaming)))
                 for e in (both, alone) for p in plans]
        try:
            # Freeze the replica (SIGSTOP) as soon as this process reads a first token, then look: a request not
            # done while the replica is frozen can only end through the kill, whatever this process's lag behind
            # the replica (its /metrics were no guide: under load a scrape was answered only after the answers,
            # and its gauges keep their last value). A round where every answer had been written whole before the
            # freeze is inconclusive and run again.
            await streaming.wait(tasks)
            os.killpg(doomed.proc.pid, signal.SIGSTOP)
            if not all(t.done() for t in tasks):
                kill(doomed)  # SIGKILL ends a stopped process too: mid-answer
                killed = time.perf_counter()
                # Each of ``both``'s unfinished requests is re-sent once the kill reaches it.
                await wait_until(lambda: sum(both.failovers.values()) + sum(both.connect_failures.values()),
                                 lambda n: n == N or all(t.done() for t in tasks[:N]), "fail-over",
                                 HANG_GUARD_S)
                failed_over = time.perf_counter()
            else:
                os.killpg(doomed.proc.pid, signal.SIGCONT)
            results = await asyncio.wait_for(asyncio.gather(*tasks), HANG_GUARD_S)
        finally:
            for t in tasks:
                t.cancel()
            await both.close()
            await alone.close()
        if doomed.proc.poll() is not None:
            break
        print(f"\nround {round_}: every answer was written whole before the first token was read; again")
    else:
        pytest.fail("3 rounds: every answer was written whole before this process read a first token (a starved "
                    "test process)")

    served, alone_ended = [r for r, _ in results[:N]], [r for r, _ in results[N:]]
    for completion in served:
        assert isinstance(completion, Completion), repr(completion)
        # Only one replica's stream is in an answer: the doomed replica's partial tokens were dropped.
        assert len(completion.token_ids) == completion.usage.completion_tokens == LONG.max_tokens
        assert completion.finish_reason == "length"
    on_survivor = sum(c.replica == vllm_server for c in served)  # the rest had ended on the doomed one
    assert both.failovers + both.connect_failures == Counter({doomed.url: on_survivor})
    errors = [r for r in alone_ended if not isinstance(r, Completion)]  # a Completion: it ended before the kill
    for error in errors:
        assert isinstance(error, EngineUnavailableError), repr(error)
        assert doomed.url in str(error) and "MMRAG_ENGINE_URLS" in str(error)
        assert "failed mid-request" in str(error) or "could not connect" in str(error)
    assert len(errors) == alone.failovers[doomed.url] + alone.connect_failures[doomed.url]
    dropped = both.failovers[doomed.url] + alone.failovers[doomed.url]
    assert dropped >= 1, "the kill was to catch requests mid-answer"
    to_answers = max(t for _, t in results[:N]) - killed
    to_503 = max((t for r, t in results[N:] if isinstance(r, EngineUnavailableError)), default=killed) - killed
    print(f"\nreplica SIGKILL with {2 * N} long requests on it, {dropped} dropped mid-answer: "
          f"{on_survivor} re-sent to the survivor {(failed_over - killed) * 1000:.0f} ms after the kill (all answered "
          f"after {to_answers:.1f} s); {len(errors)} with no replica left raised EngineUnavailableError after "
          f"{to_503 * 1000:.0f} ms")


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
    (other jobs on the 2 cores, a GC pause) shows up here."""

    async def __aenter__(self) -> LoopLag:
        self.max_s = 0.0
        self._watch = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._watch.cancel()

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


async def cancel_round(engine: RemoteEngine, plans: list[PromptPlan], scrape: httpx.AsyncClient,
                       url: str) -> CancelRound:
    """Send the plans at once; cancel them all as soon as one answer streams, as when the HTTP clients of mmrag
    disconnect; read the replica's counters until it is idle, and a second after."""
    before = await replica_counters(scrape, url)
    assert before.busy == 0, "the session replica should be idle before this test"
    streaming = Streaming(1)
    tasks = [asyncio.create_task(engine.generate(p, on_first_token=streaming)) for p in plans]
    try:
        async with LoopLag() as lag:
            await streaming.wait(tasks)
            for t in tasks:
                t.cancel()
            cancelled = time.perf_counter()
            outcomes = await asyncio.gather(*tasks, return_exceptions=True)
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
        return CancelRound(outcomes, before, idle, after, made, idle_after, lag.max_s)
    finally:
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
    assert r.after.at_max == r.before.at_max, f"an answer ran to its end (this process lagged {r.lag_s:.1f} s)"
    reached = round((r.after.queried - r.before.queried) / (sum(prompt_tokens) / N))  # the rest: cancelled sooner
    spent = r.idle.generated - r.before.generated
    assert reached >= 1 and 0 < spent < N * LONG.max_tokens / 2, (reached, spent, f"lag {r.lag_s:.1f} s")
    print(f"\ncancel of {N} long requests once one streamed (round {attempt + 1}; {reached} had reached the "
          f"replica's scheduler): its running + waiting read 0 {r.idle_after_s * 1000:.0f} ms after the cancel; "
          f"{spent} tokens made in all, of {N * LONG.max_tokens}")
