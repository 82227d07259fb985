"""The answering parts: the engine, the prefix-aware scheduler, the pipeline of each tenant, the answer cache."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from mmrag.adapters.checkpoint import ModelSource
from mmrag.core.engine import Engine, ImageInput, ImageTokenCounts
from mmrag.core.keys import KeyLease, NoLease
from mmrag.core.payload import EncoderScope
from mmrag.core.settings import DEFAULT_TENANT, DevelopmentKnobs, Settings
from mmrag.wiring.parts import (
    ANSWER_LEASE_S, EngineNotConfiguredError, Tower, development_knobs, encoder_scope, feature_store,
    resolve_model, searcher, tier_encoder, vision_tower,
)

if TYPE_CHECKING:
    from mmrag.adapters.store import FeatureStore
    from mmrag.core.scope import TenantScope
    from rag.answer_cache import AnswerCache
    from rag.decompose import Decomposer
    from rag.pipeline import Pipeline, PipelineConfig
    from retrieval.search import PageSearcher
    from serving.engine.config import EngineConfig
    from serving.metrics import Metrics
    from serving.scheduler import Scheduler, SchedulerConfig


# --- engine, scheduler, pipeline -------------------------------------------------------------------------


def engine_config(settings: Settings) -> EngineConfig:
    from serving.engine.config import EngineConfig, resolve_dtype, resolve_spin_s

    return EngineConfig(
        block_size=settings.engine.kv_block_size or None,
        kv_cache_gib=settings.engine.kv_cache_gib,
        max_model_len=settings.engine.max_model_len,
        max_images_per_prompt=settings.engine.max_images_per_prompt,
        enforce_eager=settings.engine.enforce_eager,
        dtype=resolve_dtype(settings.engine.dtype),
        max_num_seqs=settings.engine.max_num_seqs,
        max_num_batched_tokens=settings.engine.max_batched_tokens or None,
        image_input=ImageInput(settings.engine.image_input),
        image_pixels=(settings.vision.min_pixels, settings.vision.max_pixels),
        spin_s=resolve_spin_s(settings.engine.spin_ms),
    )


def require_engine_urls(settings: Settings) -> list[str]:
    """The remote replicas; commands that must act on a running engine (warm-up) stop here without them."""
    if not settings.engine.urls:
        raise EngineNotConfiguredError(
            "no running engine to talk to: start one with `mmrag engine serve` and set MMRAG_ENGINE_URLS="
            "http://127.0.0.1:8100 (comma-separate several replicas)"
        )
    return settings.engine.urls


def engine(settings: Settings, model: ModelSource, store: FeatureStore | None = None, *,
           allow_inprocess: bool = True, encoder: EncoderScope | None = None) -> Engine:
    """Remote `vllm serve` replicas when MMRAG_ENGINE_URLS is set, else vLLM in this process. It reads image
    tokens of ``encoder`` only (default: the configured model's), refusing stale ones whatever names them."""
    encoder = encoder or encoder_scope(settings, model)
    if settings.engine.urls:
        from serving.engine.features import FeatureProvider
        from serving.engine.remote import RemoteEngine

        features = FeatureProvider.scoped(store or feature_store(settings), encoder, settings.vision.tier_table)

        # Refuses a replica that serves another checkpoint (a fine-tune under the same name), at start-up.
        return RemoteEngine.connect(settings.engine.urls, model, features, timeout_s=settings.engine.timeout_s,
                                    queue_bound=settings.ray.affinity_queue_bound,
                                    image_input=ImageInput(settings.engine.image_input),
                                    image_pixels=(settings.vision.min_pixels, settings.vision.max_pixels),
                                    max_num_seqs=settings.engine.max_num_seqs,
                                    kv_events=dict(zip(settings.engine.urls, settings.engine.kv_events_endpoints)))
    if not allow_inprocess:
        require_engine_urls(settings)
    return inprocess_engine(settings, model, store, encoder=encoder)


def inprocess_engine(settings: Settings, model: ModelSource, store: FeatureStore | None = None, *,
                     encoder: EncoderScope | None = None, kv_events: str | None = None) -> Engine:
    """vLLM in this process over the feature store, reading image tokens of ``encoder`` only (default: the
    configured model's): what a Ray engine replica runs, whatever MMRAG_ENGINE_URLS names."""
    from serving.engine.features import FeatureProvider
    from serving.engine.inprocess import InProcessEngine

    encoder = encoder or encoder_scope(settings, model)
    features = FeatureProvider.scoped(store or feature_store(settings), encoder, settings.vision.tier_table)
    config = engine_config(settings)
    if kv_events:
        config = dataclasses.replace(config, kv_events=kv_events)  # where this replica publishes (Ray)
    return InProcessEngine.start(model, features, config)


def scheduler_config(settings: Settings) -> SchedulerConfig:
    from serving.scheduler import Policy, SchedulerConfig

    return SchedulerConfig(
        policy=Policy(settings.scheduler.policy),
        max_concurrency=settings.scheduler.max_concurrency,
        max_image_tokens_in_flight=settings.scheduler.max_image_tokens_in_flight,
        max_wait_ms=settings.scheduler.max_wait_ms,
        queue_cap=settings.scheduler.queue_cap,
        short_image_tokens=settings.scheduler.short_image_tokens,
        short_reserved=settings.scheduler.short_reserved,
    )


def pipeline_config(settings: Settings, knobs: DevelopmentKnobs | None = None) -> PipelineConfig:
    from rag.pipeline import PipelineConfig
    from rag.plans import AnswerMode

    knobs = knobs or development_knobs(settings)
    return PipelineConfig(top_k=settings.retrieval.top_k, max_tokens=settings.answer.max_tokens,
                          max_images_per_prompt=settings.engine.max_images_per_prompt,
                          answer_mode=AnswerMode(settings.answer.mode),
                          sub_answer_max_tokens=settings.answer.sub_answer_max_tokens,
                          max_model_len=settings.engine.max_model_len, fixed_length=knobs.answer_fixed_length,
                          one_prompt_pages=settings.answer.one_prompt_pages, figure_crops=settings.answer.figure_crops)


def decomposer(settings: Settings, engine: Engine, scope: TenantScope | None = None,
               knobs: DevelopmentKnobs | None = None) -> Decomposer:
    """MMRAG_DECOMPOSER: ``auto`` asks the model unless its weights are random. Its requests carry the
    scope's cache salt. With the answer cache on, it remembers the model's last decompositions (as many as the
    cache keeps answers a tenant), so a repeated question sends no engine request at all."""
    from rag.decompose import Decomposer

    knobs = knobs or development_knobs(settings)
    answer = settings.answer
    ask_model = answer.decomposer == "model" or (answer.decomposer == "auto" and not engine.random_weights)
    return Decomposer(engine if ask_model else None, max_n=answer.max_sub_questions,
                      max_question_chars=answer.max_question_chars, max_tokens=answer.decompose_max_tokens,
                      fixed_tokens=knobs.decompose_fixed_tokens,
                      cache_salt=(scope or tenant_scope(settings)).cache_salt,
                      remember=settings.answer.cache_max_per_tenant if settings.answer.cache else 0)


def pipeline(settings: Settings, engine: Engine, *, scope: TenantScope | None = None, client=None,
             encoder: EncoderScope | None = None, store: FeatureStore | None = None, tower: Tower | None = None,
             answers: AnswerCache | None = None, knobs: DevelopmentKnobs | None = None) -> tuple[Pipeline, Scheduler]:
    """The pipeline of ``scope`` (default: the default tenant's), its plans going through one prefix-aware
    scheduler. It retrieves only pages of ``encoder`` (default: the configured model's), so no stale tokens
    are fed.

    The caller owns the engine and closes ``pipeline.searcher.client``. ``store``: the one the engine reads, where
    pages asked for in a tier they lack are stored once encoded (default: the configured one). ``tower``: the
    process's vision tower (vision_tower), which those tier encodes run on (default: one of the pipeline's own).
    ``answers``: the answer cache (answer_cache; default: none). ``knobs``: the benchmark knobs (default:
    development_knobs). Other tenants' pipelines share the scheduler, tiers and answer cache (``scoped_pipeline``).
    """
    from rag.tiers import PageTiers
    from serving.scheduler import Scheduler

    model = resolve_model(settings)
    scope = scope or tenant_scope(settings)
    encoder = encoder or encoder_scope(settings, model)
    counts = ImageTokenCounts()
    scheduler = Scheduler(engine, scheduler_config(settings), image_tokens=counts.of_plan)
    store = store or feature_store(settings)
    tiers = PageTiers(settings.vision.tier_table, settings.documents, store,
                      tier_encoder(settings, tower or vision_tower(settings, model)))
    pipe = scoped_pipeline(settings, scope, engine, submit=scheduler.submit, counts=counts, tiers=tiers,
                           search=searcher(settings, collection=scope.collection, client=client, encoder=encoder),
                           lease=answer_lease(store), answers=answers, knobs=knobs)
    return pipe, scheduler


def answer_cache(settings: Settings, metrics: Metrics | None = None) -> AnswerCache | None:
    """MMRAG_ANSWER_CACHE: one cache for the process (the tenant is in every key), in Redis when MMRAG_REDIS_URL
    is set, else under data_dir/answers; its lookups counted in ``metrics``. None when it is off."""
    if not settings.answer.cache:
        return None
    from mmrag.adapters.answer_store import open_answer_store
    from rag.answer_cache import AnswerCache

    store = open_answer_store(redis_url=settings.storage.redis_url, folder=settings.storage.data_dir / "answers")
    return AnswerCache(store, max_per_tenant=settings.answer.cache_max_per_tenant,
                       on_lookup=metrics.record_answer_cache if metrics is not None else None)


def answer_prompt_version(settings: Settings, knobs: DevelopmentKnobs | None = None) -> str:
    """What shapes an answer besides its question, pages and model, hashed for the answer cache's keys: every
    system prompt, the prompt templates (rag/plans.py's source: any change of wording there is a new version) and
    the settings that change prompts or decoding."""
    import inspect

    from rag import plans
    from rag.answer_cache import prompt_version
    from serving.engine.prompt import SYSTEM_PROMPTS

    knobs = knobs or development_knobs(settings)
    templates = hashlib.sha256(inspect.getsource(plans).encode()).hexdigest()
    return prompt_version(*(f"{name}={text}" for name, text in sorted(SYSTEM_PROMPTS.items())),
                          f"templates={templates}", f"decomposer={settings.answer.decomposer}",
                          f"max_sub_questions={settings.answer.max_sub_questions}",
                          f"sub_answer_max_tokens={settings.answer.sub_answer_max_tokens}",
                          f"one_prompt_pages={settings.answer.one_prompt_pages}", f"top_k={settings.retrieval.top_k}",
                          f"figure_crops={settings.answer.figure_crops}",
                          f"answer_fixed_length={knobs.answer_fixed_length}",
                          f"decompose_fixed_tokens={knobs.decompose_fixed_tokens}",
                          f"image_input={settings.engine.image_input}")


def answer_lease(store: FeatureStore) -> Callable[[], KeyLease]:
    """A new lease per answer on the pages it shows (rag/pipeline.py): held to its last token, at most
    ANSWER_LEASE_S if the server dies first."""
    from mmrag.adapters.store import StoreLease

    return lambda: StoreLease(store, "answer", ANSWER_LEASE_S)


def scoped_pipeline(settings: Settings, scope: TenantScope, engine: Engine, *, submit, counts: ImageTokenCounts,
                    tiers, search: PageSearcher, lease: Callable[[], KeyLease] = NoLease,
                    answers: AnswerCache | None = None, knobs: DevelopmentKnobs | None = None) -> Pipeline:
    """One tenant's pipeline over process-wide parts (engine, the scheduler's ``submit``, token counts, tiers):
    ``search`` reads the scope's collection, and the scope's salt goes on every plan and decomposition request.
    A new pipeline per tenant, so a field added to Pipeline is never shared between tenants by accident."""
    from rag.pipeline import Pipeline

    knobs = knobs or development_knobs(settings)
    return Pipeline(decomposer(settings, engine, scope, knobs), search, engine,
                    config=pipeline_config(settings, knobs), submit=submit, token_counts=counts, tiers=tiers,
                    cache_salt=scope.cache_salt, lease=lease, answers=answers, tenant=scope.tenant,
                    prompt_version=answer_prompt_version(settings, knobs) if answers is not None else "")


def tenant_scope(settings: Settings, tenant: str = DEFAULT_TENANT) -> TenantScope:
    """The tenant's scope (mmrag/core/scope.py): built here, handed to all that acts for the tenant."""
    from mmrag.core.scope import TenantScope

    return TenantScope.of(settings, tenant)


def for_tenant(tenant: str, settings: Settings | None = None) -> tuple[Settings, TenantScope]:
    """A CLI command's ``--tenant``: the settings, and the tenant's scope, whose collection the command passes to
    the index and searcher builders (``collection=scope.collection``) and whose salt and roots it acts under."""
    settings = settings if settings is not None else Settings()
    return settings, tenant_scope(settings, tenant)
