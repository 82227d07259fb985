"""Pick the engine from Settings: remote `vllm serve` replicas when MMRAG_ENGINE_URLS is set, else in-process."""

from __future__ import annotations

from core.settings import Settings
from ingestion.model_source import ModelSource
from ingestion.store import open_feature_store
from serving.engine.base import Engine
from serving.engine.config import EngineConfig
from serving.engine.features import FeatureProvider


def open_engine(settings: Settings, model: ModelSource, *, allow_inprocess: bool = True) -> Engine:
    features = FeatureProvider(open_feature_store(settings.data_dir, settings.redis_url))
    if settings.engine_url_list:
        from serving.engine.remote import RemoteEngine

        return RemoteEngine(settings.engine_url_list, model, features)
    if not allow_inprocess:
        require_engine_urls(settings)
    from serving.engine.inprocess import InProcessEngine

    return InProcessEngine.start(model, features, EngineConfig.from_settings(settings))


def require_engine_urls(settings: Settings) -> list[str]:
    """The remote replicas; commands that must act on a running engine (warm-up) stop here without them."""
    if not settings.engine_url_list:
        raise EngineNotConfiguredError(
            "no running engine to talk to: start one with `mmrag engine serve` and set MMRAG_ENGINE_URLS="
            "http://127.0.0.1:8100 (comma-separate several replicas)"
        )
    return settings.engine_url_list


class EngineNotConfiguredError(RuntimeError):
    pass
