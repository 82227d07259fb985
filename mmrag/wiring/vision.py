"""The vision service: `mmrag vision serve`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmrag.core.settings import Settings
from mmrag.wiring.parts import feature_store, local_vision_encoder, resolve_model

if TYPE_CHECKING:
    from fastapi import FastAPI


# --- the vision service ----------------------------------------------------------------------------------


def vision_app(settings: Settings) -> FastAPI:
    """`mmrag vision serve`: the tower on MMRAG_VISION_DEVICE, batching its callers' images, its tokens going
    into the configured feature store. It encodes in this process even where MMRAG_VISION_URL (an environment
    shared with ingestion and the API) names the service itself."""
    from serving.vision.app import VisionService, create_vision_app, encoder_info
    from serving.vision.batcher import VisionBatcher
    from serving.vision.metrics import VisionMetrics

    encoder = local_vision_encoder(settings, resolve_model(settings))
    store = feature_store(settings)
    info = encoder_info(encoder)
    metrics = VisionMetrics({"version": info.version, "policy": str(info.policy), "family": info.family,
                             "device": info.device, "dtype": info.dtype})
    batcher = VisionBatcher(encoder, store, max_batch=settings.vision.max_batch,
                            max_wait_ms=settings.vision.max_wait_ms, queue_cap=settings.vision.queue_cap,
                            observe=metrics)
    return create_vision_app(settings.vision_service, VisionService(encoder, store, batcher, metrics, info))
