"""The Ray Serve request router of the engine deployment: routes a prompt plan by its leading image keys.

It runs in the process that holds the engine deployment's handle (the API process), one instance per
handle, and applies serving/routing.py — the same rule as the `vllm serve` transport — to the plan it finds
as the request's first argument: the replica that holds the longest image prefix of the plan (learned from
what this router sent it, :meth:`on_request_routed`), else the plan's rendezvous home, unless that replica
reports more than ``queue_bound`` ongoing requests, then the least loaded. Plans without images route by
their system prompt. Replicas come and go (:meth:`update_replicas`, :meth:`on_replica_actor_died`): a dead
or removed replica's entries are dropped, a replacement starts with none.

Who holds which prefix comes from the replicas' own KV events where the deployment publishes them
(``kv_events``: each replica's engine publishes on its node, serving/kv_events.py; this process's one
subscriber for the deployment, :func:`serving.kv_events.shared_subscriber`, follows them — the router tells it
the live replicas, the engine client, serving/ray/engine.py, asks new replicas where they publish), else from
the table learned from routing (what was sent where), LRU-bounded per replica; a wrong guess costs a cache
miss, never a wrong answer.

``routing`` in the request's keyword arguments selects a baseline on the same replicas (the benchmark and the
tests measure them in one run): ``default`` is Ray Serve's own PowerOfTwoChoicesRequestRouter's choice (two
random replicas, the shorter queue wins; without its FIFOMixin, which would hand a replica found for one
request to an older one — wrong for affinity, so this router, like Ray's PrefixCacheAffinityRouter, leaves it
out), ``replica:<id>`` one named replica (the single-replica baseline, and each replica's prefix-cache reset;
one that is gone: routed as the default), ``table`` the affinity rule on the learned table alone where the
replicas publish KV events (the benchmark's baseline). Other calls without a plan route as the default.
"""

from __future__ import annotations

# Ray's default router has no public import path (its config default names this module, as Ray's own
# PrefixCacheAffinityRouter imports it); it serves the ``default`` baseline and the calls without a plan.
from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import (
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from mmrag.adapters.fences import Fence, Target
from mmrag.core.engine import ImageInput, PromptPlan
from serving.engine.images import multi_modal_uuid
from serving.kv_events import shared_subscriber
from serving.routing import AffinityTable, prefix_path, rank_replicas

# What this router reaches into in Ray Serve beyond its public API, as tested (pyproject.toml pins ray[serve]):
# the default router's choice, and RequestRouter's probe of queue lengths and its replica-set hooks. Checked at
# import: a Ray whose internals changed is refused here, saying which release to install, not mid-request.
FENCE = Fence(("ray",), ">=2.60,<2.61", "serving/ray/router.py", (
    Target("ray.serve._private.request_router", "PowerOfTwoChoicesRequestRouter.choose_replicas",
           ("self", "candidate_replicas", "pending_request")),
    Target("ray.serve.request_router", "RequestRouter._probe_queue_lens", ("self", "replicas", "backoff_index")),
    Target("ray.serve.request_router", "RequestRouter.on_replica_actor_died", ("self", "replica_id")),
    Target("ray.serve.request_router", "RequestRouter.update_replicas", ("self", "replicas")),
))
FENCE.check()

AFFINITY = "affinity"
TABLE = "table"  # the affinity rule by the learned table alone, where the replicas publish KV events (baseline)
DEFAULT = "default"  # Ray Serve's PowerOfTwoChoices
PINNED = "replica:"  # + a replica's full id: that replica only
KV_EVENTS = "mmrag-engine"  # the engine deployment's subscriber in this process (shared_subscriber)


def _plan(request: PendingRequest | None) -> PromptPlan | None:
    if request is None or not request.args or not isinstance(request.args[0], PromptPlan):
        return None
    return request.args[0]


def _routing(request: PendingRequest | None) -> str:
    return str((request.kwargs if request is not None else {}).get("routing", AFFINITY))


class ImageAffinityRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    def initialize_state(self, queue_bound: int = 8, capacity: int = 4096, kv_events: bool = False,
                         image_input: str = ImageInput.EMBEDS.value) -> None:
        """Called by Ray Serve with the deployment's ``request_router_kwargs``."""
        self.queue_bound = queue_bound
        self.affinity = AffinityTable(capacity)
        self.events = shared_subscriber(KV_EVENTS) if kv_events else None
        self.image_input = ImageInput(image_input)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        plan, routing = _plan(pending_request), _routing(pending_request)
        by_id = {r.replica_id.to_full_id_str(): r for r in candidate_replicas}
        pinned = by_id.get(routing.removeprefix(PINNED)) if routing.startswith(PINNED) else None
        if pinned is None and (plan is None or routing not in (AFFINITY, TABLE)):  # a pinned one gone: the default
            return await PowerOfTwoChoicesRequestRouter.choose_replicas(self, candidate_replicas, pending_request)
        if pending_request is not None:
            # What is returned is final for this try: when the replicas are full, back off before the next.
            pending_request.routing_context.should_backoff = True
        if pinned is not None:
            return [[pinned]]
        queues = await self._queue_lengths(candidate_replicas)
        known: dict[str, int] = {}
        if self.events is not None and routing == AFFINITY:
            # The form in which the replica's engine sends the images names them in its events; a plan under
            # several policies goes as tokens (serving/engine/images.plan_form), which routing does not model.
            known = self.events.index.holding(
                queues, plan.cache_salt, [multi_modal_uuid(k, self.image_input) for k in plan.images])
            self.events.decided(known, len(queues))
        return [[by_id[r]] for r in rank_replicas(plan, queues, self.affinity, self.queue_bound, known)]

    async def _queue_lengths(self, replicas: list[RunningReplica]) -> dict[str, int]:
        """Ongoing requests per replica: Ray's cached figure (updated on each send and each replica report),
        else a probe; a replica that does not answer the probe is left out (Ray will mark it dead)."""
        out: dict[str, int] = {}
        unknown: list[RunningReplica] = []
        for r in replicas:
            cached = self._replica_queue_len_cache.get(r.replica_id) if self._use_replica_queue_len_cache else None
            if cached is None:
                unknown.append(r)
            else:
                out[r.replica_id.to_full_id_str()] = cached
        if unknown:
            for r, length in await self._probe_queue_lens(unknown, 0):
                if length is not None:
                    out[r.replica_id.to_full_id_str()] = length
        return out

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        """The replica now prefills the plan: a plan sharing its figure, even one sent concurrently, follows.
        A prefix-cache reset (RayEngine.reset_prefix_cache routes one to each replica) empties its entries."""
        plan = _plan(pending_request)
        if pending_request.metadata.call_method == "reset_prefix_cache":
            self.affinity.drop(replica_id.to_full_id_str())
        elif plan is not None:
            self.affinity.record(replica_id.to_full_id_str(), prefix_path(plan))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.affinity.drop(replica_id.to_full_id_str())
        if self.events is not None:
            self.events.discard(replica_id.to_full_id_str())

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.affinity.retain(r.replica_id.to_full_id_str() for r in replicas)
        if self.events is not None:
            self.events.expect(r.replica_id.to_full_id_str() for r in replicas)
