"""The prefix-aware scheduler: pure ordering functions on plain lists, then the queue's rules.

The queue-rule tests drive the scheduler with `RecordingEngine`, a test double that completes plans when
the test says so: it makes dispatch order, gating and admission observable step by step. The cache effect
itself is measured on the real vLLM engine (tests/test_scheduler_engine.py).
"""

from __future__ import annotations

import asyncio

import pytest

from mmrag.core.engine import Completion, PromptPlan, Usage
from serving.scheduler import (BATCHES_OFFERED, Policy, Scheduler, SchedulerConfig, order_dfs_weight, order_fcfs,
                              order_lpm)
from tests.waiting import eventually


def test_fcfs_keeps_arrival_order():
    assert order_fcfs([("b",), ("a",), ("c",)]) == [0, 1, 2]


def test_dfs_weight_sends_plans_sharing_a_figure_back_to_back_heaviest_group_first():
    prefixes = [("x", "p"), ("a", "b"), ("y",), ("a", "c"), ("x", "q"), ("a",)]
    order = order_dfs_weight(prefixes)
    assert order == [5, 1, 3, 0, 4, 2]  # group a (3 plans), then x (2), then y


def test_dfs_weight_puts_the_shortest_plan_of_a_group_before_the_plans_extending_it():
    order = order_dfs_weight([("a", "b", "d"), ("a", "b"), ("a",)])
    assert order == [2, 1, 0]


def test_dfs_weight_breaks_weight_ties_by_arrival():
    assert order_dfs_weight([("b",), ("a",), ("b",), ("a",)]) == [0, 2, 1, 3]


def test_lpm_puts_longest_cached_prefix_first_and_is_stable():
    cached = {("a",), ("a", "b")}
    matched = lambda p: max((n for n in range(len(p), 0, -1) if p[:n] in cached), default=0)  # noqa: E731
    assert order_lpm([("c",), ("a", "x"), ("a", "b", "z"), ("d",)], matched) == [2, 1, 0, 3]


class RecordingEngine:
    """Test double: records dispatch order and finishes a plan's prefill / the plan itself on demand."""

    model_name = "recording"
    random_weights = True

    def __init__(self, batch: int = 64) -> None:
        self.started: list[str] = []
        self.prefill: dict[str, asyncio.Event] = {}
        self.done: dict[str, asyncio.Event] = {}
        self.batch, self.batch_asks = batch, 0

    async def batch_capacity(self) -> int:
        self.batch_asks += 1
        await asyncio.sleep(0)  # an engine answers later: submits arriving meanwhile wait for the same answer
        return self.batch

    async def generate(self, plan: PromptPlan, *, on_first_token=None) -> Completion:
        self.started.append(plan.text)
        self.prefill[plan.text], self.done[plan.text] = asyncio.Event(), asyncio.Event()
        await self.prefill[plan.text].wait()
        if on_first_token:
            on_first_token()
        await self.done[plan.text].wait()
        return Completion(plan.text, [], Usage(), self.model_name)

    async def finish(self, name: str, *, prefill_only: bool = False) -> None:
        self.prefill[name].set()
        if not prefill_only:
            self.done[name].set()
        for _ in range(5):
            await asyncio.sleep(0)


def plan(name: str, *images: str) -> PromptPlan:
    return PromptPlan(images=tuple(images), text=name)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def scheduler(engine, **kw) -> Scheduler:
    return Scheduler(engine, SchedulerConfig(**kw), image_tokens=lambda p: 100 * len(p.images))


async def test_siblings_wait_for_the_group_leaders_prefill_then_run_together():
    eng = RecordingEngine()
    s = scheduler(eng, max_concurrency=4)
    tasks = [asyncio.create_task(s.submit(plan(n, "A", x))) for n, x in [("p1", "B"), ("p2", "C"), ("p3", "D")]]
    await settle()
    assert eng.started == ["p1"] and s.waiting == 2 and s.stats.gated > 0
    await eng.finish("p1", prefill_only=True)
    assert sorted(eng.started) == ["p1", "p2", "p3"]
    for name in ("p1", "p2", "p3"):
        await eng.finish(name)
    assert [t.result().text for t in tasks] == ["p1", "p2", "p3"]


async def test_parts_sharing_pages_after_a_cached_first_one_wait_for_the_first_parts_prefill():
    """A joint answer's parts (rag/plans.joint_parts) share every page. Their first page is cached already (an
    earlier plan led with it), the pages after it are not: the second part waits for the first one's prefill
    and hits those pages, instead of computing them beside it."""
    eng = RecordingEngine()
    s = scheduler(eng, max_concurrency=4)
    earlier = asyncio.create_task(s.submit(plan("earlier", "A")))
    await settle()
    await eng.finish("earlier")
    parts = [asyncio.create_task(s.submit(plan(n, "A", "B", "C"))) for n in ("part1", "part2")]
    other = asyncio.create_task(s.submit(plan("other", "A", "D")))  # shares only the cached page: not held
    await settle()
    assert eng.started == ["earlier", "part1", "other"] and s.waiting == 1
    await eng.finish("part1", prefill_only=True)
    assert eng.started[-1] == "part2"
    for name in ("part1", "part2", "other"):
        await eng.finish(name)
    await asyncio.gather(earlier, other, *parts)
    assert s.in_flight == 0


async def test_a_page_warmed_past_the_scheduler_is_never_waited_for():
    """Warm-up prefills pages on the engine directly (serving/api/startup.py tells the scheduler): two plans
    leading with a warm page start together, where a cold page holds the second for the first's prefill."""
    from serving.warmup import warm_plan

    eng = RecordingEngine()
    s = scheduler(eng, max_concurrency=4)
    s.note_prefilled(warm_plan("W"))
    warm = [asyncio.create_task(s.submit(plan(n, "W", x))) for n, x in (("w1", "B"), ("w2", "C"))]
    cold = [asyncio.create_task(s.submit(plan(n, "K", x))) for n, x in (("k1", "B"), ("k2", "C"))]
    await settle()
    assert eng.started == ["w1", "w2", "k1"] and s.waiting == 1
    await eng.finish("k1", prefill_only=True)
    for name in ("w1", "w2", "k1", "k2"):
        await eng.finish(name)
    await asyncio.gather(*warm, *cold)


async def test_fcfs_never_holds_a_plan_back():
    eng = RecordingEngine()
    s = scheduler(eng, policy=Policy.FCFS, max_concurrency=4)
    tasks = [asyncio.create_task(s.submit(plan(n, "A"))) for n in ("p1", "p2")]
    await settle()
    assert eng.started == ["p1", "p2"]
    for n in ("p1", "p2"):
        await eng.finish(n)
    await asyncio.gather(*tasks)


async def test_concurrency_limit_and_image_token_admission_bound_what_is_in_flight():
    eng = RecordingEngine()
    s = scheduler(eng, policy=Policy.FCFS, max_concurrency=2, max_image_tokens_in_flight=250)
    tasks = [asyncio.create_task(s.submit(plan(f"p{i}", f"K{i}", f"L{i}"))) for i in range(3)]  # 200 tokens each
    await settle()
    assert eng.started == ["p0"]  # a second 200-token plan would exceed the 250-token budget
    await eng.finish("p0")
    assert eng.started == ["p0", "p1"]
    await eng.finish("p1")
    await eng.finish("p2")
    await asyncio.gather(*tasks)
    assert s.in_flight == 0 and s.waiting == 0


async def test_a_plan_that_can_never_fit_the_budget_is_refused_with_the_fix():
    s = scheduler(RecordingEngine(), max_image_tokens_in_flight=150)
    with pytest.raises(ValueError, match="lower top-k"):
        await s.submit(plan("big", "A", "B"))


async def test_a_plan_waiting_past_max_wait_goes_next_whatever_the_policy():
    now = [0.0]
    eng = RecordingEngine()
    s = Scheduler(eng, SchedulerConfig(max_concurrency=1, max_wait_ms=1000),
                  image_tokens=lambda p: 1, clock=lambda: now[0])
    first = asyncio.create_task(s.submit(plan("busy", "Z")))
    await settle()
    lonely = asyncio.create_task(s.submit(plan("lonely", "Y")))
    now[0] = 0.5
    crowd = [asyncio.create_task(s.submit(plan(f"c{i}", "X"))) for i in range(3)]  # heavier group
    await settle()
    now[0] = 2.0  # "lonely" has now waited 2 s > 1 s
    await eng.finish("busy")
    assert eng.started == ["busy", "lonely"] and s.stats.fairness_overrides >= 1
    await eng.finish("lonely")
    for i in range(3):
        await eng.finish(f"c{i}")
    await asyncio.gather(first, lonely, *crowd)


async def test_engine_errors_reach_the_caller_and_free_the_slot():
    class Failing(RecordingEngine):
        async def generate(self, plan, *, on_first_token=None):
            raise RuntimeError("engine said no")

    s = scheduler(Failing(), max_concurrency=1)
    with pytest.raises(RuntimeError, match="engine said no"):
        await s.submit(plan("p", "A"))
    assert s.in_flight == 0


async def test_above_the_queue_cap_the_order_falls_back_to_fcfs():
    eng = RecordingEngine()
    s = scheduler(eng, max_concurrency=1, queue_cap=2)
    first = asyncio.create_task(s.submit(plan("busy", "Z")))
    await settle()
    # Arrival order: a lone plan, then a heavier group that dfs-weight would send first.
    waiting = [asyncio.create_task(s.submit(plan(n, k))) for n, k in [("lone", "Y"), ("g1", "X"), ("g2", "X")]]
    await settle()
    await eng.finish("busy")
    assert eng.started == ["busy", "lone"] and s.stats.fcfs_fallbacks >= 1
    for n in ("lone", "g1", "g2"):
        await eng.finish(n)
    await asyncio.gather(first, *waiting)


async def test_a_cancelled_caller_takes_its_queued_plan_out_and_aborts_its_running_one():
    eng = RecordingEngine()
    s = scheduler(eng, policy=Policy.FCFS, max_concurrency=1)
    running = asyncio.create_task(s.submit(plan("p0", "A")))
    queued = asyncio.create_task(s.submit(plan("p1", "B")))
    nxt = asyncio.create_task(s.submit(plan("p2", "C")))
    await settle()
    assert eng.started == ["p0"] and s.waiting == 2

    queued.cancel()  # its client left while it waited: it must never reach the engine
    await settle()
    assert s.waiting == 1 and s.stats.cancelled_queued == 1

    running.cancel()  # its client left mid-generation: the engine request is cancelled, the slot freed
    await settle()
    assert s.stats.cancelled_running == 1 and eng.started == ["p0", "p2"] and s.in_flight == 1
    await eng.finish("p2")
    assert (await nxt).text == "p2"
    assert running.cancelled() and queued.cancelled() and s.waiting == 0 and s.in_flight == 0
    assert "p1" not in eng.started


async def test_a_caller_that_leaves_as_its_plan_is_dispatched_frees_the_slot():
    """The CI flake of test_cancel: a plan dispatched (its run task created, not yet started) as its caller
    leaves in the same turn of the loop. The run task is cancelled before its first step, so its body, and a
    ``finally`` in it, never runs: the slot must be freed all the same, or the scheduler stays full for ever."""
    eng = RecordingEngine()
    s = scheduler(eng, policy=Policy.FCFS, max_concurrency=1)
    first = asyncio.create_task(s.submit(plan("p0", "A")))
    await settle()
    second = asyncio.create_task(s.submit(plan("p1", "B")))
    await settle()
    assert eng.started == ["p0"] and s.waiting == 1
    # p0 completes and, in the same turn, p1's caller leaves: p0's end dispatches p1 (its run task created)
    # before p1's caller hears of its cancellation and abandons it.
    eng.prefill["p0"].set()
    eng.done["p0"].set()
    second.cancel()
    await settle()
    assert (await first).text == "p0" and second.cancelled()
    assert s.in_flight == 0 and s.waiting == 0, (s.in_flight, s.waiting)
    assert s.stats.cancelled_running + s.stats.cancelled_queued == 1
    third = asyncio.create_task(s.submit(plan("p2", "C")))  # the slot is usable again
    await settle()
    await eng.finish("p2")
    assert (await third).text == "p2" and s.in_flight == 0


async def test_gating_never_holds_a_plan_behind_another_tenants_prefill():
    """Issue 23's probe 2: tenant B's plan shares tenant A's leading figure, but B's cache salt means it can
    never reuse A's KV, so holding it behind A's prefill is pure loss. Same salt: held, as before."""
    eng = RecordingEngine()
    s = scheduler(eng, max_concurrency=4)

    def salted(name: str, salt: str) -> PromptPlan:
        return PromptPlan(images=("A", "B"), text=name, cache_salt=salt)

    tasks = [asyncio.create_task(s.submit(salted("a1", "tenant-a")))]
    await settle()
    tasks += [asyncio.create_task(s.submit(salted("b1", "tenant-b"))),
              asyncio.create_task(s.submit(salted("a2", "tenant-a")))]
    await settle()
    assert eng.started == ["a1", "b1"] and s.waiting == 1  # a2 waits for a1's prefill; b1 does not
    await eng.finish("a1", prefill_only=True)
    assert eng.started == ["a1", "b1", "a2"]
    for name in ("a1", "b1", "a2"):
        await eng.finish(name)
    await asyncio.gather(*tasks)


async def test_an_overdue_plan_waiting_for_the_budget_is_not_overtaken_by_younger_smaller_plans():
    """Without the hold, plans small enough to fit beside the running one would start each time a slot frees,
    and the overdue plan that needs the whole budget could wait for ever."""
    now = [0.0]
    eng = RecordingEngine()
    s = Scheduler(eng, SchedulerConfig(policy=Policy.FCFS, max_concurrency=3, max_image_tokens_in_flight=300,
                                       max_wait_ms=1000), image_tokens=lambda p: 100 * len(p.images),
                  clock=lambda: now[0])
    tasks = [asyncio.create_task(s.submit(plan("small0", "A")))]
    await settle()
    tasks.append(asyncio.create_task(s.submit(plan("big", "B", "C", "D"))))  # 300 tokens: the whole budget
    await settle()
    now[0] = 2.0  # big is overdue; small0 still holds 100 tokens
    tasks += [asyncio.create_task(s.submit(plan(f"small{i}", f"E{i}"))) for i in (1, 2)]
    await settle()
    assert eng.started == ["small0"] and s.waiting == 3  # small1 and small2 would fit, but big goes first
    await eng.finish("small0")
    assert eng.started == ["small0", "big"]
    await eng.finish("big")
    assert eng.started == ["small0", "big", "small1", "small2"]
    for name in ("small1", "small2"):
        await eng.finish(name)
    await asyncio.gather(*tasks)


async def test_an_overdue_plan_that_leaves_the_queue_lets_the_plans_it_held_back_start_at_once():
    """Found by the property test: the overdue plan holding younger ones back was cancelled by its caller, and the
    younger plan that fits waited for an unrelated event (a finish, a timer) though a slot and the budget were free."""
    now = [0.0]
    eng = RecordingEngine()
    s = Scheduler(eng, SchedulerConfig(policy=Policy.FCFS, max_concurrency=3, max_image_tokens_in_flight=300,
                                       max_wait_ms=1000), image_tokens=lambda p: 100 * len(p.images),
                  clock=lambda: now[0])
    running = asyncio.create_task(s.submit(plan("small0", "A")))
    await settle()
    big = asyncio.create_task(s.submit(plan("big", "B", "C", "D")))
    await settle()
    now[0] = 2.0
    small = asyncio.create_task(s.submit(plan("small1", "E")))
    await settle()
    assert eng.started == ["small0"]  # held behind the overdue big plan
    big.cancel()
    await settle()
    assert eng.started == ["small0", "small1"] and s.waiting == 0 and s.stats.cancelled_queued == 1
    for name in ("small0", "small1"):
        await eng.finish(name)
    await asyncio.gather(running, small)
    with pytest.raises(asyncio.CancelledError):
        await big


async def test_a_tenant_with_a_long_queue_does_not_hold_another_tenants_plan_behind_it():
    """Issue 41: plans of different tenants (cache salts) share no prefix; among them the tenant with the fewest
    plans in flight goes first, so B's twenty queued plans do not run before A's one."""
    from dataclasses import replace

    eng = RecordingEngine()
    s = scheduler(eng, max_concurrency=2, max_wait_ms=10**9)
    flood = [asyncio.create_task(s.submit(replace(plan(f"b{i}", f"B{i}"), cache_salt="b"))) for i in range(20)]
    await settle()
    assert eng.started == ["b0", "b1"] and s.waiting == 18
    mine = asyncio.create_task(s.submit(replace(plan("a0", "A0"), cache_salt="a")))
    await settle()
    await eng.finish("b0")
    assert eng.started[-1] == "a0"  # the freed slot: A's, ahead of B's eighteen
    await eng.finish("a0")
    assert mine.result().text == "a0"
    for name in [f"b{i}" for i in range(1, 20)]:
        await eng.finish(name)
    assert [t.result().text for t in flood] == [f"b{i}" for i in range(20)]


async def test_another_tenants_fresh_plan_goes_before_a_flooding_tenants_overdue_ones():
    """Issue 41: under B's flood every one of B's queued plans has waited past max_wait_ms; overdue plans go
    first only within a tenant, so A's plan, just submitted, takes the next freed slot (measured before: A's
    plans waited behind every overdue plan of B's, 8.7 s a question beside 0.8 s alone)."""
    from dataclasses import replace

    now = [0.0]
    eng = RecordingEngine()
    s = Scheduler(eng, SchedulerConfig(max_concurrency=2, max_wait_ms=1000), image_tokens=lambda p: 1,
                  clock=lambda: now[0])
    flood = [asyncio.create_task(s.submit(replace(plan(f"b{i}", f"B{i}"), cache_salt="b"))) for i in range(8)]
    await settle()
    assert eng.started == ["b0", "b1"]
    now[0] = 5.0  # B's six queued plans are overdue
    mine = asyncio.create_task(s.submit(replace(plan("a0", "A0"), cache_salt="a")))
    await settle()
    await eng.finish("b0")
    assert eng.started[-1] == "a0"  # ahead of B's overdue six
    await eng.finish("b1")
    assert eng.started[-1] == "b2"  # then B's, oldest first
    await eng.finish("a0")
    for name in [f"b{i}" for i in range(2, 8)]:
        await eng.finish(name)
    assert mine.result().text == "a0" and [t.result().text for t in flood] == [f"b{i}" for i in range(8)]


async def test_slots_are_kept_for_a_tenant_busy_a_moment_ago_and_given_back_when_it_is_gone():
    """Issue 41: A asks a question (two parts at once) every few seconds beside B's flood. Between A's
    questions B, at or over its share, leaves A's two slots free (A's last burst; at most a quarter of 8), so A's
    next parts start at once instead of waiting for two of B's plans to end. While A is busy B takes any slot
    that frees (nothing kept for a busy tenant); once A has been idle TENANT_RECENT_S, the timer gives B the
    kept slots back. Alone, a tenant takes every slot."""
    from dataclasses import replace

    from serving.scheduler import TENANT_RECENT_S

    now, timers = [0.0], []

    class Timer:
        def __init__(self, delay, callback) -> None:
            self.due, self.callback = now[0] + delay, callback
            timers.append(self)

        def cancel(self) -> None:
            timers.remove(self)

    eng = RecordingEngine()
    s = Scheduler(eng, SchedulerConfig(max_concurrency=8, max_wait_ms=1000), image_tokens=lambda p: 1,
                  clock=lambda: now[0], call_later=Timer)
    salted = lambda name, salt: replace(plan(name, name.upper()), cache_salt=salt)  # noqa: E731
    alone = [asyncio.create_task(s.submit(salted(f"a{i}", "a"))) for i in range(2)]
    await settle()
    for name in ("a0", "a1"):
        await eng.finish(name)
    await asyncio.gather(*alone)

    now[0] = 1.0
    flood = [asyncio.create_task(s.submit(salted(f"b{i}", "b"))) for i in range(20)]
    await settle()
    assert eng.started[2:] == [f"b{i}" for i in range(6)] and s.stats.kept_held > 0  # two slots kept for A
    mine = [asyncio.create_task(s.submit(salted(f"a{i}", "a"))) for i in (2, 3)]
    await settle()
    assert eng.started[-2:] == ["a2", "a3"] and s.in_flight == 8  # at once, no wait for B's plans
    await eng.finish("b0")
    assert eng.started[-1] == "b6"  # A is busy: nothing kept, B takes the freed slot
    for name in ("a2", "a3"):
        await eng.finish(name)
    await asyncio.gather(*mine)
    assert s.in_flight == 6 and eng.started[-1] == "b6"  # A idle a moment: its two slots kept again

    now[0] += TENANT_RECENT_S + 1  # A idle past the window: the timer gives B the slots back
    [timer] = [t for t in timers if t.due <= now[0]]
    timer.callback()
    await settle()
    assert eng.started[-2:] == ["b7", "b8"] and s.in_flight == 8
    for i in range(1, 20):
        now[0] += 0.1
        await eng.finish(f"b{i}")
    assert [t.result().text for t in flood] == [f"b{i}" for i in range(20)]


async def test_unset_concurrency_is_twice_the_engines_batch_asked_once_before_the_first_plan():
    eng = RecordingEngine(batch=3)
    s = Scheduler(eng, SchedulerConfig(max_concurrency=0), image_tokens=lambda p: 1)  # from the engine's batch
    tasks = [asyncio.ensure_future(s.submit(plan(f"p{i}", f"img{i}"))) for i in range(8)]
    await eventually(lambda: len(eng.started) == 6, timeout=10, what="two of the engine's batches dispatched")
    await settle()
    assert eng.batch_asks == 1  # eight submits arriving while the engine was asked: one ask
    assert BATCHES_OFFERED == 2  # one batch decoding, one waiting inside the engine
    assert s.config.max_concurrency == s.stats.max_concurrency == s.tenants.max_concurrency == 6
    assert eng.started == [f"p{i}" for i in range(6)]  # two batches, not a fixed 4, at once
    for name in list(eng.started):
        await eng.finish(name)
    await settle()
    assert len(eng.started) == 8
    for name in eng.started[6:]:
        await eng.finish(name)
    assert [c.text for c in await asyncio.gather(*tasks)] == [f"p{i}" for i in range(8)]
    assert await s.fit() == 6 and eng.batch_asks == 1


async def test_a_set_concurrency_never_asks_the_engine():
    eng = RecordingEngine(batch=64)
    s = Scheduler(eng, SchedulerConfig(max_concurrency=2), image_tokens=lambda p: 1)
    tasks = [asyncio.ensure_future(s.submit(plan(f"p{i}", f"img{i}"))) for i in range(3)]
    await settle()
    assert eng.started == ["p0", "p1"] and eng.batch_asks == 0
    for name in ("p0", "p1"):
        await eng.finish(name)
    await settle()
    await eng.finish("p2")
    await asyncio.gather(*tasks)


async def test_an_engine_that_cannot_say_its_batch_fails_the_plan_and_is_asked_again():
    class Silent(RecordingEngine):
        async def batch_capacity(self) -> int:
            self.batch_asks += 1
            if self.batch_asks == 1:
                raise RuntimeError("replica down")
            return 3

    eng = Silent()
    s = Scheduler(eng, SchedulerConfig(max_concurrency=0), image_tokens=lambda p: 1)
    with pytest.raises(RuntimeError, match="replica down"):
        await s.submit(plan("p0", "a"))
    assert eng.started == [] and s.config.max_concurrency == 0
    task = asyncio.ensure_future(s.submit(plan("p1", "b")))
    await eventually(lambda: eng.started, timeout=10, what="p1 dispatched")
    assert eng.started == ["p1"] and s.config.max_concurrency == 2 * 3
    await eng.finish("p1")
    await task


def test_a_negative_concurrency_is_refused_with_the_setting_to_fix():
    with pytest.raises(ValueError, match="MMRAG_MAX_CONCURRENCY"):
        SchedulerConfig(max_concurrency=-1)
