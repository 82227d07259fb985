"""The routing rule: which engine replica serves a prompt plan. Pure (no I/O, no clock): one implementation
for both transports, Ray Serve's request router (serving/ray/router.py) and `vllm serve` URLs
(serving/engine/remote.py).

A plan renders ``[system prompt][images in order][text]``, so the KV a replica can reuse for it is the longest
leading run of its images that the replica prefilled after the same system prompt. The rule:

1. home = the replica that holds the longest leading image prefix of the plan — by the replica's own KV events
   where they flow (serving/kv_events.py: who holds which prefix, passed in as data), else as learned from
   what each replica was sent (:class:`AffinityTable`); when none holds any, the plan's rendezvous home
   (highest-random-weight hash of its first image, else of ``system:<system_prompt_id>``), so a new figure has
   one stable home on every router, and adding or removing a replica moves only the keys that ranked it first;
2. unless the home's queue is longer than ``bound``: then the least loaded replica (ties: rendezvous order).

Plans without images are keyed by their system prompt alone. Replicas come and go: the caller passes the live
replicas on every call, and drops a dead one's entries (:meth:`AffinityTable.drop`), since a restarted replica
starts with an empty cache.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Mapping

from mmrag.core.engine import PromptPlan

Path = tuple[str, ...]  # ("system:<id>", image key, image key, ...): a plan's KV prefix as routing sees it


def prefix_path(plan: PromptPlan) -> Path:
    """The plan's shareable prefix: its system prompt, then its images in prompt order."""
    # The cache salt (a tenant's) starts the path: plans of another salt share no KV, so no prefix either.
    return (f"{plan.cache_salt}system:{plan.system_prompt_id}", *(str(k) for k in plan.images))


def route_key(plan: PromptPlan) -> str:
    """The rendezvous key: the salt and the first image (the start of the shared KV prefix), else the salt and
    the system prompt. The default tenant's salt is empty, so its keys are what they always were."""
    return plan.cache_salt + (str(plan.images[0]) if plan.images else f"system:{plan.system_prompt_id}")


def rendezvous_order(key: str, replicas: Iterable[str]) -> list[str]:
    """Replicas by descending weight hash(replica, key): the first is the key's home, the rest its fall-backs."""

    def weight(replica: str) -> int:
        digest = hashlib.blake2b(f"{replica}\x00{key}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big")

    return sorted(replicas, key=weight, reverse=True)


def _prefixes(path: Path) -> list[Path]:
    """The prefixes that count as held: system + 1..n images; a plan without images, the system prompt alone."""
    return [path] if len(path) == 1 else [path[:k] for k in range(2, len(path) + 1)]


class AffinityTable:
    """What each replica holds, as prefixes of the paths it was sent (routing records a path when it sends the
    request: the replica prefills it, and a concurrent plan sharing the figure must follow it there).

    Each replica keeps at most ``capacity`` prefixes, the least recently sent dropped first, as its KV cache
    evicts the least recently used blocks; the table is a hint, never a promise (a wrong guess costs a miss).
    """

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._held: dict[str, OrderedDict[Path, None]] = {}

    def record(self, replica: str, path: Path) -> None:
        held = self._held.setdefault(replica, OrderedDict())
        for prefix in _prefixes(path):
            held[prefix] = None
            held.move_to_end(prefix)
        while len(held) > self.capacity:
            held.popitem(last=False)

    def match(self, replica: str, path: Path) -> int:
        """How many leading elements of ``path`` the replica holds (0: none of its images, or for a plan without
        images, not its system prompt)."""
        held = self._held.get(replica)
        if held:
            for prefix in reversed(_prefixes(path)):
                if prefix in held:
                    return len(prefix)
        return 0

    def drop(self, replica: str) -> None:
        """Forget a replica (it died, was restarted or scaled away: its cache is gone)."""
        self._held.pop(replica, None)

    def retain(self, replicas: Iterable[str]) -> None:
        """Forget every replica not in ``replicas`` (the live set)."""
        for gone in set(self._held) - set(replicas):
            del self._held[gone]

    def replicas(self) -> list[str]:
        return list(self._held)


def rank_replicas(plan: PromptPlan, queues: Mapping[str, int], table: AffinityTable, bound: int,
                  events: Mapping[str, int] | None = None) -> list[str]:
    """The live replicas (``queues``: replica → requests it has queued or running) in the order to try: the
    rule's choice first, then the fall-backs, least loaded first (ties: rendezvous order). ``events``: for the
    replicas whose KV events are known, how many of the plan's leading images each holds by its own word; the
    others are asked of ``table``."""
    order = rendezvous_order(route_key(plan), queues)
    if not order:
        return []
    path = prefix_path(plan)
    events = events or {}
    # The table counts the system prompt as the path's first element; events count images: one scale.
    held = {r: events[r] + 1 if events.get(r) else 0 if r in events else table.match(r, path) for r in order}
    longest = max(held.values())
    # The holder of the longest prefix (ties: the shorter queue, then rendezvous order), else the rendezvous home.
    home = min((r for r in order if held[r] == longest), key=lambda r: queues[r]) if longest else order[0]
    if queues[home] > bound:
        return sorted(order, key=lambda r: queues[r])  # stable: rendezvous order on ties
    return [home, *sorted((r for r in order if r != home), key=lambda r: queues[r])]


def choose_replica(plan: PromptPlan, queues: Mapping[str, int], table: AffinityTable, bound: int,
                   events: Mapping[str, int] | None = None) -> str | None:
    """The rule's choice among the live replicas, or None when there are none."""
    ranked = rank_replicas(plan, queues, table, bound, events)
    return ranked[0] if ranked else None

