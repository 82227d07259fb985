"""Ray Serve: `mmrag serve --ray`, and the applications a RayService deploys."""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

from mmrag.core.engine import Engine
from mmrag.core.settings import Settings
from mmrag.wiring.parts import feature_store, resolve_model
from mmrag.wiring.answering import inprocess_engine
from mmrag.wiring.service import create_app
from mmrag.wiring.vision import vision_app

if TYPE_CHECKING:
    from fastapi import FastAPI

    from serving.ray.app import RayServeConfig
    from serving.ray.engine import RayEngine

log = logging.getLogger(__name__)


# --- Ray Serve (`mmrag serve --ray`) -----------------------------------------------------------------------


def ray_config(settings: Settings) -> RayServeConfig:
    from serving.ray.app import RayServeConfig

    return RayServeConfig(address=settings.ray.address, replicas=settings.ray.replicas,
                          queue_bound=settings.ray.affinity_queue_bound, replica_cpus=settings.ray.replica_cpus,
                          replica_gpus=settings.ray.replica_gpus,
                          max_ongoing_requests=settings.engine.max_num_seqs + settings.ray.affinity_queue_bound,
                          http_host=settings.api.host, http_port=settings.ray.http_port,
                          vision_max_replicas=settings.ray.vision_max_replicas,
                          kv_events=settings.ray.kv_events, image_input=settings.engine.image_input)


def replica_engine(settings: Settings, kv_events: str | None = None) -> Engine:
    """What each Ray engine replica runs: vLLM in its process over the configured feature store, publishing
    its KV events at ``kv_events`` (MMRAG_RAY_KV_EVENTS: the replica picks the port)."""
    return inprocess_engine(settings, resolve_model(settings), kv_events=kv_events)


def ray_engine_application(args: dict | None = None):
    """The engine application from MMRAG_* settings: Serve's builder (``import_path:
    mmrag.wiring:ray_engine_application`` in a RayService), and what `mmrag serve --ray` deploys."""
    from serving.ray.app import engine_application

    settings = Settings(**(args or {}))
    return engine_application(ray_config(settings), functools.partial(replica_engine, settings))


def ray_vision_application(args: dict | None = None):
    """The vision application from MMRAG_* settings (Serve's builder, like :func:`ray_engine_application`)."""
    from serving.ray.app import vision_application

    settings = Settings(**(args or {}))
    return vision_application(ray_config(settings), functools.partial(vision_app, settings))


def ray_engine(settings: Settings, *, num_cpus: int | None = None) -> RayEngine:
    """Join (MMRAG_RAY_ADDRESS) or start a Ray cluster, deploy the engine replicas (unless MMRAG_RAY_DEPLOY is
    false: the cluster runs them), and return the Engine over their handle. ``num_cpus``: the CPUs a local
    cluster announces."""
    from serving.ray.app import connect, deploy_engine, engine_handle
    from serving.ray.engine import RayEngine

    config = ray_config(settings)
    if config.address and not settings.storage.redis_url:
        log.warning("MMRAG_RAY_ADDRESS joins a cluster but MMRAG_REDIS_URL is empty: every replica reads the "
                    "feature store on its own disk (%s); set MMRAG_REDIS_URL unless all run on this machine",
                    settings.storage.features_dir)
    log.info("Ray cluster ready in %.1f s", connect(config, num_cpus=num_cpus))
    handle = (deploy_engine(config, functools.partial(replica_engine, settings)) if settings.ray.deploy
              else engine_handle())
    return RayEngine(handle, resolve_model(settings), kv_events=settings.ray.kv_events)


def ray_app(settings: Settings) -> FastAPI:
    """`mmrag serve --ray`: the REST app in this process, its engine the Ray replicas, its vision service the
    Ray deployment at /vision on Serve's HTTP proxy (MMRAG_VISION_URL points there)."""
    from serving.ray.app import deploy_vision, vision_url

    eng = ray_engine(settings)
    config = ray_config(settings)
    url = deploy_vision(config, functools.partial(vision_app, settings)) if settings.ray.deploy else vision_url(config)
    # The one settings copy in the wiring (tests/test_architecture.py): the service's URL exists only once Serve
    # has deployed it, and every part that encodes (tower, encoder scope, tiers, ingest) reads it from there.
    settings = settings.replace(vision_url=url)
    return create_app(settings, engine=eng, store=feature_store(settings))
