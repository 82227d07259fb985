"""Prefix-aware scheduling of prompt plans in front of the engine.

The sub-question plans of all in-flight requests enter one queue. A policy orders the queue — FCFS, LPM
(longest prefix already sent first) or DFS-weight (SGLang's: walk the trie of image-key prefixes, heavier
subtrees first, so plans sharing a figure leave back to back). On top of the order:

- group gating: a plan whose leading image is being prefilled by another in-flight plan waits for that
  prefill to finish, so it hits the KV the first plan creates instead of computing it a second time;
- a concurrency limit to the engine, and admission by image tokens in flight (the guard against KV
  exhaustion);
- fairness: a plan that has waited ``max_wait_ms`` goes next, whatever the policy says;
- above ``queue_cap`` waiting plans, plain FCFS, to bound the policy's own cost;
- cancellation: a cancelled ``submit`` (its question's client left) takes its plan out of the queue, or
  cancels its engine request if it is running, so abandoned work frees capacity at once;
- mixed resolutions (``short_image_tokens``): plans of at most that many image tokens form a queue of their
  own, served before the long plans, and ``short_reserved`` of the concurrency slots are theirs alone — a
  short plan never waits for a slot behind long image prefills (each takes seconds on a CPU).

Why a reserved share and not a bound on the image-token spread in flight: the spread bound is for batches that
pay for padding (a GPU kernel over ragged lengths); vLLM packs a batch's tokens without padding, so a mixed
batch costs nothing extra, and a bound would idle slots whenever the queue's head is of the other size (it is
not work-conserving) without putting the short plans first. The reservation keeps every slot busy while both
queues have work, bounds a short plan's wait by the short plans ahead of it, and leaves the long plans
``max_concurrency - short_reserved`` slots of their own (plus ``max_wait_ms`` fairness), so they cannot starve.

``KVResidency`` estimates the image tokens the engine's prefix cache holds, for serving/metrics.

Ordering functions are pure, over plain lists, and testable without an engine.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from core.engine import Completion, Engine, OnText, PromptPlan

T = TypeVar("T")
Key = Hashable


class Policy(str, enum.Enum):
    FCFS = "fcfs"
    LPM = "lpm"
    DFS_WEIGHT = "dfs-weight"


# --- pure ordering functions over lists of image-key tuples ---------------------------------------------


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
    policy: Policy = Policy.DFS_WEIGHT
    max_concurrency: int = 4
    max_image_tokens_in_flight: int = 32_768
    max_wait_ms: float = 2_000.0
    queue_cap: int = 128
    short_image_tokens: int = 0  # 0: one queue; else the largest plan (in image tokens) of the short queue
    short_reserved: int = 1  # slots only short plans take (with short_image_tokens set)

    def __post_init__(self) -> None:
        if self.short_image_tokens and not 0 < self.short_reserved < self.max_concurrency:
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
    queue_waits_s: list[float] = field(default_factory=list)  # drained by the metrics layer
    group_sizes: list[int] = field(default_factory=list)  # plans per leading image, per dispatch round
    # (resolution policy of the images, image tokens) per dispatched plan and policy: the metrics layer names
    # the tier and whether it is pooled. The policy is None for keys that carry none (test doubles).
    image_tokens_by_policy: list[tuple[Any, int]] = field(default_factory=list)
    # The KVResidency estimate (track_kv): image tokens resident in the prefix cache, of its capacity.
    kv_image_tokens: int = 0
    kv_capacity_tokens: int = 0


@dataclass(slots=True)
class _Waiting:
    plan: PromptPlan
    seq: int
    arrival: float
    image_tokens: int
    short: bool
    future: asyncio.Future = field(repr=False)
    task: asyncio.Task | None = field(default=None, repr=False)  # the engine request, once dispatched
    on_text: OnText | None = field(default=None, repr=False)  # the caller's, forwarded to the engine


class Scheduler:
    """``await scheduler.submit(plan)`` instead of ``await engine.generate(plan)``."""

    def __init__(self, engine: Engine, config: SchedulerConfig = SchedulerConfig(), *,
                 image_tokens: Callable[[PromptPlan], int], clock: Callable[[], float] = time.monotonic) -> None:
        self.engine = engine
        self.config = config
        self.stats = SchedulerStats()
        self._image_tokens = image_tokens
        self._clock = clock
        self._queue: list[_Waiting] = []
        self._seq = itertools.count()
        self._in_flight = 0
        self._long_in_flight = 0
        self._tokens_in_flight = 0
        self.residency: KVResidency | None = None  # set by track_kv
        self._prefilling: dict[Key, int] = {}  # leading image → plans of it still in prefill
        self._recent: OrderedDict[tuple[Key, ...], None] = OrderedDict()  # LPM's view of what is cached
        self._tasks: set[asyncio.Task] = set()

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def track_kv(self, capacity_tokens: int) -> KVResidency:
        """Estimate, from here on, the image tokens resident in a prefix cache of this many tokens."""
        self.residency = KVResidency(capacity_tokens)
        self.stats.kv_capacity_tokens, self.stats.kv_image_tokens = capacity_tokens, 0
        return self.residency

    async def submit(self, plan: PromptPlan, *, on_text: OnText | None = None) -> Completion:
        loop = asyncio.get_running_loop()
        tokens = self._image_tokens(plan)
        if tokens > self.config.max_image_tokens_in_flight:
            raise ValueError(
                f"a plan with {tokens} image tokens can never fit the {self.config.max_image_tokens_in_flight}-token "
                "in-flight budget: lower top-k or max_pixels, or raise the budget"
            )
        short = 0 < self.config.short_image_tokens and tokens <= self.config.short_image_tokens
        item = _Waiting(plan, next(self._seq), self._clock(), tokens, short, loop.create_future(), on_text=on_text)
        self._queue.append(item)
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
            self.stats.cancelled_queued += 1
        elif item.task is not None and not item.task.done():
            item.task.cancel()  # _run's finally frees its capacity and dispatches the next plan
            self.stats.cancelled_running += 1

    # The dispatcher runs synchronously at every event that can free capacity: a submit, a first token,
    # a completion. No background loop, so nothing to start or stop.
    def _dispatch(self) -> None:
        while self._queue and self._in_flight < self.config.max_concurrency:
            item = self._next()
            if item is None:
                return
            self._queue.remove(item)
            self._start(item)

    def _next(self) -> _Waiting | None:
        now = self._clock()
        overdue = [w for w in self._queue if (now - w.arrival) * 1000 >= self.config.max_wait_ms]
        if overdue:
            self.stats.fairness_overrides += 1
            candidates = overdue  # already in arrival order
        elif len(self._queue) > self.config.queue_cap:
            self.stats.fcfs_fallbacks += 1
            candidates = self._queue
        else:
            candidates = [self._queue[i] for i in self._order([w.plan.images for w in self._queue])]
            if self.config.short_image_tokens:
                candidates.sort(key=lambda w: not w.short)  # stable: the short queue first, each in policy order
        long_slots = self.config.max_concurrency - (self.config.short_reserved if self.config.short_image_tokens else 0)
        for w in candidates:
            if not w.short and self._long_in_flight >= long_slots:
                self.stats.long_held += 1
                continue
            if self._tokens_in_flight and self._tokens_in_flight + w.image_tokens > self.config.max_image_tokens_in_flight:
                continue
            if w not in overdue and self._gated(w):
                self.stats.gated += 1
                continue
            return w
        return None

    def _order(self, prefixes: list[tuple[Key, ...]]) -> list[int]:
        policy = self.config.policy
        if policy is Policy.DFS_WEIGHT:
            return order_dfs_weight(prefixes)
        if policy is Policy.LPM:
            return order_lpm(prefixes, self._matched)
        return order_fcfs(prefixes)

    def _gated(self, w: _Waiting) -> bool:
        """Hold a plan while another plan is prefilling its leading image for the first time.

        Once one prefill of that image finished, its blocks are in the prefix cache and followers can run
        concurrently. FCFS is the no-cleverness baseline: it never holds a plan back.
        """
        if self.config.policy is Policy.FCFS or not w.plan.images:
            return False
        lead = w.plan.images[0]
        return lead in self._prefilling and (lead,) not in self._recent

    def _matched(self, prefix: tuple[Key, ...]) -> int:
        return max((n for n in range(len(prefix), 0, -1) if prefix[:n] in self._recent), default=0)

    def _start(self, w: _Waiting) -> None:
        self._in_flight += 1
        self._long_in_flight += not w.short
        self._tokens_in_flight += w.image_tokens
        self.stats.dispatched += 1
        self.stats.short_dispatched += w.short
        self.stats.image_tokens_by_policy += self._by_policy(w)
        self.stats.queue_waits_s.append(self._clock() - w.arrival)
        lead = w.plan.images[0] if w.plan.images else None
        if lead is not None:
            self._prefilling[lead] = self._prefilling.get(lead, 0) + 1
            self.stats.group_sizes.append(1 + sum(1 for q in self._queue if q.plan.images[:1] == (lead,)))
        task = w.task = asyncio.get_running_loop().create_task(self._run(w, lead))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, w: _Waiting, lead: Any) -> None:
        prefilled = False

        def on_first_token() -> None:
            nonlocal prefilled
            if not prefilled:
                prefilled = True
                self._end_prefill(lead, w.plan)

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
        finally:
            on_first_token()
            self._in_flight -= 1
            self._long_in_flight -= not w.short
            self._tokens_in_flight -= w.image_tokens
            self._dispatch()

    def _end_prefill(self, lead: Any, plan: PromptPlan) -> None:
        self._observe(plan)  # its images' KV is in the cache from the end of prefill on
        if lead is not None:
            self._prefilling[lead] -= 1
            if not self._prefilling[lead]:
                del self._prefilling[lead]
        for n in range(1, len(plan.images) + 1):
            self._recent[plan.images[:n]] = None
            self._recent.move_to_end(plan.images[:n])
        while len(self._recent) > 4096:
            self._recent.popitem(last=False)
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
