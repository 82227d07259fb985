"""Mixed resolutions: the scheduler's short queue with reserved slots, and the estimate of image tokens resident
in the KV cache.

Driven by `RecordingEngine` (tests/test_scheduler.py: a test double that finishes a plan when the test says
so), so the order plans reach the engine is observable step by step. That the option shortens the short
requests' TTFT on the real engine is measured by `mmrag bench` (configs mixed / mixed_tiered), not here.
"""

from __future__ import annotations

import asyncio

import pytest

from serving.scheduler import KVResidency, Policy, Scheduler, SchedulerConfig
from tests.test_scheduler import RecordingEngine, plan, settle
from tests.waiting import eventually

TOKENS = {"S": 64, "T": 64, "A4": 1024, "B4": 1024, "C4": 1024, "D4": 1024, "E4": 1024}


def scheduler(engine, **kw) -> Scheduler:
    return Scheduler(engine, SchedulerConfig(**kw), image_tokens=lambda p: sum(TOKENS[k] for k in p.images))


async def _short_behind_longs(**kw) -> tuple[RecordingEngine, Scheduler, list[asyncio.Task]]:
    """Four long plans arrive, then one short: two slots, so two long plans run and two wait with the short."""
    eng = RecordingEngine()
    s = scheduler(eng, policy=Policy.FCFS, max_concurrency=2, **kw)
    tasks = [asyncio.create_task(s.submit(plan(f"long{i}", k))) for i, k in enumerate(("A4", "B4", "C4", "D4"))]
    await settle()
    tasks.append(asyncio.create_task(s.submit(plan("short", "S"))))
    await settle()
    return eng, s, tasks


async def _finish_all(eng: RecordingEngine, tasks: list[asyncio.Task]) -> None:
    while not all(t.done() for t in tasks):
        for name in list(eng.started):
            if not eng.done[name].is_set():
                await eng.finish(name)
    await asyncio.gather(*tasks)


async def test_without_the_option_a_short_plan_waits_behind_every_long_plan_before_it():
    eng, s, tasks = await _short_behind_longs()
    assert eng.started == ["long0", "long1"]
    await eng.finish("long0")
    assert eng.started[-1] == "long2"  # the freed slot goes to the next long prefill, not to the short plan
    await _finish_all(eng, tasks)
    assert eng.started.index("short") == 4


async def test_with_the_option_a_short_plan_takes_its_reserved_slot_at_once():
    eng, s, tasks = await _short_behind_longs(short_image_tokens=256, short_reserved=1)
    # One slot is the short queue's: one long plan runs, and the short plan starts as soon as it arrives.
    assert eng.started == ["long0", "short"]
    assert s.stats.long_held > 0 and s.stats.short_dispatched == 1
    await _finish_all(eng, tasks)
    assert sorted(eng.started) == ["long0", "long1", "long2", "long3", "short"]


async def test_the_short_queue_goes_first_when_a_slot_frees_and_long_plans_keep_their_share():
    eng = RecordingEngine()
    s = scheduler(eng, policy=Policy.FCFS, max_concurrency=3, short_image_tokens=256, short_reserved=1)
    tasks = [asyncio.create_task(s.submit(plan(n, k))) for n, k in
             [("long0", "A4"), ("long1", "B4"), ("long2", "C4"), ("long3", "D4")]]
    await settle()
    assert eng.started == ["long0", "long1"]  # the third slot is held for short plans
    tasks += [asyncio.create_task(s.submit(plan(n, k))) for n, k in [("s1", "S"), ("s2", "T")]]
    await settle()
    assert eng.started == ["long0", "long1", "s1"]
    await eng.finish("long0")
    # A long slot freed: the short queue is served first (s2 arrived after long2 and long3).
    assert eng.started == ["long0", "long1", "s1", "s2"]
    await eng.finish("s1")
    # The short queue is empty: long plans take their share again (long1 and long2: two of three slots) ...
    assert eng.started[-1] == "long2"
    await eng.finish("s2")
    # ... but never the reserved one, even with long3 waiting and that slot idle.
    assert eng.started[-1] == "long2" and s.in_flight == 2 and s.waiting == 1
    await _finish_all(eng, tasks)


async def test_an_overdue_long_plan_still_goes_next_within_the_long_slots():
    now = [0.0]
    eng = RecordingEngine()
    s = Scheduler(eng, SchedulerConfig(policy=Policy.FCFS, max_concurrency=2, max_wait_ms=1000,
                                       short_image_tokens=256), image_tokens=lambda p: sum(TOKENS[k] for k in p.images),
                  clock=lambda: now[0])
    tasks = [asyncio.create_task(s.submit(plan(n, k))) for n, k in [("long0", "A4"), ("long1", "B4")]]
    await settle()
    now[0] = 0.5
    tasks += [asyncio.create_task(s.submit(plan(n, k))) for n, k in [("s1", "S"), ("s2", "T")]]
    await settle()
    assert eng.started == ["long0", "s1"]
    now[0] = 2.0  # long1 waited 2 s > 1 s: it goes before s2 once the long slot frees
    await eng.finish("long0")
    assert eng.started == ["long0", "s1", "long1"] and s.stats.fairness_overrides >= 1
    await _finish_all(eng, tasks)


def test_a_reservation_that_leaves_long_plans_no_slot_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="MMRAG_SCHEDULER_SHORT_RESERVED"):
        SchedulerConfig(max_concurrency=2, short_image_tokens=256, short_reserved=2)
    SchedulerConfig(max_concurrency=2, short_reserved=2)  # no short queue: the reservation means nothing


def test_the_settings_reach_the_scheduler_config_and_a_bad_reservation_fails_with_the_variable_to_fix():
    from mmrag.core.settings import Settings
    from mmrag.wiring import scheduler_config

    settings = Settings(scheduler_short_image_tokens=512, scheduler_short_reserved=2, max_concurrency=4)
    config = scheduler_config(settings)
    assert (config.short_image_tokens, config.short_reserved, config.max_concurrency) == (512, 2, 4)
    with pytest.raises(ValueError, match="MMRAG_SCHEDULER_SHORT_RESERVED"):
        scheduler_config(Settings(scheduler_short_image_tokens=512, scheduler_short_reserved=4, max_concurrency=4))


async def test_dispatched_plans_are_counted_by_resolution_policy():
    eng = RecordingEngine()
    s = scheduler(eng, max_concurrency=4)
    task = asyncio.create_task(s.submit(plan("p", "S", "A4")))
    await settle()
    assert s.stats.image_tokens_by_policy == [(None, 64 + 1024)]  # string keys carry no policy
    await _finish_all(eng, [task])


# --- the KV residency estimate ------------------------------------------------------------------------------


def test_residency_shares_image_prefixes_and_counts_each_once():
    kv = KVResidency(10_000)
    kv.observe(("A", "B"), [1000, 500], 40)
    kv.observe(("A", "C"), [1000, 300], 40)  # A's prefix is the same node: counted once
    assert kv.image_tokens == 1000 + 500 + 300
    assert kv.share == pytest.approx(1800 / 10_000)


def test_residency_evicts_least_recent_chains_tail_first():
    kv = KVResidency(2_100)
    kv.observe(("A", "B"), [1000, 500], 50)
    kv.observe(("C",), [500], 50)  # 2100 tokens: all fit
    assert kv.image_tokens == 2000
    kv.observe(("A",), [1000], 600)  # A refreshed; 600 new tokens evict the first prompt's text, then (A, B)
    assert kv.image_tokens == 1500  # A and C remain: the chain's tail (A, B) was evicted before its head


async def test_the_scheduler_feeds_its_residency_estimate_as_prefills_end():
    eng = RecordingEngine()
    s = scheduler(eng, max_concurrency=4)
    kv = s.track_kv(4096)
    task = asyncio.create_task(s.submit(plan("p", "S", "A4")))
    await settle()
    assert kv.image_tokens == 0 and kv.resident_prefix(("S", "A4"), [64, 1024]) == 0  # still in prefill
    await eng.finish("p", prefill_only=True)
    assert kv.image_tokens == s.stats.kv_image_tokens == 64 + 1024
    assert kv.resident_prefix(("S", "A4"), [64, 1024]) == 1088
    assert kv.resident_prefix(("S", "T"), [64, 64]) == 64  # the same first page, then another: its run stops
    assert kv.resident_prefix(("A4",), [1024]) == 0  # A4 is cached behind S only
    await _finish_all(eng, [task])
    assert s.stats.kv_capacity_tokens == 4096


# --- the served metrics, after a real question through the app ----------------------------------------------


async def test_a_served_question_shows_image_tokens_by_tier_pooling_and_kv_share_on_metrics(api_server):
    import httpx
    from serving.metrics import parse_samples
    from tests.conftest import API_KEY

    def samples(text: str) -> dict[tuple[str, tuple], float]:
        return {(name, tuple(sorted(labels.items()))): value
                for name, rows in parse_samples(text).items() for labels, value in rows}

    async with httpx.AsyncClient(base_url=api_server["url"], timeout=120) as http:
        r = await http.post("/v1/ask", json={"question": "What is the retry limit of the ingest service?"},
                            headers={"Authorization": f"Bearer {API_KEY}"})
        assert r.status_code == 200, r.text

        async def drained() -> dict:  # the app drains the scheduler's stats once a second
            got = samples((await http.get("/metrics")).text)
            assert got.get(("mmrag_tier_image_tokens_per_request_count", (("tier", "standard"),)), 0) > 0
            return got

        got = await eventually(drained, timeout=30, what="the scheduler's stats drained to /metrics")
    # Indexed pages carry the standard tier's keys: the label is the tier's name (Settings.tier_table).
    assert got[("mmrag_tier_image_tokens_per_request_count", (("tier", "standard"),))] > 0
    assert got[("mmrag_pooling_image_tokens_total", (("pooled", "false"),))] > 0
    assert got[("mmrag_pooling_image_tokens_total", (("pooled", "true"),))] == 0
    capacity = got[("mmrag_kv_capacity_tokens", ())]
    assert capacity > 0 and 0 < got[("mmrag_kv_image_tokens_resident", ())] <= capacity


async def test_a_free_reserved_slot_takes_a_short_plan_even_while_an_overdue_long_plan_waits():
    """Issue 23's probe 1: two long plans, the second overdue; a short plan arrives. The reserved slot is free
    and the short plan may use it, so it starts at once (it used to wait behind the overdue long plan, which
    could not start either: no long slot was free)."""
    now = [0.0]
    eng = RecordingEngine()
    s = Scheduler(eng, SchedulerConfig(policy=Policy.FCFS, max_concurrency=2, max_wait_ms=1000,
                                       short_image_tokens=256, short_reserved=1),
                  image_tokens=lambda p: sum(TOKENS[k] for k in p.images), clock=lambda: now[0])
    tasks = [asyncio.create_task(s.submit(plan(n, k))) for n, k in [("long0", "A4"), ("long1", "B4")]]
    await settle()
    now[0] = 2.0  # long1 is overdue, and no long slot is free for it
    tasks.append(asyncio.create_task(s.submit(plan("short", "S"))))
    await settle()
    assert eng.started == ["long0", "short"] and s.in_flight == 2 and s.waiting == 1
    await _finish_all(eng, tasks)
