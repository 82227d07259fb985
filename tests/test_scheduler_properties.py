"""The scheduler's rules as properties over random arrival streams (hypothesis), on the recording engine.

Hypothesis draws a configuration and a stream of events: plans arriving (of three tenants' salts, short or long
images, one or two of them), prefills ending, plans finishing, callers leaving, time passing. After every event
the scheduler has dispatched all it would (it dispatches synchronously at each event; a passing wait is its
timer firing, ``Scheduler.wake``). This test then restates each rule from first principles, over what it saw
(which plans run, which finished their prefill, when each arrived), never asking the scheduler why:

- the image-token budget and the slots are never exceeded;
- a free reserved slot is never left idle while a short plan waits that the budget can take;
- no plan waits past ``max_wait_ms`` while a slot it may use is free and the budget can take it, unless an
  older overdue plan waits for the budget (nothing younger overtakes that one, or it could starve);
- a plan otherwise able to start waits only behind a prefill of its own salt, system prompt and first image
  that no plan has finished yet (gating never crosses salts), and never under FCFS;
- a slot "it may use" leaves free, for a tenant (salt) at or over its share, as many slots as each other
  tenant busy or idle for less than TENANT_RECENT_S had in flight at once in its last busy spell, less what it
  holds or waits for now (at most a quarter): the test keeps those spells itself, from what runs and waits
  after each event.

The cases that first showed two of these broken are named tests in tests/test_scheduler.py and
tests/test_mixed_resolution.py.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from mmrag.core.engine import PromptPlan
from serving.scheduler import TENANT_RECENT_S, Policy, Scheduler, SchedulerConfig
from tests.test_scheduler import RecordingEngine
from tests.waiting import eventually

MAX_WAIT_MS = 1000.0
TOKENS = {"s1": 64, "s2": 96, "L1": 1024, "L2": 1536, "L3": 2048}
SHORT_IMAGE_TOKENS = 256  # s1+s2 = 160: short; any plan with an L image: long
SALTS = ("", "tenant-a", "tenant-b")


@st.composite
def configs(draw) -> SchedulerConfig:
    max_concurrency = draw(st.integers(1, 4))
    short = max_concurrency > 1 and draw(st.booleans())
    return SchedulerConfig(
        policy=draw(st.sampled_from(list(Policy))),
        max_concurrency=max_concurrency,
        max_image_tokens_in_flight=draw(st.sampled_from([2048, 3072, 4096, 32_768])),
        max_wait_ms=MAX_WAIT_MS,
        queue_cap=draw(st.integers(1, 8)),
        short_image_tokens=SHORT_IMAGE_TOKENS if short else 0,
        short_reserved=draw(st.integers(1, max_concurrency - 1)) if short else 1,
    )


submits = st.tuples(st.just("submit"), st.sampled_from(SALTS), st.sampled_from(sorted(TOKENS)),
                    st.sampled_from([None, *sorted(TOKENS)]))
events = st.lists(st.one_of(
    submits, submits,  # arrivals twice as likely as any other event
    st.tuples(st.just("prefill"), st.integers(0, 7)),
    st.tuples(st.just("finish"), st.integers(0, 7)),
    st.tuples(st.just("cancel"), st.integers(0, 7)),
    st.tuples(st.just("tick"), st.sampled_from([0.1, 0.4, 0.7, 1.2])),
    st.tuples(st.just("tick"), st.sampled_from([0.1, 0.4, 0.7, 1.2])),
), min_size=1, max_size=40)


@dataclass
class Seen:
    """What the test observed, in its own terms: plans by name."""

    plans: dict[str, PromptPlan] = field(default_factory=dict)
    arrival: dict[str, float] = field(default_factory=dict)
    tasks: dict[str, asyncio.Task] = field(default_factory=dict)
    prefilled: set[str] = field(default_factory=set)  # plans whose prefill ended (finishing ends it too)
    finished: set[str] = field(default_factory=set)
    # Per salt: plans in flight at most in its current busy spell, in its last one, and when that one ended.
    peak: dict[str, int] = field(default_factory=dict)
    burst: dict[str, int] = field(default_factory=dict)
    idle_since: dict[str, float] = field(default_factory=dict)
    checked: int = 0  # plans of eng.started already checked (the earlier events' starts)


def tokens(p: PromptPlan) -> int:
    return sum(TOKENS[k] for k in p.images)


def prefixes(p: PromptPlan) -> list[tuple[str, ...]]:
    """The plan's salt and system prompt with its first image, first two, ...: what a plan that shares them reuses."""
    return [(p.cache_salt, p.system_prompt_id, *p.images[:k]) for k in range(1, len(p.images) + 1)]


def check(config: SchedulerConfig, s: Scheduler, eng: RecordingEngine, seen: Seen, now: float) -> None:
    gone = {n for n, t in seen.tasks.items() if t.cancelled()}
    running = [n for n in eng.started if n not in seen.finished and n not in gone]
    seq = lambda n: int(n[1:])  # noqa: E731  (submission order: plans named p<event index>)
    waiting = sorted((n for n in seen.plans if n not in eng.started and n not in gone), key=seq)
    assert s.in_flight == len(running) and s.waiting == len(waiting)

    short = lambda n: 0 < config.short_image_tokens and tokens(seen.plans[n]) <= config.short_image_tokens  # noqa: E731
    reserved = config.short_reserved if config.short_image_tokens else 0
    in_flight_tokens = sum(tokens(seen.plans[n]) for n in running)
    long_running = sum(not short(n) for n in running)

    # The budget and the slots.
    assert in_flight_tokens <= config.max_image_tokens_in_flight
    assert len(running) <= config.max_concurrency and long_running <= config.max_concurrency - reserved

    # Tenants' busy spells, as this event left them.
    busy = {seen.plans[n].cache_salt for n in running + waiting}
    for salt in busy:
        if salt not in seen.peak:  # a new spell; a tenant idle past the window was forgotten, its burst too
            seen.peak[salt] = 0
            if now - seen.idle_since.pop(salt, now) >= TENANT_RECENT_S:
                seen.burst.pop(salt)
        seen.peak[salt] = max(seen.peak[salt], sum(seen.plans[n].cache_salt == salt for n in running))
    for salt in set(seen.peak) - busy:  # its spell ended with this event
        seen.burst[salt], seen.idle_since[salt] = seen.peak.pop(salt), now
    recent = {t for t, since in seen.idle_since.items() if now - since < TENANT_RECENT_S}
    free_slots = config.max_concurrency - len(running)

    def may(n: str, free: int = free_slots, among: list[str] = running, queued: list[str] = waiting) -> bool:
        """The tenant rule: not one of the slots kept free for another tenant, busy or idle a moment."""
        salt = seen.plans[n].cache_salt
        holds = lambda t: sum(seen.plans[r].cache_salt == t for r in among + queued)  # noqa: E731
        kept = min(sum(max(0, seen.burst.get(t, 0) - holds(t)) for t in (busy | recent) - {salt}),
                   config.max_concurrency // 4)
        mine = sum(seen.plans[r].cache_salt == salt for r in among)
        return not kept or free > kept or mine < config.max_concurrency / len(busy | recent | {salt})

    # This event's starts, in order (the engine starts them as they were dispatched): none took a kept slot.
    new = [n for n in eng.started[seen.checked:] if n in running]
    seen.checked = len(eng.started)
    before = [n for n in running if n not in new]
    for i, n in enumerate(new):
        assert may(n, config.max_concurrency - len(before) - i, before + new[:i], waiting + new[i:]), (
            f"plan {n} of salt {seen.plans[n].cache_salt!r} took a slot kept for another tenant: bursts "
            f"{ {t: seen.burst.get(t, 0) for t in busy | recent} }, {config.max_concurrency - len(before) - i} free")

    free = len(running) < config.max_concurrency
    reserved_free = free and len(running) - long_running < reserved
    fits = lambda n: in_flight_tokens + tokens(seen.plans[n]) <= config.max_image_tokens_in_flight  # noqa: E731
    slot = lambda n: free and may(n) and (short(n) or long_running < config.max_concurrency - reserved)  # noqa: E731
    overdue = [n for n in waiting if (now - seen.arrival[n]) * 1000 >= MAX_WAIT_MS]
    # Prefixes whose prefill is running, and prefixes some plan finished prefilling (their KV is cached).
    prefilling = {x for n in running if n not in seen.prefilled for x in prefixes(seen.plans[n])}
    cached = {x for n in seen.prefilled for x in prefixes(seen.plans[n])}

    for n in waiting:
        p = seen.plans[n]
        if short(n) and reserved_free and may(n):  # a free reserved slot is never idle while a short plan waits ...
            assert not fits(n), f"short plan {n} waits with a reserved slot free and the budget room"
            continue  # ... that the budget can take
        if not (slot(n) and fits(n)):
            continue  # no slot it may use, or the budget is full: waiting is right
        older_blocked = [v for v in overdue if seq(v) < seq(n) and slot(v) and not fits(v)]
        if older_blocked:
            continue  # an older overdue plan waits for the budget: nothing younger overtakes it
        assert n not in overdue, f"overdue plan {n} waits with a slot it may use free and the budget room"
        # Not overdue, a slot and the budget free: only gating may hold it, and only behind its own salt.
        assert config.policy is not Policy.FCFS, f"FCFS held {n} back with a slot free"
        # Held: another plan of its salt is prefilling a longer prefix of its images than any has finished.
        computing = [x for x in prefixes(p) if x in prefilling]
        assert computing and computing[-1] not in cached, (
            f"plan {n} (salt {p.cache_salt!r}, images {p.images}) held with a slot free and no prefill of its "
            f"own salt and images running: running {[(seen.plans[r].cache_salt, seen.plans[r].images) for r in running]}")


async def scenario(config: SchedulerConfig, stream: list[tuple]) -> None:
    now = [0.0]
    eng = RecordingEngine()
    timers: set[Timer] = set()  # the scheduler's armed timers: this test fires them (wake) when their time comes

    class Timer:
        def __init__(self, delay: float, _callback) -> None:
            self.due = now[0] + delay
            timers.add(self)

        def cancel(self) -> None:
            timers.discard(self)

    s = Scheduler(eng, config, image_tokens=tokens, clock=lambda: now[0], call_later=Timer)
    seen = Seen()

    async def settle() -> None:
        for _ in range(12):
            await asyncio.sleep(0)

    for i, event in enumerate(stream):
        kind = event[0]
        running = [n for n in eng.started if n not in seen.finished and not seen.tasks[n].done()]
        if kind == "submit":
            _, salt, first, second = event
            images = (first,) if second is None or second == first else (first, second)
            name = f"p{i}"
            p = PromptPlan(images=images, text=name, cache_salt=salt)
            if tokens(p) > config.max_image_tokens_in_flight:  # refused at once: it could never fit
                with pytest.raises(ValueError, match="in-flight budget"):
                    await s.submit(p)
                continue
            seen.plans[name] = p
            seen.arrival[name] = now[0]
            seen.tasks[name] = asyncio.create_task(s.submit(seen.plans[name]))
        elif kind == "prefill" and running:
            name = running[event[1] % len(running)]
            if name not in seen.prefilled:
                seen.prefilled.add(name)
                await eng.finish(name, prefill_only=True)
        elif kind == "finish" and running:
            name = running[event[1] % len(running)]
            seen.prefilled.add(name)
            seen.finished.add(name)
            await eng.finish(name)
        elif kind == "cancel" and seen.tasks:
            live = [n for n, t in seen.tasks.items() if not t.done()]
            if live:
                name = live[event[1] % len(live)]
                seen.tasks[name].cancel()
                if name in eng.started:
                    seen.finished.add(name)  # the scheduler cancels its engine request and frees the slot
                    seen.prefilled.add(name)  # (its first-token callback runs as it stops)
        elif kind == "tick":
            now[0] += event[1]
            if any(t.due <= now[0] for t in timers):  # the timer the scheduler armed has fired
                timers.clear()
                s.wake()
        await settle()
        check(config, s, eng, seen, now[0])

    # Drain: every plan that was not cancelled completes (each round starts at least one: a hang fails).
    for _ in range(len(seen.tasks) + 1):
        if all(t.done() for t in seen.tasks.values()):
            break
        for name in [n for n in eng.started if n not in seen.finished]:
            seen.prefilled.add(name)
            seen.finished.add(name)
            await eng.finish(name)
        now[0] += 1.0
        s.wake()
        await settle()
    assert all(t.done() for t in seen.tasks.values()), f"never started: {[n for n in seen.plans if n not in eng.started]}"
    for name, task in seen.tasks.items():
        assert task.cancelled() or task.result().text == name
    assert s.in_flight == 0 and s.waiting == 0


# The cases that once broke a rule, run first whatever hypothesis draws: issue 23's two probes, a gated plan
# whose wait runs out while its leader still prefills (only the timer can start it), and an overdue plan waiting
# for the budget that leaves the queue, freeing the younger plan it held back (only its leaving can start it),
# and a slot kept free for a tenant that was busy a moment ago (TenantSlots).
@example(SchedulerConfig(policy=Policy.FCFS, max_concurrency=2, max_wait_ms=MAX_WAIT_MS, short_image_tokens=256),
         [("submit", "", "L1", None), ("submit", "", "L2", None), ("tick", 1.2), ("submit", "", "s1", None)])
@example(SchedulerConfig(max_concurrency=4, max_wait_ms=MAX_WAIT_MS),
         [("submit", "tenant-a", "L1", "s1"), ("submit", "tenant-b", "L1", "s1"), ("submit", "tenant-a", "L1", None)])
@example(SchedulerConfig(max_concurrency=2, max_wait_ms=MAX_WAIT_MS),
         [("submit", "", "L1", None), ("submit", "", "L1", "s1"), ("tick", 1.2)])
@example(SchedulerConfig(policy=Policy.FCFS, max_concurrency=2, max_image_tokens_in_flight=4096,
                         max_wait_ms=MAX_WAIT_MS, queue_cap=1),
         [("submit", "", "L1", None), ("submit", "", "L1", "L2"), ("finish", 0), ("submit", "", "L1", "L2"),
          ("tick", 1.2), ("submit", "", "L1", None), ("cancel", 1)])
@example(SchedulerConfig(max_concurrency=4, max_wait_ms=MAX_WAIT_MS),  # a slot kept for tenant-a, idle a moment
         [("submit", "tenant-a", "L1", None), ("finish", 0), *[("submit", "tenant-b", "L2", None)] * 4,
          ("tick", 1.2), ("submit", "tenant-a", "L1", None)])
@example(SchedulerConfig(policy=Policy.LPM, max_concurrency=2, max_image_tokens_in_flight=3072,  # found by hypothesis:
                         max_wait_ms=MAX_WAIT_MS, queue_cap=1),  # a younger plan offered first by the tenant sort
         [("submit", "", "L1", None), ("submit", "", "L1", None), ("submit", "tenant-a", "L1", "L2"),  # waits
          ("tick", 1.2)])  # for the budget, and must not hold back an older overdue plan that fits
@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs(), events)
def test_the_scheduler_rules_hold_over_random_arrival_streams(config, stream):
    asyncio.run(scenario(config, stream))


async def test_a_gated_plan_starts_when_its_wait_runs_out_with_no_other_event():
    """The timer behind ``wake``: a plan gated behind a long prefill goes when it becomes overdue, on the real
    clock, though the leader's prefill never ends. What the timer found is read as it fires, not at a moment
    guessed on the clock: before it, only the leader had started, and the follower was gated."""
    eng = RecordingEngine()
    s = Scheduler(eng, SchedulerConfig(max_concurrency=2, max_wait_ms=50), image_tokens=tokens)
    woken: list[tuple[list[str], int]] = []  # at each firing of the timer: the plans started, the gated count
    wake = s.wake

    def recording_wake() -> None:
        woken.append((list(eng.started), s.stats.gated))
        wake()

    s.wake = recording_wake  # what the scheduler arms its (real) timer with
    leader = asyncio.create_task(s.submit(PromptPlan(images=("L1",), text="leader")))
    follower = asyncio.create_task(s.submit(PromptPlan(images=("L1", "s1"), text="follower")))
    await eventually(lambda: len(eng.started) == 2, timeout=60, what="the follower started")
    assert woken, "the follower started, but not by the timer"
    started_then, gated_then = woken[0]
    assert started_then == ["leader"] and gated_then > 0
    assert eng.started == ["leader", "follower"] and s.stats.fairness_overrides == 1
    for name in ("leader", "follower"):
        await eng.finish(name)
    await asyncio.gather(leader, follower)
