"""The Ray Serve applications of `mmrag serve --ray`, and joining or starting the cluster they run on.

- ``mmrag-engine``: N engine replicas (serving/ray/deployments.py EngineReplica), routed by
  serving/ray/router.py; no HTTP route — the API reaches it through its DeploymentHandle (RayEngine).
- ``mmrag-vision``: the vision service at ``/vision`` on Serve's HTTP proxy, autoscaled on its ongoing
  requests (its batcher's queue), so the API's MMRAG_VISION_URL is that route.

The API stays the normal FastAPI process (mmrag/wiring/ ``ray_app``), not a Serve ingress: its state — the
prefix-aware scheduler, admission, conversations, ingest jobs over Qdrant — is per process by design, and
one process holding the engine handle gives the router one view of all traffic.

Ray is imported inside the functions: `mmrag serve` without --ray never loads it.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mmrag.core.engine import Engine
from mmrag.core.settings import default_of
from serving.ray.deployments import EngineReplica, VisionReplica

ENGINE_APP = "mmrag-engine"
ENGINE_DEPLOYMENT = "engine"
VISION_APP = "mmrag-vision"
VISION_ROUTE = "/vision"


@dataclass(frozen=True, slots=True)
class RayServeConfig:
    address: str  # "" starts a local cluster; "auto" or <head>:6379 joins one from a cluster node
    replicas: int
    queue_bound: int
    replica_cpus: float  # Ray CPUs reserved per replica (scheduling only; vLLM sets its own threads)
    replica_gpus: float  # Ray GPUs per replica (1 on GPU workers: the engine's device)
    max_ongoing_requests: int  # per replica, what Ray lets in before queueing at the router
    http_host: str
    http_port: int
    vision_max_replicas: int
    # Each engine replica publishes its KV events and the router follows them (serving/kv_events.py); the form
    # images are sent in names them in the events (serving/engine/images.multi_modal_uuid).
    kv_events: bool = default_of("ray_kv_events")
    image_input: str = default_of("image_input")

    @property
    def actor_options(self) -> dict[str, float]:
        return {"num_cpus": self.replica_cpus, "num_gpus": self.replica_gpus}


def local_cpus(config: RayServeConfig) -> int:
    """The CPUs a local cluster announces: at least what every replica reserves (the engine replicas and the
    vision service at its most). Ray's CPUs are scheduling tokens here — vLLM and torch pick their own
    threads — and a 2-core host must still place 2 engine replicas and the vision replica, or Serve waits for
    a CPU that never comes."""
    return max(os.cpu_count() or 1,
               math.ceil(config.replica_cpus * (config.replicas + config.vision_max_replicas)))


def connect(config: RayServeConfig, *, num_cpus: int | None = None) -> float:
    """Join the cluster at ``config.address``, or start a local one; returns the seconds it took."""
    import ray

    if config.address.startswith("ray://"):
        # Ray Client cannot stream from a DeploymentHandle (ray/serve/handle.py refuses stream=True), and the
        # engine streams every answer.
        raise ValueError(f"MMRAG_RAY_ADDRESS={config.address}: Ray Client (ray://) cannot stream from Serve "
                         "handles. Run `mmrag serve --ray` on a cluster node with MMRAG_RAY_ADDRESS=auto (or "
                         "<head>:6379, the GCS address)")
    started = time.perf_counter()
    if not ray.is_initialized():
        if config.address:
            ray.init(address=config.address)
        else:
            ray.init(num_cpus=num_cpus or local_cpus(config), include_dashboard=False)
    from ray import serve

    serve.start(http_options={"host": config.http_host, "port": config.http_port})
    return time.perf_counter() - started


def engine_application(config: RayServeConfig, build: Callable[[], Engine]) -> Any:
    """The engine application. ``build`` must be picklable (a module-level function or a partial of one):
    each replica calls it."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from serving.ray.router import ImageAffinityRouter

    return serve.deployment(
        EngineReplica,
        name=ENGINE_DEPLOYMENT,
        num_replicas=config.replicas,
        max_ongoing_requests=config.max_ongoing_requests,
        ray_actor_options=config.actor_options,
        # A replica that died (its actor killed, its node lost) is seen at its next health check, and only then
        # replaced: 2 s rather than Ray's 10 (a check is one call to vLLM's check_health, nothing heavier).
        health_check_period_s=2,
        health_check_timeout_s=60,  # a replica busy prefilling on CPU answers late, not never
        request_router_config=RequestRouterConfig(
            request_router_class=ImageAffinityRouter,
            request_router_kwargs={"queue_bound": config.queue_bound, "kv_events": config.kv_events,
                                   "image_input": config.image_input}),
    ).bind(build, kv_events=config.kv_events)


def vision_application(config: RayServeConfig, build: Callable[[], Any]) -> Any:
    """The vision application; ``build`` makes its FastAPI app on each replica."""
    from ray import serve

    return serve.deployment(
        serve.ingress()(VisionReplica),
        name="vision",
        ray_actor_options=config.actor_options,
        # Scaled on ongoing requests per replica: the batcher's queue plus the batch in its forward.
        autoscaling_config={"min_replicas": 1, "max_replicas": config.vision_max_replicas,
                            "target_ongoing_requests": 8},
    ).bind(build)


def deploy_engine(config: RayServeConfig, build: Callable[[], Engine]) -> Any:
    """Deploy (or update) the engine application; returns its DeploymentHandle once every replica runs."""
    from ray import serve

    return serve.run(engine_application(config, build), name=ENGINE_APP, route_prefix=None)


def deploy_vision(config: RayServeConfig, build: Callable[[], Any]) -> str:
    """Deploy the vision application; returns its base URL (what MMRAG_VISION_URL names)."""
    from ray import serve

    serve.run(vision_application(config, build), name=VISION_APP, route_prefix=VISION_ROUTE)
    return vision_url(config)


def engine_handle() -> Any:
    """The handle of an engine application the cluster already runs (deployed by a RayService)."""
    from ray import serve

    return serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name=ENGINE_APP)


def vision_url(config: RayServeConfig) -> str:
    """The vision route on Serve's HTTP proxy of this node (the API runs on a cluster node: see connect)."""
    host = "127.0.0.1" if config.http_host in ("0.0.0.0", "") else config.http_host
    return f"http://{host}:{config.http_port}{VISION_ROUTE}"
