"""The composition root: the ONE place that turns :class:`Settings` into objects.

Every command, the REST app and the tests build their parts here, so a setting is read in exactly one
place; components declare no defaults of their own either: theirs are the settings' (mmrag/core/settings.py
``default_of``), and tests/test_wiring.py checks that each maps its setting.
Heavy libraries (torch, vLLM, transformers) are imported inside the builders, never at module import, so
``mmrag --help`` stays fast.

One module per concern, each deployment a short builder over the shared parts:

- :mod:`.parts`: the model, feature store, vision encoders, embedders, index, ingest pipeline and searcher;
- :mod:`.answering`: the engine, scheduler, pipelines per tenant and the answer cache;
- :mod:`.service`: the REST service, in one process or split across services (remote engine replicas, the
  vision service), as the settings place its parts;
- :mod:`.vision`: the vision service (`mmrag vision serve`);
- :mod:`.ray_serve`: Ray Serve (`mmrag serve --ray`, and a RayService's application builders).

Callers use ``from mmrag import wiring`` and the names below.
"""

from mmrag.wiring.answering import (
    answer_cache, answer_lease, answer_prompt_version, decomposer, engine, engine_config, for_tenant,
    inprocess_engine, pipeline, pipeline_config, require_engine_urls, scheduler_config, scoped_pipeline,
    tenant_scope,
)
from mmrag.wiring.parts import (
    ANSWER_LEASE_S, TINY_MODEL_NAME, DevelopmentKnobError, EngineNotConfiguredError, ModelNotConfiguredError, Tower,
    development_knobs, development_model_dir, encoder_scope, feature_store, fusion, image_embedder, ingestor,
    late_retriever, local_vision_encoder, model_family, page_index, read_index, reencoder, resolve_model, searcher,
    text_embedder, tier_encoder, vision_encoder, vision_placement, vision_tower,
)
from mmrag.wiring.ray_serve import (
    ray_app, ray_config, ray_engine, ray_engine_application, ray_vision_application, replica_engine,
)
from mmrag.wiring.service import build_services, create_app, tenant_view
from mmrag.wiring.vision import vision_app

__all__ = [
    "ANSWER_LEASE_S", "DevelopmentKnobError", "EngineNotConfiguredError", "ModelNotConfiguredError",
    "TINY_MODEL_NAME", "Tower", "answer_cache", "answer_lease", "answer_prompt_version", "build_services",
    "create_app", "decomposer", "development_knobs", "development_model_dir", "encoder_scope", "engine",
    "engine_config", "feature_store", "for_tenant", "fusion", "image_embedder", "ingestor", "inprocess_engine",
    "late_retriever", "local_vision_encoder", "model_family", "page_index", "pipeline", "pipeline_config",
    "ray_app", "ray_config", "ray_engine", "ray_engine_application", "ray_vision_application", "read_index",
    "reencoder", "replica_engine", "require_engine_urls", "resolve_model", "scheduler_config", "scoped_pipeline",
    "searcher", "tenant_scope", "tenant_view", "text_embedder", "tier_encoder", "vision_app", "vision_encoder",
    "vision_placement", "vision_tower",
]
