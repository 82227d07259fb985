"""Prefix-aware scheduling of prompt plans in front of the engine.

The sub-question plans of all in-flight requests enter one queue. Two units decide what runs, kept apart:

- the order (pure functions over plain lists of prefix paths, ``routing.prefix_path``: the cache salt and
  system prompt, then the images): FCFS, LPM (longest prefix already prefilled first) or DFS-weight
  (SGLang's: walk the trie of prefixes, heavier subtrees first, so plans sharing a figure leave back to back);
  overdue plans (waited ``max_wait_ms``) are offered first, in arrival order, whatever the policy says; above
  ``queue_cap`` waiting plans, plain FCFS, to bound the policy's own cost;
- admission (:class:`Admission`): which of the offered plans may start now —
  - a concurrency limit to the engine, and the image tokens in flight within a budget (the guard against
    KV exhaustion);
  - mixed resolutions (``short_image_tokens``): plans of at most that many image tokens form a queue of
    their own, offered before the long plans, and ``short_reserved`` of the slots are theirs alone, so a
    short plan never waits for a slot behind long image prefills (each takes seconds on a CPU);
  - group gating: a plan whose leading image is being prefilled by another in-flight plan of the same salt
    waits for that prefill to finish, so it hits the KV the first plan creates instead of computing it again.

Tenants (cache salts): plans of different salts share no prefix, so between them the order is fair share, not
the policy — the salt with the fewest plans in flight goes first (:meth:`Scheduler._next`), and
:class:`TenantSlots` keeps a few slots free for a tenant that was busy a moment ago and will be again (a question
every few seconds beside another tenant's flood): a salt at or over its share leaves free as many slots as each
such tenant last had in flight at once, at most a quarter of them, so that tenant's next question starts at once
instead of waiting for the flood's plans to end. One salt: nothing is kept free.

Cancellation: a cancelled ``submit`` (its question's client left) takes its plan out of the queue, or cancels
its engine request if it is running, so abandoned work frees capacity at once.

The rules hold as properties over random arrival streams (tests/test_scheduler_properties.py): a free reserved
slot is never idle while a short plan waits, no plan waits past ``max_wait_ms`` while a slot it may use is free,
the budget is never exceeded, and gating never crosses salts.

Why a reserved share and not a bound on the image-token spread in flight: the spread bound is for batches that
pay for padding (a GPU kernel over ragged lengths); vLLM packs a batch's tokens without padding, so a mixed
batch costs nothing extra, and a bound would idle slots whenever the queue's head is of the other size (it is
not work-conserving) without putting the short plans first. The reservation keeps every slot busy while both
queues have work, bounds a short plan's wait by the short plans ahead of it, and leaves the long plans
``max_concurrency - short_reserved`` slots of their own (plus ``max_wait_ms`` fairness), so they cannot starve.

``KVResidency`` estimates the image tokens the engine's prefix cache holds, for serving/metrics.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from mmrag.core.engine import Completion, Engine, OnText, PromptPlan
from mmrag.core.settings import default_of
from serving.routing import Path, prefix_path

log = logging.getLogger(__name__)

T = TypeVar("T")

# MMRAG_MAX_CONCURRENCY=0 lets in this many of the engine's batches: one decoding and one waiting inside the engine.
# With exactly one batch in flight a sequence that ends leaves its slot empty until mmrag has seen the end, sent the
# next plan, and the engine has taken it in (tokenised, its image tokens loaded); a second batch already waiting in
# the engine fills it at the next step. The rest still waits here, in the scheduler's order. Measured:
# docs/benchmarks.md.
BATCHES_OFFERED = 2
Key = Hashable


class Policy(str, enum.Enum):
    FCFS = "fcfs"
    LPM = "lpm"
    DFS_WEIGHT = "dfs-weight"


# --- pure ordering functions over lists of prefix paths ---------------------------------------------------


def order_fcfs(prefixes: Sequence[tuple[Key, ...]]) -> list[int]:
    return list(range(len(prefixes)))


def order_lpm(prefixes: Sequence[tuple[Key, ...]], matched: Callable[[tuple[Key, ...]], int]) -> list[int]:
    """Longest already-cached prefix first (``matched`` says how many leading images are cached); stable."""
    return sorted(range(len(prefixes)), key=lambda i: -matched(prefixes[i]))


def order_dfs_weight(prefixes: Sequence[tuple[Key, ...]]) -> list[int]:
    """Depth-first over the trie of image prefixes, heavier subtrees first; arrival order breaks ties.

    Plans that end at a node leave before the node's children, so the shortest plan of a group — whose
    prefix the others extend — goes first and its KV is there for its siblings.
    """
    root = _Node()
    for i, prefix in enumerate(prefixes):
        node = root
        node.weight += 1
        for k in prefix:
            node = node.children.setdefault(k, _Node(first=i))
            node.weight += 1
        node.plans.append(i)
    out: list[int] = []
    stack = [root]
    while stack:
        node = stack.pop()
        out.extend(node.plans)
        # Push lighter subtrees first so the heaviest is popped next; ties: earliest arrival first.
        stack.extend(sorted(node.children.values(), key=lambda n: (n.weight, -n.first)))
    return out


@dataclass(slots=True)
class _Node:
    first: int = 0
    weight: int = 0
    plans: list[int] = field(default_factory=list)
    children: dict[Key, _Node] = field(default_factory=dict)


# --- the scheduler --------------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    """Each default is the setting's (mmrag/core/settings.py, declared once there; MMRAG_<name> in brackets)."""

    policy: Policy = Policy(default_of("scheduler_policy"))  # [SCHEDULER_POLICY]
    # Plans in flight. 0: BATCHES_OFFERED times what the engine batches (Engine.batch_capacity: its max_num_seqs,
    # the replicas' sum), asked once before the first plan (Scheduler.fit).
    max_concurrency: int = default_of("max_concurrency")
    max_image_tokens_in_flight: int = default_of("max_image_tokens_in_flight")
    max_wait_ms: float = default_of("max_wait_ms")
    queue_cap: int = default_of("queue_cap")
    # 0: one queue; else the largest plan (in image tokens) of the short queue [SCHEDULER_SHORT_IMAGE_TOKENS]
    short_image_tokens: int = default_of("scheduler_short_image_tokens")
    # Slots only short plans take (with short_image_tokens set) [SCHEDULER_SHORT_RESERVED]
    short_reserved: int = default_of("scheduler_short_reserved")

    def __post_init__(self) -> None:
        if self.max_concurrency < 0:
            raise ValueError(f"max_concurrency={self.max_concurrency}: set MMRAG_MAX_CONCURRENCY to the plans to "
                             "let into the engine at once, or 0 for as many as it batches")
        if self.short_image_tokens and self.max_concurrency and not 0 < self.short_reserved < self.max_concurrency:
            raise ValueError(
                f"short_reserved={self.short_reserved} must be at least 1 and below max_concurrency="
                f"{self.max_concurrency}, or long plans would never run (or short ones get no slot): set "
                "MMRAG_SCHEDULER_SHORT_RESERVED accordingly, or MMRAG_SCHEDULER_SHORT_IMAGE_TOKENS=0 for one queue"
            )


@dataclass(slots=True)
class SchedulerStats:
    """Counts for serving/metrics; the scheduler only counts, the metrics module exports."""

    submitted: int = 0
    dispatched: int = 0
    fairness_overrides: int = 0
    fcfs_fallbacks: int = 0
    gated: int = 0  # times a plan was held back to wait for its group leader's prefill
    cancelled_queued: int = 0  # plans whose caller left while they waited: they never reached the engine
    cancelled_running: int = 0  # plans whose caller left while they ran: their engine request was cancelled
    short_dispatched: int = 0  # plans dispatched from the short queue (short_image_tokens set)
    long_held: int = 0  # times a long plan was held back to keep the short plans' reserved slots free
    kept_held: int = 0  # times a plan was held back to keep slots free for another tenant's next plans
    queue_waits_s: list[float] = field(default_factory=list)  # drained by the metrics layer
    group_sizes: list[int] = field(default_factory=list)  # plans per leading image, per dispatch round
    # (resolution policy of the images, image tokens) per dispatched plan and policy: the metrics layer names
    # the tier and whether it is pooled. The policy is None for keys that carry none (test doubles).
    image_tokens_by_policy: list[tuple[Any, int]] = field(default_factory=list)
    # The KVResidency estimate (track_kv): image tokens resident in the prefix cache, of its capacity.
    kv_image_tokens: int = 0
    kv_capacity_tokens: int = 0
    max_concurrency: int = 0  # plans let into the engine at once, as set or fitted to the engine (Scheduler.fit)


@dataclass(slots=True)
class _Waiting:
    plan: PromptPlan
    path: Path  # routing.prefix_path(plan): the salt and system prompt, then the images
    seq: int
    arrival: float
    image_tokens: int
    short: bool
    future: asyncio.Future = field(repr=False)
    task: asyncio.Task | None = field(default=None, repr=False)  # the engine request, once dispatched
    on_text: OnText | None = field(default=None, repr=False)  # the caller's, forwarded to the engine
    prefilled: bool = False  # its prefill over (or its run ended): followers gated on its lead may start
    ended: bool = False  # its capacity given back (Scheduler._end): once, whichever way its run ended

    @property
    def lead(self) -> Path | None:
        """The prefix whose KV the plan's followers wait for: salt + system prompt + first image."""
        return self.path[:2] if len(self.path) > 1 else None


class Block(str, enum.Enum):
    """Why admission keeps a plan waiting (:meth:`Admission.block`)."""

    SLOT = "slot"  # every slot is taken
    LONG_SLOT = "long_slot"  # the free slots are the short plans' reserved ones
    BUDGET = "budget"  # its image tokens would overrun the in-flight budget
    HELD = "held"  # an older overdue plan waits for the budget: nothing younger overtakes it
    GATED = "gated"  # a plan of the same salt is prefilling images it leads with: wait and hit that KV
    KEPT = "kept"  # the free slots are kept for another tenant's next plans (TenantSlots)


class Admission:
    """Who may start now, apart from the order plans are offered in (the way SGLang keeps its PrefillAdder
    apart from its schedule policy). Plain state, no clock and no asyncio, so each rule is testable alone:

    - slots: at most ``max_concurrency`` plans in flight; long plans at most ``max_concurrency - short_reserved``
      when the short queue is on, so ``short_reserved`` slots are always the short plans';
    - the image-token budget: the image tokens in flight never exceed ``max_image_tokens_in_flight`` (a plan
      larger than the budget is refused at submit, so the budget never blocks an idle engine);
    - fairness: an overdue plan is never gated, and while an overdue plan waits for the budget no younger
      plan overtakes it, overdue or not (else a stream of smaller plans could keep it out for ever), except a
      short plan into a free reserved slot: that slot is not one the waiting plan may use unless it is short;
    - gating: a plan waits while another plan of the same salt and system prompt prefills a longer prefix of
      its images than any plan has finished (its leading image for the first time, or the pages after a warm
      first one: a joint answer's parts share every page), then hits that KV. Another salt's prefill is never
      waited for: it can never be reused (its salt is in the first block's hash). A short plan with a reserved
      slot free is never gated: its prefill is cheap, and the slot exists so that short plans do not wait.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.in_flight = 0
        self.long_in_flight = 0
        self.tokens_in_flight = 0
        self.prefilling: dict[Path, int] = {}  # prefix → plans in flight with it, still in prefill
        self.prefilled: OrderedDict[Path, None] = OrderedDict()  # prefixes some plan finished prefilling
        self._reserved = config.short_reserved if config.short_image_tokens else 0

    @property
    def free(self) -> bool:
        return self.in_flight < self.config.max_concurrency

    @property
    def reserved_free(self) -> bool:
        """A short plan's reserved slot is free (there are reserved slots, and fewer short plans run)."""
        return self.free and self.in_flight - self.long_in_flight < self._reserved

    def block(self, w: _Waiting, *, overdue: bool = False, hold: bool = False) -> Block | None:
        """Why ``w`` may not start now, or None. ``overdue``: it waited ``max_wait_ms``; ``hold``: an older
        overdue plan waits for the budget."""
        if not self.free:
            return Block.SLOT
        if not w.short and self.long_in_flight >= self.config.max_concurrency - self._reserved:
            return Block.LONG_SLOT
        if self.tokens_in_flight + w.image_tokens > self.config.max_image_tokens_in_flight:
            return Block.BUDGET
        reserved = w.short and self.reserved_free
        if hold and not reserved:
            return Block.HELD
        if not overdue and not reserved and self.gated(w):
            return Block.GATED
        return None

    def gated(self, w: _Waiting) -> bool:
        """Another plan is prefilling a prefix of ``w``'s path (salt and system prompt, then images) longer than
        the longest one some plan has finished: waiting for it, ``w`` hits those images' KV instead of
        computing it beside it. FCFS, the no-cleverness baseline, never gates."""
        if self.config.policy is Policy.FCFS or w.lead is None:
            return False
        computing = next((n for n in range(len(w.path), 1, -1) if w.path[:n] in self.prefilling), 0)
        return computing > 0 and w.path[:computing] not in self.prefilled

    def start(self, w: _Waiting) -> None:
        self.in_flight += 1
        self.long_in_flight += not w.short
        self.tokens_in_flight += w.image_tokens
        for n in range(2, len(w.path) + 1):
            self.prefilling[w.path[:n]] = self.prefilling.get(w.path[:n], 0) + 1

    def end_prefill(self, w: _Waiting) -> None:
        """Its KV is in the prefix cache from here on: followers of each of its prefixes may start."""
        for n in range(2, len(w.path) + 1):
            self.prefilling[w.path[:n]] -= 1
            if not self.prefilling[w.path[:n]]:
                del self.prefilling[w.path[:n]]
        self.note_prefilled(w.path)

    def note_prefilled(self, path: Path) -> None:
        """Each prefix of ``path`` is in the prefix cache (the most recent last; the oldest forgotten first)."""
        for n in range(2, len(path) + 1):
            self.prefilled[path[:n]] = None
            self.prefilled.move_to_end(path[:n])
        while len(self.prefilled) > PREFILLED_TRACKED:
            self.prefilled.popitem(last=False)

    def finish(self, w: _Waiting) -> None:
        self.in_flight -= 1
        self.long_in_flight -= not w.short
        self.tokens_in_flight -= w.image_tokens

    def matched(self, path: Path) -> int:
        """Images of ``path`` whose prefix some plan prefilled (LPM's view of what is cached)."""
        return max((n - 1 for n in range(len(path), 1, -1) if path[:n] in self.prefilled), default=0)


PREFILLED_TRACKED = 4096  # prefixes remembered as prefilled; the oldest are forgotten first
TENANT_RECENT_S = 60.0  # a tenant idle this long is gone: no slot is kept for it any more


@dataclass(slots=True)
class _Spell:
    """One tenant's (cache salt's) plans, now and in its last busy spell."""

    running: int = 0
    waiting: int = 0
    peak: int = 0  # most plans in flight at once in the current busy spell
    burst: int = 0  # ... in the last one that ended
    idle_since: float | None = None  # when its last busy spell ended; None while busy


class TenantSlots:
    """Slots kept free for tenants that were busy a moment ago, the plan-level twin of the API's admission rule.

    A tenant asking a question every few seconds beside another tenant's flood finds every slot taken each time
    it asks; the fewest-in-flight order gives it the next freed slots, but its plans (a split answer's parts, sent
    together) still wait for that many of the flood's plans to end, about a decode each. So a tenant (salt) at or
    over its guaranteed share (``max_concurrency`` over the busy and recently idle tenants) may not take the
    last ``kept_free`` slots: for each other tenant busy or idle for less than ``recent_s``, as many slots as it
    had in flight at once in its last busy spell less those it holds or waits for now (its parts arrive one
    submit at a time: the slots stay kept until the last one is in), at most a quarter of the slots in all. Once
    the other tenant holds its burst, nothing is kept for it (the fewest-in-flight order serves it); a tenant idle
    past ``recent_s`` is forgotten. Plain state: the caller passes the time.
    """

    def __init__(self, max_concurrency: int, recent_s: float = TENANT_RECENT_S) -> None:
        self.max_concurrency, self.recent_s = max_concurrency, recent_s
        self._spells: dict[str, _Spell] = {}

    def running(self, salt: str) -> int:
        spell = self._spells.get(salt)
        return spell.running if spell else 0

    def arrive(self, salt: str) -> None:
        spell = self._spells.setdefault(salt, _Spell())
        if not (spell.running or spell.waiting):
            spell.peak, spell.idle_since = 0, None  # a new busy spell
        spell.waiting += 1

    def start(self, salt: str) -> None:
        spell = self._spells[salt]
        spell.waiting -= 1
        spell.running += 1
        spell.peak = max(spell.peak, spell.running)

    def leave(self, salt: str, now: float, *, ran: bool) -> None:
        """One of ``salt``'s plans left: its run ended (``ran``) or it left the queue."""
        spell = self._spells[salt]
        if ran:
            spell.running -= 1
        else:
            spell.waiting -= 1
        if not (spell.running or spell.waiting):
            spell.burst, spell.idle_since = spell.peak, now

    def kept_free(self, salt: str, now: float) -> int:
        """Slots ``salt`` leaves free when it is at or over its share."""
        kept = sum(max(0, s.burst - s.running - s.waiting) for t, s in self._spells.items()
                   if t != salt and (s.idle_since is None or self._recent(s, now)))
        return min(kept, self.max_concurrency // 4)

    def may_take(self, salt: str, free: int, now: float) -> bool:
        """May one of ``salt``'s plans take one of the ``free`` slots now?"""
        kept = self.kept_free(salt, now)
        if not kept or free > kept:
            return True
        known = sum(1 for t, s in self._spells.items() if t == salt or s.idle_since is None or self._recent(s, now))
        return self.running(salt) < self.max_concurrency / known

    def next_change(self, now: float) -> float | None:
        """Seconds until the first recently idle tenant is forgotten (then less may be kept free), or None."""
        due = [s.idle_since + self.recent_s - now for s in self._spells.values()
               if s.burst and self._recent(s, now)]
        return max(min(due), 0.0) if due else None

    def forget(self, now: float) -> None:
        """Drop tenants idle past ``recent_s`` (bounded memory across many tenants)."""
        for salt in [t for t, s in self._spells.items() if s.idle_since is not None and not self._recent(s, now)]:
            del self._spells[salt]

    def _recent(self, spell: _Spell, now: float) -> bool:
        return spell.idle_since is not None and now - spell.idle_since < self.recent_s


class Scheduler:
    """``await scheduler.submit(plan)`` instead of ``await engine.generate(plan)``.

    Each time capacity may have freed (a submit, a first token, a completion, a wait running out), the plans
    are offered to :class:`Admission` in this order, and the first it admits starts; until none can:
    the overdue plans in arrival order, then the rest in the policy's order (above ``queue_cap`` waiting
    plans, arrival order; with the short queue on, its plans before the long ones).
    """

    def __init__(self, engine: Engine, config: SchedulerConfig = SchedulerConfig(), *,
                 image_tokens: Callable[[PromptPlan], int], clock: Callable[[], float] = time.monotonic,
                 call_later: Callable[[float, Callable[[], None]], Any] | None = None) -> None:
        """``clock`` and ``call_later`` (default: the running loop's, on ``time.monotonic``): a test that drives
        time itself passes its own, and calls :meth:`wake` when its time passes."""
        self.engine = engine
        self.config = config
        self.stats = SchedulerStats()
        self.admission = Admission(config)
        self._image_tokens = image_tokens
        self._clock = clock
        self._queue: list[_Waiting] = []
        self._seq = itertools.count()
        self.residency: KVResidency | None = None  # set by track_kv
        self._tasks: set[asyncio.Task] = set()
        self._call_later = call_later
        self._timer: Any = None  # what call_later returned: something with cancel()
        self.tenants = TenantSlots(config.max_concurrency)  # plans by cache salt (tenant), and slots kept free
        self.stats.max_concurrency = config.max_concurrency
        self._fitting: asyncio.Future[int] | None = None

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @property
    def in_flight(self) -> int:
        return self.admission.in_flight

    def note_prefilled(self, plan: PromptPlan) -> None:
        """``plan``'s prefix was prefilled past this scheduler (warm-up's, serving/api/startup.py): a plan that
        leads with it is never held for another plan's prefill of it (gating), and LPM counts it as cached."""
        self.admission.note_prefilled(prefix_path(plan))

    def track_kv(self, capacity_tokens: int) -> KVResidency:
        """Estimate, from here on, the image tokens resident in a prefix cache of this many tokens."""
        self.residency = KVResidency(capacity_tokens)
        self.stats.kv_capacity_tokens, self.stats.kv_image_tokens = capacity_tokens, 0
        return self.residency

    async def fit(self) -> int:
        """The plans let into the engine at once: ``config.max_concurrency``, or where that is 0, BATCHES_OFFERED
        times the engine's batch (Engine.batch_capacity: a replica started with 64 sequences is offered 128 plans,
        two such replicas 256), asked once. The first submit calls it; a server calls it at start-up so that no
        question waits for the ask."""
        if self.config.max_concurrency:
            return self.config.max_concurrency
        if self._fitting is None:
            self._fitting = asyncio.ensure_future(self.engine.batch_capacity())
        try:
            n = await asyncio.shield(self._fitting)
        except BaseException:
            if self._fitting.done():  # the engine's error: the next plan asks again
                self._fitting = None
            raise
        if not self.config.max_concurrency:
            self.config = replace(self.config, max_concurrency=BATCHES_OFFERED * max(1, n))
            self.admission.config = self.config
            self.tenants.max_concurrency = self.stats.max_concurrency = self.config.max_concurrency
            log.info("scheduler: %d plans in flight at once, %d times the engine's batch of %d "
                     "(MMRAG_MAX_CONCURRENCY=0)", self.config.max_concurrency, BATCHES_OFFERED, max(1, n))
        return self.config.max_concurrency

    async def submit(self, plan: PromptPlan, *, on_text: OnText | None = None) -> Completion:
        if not self.config.max_concurrency:
            await self.fit()
        loop = asyncio.get_running_loop()
        tokens = self._image_tokens(plan)
        if tokens > self.config.max_image_tokens_in_flight:
            raise ValueError(
                f"a plan with {tokens} image tokens can never fit the {self.config.max_image_tokens_in_flight}-token "
                "in-flight budget: lower top-k or max_pixels, or raise the budget"
            )
        short = 0 < self.config.short_image_tokens and tokens <= self.config.short_image_tokens
        item = _Waiting(plan, prefix_path(plan), next(self._seq), self._clock(), tokens, short,
                        loop.create_future(), on_text=on_text)
        self._queue.append(item)
        self.tenants.forget(item.arrival)
        self.tenants.arrive(plan.cache_salt)
        self.stats.submitted += 1
        self._dispatch()
        try:
            return await item.future
        except asyncio.CancelledError:
            self._abandon(item)
            raise

    def _abandon(self, item: _Waiting) -> None:
        if item in self._queue:
            self._queue.remove(item)
            self.tenants.leave(item.plan.cache_salt, self._clock(), ran=False)
            self.stats.cancelled_queued += 1
            self._dispatch()  # it may have held younger plans back (an overdue plan waiting for the budget)
        elif item.task is not None and not item.task.done():
            item.task.cancel()  # _run's finally frees its capacity and dispatches the next plan
            self.stats.cancelled_running += 1

    def wake(self) -> None:
        """Offer the queue again (the timer's callback: a gated plan's wait ran out)."""
        self._timer = None
        self._dispatch()

    # The dispatcher runs synchronously at every event that can free capacity: a submit, a first token,
    # a completion, and the one timer below. No background loop, so nothing to start or stop.
    def _dispatch(self) -> None:
        while self._queue and self.admission.free:
            item = self._next()
            if item is None:
                break
            self._queue.remove(item)
            self._start(item)
        self._arm_timer()

    def _arm_timer(self) -> None:
        """With a slot free and plans waiting, wake when the first of them becomes overdue (a plan that was
        gated may then start: no other event need come; fairness must not wait for one), or when a tenant that
        slots were kept free for is forgotten (a plan held for it may then start)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._queue or not self.admission.free:
            return
        now = self._clock()
        overdue = min(w.arrival for w in self._queue) + self.config.max_wait_ms / 1000 - now
        dues = [overdue] if overdue > 0 else []
        forgotten = self.tenants.next_change(now)  # then fewer slots may be kept: a plan held for them may start
        if forgotten is not None:
            dues.append(forgotten + 1e-3)  # just past it: the tenant is no longer recent then
        if dues:
            self._timer = (self._call_later or asyncio.get_running_loop().call_later)(min(dues), self.wake)

    def _next(self) -> _Waiting | None:
        now = self._clock()
        overdue = [w for w in self._queue if (now - w.arrival) * 1000 >= self.config.max_wait_ms]
        rest = [w for w in self._queue if (now - w.arrival) * 1000 < self.config.max_wait_ms]
        if len(self._queue) > self.config.queue_cap:
            self.stats.fcfs_fallbacks += 1
        elif rest:
            rest = [rest[i] for i in self._order([w.path for w in rest])]
        if self.config.short_image_tokens:
            rest.sort(key=lambda w: not w.short)  # stable: the short queue first, each in policy order
        offered = [(w, True) for w in overdue] + [(w, False) for w in rest]
        if len({w.plan.cache_salt for w in self._queue}) > 1:
            # Fair share between tenants (each its own salt, so no prefix of one helps another): the tenant with
            # the fewest plans in flight first, each tenant's own in the order above (stable). Overdue plans too:
            # under one tenant's flood its plans are all overdue, and arrival order would queue another tenant's
            # plan behind every one of them (max_wait_ms guards a policy's order within a tenant, not this).
            offered.sort(key=lambda o: self.tenants.running(o[0].plan.cache_salt))
        # An overdue plan waits for the budget: nothing younger overtakes it. Younger by submission (``seq``, the
        # queue's order), not by the offered order: the tenant sort may offer a younger plan first, and its wait
        # must not hold back an older one.
        held_from: int | None = None  # the seq of the oldest overdue plan waiting for the budget
        free = self.config.max_concurrency - self.admission.in_flight
        for w, is_overdue in offered:
            hold = held_from is not None and w.seq > held_from
            why = self.admission.block(w, overdue=is_overdue, hold=hold)
            if why is None and not self.tenants.may_take(w.plan.cache_salt, free, now):
                why = Block.KEPT
            if why is None:
                self.stats.fairness_overrides += is_overdue
                return w
            if is_overdue and why is Block.BUDGET:
                held_from = w.seq if held_from is None else min(held_from, w.seq)
            else:
                self.stats.long_held += why is Block.LONG_SLOT
                self.stats.gated += why is Block.GATED
                self.stats.kept_held += why is Block.KEPT
        return None

    def _order(self, paths: list[Path]) -> list[int]:
        policy = self.config.policy
        if policy is Policy.DFS_WEIGHT:
            return order_dfs_weight(paths)
        if policy is Policy.LPM:
            return order_lpm(paths, self.admission.matched)
        return order_fcfs(paths)

    def _start(self, w: _Waiting) -> None:
        self.admission.start(w)
        self.tenants.start(w.plan.cache_salt)
        self.stats.dispatched += 1
        self.stats.short_dispatched += w.short
        self.stats.image_tokens_by_policy += self._by_policy(w)
        self.stats.queue_waits_s.append(self._clock() - w.arrival)
        if w.lead is not None:
            self.stats.group_sizes.append(1 + sum(1 for q in self._queue if q.lead == w.lead))
        task = w.task = asyncio.get_running_loop().create_task(self._run(w))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        # A run task cancelled before its first step (its caller left in the turn that dispatched it) never
        # runs its body, nor the finally in it: this gives its slot back then (a no-op once _run has).
        task.add_done_callback(lambda _: self._end(w))

    async def _run(self, w: _Waiting) -> None:
        def on_first_token() -> None:
            self._end_prefill(w)
            self._dispatch()

        try:
            # on_text only when asked for: an engine that never streams text need not take it.
            streamed = {"on_text": w.on_text} if w.on_text is not None else {}
            completion = await self.engine.generate(w.plan, on_first_token=on_first_token, **streamed)
        except BaseException as exc:  # the caller gets the engine's own error; the scheduler moves on
            if not w.future.done():
                w.future.set_exception(exc)
        else:
            u = completion.usage
            self._observe(w.plan, u.prompt_tokens - u.image_tokens + u.completion_tokens)
            if not w.future.done():  # done: cancelled by a caller that left as the completion arrived
                w.future.set_result(completion)
        finally:  # here, not only in the done callback: a caller that got its completion sees the slot free
            self._end(w)

    def _end_prefill(self, w: _Waiting) -> None:
        if not w.prefilled:
            w.prefilled = True
            self._observe(w.plan)  # its images' KV is in the cache from the end of prefill on
            self.admission.end_prefill(w)

    def _end(self, w: _Waiting) -> None:
        """``w``'s capacity given back and the next plans dispatched, once however its run ended."""
        if w.ended:
            return
        w.ended = True
        self._end_prefill(w)
        self.admission.finish(w)
        self.tenants.leave(w.plan.cache_salt, self._clock(), ran=True)
        self._dispatch()

    def _observe(self, plan: PromptPlan, other_tokens: int | None = None) -> None:
        if self.residency is not None:
            tokens = [self._image_tokens(replace(plan, images=(k,))) for k in plan.images]
            self.residency.observe(plan.images, tokens, other_tokens)
            self.stats.kv_image_tokens = self.residency.image_tokens

    def _by_policy(self, w: _Waiting) -> list[tuple[Any, int]]:
        policies = {getattr(k, "policy", None) for k in w.plan.images}
        if len(policies) <= 1:  # the usual plan: every page under one policy
            return [(next(iter(policies), None), w.image_tokens)]
        return [(p, self._image_tokens(replace(w.plan, images=tuple(k for k in w.plan.images
                                                                   if getattr(k, "policy", None) == p))))
                for p in sorted(policies, key=str)]


class KVResidency:
    """An estimate of the image tokens whose KV the engine's prefix cache holds: the cache modelled as an LRU
    over the prompts the scheduler sent, in tokens, of the engine's KV capacity.

    A prompt is a chain: one node per image prefix (``images[:1]``, ``images[:2]``, …; the prefix cache shares
    them between prompts), sized by that image's tokens, entered when the plan's prefill ends; when it
    finishes, a node of its own for the text and the answer. vLLM frees a finished request's blocks tail
    first, so the chain enters the LRU tail first and its head leaves last; a node seen again is refreshed.
    What fits in the capacity, most recent first, is taken as resident. ``mmrag bench`` measures how well it
    predicts the engine's own cached image tokens (``kv_estimate_*`` in its JSON).

    Its error, all of one sign but the first: (1) tokens, not blocks — each chain ends in a partial block, so
    the real cache fills up to one block per prompt sooner (the estimate evicts later: over by at most
    ``block_size`` tokens of capacity per resident prompt); (2) engine work not submitted here is invisible —
    warm-up prefills (under), question decomposition and synthesis without images (over: their KV would have
    evicted image blocks), a ``reset_prefix_cache`` (over until the chains are seen again); (3) running
    requests' blocks cannot be evicted, and a preempted request's are dropped: neither is modelled.
    """

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_tokens = capacity_tokens
        self._lru: OrderedDict[Any, tuple[int, bool]] = OrderedDict()  # node -> (tokens, is image)
        self._tokens = 0
        self._image = 0

    @property
    def image_tokens(self) -> int:
        return self._image

    @property
    def share(self) -> float:
        """Image tokens resident as a share of the whole KV capacity (0..1)."""
        return self._image / self.capacity_tokens if self.capacity_tokens else 0.0

    def observe(self, images: tuple[Key, ...], image_tokens: Sequence[int], other_tokens: int | None = None) -> None:
        """A prompt's images in prompt order with their tokens: prefilled (``other_tokens`` None), or finished
        with this many other tokens (its text and answer, a node of its own)."""
        if other_tokens is not None:
            self._put(object(), max(other_tokens, 0), False)
        for n in range(len(images), 0, -1):  # tail first: the leading image is the most recently used
            self._put(images[:n], image_tokens[n - 1], True)
        while self._tokens > self.capacity_tokens and self._lru:
            _, (tokens, is_image) = self._lru.popitem(last=False)
            self._count(-tokens, is_image)

    def resident_prefix(self, images: tuple[Key, ...], image_tokens: Sequence[int]) -> int:
        """Image tokens of the longest leading run of ``images`` held as a prefix: what the estimate says a
        prompt with these images would find cached (the bench compares it with the engine's own count)."""
        hit = 0
        for n in range(1, len(images) + 1):
            if images[:n] not in self._lru:
                break
            hit += image_tokens[n - 1]
        return hit

    def _put(self, node: Any, tokens: int, is_image: bool) -> None:
        old = self._lru.pop(node, None)
        if old is not None:
            self._count(-old[0], old[1])
        self._lru[node] = (tokens, is_image)
        self._count(tokens, is_image)

    def _count(self, tokens: int, is_image: bool) -> None:
        self._tokens += tokens
        self._image += tokens if is_image else 0
