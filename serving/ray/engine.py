"""RayEngine: the Engine contract (mmrag/core/engine.py) over the engine deployment's DeploymentHandle.

The handle's request router (serving/ray/router.py) picks the replica; this client streams the replica's
events into ``on_first_token`` / ``on_text`` and returns its completion. Faults: a replica that dies with a
request in flight (killed, its node lost) fails that request's stream with a RayActorError; the router has
then marked it dead, and the request is sent again, to a live replica — at most ``attempts`` times. Re-sending
is safe for the same reasons as the `vllm serve` transport's (serving/engine/remote.py ``_send``): the
answer is a pure function of the prompt, nothing of a failed attempt reaches the caller, ``on_first_token``
fires once and of the text already streamed a later attempt tells only what goes beyond it. So each request is
answered exactly once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from mmrag.adapters.checkpoint import ModelSource
from mmrag.core.engine import Completion, KVCapacity, OnText, PromptPlan
from serving.engine.remote import EngineUnavailableError, once, Told
from serving.ray.deployments import DONE, FIRST, TEXT
from serving.kv_events import KvEventSubscriber, shared_subscriber
from serving.ray.router import AFFINITY, KV_EVENTS, PINNED

log = logging.getLogger(__name__)


class RayEngine:
    def __init__(self, handle: Any, model: ModelSource, *, routing: str = AFFINITY, attempts: int = 4,
                 kv_events: bool = False) -> None:
        """``handle``: the engine deployment's DeploymentHandle. ``routing``: ``affinity`` (serving/routing.py),
        or a baseline the router also knows (``default``: Ray's PowerOfTwoChoices; ``replica:<id>``).
        ``kv_events``: the replicas publish KV events; this client tells the router's subscriber where."""
        self.handle = handle
        self.kv_events: KvEventSubscriber | None = shared_subscriber(KV_EVENTS) if kv_events else None
        self.model = model
        self.model_name = model.name
        self.random_weights = model.random_weights
        self.routing = routing
        self.attempts = attempts
        self.retries = 0  # requests re-sent after their replica died

    def with_routing(self, routing: str) -> RayEngine:
        """The same deployment under another routing (the benchmark's baselines, on the same replicas)."""
        return RayEngine(self.handle, self.model, routing=routing, attempts=self.attempts,
                         kv_events=self.kv_events is not None)

    async def generate(self, plan: PromptPlan, *, on_first_token: Callable[[], None] | None = None,
                       on_text: OnText | None = None) -> Completion:
        from ray.exceptions import RayActorError

        if self.kv_events is not None and self.kv_events.missing():
            await self.follow_kv_events()
        first, told = once(on_first_token), Told(on_text)
        failures: list[str] = []
        for _ in range(self.attempts):
            tell = told.attempt()
            try:
                async for kind, value in self.handle.options(stream=True).generate.remote(plan, routing=self.routing):
                    if kind == FIRST and first is not None:
                        first()
                    elif kind == TEXT and tell is not None:
                        tell(value)
                    elif kind == DONE:
                        return value
                failures.append("the stream ended without its completion")
            except RayActorError as exc:  # the replica died (or became unreachable) with the request in flight
                failures.append(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            self.retries += 1
            log.warning("engine replica lost a request (%s); re-sending it", failures[-1])
        raise EngineUnavailableError(
            f"no engine replica could serve the request after {self.attempts} attempts: {'; '.join(failures)}. "
            "Check the Ray cluster (`ray status`) and the engine deployment (`serve status`)."
        )

    async def kv_capacity(self) -> KVCapacity:
        """One replica's capacity: replicas share a configuration, and each holds only the keys routed to it."""
        return await self.handle.kv_capacity.remote()

    async def batch_capacity(self) -> int:
        """The live replicas' batches together (the replicas' sum: each runs its own vLLM engine)."""
        return sum(await self.handle.broadcast("batch_capacity").results_async())

    async def reset_prefix_cache(self) -> None:
        """Drop every live replica's cached prefixes. One call per replica, pinned to it through the router (not
        Serve's broadcast, which bypasses the router), so the router forgets what each held."""
        reset = await asyncio.gather(*(self.handle.reset_prefix_cache.remote(routing=PINNED + r)
                                       for r in await self.replica_ids()))
        for replica in reset if self.kv_events is not None else ():
            if replica:  # "": that replica did not reset
                self.kv_events.index.cleared(replica)

    async def follow_kv_events(self) -> dict[str, str]:
        """Ask every live replica where it publishes its KV events and follow each (the router has told the
        subscriber which replicas are live; one it has not seen yet is followed all the same)."""
        assert self.kv_events is not None
        found = {r: e for r, e in await self.handle.broadcast("kv_events_endpoint").results_async() if e}
        for replica, endpoint in found.items():
            self.kv_events.add(replica, endpoint)
        return found

    async def replica_ids(self) -> list[str]:
        """The live replicas' full ids (their Ray actor names, in the ``serve`` namespace)."""
        return sorted(await self.handle.broadcast("replica_id").results_async())

    async def close(self) -> None:
        """The deployment outlives this client: `serve shutdown` (or the app's lifetime) stops it."""
