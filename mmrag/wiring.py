"""The composition root: the ONE place that turns :class:`Settings` into objects.

Every command, the REST app and the tests build their parts here, so a setting is read in exactly one
place and components carry no defaults of their own that could disagree with it (tests/test_wiring.py
checks each config built from default Settings against the component's documented default).
Heavy libraries (torch, vLLM, transformers) are imported inside the builders, never at module import, so
``mmrag --help`` stays fast.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from mmrag.adapters.checkpoint import ModelSource, configured_model
from mmrag.core.engine import Engine, ImageInput, ImageTokenCounts
from mmrag.core.keys import KeyLease, NoLease
from mmrag.core.payload import EncoderScope, pages_per_encoder
from mmrag.core.settings import DEFAULT_TENANT, Settings

if TYPE_CHECKING:
    from pathlib import Path

    from fastapi import FastAPI

    from mmrag.adapters.embed import ImageEmbedder, TextEmbedder
    from mmrag.adapters.late import LateInteractionRetriever
    from mmrag.adapters.qdrant import PageIndex
    from mmrag.adapters.store import FeatureStore
    from mmrag.adapters.vision import VisionEncoder
    from mmrag.adapters.vision_client import RemoteVisionEncoder
    from mmrag.core.keys import ResolutionPolicy
    from mmrag.core.scope import TenantScope
    from ingestion.pipeline import Ingestor
    from rag.answer_cache import AnswerCache
    from rag.decompose import Decomposer
    from rag.pipeline import Pipeline, PipelineConfig
    from retrieval.search import PageSearcher
    from serving.api.conversations import Conversations
    from serving.api.services import Services
    from serving.engine.config import EngineConfig
    from serving.ingest_jobs import IngestJobs
    from serving.metrics import Metrics
    from serving.ray.app import RayServeConfig
    from serving.ray.engine import RayEngine
    from serving.scheduler import Scheduler, SchedulerConfig

log = logging.getLogger(__name__)

TINY_MODEL_NAME = "mmrag-tiny-qwen2vl"
# How long an answer's lease on its pages' tokens outlives a server killed mid-answer (it is released at the
# answer's end otherwise); longer than any answer takes, so a live answer never loses its pages.
ANSWER_LEASE_S = 900.0


class EngineNotConfiguredError(RuntimeError):
    pass


class ModelNotConfiguredError(RuntimeError):
    """No MMRAG_MODEL in the production profile: refused rather than serving a random-weight model's noise."""


# --- model, store, encoders ------------------------------------------------------------------------------


def resolve_model(settings: Settings) -> ModelSource:
    """MMRAG_MODEL, or (when empty, in the development profile only) the tiny random-weight test model, built
    offline under the data dir. Empty in production: ModelNotConfiguredError, naming the fix."""
    if settings.model:
        return configured_model(settings.model)
    path = development_model_dir(settings)
    if path is None:
        raise ModelNotConfiguredError(
            "MMRAG_MODEL is not set: set it to a Qwen2-VL, Qwen2.5-VL or Qwen3-VL checkpoint (a local folder, or "
            "a hub id already in the local cache), or set MMRAG_PROFILE=development to build and serve the tiny "
            "random-weight test model (for trying mmrag out: its answers are noise)")
    from mmrag.devkit.tiny_model import MODEL_NAME, ensure_tiny_model

    if not (path / "config.json").is_file():
        log.info("no MMRAG_MODEL configured: building the tiny random-weight test model at %s", path)
    return ModelSource(ensure_tiny_model(path).resolve(), MODEL_NAME, True)


def development_model_dir(settings: Settings) -> Path | None:
    """Where the tiny model that stands in for an empty MMRAG_MODEL lives (the development profile), or None: the
    model is configured, or the production profile refuses to start without one. What resolve_model serves, and
    what `mmrag config show` reports as filled by the profile, without building anything."""
    return settings.tiny_model_dir if not settings.model and settings.profile == "development" else None


def feature_store(settings: Settings) -> FeatureStore:
    """Redis when MMRAG_REDIS_URL is set, local disk under the data dir otherwise."""
    from mmrag.adapters.store import DiskFeatureStore, RedisFeatureStore

    if settings.redis_url:
        return RedisFeatureStore(settings.redis_url)
    return DiskFeatureStore(settings.features_dir)


def vision_placement(settings: Settings, *, require_device: bool = True):
    """MMRAG_VISION_DEVICE / MMRAG_VISION_DTYPE resolved for this host (mmrag/adapters/hardware.py)."""
    from mmrag.adapters.hardware import vision_placement as resolve

    return resolve(settings.vision_device, settings.vision_dtype, require_device=require_device)


def vision_encoder(settings: Settings, model: ModelSource) -> VisionEncoder | RemoteVisionEncoder:
    """The vision service at MMRAG_VISION_URL when set (`mmrag vision serve`: same interface, same keys),
    else the tower in this process on MMRAG_VISION_DEVICE."""
    if settings.vision_url:
        from mmrag.adapters.vision_client import RemoteVisionEncoder

        return RemoteVisionEncoder.of_settings(settings)
    import torch

    from mmrag.adapters.vision import VisionEncoder

    placement = vision_placement(settings)
    pixels = settings.image_input == ImageInput.PIXELS.value
    return VisionEncoder(model.path, settings.resolution_policy, salt=settings.encoder_salt,
                         dtype=getattr(torch, placement.dtype), device=placement.device, keep_pixels=pixels,
                         tokens=settings.ingest_image_tokens)


_scopes: dict[tuple[str, str, bool], EncoderScope] = {}


def encoder_scope(settings: Settings, model: ModelSource, *, before_preprocessing: bool = False) -> EncoderScope:
    """The encoder whose image tokens the configured model serves: its version (weights, processor config and
    implementation, salt, device kind, dtype) under the configured resolution policy. Reads the tower's weights to hash them
    (builds no module, needs no GPU even for MMRAG_VISION_DEVICE=cuda), once per process for the same
    settings: `mmrag ask` needs it for both its engine and its retrieval.

    With MMRAG_VISION_URL it is the service's own (GET /v1/info): its device kind and dtype, which this host
    cannot know, are part of the version, and its keys are the ones ingestion stored; when the service does
    not answer at start-up, the version computed here, with a warning.

    ``before_preprocessing``: the scope the same encoder had before its version covered the preprocessing
    implementation, i.e. the keys pages ingested then carry (`mmrag index check` names them old); always computed
    here, since a vision service reports today's version only."""
    cache_key = (str(model.path), settings.model_dump_json(), before_preprocessing)
    if cache_key in _scopes:
        return _scopes[cache_key]
    info = None
    if settings.vision_url and not before_preprocessing:
        from mmrag.adapters.vision_client import VisionServiceError, service_info

        try:
            info = service_info(settings.vision_url, api_key=settings.vision_api_key)
        except VisionServiceError as exc:
            # Questions without images must still be answered: serve the scope this host's settings give (the
            # same as the service's when both hosts set MMRAG_VISION_DEVICE and MMRAG_VISION_DTYPE alike).
            log.warning("%s; serving the encoder version computed here from MMRAG_VISION_DEVICE=%s and "
                        "MMRAG_VISION_DTYPE=%s, which must be the service's", exc, settings.vision_device,
                        settings.vision_dtype)
    if info is not None:
        if info.policy != settings.resolution_policy:
            log.warning("the vision service at %s encodes under %s, not MMRAG_MIN_PIXELS/MMRAG_MAX_PIXELS (%s) of "
                        "this host: its policy is the one served", settings.vision_url, info.policy,
                        settings.resolution_policy)
        _scopes[cache_key] = EncoderScope(info.version, info.policy)
    else:
        import torch

        from mmrag.adapters.vision import encoder_versions_of

        placement = vision_placement(settings, require_device=False)
        # One read and hash of the tower gives both versions (`mmrag index check` asks for both): keep both, but
        # today's only where it is the one served, not where a vision service that was not asked yet reports it.
        current, before = encoder_versions_of(model.path, salt=settings.encoder_salt,
                                              dtype=getattr(torch, placement.dtype), device_kind=placement.kind)
        _scopes[(*cache_key[:2], True)] = EncoderScope(before, settings.resolution_policy)
        if not (settings.vision_url and before_preprocessing):
            _scopes[(*cache_key[:2], False)] = EncoderScope(current, settings.resolution_policy)
    return _scopes[cache_key]


def model_family(model: ModelSource) -> str:
    """The checkpoint's ``model_type`` (qwen2_vl, ...): what `mmrag index check` and the encoder info metric
    name. Read from config.json, so it costs no weights."""
    from mmrag.adapters.families import checkpoint_family

    return checkpoint_family(model.path).model_type


def text_embedder(settings: Settings) -> TextEmbedder:
    from mmrag.adapters.embed import TextEmbedder

    return TextEmbedder(settings.text_embedder, batch_size=settings.embed_batch_size)


def image_embedder(settings: Settings) -> ImageEmbedder | None:
    """The CLIP image channel, or None when it is off (no local weights)."""
    if not settings.image_channel:
        return None
    from mmrag.adapters.embed import ImageEmbedder

    return ImageEmbedder(settings.clip_model, settings.clip_weights, batch_size=settings.embed_batch_size)


_LATE: dict[str, LateInteractionRetriever] = {}


def late_retriever(settings: Settings) -> LateInteractionRetriever | None:
    """The late-interaction page-image retriever (MMRAG_PAGE_RETRIEVER names its folder), or None. One per folder
    per process: the CLI, the server and its tenants share the loaded model."""
    folder = settings.late_retriever
    if folder is None:
        return None
    from mmrag.adapters.late import LateInteractionRetriever

    key = str(folder.resolve())
    if key not in _LATE:
        _LATE[key] = LateInteractionRetriever(folder, batch_size=settings.embed_batch_size)
    return _LATE[key]


def fusion(settings: Settings):
    from retrieval.search import Fusion

    return Fusion(settings.fusion, settings.fusion_weight_table)


# --- the index -------------------------------------------------------------------------------------------


def page_index(settings: Settings, text_dim: int, *, client=None, late_dim: int = 0) -> PageIndex:
    """The index for writing (its collection created or checked against the embedders' sizes). ``late_dim``: the
    late-interaction retriever's vector size, when MMRAG_PAGE_RETRIEVER names one."""
    from mmrag.adapters.embed import clip_embed_dim
    from mmrag.adapters.qdrant import PageIndex, open_qdrant

    index = PageIndex(client or open_qdrant(settings.qdrant_url, settings.qdrant_path), settings.qdrant_collection,
                      text_dim=text_dim, image_dim=clip_embed_dim(settings.clip_model), late_dim=late_dim)
    index.ensure_collection()
    return index


def read_index(settings: Settings) -> PageIndex:
    """The index for reading only: no embedder is loaded and no vector sizes are needed."""
    from mmrag.adapters.qdrant import PageIndex, open_qdrant

    return PageIndex(open_qdrant(settings.qdrant_url, settings.qdrant_path), settings.qdrant_collection,
                     text_dim=0, image_dim=0)


def ingestor(settings: Settings, *, model: ModelSource | None = None, store: FeatureStore | None = None,
             index: PageIndex | None = None, text: TextEmbedder | None = None,
             image: ImageEmbedder | None = None, encoder: VisionEncoder | RemoteVisionEncoder | None = None
             ) -> Ingestor:
    """The ingest pipeline; parts already built (the server's store, index, embedders, tower) are reused."""
    from ingestion.pipeline import Ingestor

    model = model or resolve_model(settings)
    text = text or text_embedder(settings)
    if image is None:
        image = image_embedder(settings)
    encoder = encoder or vision_encoder(settings, model)
    late = late_retriever(settings)
    if settings.ingest_tier_policies and settings.vision_url:
        raise ValueError("MMRAG_INGEST_TIERS beyond standard needs the vision tower in this process: the vision "
                         "service (MMRAG_VISION_URL) encodes its one policy; unset one of them")
    return Ingestor(
        settings,
        encoder=encoder,
        store=store or feature_store(settings),
        index=index or page_index(settings, text.dim, late_dim=late.dim if late else 0),
        text_embedder=text,
        image_embedder=image,
        tier_encoders=[encoder.with_policy(p) for p in settings.ingest_tier_policies],
        late=late,
        late_pool_factor=settings.page_pool_factor,
    )


def searcher(settings: Settings, *, client=None, encoder: EncoderScope | None = None,
             text: TextEmbedder | None = None, image: ImageEmbedder | None = None) -> PageSearcher:
    """``encoder``: retrieve only pages whose tokens it made (whoever feeds hits to the VLM must pass it).
    Embedders already built (another tenant's searcher) are reused."""
    from mmrag.adapters.qdrant import open_async_qdrant
    from retrieval.search import PageSearcher

    return PageSearcher(client or open_async_qdrant(settings.qdrant_url, settings.qdrant_path),
                        settings.qdrant_collection, text or text_embedder(settings),
                        image if image is not None else image_embedder(settings), late=late_retriever(settings),
                        fusion=fusion(settings), top_k=settings.top_k, candidate_k=settings.candidate_k,
                        page_prefetch=settings.page_prefetch, encoder=encoder)


# --- engine, scheduler, pipeline -------------------------------------------------------------------------


def engine_config(settings: Settings) -> EngineConfig:
    from serving.engine.config import EngineConfig, resolve_dtype

    return EngineConfig(
        block_size=settings.kv_block_size or None,
        kv_cache_gib=settings.kv_cache_gib,
        max_model_len=settings.max_model_len,
        max_images_per_prompt=settings.max_images_per_prompt,
        enforce_eager=settings.enforce_eager,
        dtype=resolve_dtype(settings.engine_dtype),
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_batched_tokens or None,
        image_input=ImageInput(settings.image_input),
        image_pixels=(settings.min_pixels, settings.max_pixels),
    )


def require_engine_urls(settings: Settings) -> list[str]:
    """The remote replicas; commands that must act on a running engine (warm-up) stop here without them."""
    if not settings.engine_url_list:
        raise EngineNotConfiguredError(
            "no running engine to talk to: start one with `mmrag engine serve` and set MMRAG_ENGINE_URLS="
            "http://127.0.0.1:8100 (comma-separate several replicas)"
        )
    return settings.engine_url_list


def engine(settings: Settings, model: ModelSource, store: FeatureStore | None = None, *,
           allow_inprocess: bool = True, encoder: EncoderScope | None = None) -> Engine:
    """Remote `vllm serve` replicas when MMRAG_ENGINE_URLS is set, else vLLM in this process. It reads image
    tokens of ``encoder`` only (default: the configured model's), refusing stale ones whatever names them."""
    from serving.engine.features import FeatureProvider

    encoder = encoder or encoder_scope(settings, model)
    features = FeatureProvider.scoped(store or feature_store(settings), encoder, settings.tier_table)
    if settings.engine_url_list:
        from serving.engine.remote import RemoteEngine

        # Refuses a replica that serves another checkpoint (a fine-tune under the same name), at start-up.
        return RemoteEngine.connect(settings.engine_url_list, model, features, timeout_s=settings.engine_timeout_s,
                                    queue_bound=settings.ray_affinity_queue_bound,
                                    image_input=ImageInput(settings.image_input),
                                    image_pixels=(settings.min_pixels, settings.max_pixels),
                                    max_num_seqs=settings.max_num_seqs)
    if not allow_inprocess:
        require_engine_urls(settings)
    from serving.engine.inprocess import InProcessEngine

    return InProcessEngine.start(model, features, engine_config(settings))


def scheduler_config(settings: Settings) -> SchedulerConfig:
    from serving.scheduler import Policy, SchedulerConfig

    return SchedulerConfig(
        policy=Policy(settings.scheduler_policy),
        max_concurrency=settings.max_concurrency,
        max_image_tokens_in_flight=settings.max_image_tokens_in_flight,
        max_wait_ms=settings.max_wait_ms,
        queue_cap=settings.queue_cap,
        short_image_tokens=settings.scheduler_short_image_tokens,
        short_reserved=settings.scheduler_short_reserved,
    )


def pipeline_config(settings: Settings) -> PipelineConfig:
    from rag.pipeline import PipelineConfig
    from rag.plans import AnswerMode

    return PipelineConfig(top_k=settings.top_k, max_tokens=settings.answer_max_tokens,
                          max_images_per_prompt=settings.max_images_per_prompt,
                          answer_mode=AnswerMode(settings.answer_mode),
                          sub_answer_max_tokens=settings.sub_answer_max_tokens,
                          max_model_len=settings.max_model_len, fixed_length=settings.answer_fixed_length,
                          one_prompt_pages=settings.one_prompt_pages, figure_crops=settings.figure_crops)


def decomposer(settings: Settings, engine: Engine, scope: TenantScope | None = None) -> Decomposer:
    """MMRAG_DECOMPOSER: ``auto`` asks the model unless its weights are random. Its requests carry the
    scope's cache salt. With the answer cache on, it remembers the model's last decompositions (as many as the
    cache keeps answers a tenant), so a repeated question sends no engine request at all."""
    from rag.decompose import Decomposer

    ask_model = settings.decomposer == "model" or (settings.decomposer == "auto" and not engine.random_weights)
    return Decomposer(engine if ask_model else None, max_n=settings.max_sub_questions,
                      max_question_chars=settings.max_question_chars, max_tokens=settings.decompose_max_tokens,
                      fixed_tokens=settings.decompose_fixed_tokens,
                      cache_salt=(scope or tenant_scope(settings)).cache_salt,
                      remember=settings.answer_cache_max_per_tenant if settings.answer_cache else 0)


def pipeline(settings: Settings, engine: Engine, *, scope: TenantScope | None = None, client=None,
             encoder: EncoderScope | None = None, store: FeatureStore | None = None, tower: Tower | None = None,
             answers: AnswerCache | None = None) -> tuple[Pipeline, Scheduler]:
    """The pipeline of ``scope`` (default: the default tenant's), its plans going through one prefix-aware
    scheduler. It retrieves only pages of ``encoder`` (default: the configured model's), so no stale tokens
    are fed.

    The caller owns the engine and closes ``pipeline.searcher.client``. ``store``: the one the engine reads, where
    pages asked for in a tier they lack are stored once encoded (default: the configured one). ``tower``: the
    process's vision tower (vision_tower), which those tier encodes run on (default: one of the pipeline's own).
    ``answers``: the answer cache (answer_cache; default: none). Other tenants' pipelines share the scheduler,
    tiers and answer cache (``scoped_pipeline``).
    """
    from rag.tiers import PageTiers
    from serving.scheduler import Scheduler

    model = resolve_model(settings)
    scope = scope or tenant_scope(settings)
    encoder = encoder or encoder_scope(settings, model)
    counts = ImageTokenCounts()
    scheduler = Scheduler(engine, scheduler_config(settings), image_tokens=counts.of_plan)
    store = store or feature_store(settings)
    tiers = PageTiers(settings, store, tier_encoder(settings, tower or vision_tower(settings, model)))
    pipe = scoped_pipeline(settings, scope, engine, submit=scheduler.submit, counts=counts, tiers=tiers,
                           search=searcher(settings.scoped(scope), client=client, encoder=encoder),
                           lease=answer_lease(store), answers=answers)
    return pipe, scheduler


def answer_cache(settings: Settings, metrics: Metrics | None = None) -> AnswerCache | None:
    """MMRAG_ANSWER_CACHE: one cache for the process (the tenant is in every key), in Redis when MMRAG_REDIS_URL
    is set, else under data_dir/answers; its lookups counted in ``metrics``. None when it is off."""
    if not settings.answer_cache:
        return None
    from mmrag.adapters.answer_store import open_answer_store
    from rag.answer_cache import AnswerCache

    store = open_answer_store(redis_url=settings.redis_url, folder=settings.data_dir / "answers")
    return AnswerCache(store, max_per_tenant=settings.answer_cache_max_per_tenant,
                       on_lookup=metrics.record_answer_cache if metrics is not None else None)


def answer_prompt_version(settings: Settings) -> str:
    """What shapes an answer besides its question, pages and model, hashed for the answer cache's keys: every
    system prompt, the prompt templates (rag/plans.py's source: any change of wording there is a new version) and
    the settings that change prompts or decoding."""
    import inspect

    from rag import plans
    from rag.answer_cache import prompt_version
    from serving.engine.prompt import SYSTEM_PROMPTS

    templates = hashlib.sha256(inspect.getsource(plans).encode()).hexdigest()
    return prompt_version(*(f"{name}={text}" for name, text in sorted(SYSTEM_PROMPTS.items())),
                          f"templates={templates}", f"decomposer={settings.decomposer}",
                          f"max_sub_questions={settings.max_sub_questions}",
                          f"sub_answer_max_tokens={settings.sub_answer_max_tokens}",
                          f"one_prompt_pages={settings.one_prompt_pages}", f"top_k={settings.top_k}",
                          f"figure_crops={settings.figure_crops}",
                          f"answer_fixed_length={settings.answer_fixed_length}",
                          f"decompose_fixed_tokens={settings.decompose_fixed_tokens}",
                          f"image_input={settings.image_input}")


def answer_lease(store: FeatureStore) -> Callable[[], KeyLease]:
    """A new lease per answer on the pages it shows (rag/pipeline.py): held to its last token, at most
    ANSWER_LEASE_S if the server dies first."""
    from mmrag.adapters.store import StoreLease

    return lambda: StoreLease(store, "answer", ANSWER_LEASE_S)


def scoped_pipeline(settings: Settings, scope: TenantScope, engine: Engine, *, submit, counts: ImageTokenCounts,
                    tiers, search: PageSearcher, lease: Callable[[], KeyLease] = NoLease,
                    answers: AnswerCache | None = None) -> Pipeline:
    """One tenant's pipeline over process-wide parts (engine, the scheduler's ``submit``, token counts, tiers):
    ``search`` reads the scope's collection, and the scope's salt goes on every plan and decomposition request.
    A new pipeline per tenant, so a field added to Pipeline is never shared between tenants by accident."""
    from rag.pipeline import Pipeline

    return Pipeline(decomposer(settings, engine, scope), search, engine, config=pipeline_config(settings),
                    submit=submit, token_counts=counts, tiers=tiers, cache_salt=scope.cache_salt, lease=lease,
                    answers=answers, tenant=scope.tenant,
                    prompt_version=answer_prompt_version(settings) if answers is not None else "")


def tenant_scope(settings: Settings, tenant: str = DEFAULT_TENANT) -> TenantScope:
    """The tenant's scope (mmrag/core/scope.py): built here, handed to all that acts for the tenant."""
    from mmrag.core.scope import TenantScope

    return TenantScope.of(settings, tenant)


def for_tenant(tenant: str, settings: Settings | None = None) -> tuple[Settings, TenantScope]:
    """A CLI command's ``--tenant``: the settings reading the tenant's collection, and its scope (salt, roots)."""
    settings = settings if settings is not None else Settings()
    scope = tenant_scope(settings, tenant)
    return settings.scoped(scope), scope


# The vision tower of a process, built on its first use (a server whose work never needs one loads none).
Tower = Callable[[], "VisionEncoder | RemoteVisionEncoder"]


def vision_tower(settings: Settings, model: ModelSource) -> Tower:
    """One tower for everything a process encodes with: ingest jobs, question images and tier encodes run the
    same weights (a 7B VLM's tower is ~0.7 B parameters: one copy, not three). A caller that counts its own
    forwards takes a ``view()`` of it."""
    return functools.cache(lambda: vision_encoder(settings, model))


def tier_encoder(settings: Settings, tower: Tower) -> Callable[[ResolutionPolicy], VisionEncoder | None]:
    """Pages asked for in a tier they are not stored in are encoded by ``tower`` under the tier's policy; with
    MMRAG_VISION_URL, not at all (the service encodes its one policy): they fall back."""
    if settings.vision_url:
        return lambda policy: None
    return functools.cache(lambda policy: tower().with_policy(policy))


# --- the REST service ------------------------------------------------------------------------------------


async def build_services(settings: Settings, *, metrics: Metrics, engine_: Engine | None = None,
                         store_: FeatureStore | None = None) -> Services:
    """Everything the app serves with, built on the running loop (vLLM's async engine binds to it).

    ``engine_``/``store_``: an already started engine and the feature store it reads (tests share one engine
    per session); the store is what the feature-store metrics count.
    """
    from mmrag.adapters.qdrant import AsyncPageReader, LoopBridge
    from mmrag.adapters.store import StoreLease
    from serving.api.admission import Admission, Share
    from serving.api.limits import RequestRates
    from serving.api.conversations import Conversations
    from serving.api.services import MeteredEngine, QuestionImages, Services
    from serving.api.tenants import TenantKeys
    from serving.engine.remote import RemoteEngine
    from serving.ingest_jobs import IngestJobs

    model = resolve_model(settings)
    log.info("model: %s", model.describe())
    store = store_ or feature_store(settings)
    encoder = encoder_scope(settings, model)
    raw = engine_ if engine_ is not None else engine(settings, model, store, encoder=encoder)
    metered = MeteredEngine(raw, metrics)
    tower = vision_tower(settings, model)
    keys = TenantKeys.from_settings(settings)
    scopes = {t: tenant_scope(settings, t) for t in {DEFAULT_TENANT, *keys.tenants}}

    def scope_of(tenant: str) -> TenantScope:  # a job resumed for a tenant since removed still has its scope
        return scopes[tenant] if tenant in scopes else tenant_scope(settings, tenant)

    pipe, scheduler = pipeline(settings, metered, scope=scopes[DEFAULT_TENANT], encoder=encoder, store=store,
                               tower=tower, answers=answer_cache(settings, metrics))
    metrics.register_store(store)
    metrics.set_tiers(settings.tier_table)
    if not isinstance(raw, RemoteEngine):  # one prefix cache to model; replicas have their own (left unestimated)
        scheduler.track_kv((await raw.kv_capacity()).tokens)
    await scheduler.fit()  # MMRAG_MAX_CONCURRENCY=0: the engine's batch, asked now rather than on a question
    await pipe.searcher.stale_pages()  # warns at start-up when pages of another encoder are indexed
    reader = AsyncPageReader(pipe.searcher.client, settings.qdrant_collection)
    metrics.set_encoder(encoder, model_family(model), pages_per_encoder(await reader.pages()))
    if settings.engine_url_list:
        metrics.register_remote_replicas(settings.engine_url_list)
    loop = asyncio.get_running_loop()
    client = pipe.searcher.client

    def make_index(tenant: str) -> PageIndex:
        # Local mode allows one Qdrant client per folder: server-side ingest writes through the server's own
        # async client, from the job's worker thread, on this loop.
        late = pipe.searcher.late
        return page_index(settings.scoped(scope_of(tenant)), pipe.searcher.text_embedder.dim,
                          client=LoopBridge(client, loop), late_dim=late.dim if late else 0)

    def make_ingestor(tenant: str, tiers: tuple[str, ...]) -> Ingestor:
        job_settings = settings.scoped(scope_of(tenant))
        if tiers:  # a job's own tiers, beside MMRAG_INGEST_TIERS (checked by the route)
            job_settings = job_settings.model_copy(update={"ingest_tiers": ",".join((settings.ingest_tiers, *tiers))})
        return ingestor(job_settings, model=model, store=store, index=make_index(tenant), encoder=tower(),
                        text=pipe.searcher.text_embedder, image=pipe.searcher.image_embedder)

    jobs = IngestJobs(scope_of, make_ingestor, state=settings.data_dir / "jobs.sqlite3",
                      make_index=make_index, store=store,
                      referenced=lambda index: index.referenced_keys(settings.qdrant_collection),
                      tiers=settings.tier_table, workers=settings.ingest_workers, retry_s=settings.delete_retry_s,
                      keep=settings.ingest_jobs_kept)
    # Each conversation leases its images for as long as it lives (serving/api/conversations.py).
    conversations = Conversations(max_entries=settings.max_conversations,
                                  per_tenant=settings.conversations_per_tenant, ttl_s=settings.conversation_ttl_s,
                                  lease=functools.partial(StoreLease, store, "conversation",
                                                          settings.conversation_ttl_s))
    root = Services(settings=settings, model=model, engine=metered, pipeline=pipe, scheduler=scheduler,
                    store=store, pages=reader, metrics=metrics, jobs=jobs.for_tenant(DEFAULT_TENANT),
                    owns_engine=engine_ is None, keys=keys, scope=scopes[DEFAULT_TENANT],
                    admission=Admission(settings.max_questions_in_flight, queue=settings.admission_queue,
                                        max_wait_s=settings.admission_max_wait_s, record=metrics.record_answer,
                                        record_wait=metrics.record_admission_wait, tenants=keys.tenants,
                                        shares={t: Share(q.weight, q.questions_in_flight) for t, q in keys.quotas}),
                    question_images=QuestionImages(settings, store, lambda: tower().view()),
                    conversations=conversations.for_tenant(DEFAULT_TENANT),
                    rates=RequestRates({t: q.requests_per_s for t, q in keys.quotas if q.requests_per_s}))
    root.tenants.update({t: tenant_view(root, scopes[t], jobs, conversations) for t in keys.tenants})
    metrics.set_tenants(keys.tenants)
    return root


def tenant_view(root: Services, scope: TenantScope, jobs: IngestJobs, conversations: Conversations) -> Services:
    """The tenant's services: its own pipeline (its collection searched, its salt on every plan), pages, jobs
    and conversations, all from its scope; engine, scheduler, store, tiers and embedders stay the process's one."""
    import dataclasses

    from mmrag.adapters.qdrant import AsyncPageReader

    if scope.tenant == DEFAULT_TENANT:
        return root
    base = root.pipeline
    search = searcher(root.settings.scoped(scope), client=base.searcher.client, encoder=base.searcher.encoder,
                      text=base.searcher.text_embedder, image=base.searcher.image_embedder)
    pipe = scoped_pipeline(root.settings, scope, root.engine, submit=base.submit, counts=base.token_counts,
                           tiers=base.tiers, search=search, lease=base.lease, answers=base.answers)
    return dataclasses.replace(root, scope=scope, pipeline=pipe,
                               pages=AsyncPageReader(base.searcher.client, scope.collection),
                               jobs=jobs.for_tenant(scope.tenant),
                               conversations=conversations.for_tenant(scope.tenant),
                               tenants={})


def create_app(settings: Settings, *, engine: Engine | None = None, store: FeatureStore | None = None) -> FastAPI:
    """The REST app. ``engine``: an already started engine to share (tests), with the ``store`` it reads;
    otherwise the app starts one over the configured store."""
    from serving.api.main import create_app as assemble

    async def build(metrics: Metrics) -> Services:
        return await build_services(settings, metrics=metrics, engine_=engine, store_=store)

    return assemble(settings, build)


# --- the vision service ----------------------------------------------------------------------------------


def vision_app(settings: Settings) -> FastAPI:
    """`mmrag vision serve`: the tower on MMRAG_VISION_DEVICE, batching its callers' images, its tokens going
    into the configured feature store. It encodes in this process even where MMRAG_VISION_URL (an environment
    shared with ingestion and the API) names the service itself."""
    from serving.vision.app import VisionService, create_vision_app, encoder_info
    from serving.vision.batcher import VisionBatcher
    from serving.vision.metrics import VisionMetrics

    encoder = vision_encoder(settings.model_copy(update={"vision_url": ""}), resolve_model(settings))
    store = feature_store(settings)
    info = encoder_info(encoder)
    metrics = VisionMetrics({"version": info.version, "policy": str(info.policy), "family": info.family,
                             "device": info.device, "dtype": info.dtype})
    batcher = VisionBatcher(encoder, store, max_batch=settings.vision_max_batch,
                            max_wait_ms=settings.vision_max_wait_ms, queue_cap=settings.vision_queue_cap,
                            observe=metrics)
    return create_vision_app(settings, VisionService(encoder, store, batcher, metrics, info))


# --- Ray Serve (`mmrag serve --ray`) -----------------------------------------------------------------------


def ray_config(settings: Settings) -> RayServeConfig:
    from serving.ray.app import RayServeConfig

    return RayServeConfig(address=settings.ray_address, replicas=settings.ray_replicas,
                          queue_bound=settings.ray_affinity_queue_bound, replica_cpus=settings.ray_replica_cpus,
                          replica_gpus=settings.ray_replica_gpus,
                          max_ongoing_requests=settings.max_num_seqs + settings.ray_affinity_queue_bound,
                          http_host=settings.host, http_port=settings.ray_http_port,
                          vision_max_replicas=settings.ray_vision_max_replicas)


def replica_engine(settings: Settings) -> Engine:
    """What each Ray engine replica runs: vLLM in its process over the configured feature store."""
    return engine(settings.model_copy(update={"engine_urls": ""}), resolve_model(settings))


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
    if config.address and not settings.redis_url:
        log.warning("MMRAG_RAY_ADDRESS joins a cluster but MMRAG_REDIS_URL is empty: every replica reads the "
                    "feature store on its own disk (%s); set MMRAG_REDIS_URL unless all run on this machine",
                    settings.features_dir)
    log.info("Ray cluster ready in %.1f s", connect(config, num_cpus=num_cpus))
    handle = (deploy_engine(config, functools.partial(replica_engine, settings)) if settings.ray_deploy
              else engine_handle())
    return RayEngine(handle, resolve_model(settings))


def ray_app(settings: Settings) -> FastAPI:
    """`mmrag serve --ray`: the REST app in this process, its engine the Ray replicas, its vision service the
    Ray deployment at /vision on Serve's HTTP proxy (MMRAG_VISION_URL points there)."""
    from serving.ray.app import deploy_vision, vision_url

    eng = ray_engine(settings)
    config = ray_config(settings)
    url = deploy_vision(config, functools.partial(vision_app, settings)) if settings.ray_deploy else vision_url(config)
    settings = settings.model_copy(update={"vision_url": url})
    return create_app(settings, engine=eng, store=feature_store(settings))
