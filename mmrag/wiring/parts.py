"""Parts every deployment builds from the settings: the model, the feature store, the vision encoders, the
embedders, the index, the ingest pipeline and the searcher."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from mmrag.adapters.checkpoint import ModelSource, configured_model
from mmrag.core.engine import ImageInput
from mmrag.core.payload import EncoderScope
from mmrag.core.settings import DevelopmentKnobs, Settings

if TYPE_CHECKING:
    from pathlib import Path

    from mmrag.adapters.embed import ImageEmbedder, TextEmbedder
    from mmrag.adapters.late import LateInteractionRetriever
    from mmrag.adapters.qdrant import PageIndex
    from mmrag.adapters.store import FeatureStore
    from mmrag.adapters.vision import VisionEncoder
    from mmrag.adapters.vision_client import RemoteVisionEncoder
    from mmrag.core.keys import ResolutionPolicy
    from ingestion.pipeline import Ingestor
    from retrieval.search import PageSearcher

log = logging.getLogger(__name__)

TINY_MODEL_NAME = "mmrag-tiny-qwen2vl"
# How long an answer's lease on its pages' tokens outlives a server killed mid-answer (it is released at the
# answer's end otherwise); longer than any answer takes, so a live answer never loses its pages.
ANSWER_LEASE_S = 900.0


class EngineNotConfiguredError(RuntimeError):
    pass


class ModelNotConfiguredError(RuntimeError):
    """No MMRAG_MODEL in the production profile: refused rather than serving a random-weight model's noise."""


class DevelopmentKnobError(RuntimeError):
    """A benchmark or test knob set in the production profile: refused rather than shaping real answers."""


def development_knobs(settings: Settings) -> DevelopmentKnobs:
    """The benchmark and test knobs (mmrag/core/settings.DevelopmentKnobs) from their variables: read in the
    development profile; in production their defaults, and a start with one set is refused, naming it."""
    knobs = DevelopmentKnobs()
    if settings.model.profile == "production" and (given := sorted(knobs.model_fields_set)):
        raise DevelopmentKnobError(
            f"{', '.join('MMRAG_' + n.upper() for n in given)}: benchmark and test knobs, refused in the "
            "production profile; unset them, or set MMRAG_PROFILE=development for a benchmark")
    return knobs


# --- model, store, encoders ------------------------------------------------------------------------------


def resolve_model(settings: Settings) -> ModelSource:
    """MMRAG_MODEL, or (when empty, in the development profile only) the tiny random-weight test model, built
    offline under the data dir. Empty in production: ModelNotConfiguredError, naming the fix."""
    if settings.model.name:
        return configured_model(settings.model.name)
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
    development = not settings.model.name and settings.model.profile == "development"
    return settings.storage.tiny_model_dir if development else None


def feature_store(settings: Settings) -> FeatureStore:
    """Redis when MMRAG_REDIS_URL is set, local disk under the data dir otherwise."""
    from mmrag.adapters.store import DiskFeatureStore, RedisFeatureStore

    if settings.storage.redis_url:
        return RedisFeatureStore(settings.storage.redis_url)
    return DiskFeatureStore(settings.storage.features_dir)


def vision_placement(settings: Settings, *, require_device: bool = True):
    """MMRAG_VISION_DEVICE / MMRAG_VISION_DTYPE resolved for this host (mmrag/adapters/hardware.py)."""
    from mmrag.adapters.hardware import vision_placement as resolve

    return resolve(settings.vision.device, settings.vision.dtype, require_device=require_device)


def vision_encoder(settings: Settings, model: ModelSource) -> VisionEncoder | RemoteVisionEncoder:
    """The vision service at MMRAG_VISION_URL when set (`mmrag vision serve`: same interface, same keys),
    else the tower in this process on MMRAG_VISION_DEVICE."""
    if settings.vision.url:
        from mmrag.adapters.vision_client import RemoteVisionEncoder

        return RemoteVisionEncoder(settings.vision.url, api_key=settings.vision.api_key)
    return local_vision_encoder(settings, model)


def local_vision_encoder(settings: Settings, model: ModelSource) -> VisionEncoder:
    """The tower in this process on MMRAG_VISION_DEVICE: what the vision service runs, whatever MMRAG_VISION_URL (an
    environment it shares with ingestion and the API) names."""
    import torch

    from mmrag.adapters.vision import VisionEncoder

    placement = vision_placement(settings)
    pixels = settings.engine.image_input == ImageInput.PIXELS.value
    return VisionEncoder(model.path, settings.vision.resolution_policy, salt=settings.vision.encoder_salt,
                         dtype=getattr(torch, placement.dtype), device=placement.device, keep_pixels=pixels,
                         tokens=settings.ingestion.image_tokens)


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
    if settings.vision.url and not before_preprocessing:
        from mmrag.adapters.vision_client import VisionServiceError, service_info

        try:
            info = service_info(settings.vision.url, api_key=settings.vision.api_key)
        except VisionServiceError as exc:
            # Questions without images must still be answered: serve the scope this host's settings give (the
            # same as the service's when both hosts set MMRAG_VISION_DEVICE and MMRAG_VISION_DTYPE alike).
            log.warning("%s; serving the encoder version computed here from MMRAG_VISION_DEVICE=%s and "
                        "MMRAG_VISION_DTYPE=%s, which must be the service's", exc, settings.vision.device,
                        settings.vision.dtype)
    if info is not None:
        if info.policy != settings.vision.resolution_policy:
            log.warning("the vision service at %s encodes under %s, not MMRAG_MIN_PIXELS/MMRAG_MAX_PIXELS (%s) of "
                        "this host: its policy is the one served", settings.vision.url, info.policy,
                        settings.vision.resolution_policy)
        _scopes[cache_key] = EncoderScope(info.version, info.policy)
    else:
        import torch

        from mmrag.adapters.vision import encoder_versions_of

        placement = vision_placement(settings, require_device=False)
        # One read and hash of the tower gives both versions (`mmrag index check` asks for both): keep both, but
        # today's only where it is the one served, not where a vision service that was not asked yet reports it.
        current, before = encoder_versions_of(model.path, salt=settings.vision.encoder_salt,
                                              dtype=getattr(torch, placement.dtype), device_kind=placement.kind)
        _scopes[(*cache_key[:2], True)] = EncoderScope(before, settings.vision.resolution_policy)
        if not (settings.vision.url and before_preprocessing):
            _scopes[(*cache_key[:2], False)] = EncoderScope(current, settings.vision.resolution_policy)
    return _scopes[cache_key]


def model_family(model: ModelSource) -> str:
    """The checkpoint's ``model_type`` (qwen2_vl, ...): what `mmrag index check` and the encoder info metric
    name. Read from config.json, so it costs no weights."""
    from mmrag.adapters.families import checkpoint_family

    return checkpoint_family(model.path).model_type


def text_embedder(settings: Settings) -> TextEmbedder:
    from mmrag.adapters.embed import TextEmbedder

    return TextEmbedder(settings.retrieval.text_embedder, batch_size=settings.ingestion.embed_batch_size)


def image_embedder(settings: Settings) -> ImageEmbedder | None:
    """The CLIP image channel, or None when it is off (no local weights)."""
    if not settings.image_channel:
        return None
    from mmrag.adapters.embed import ImageEmbedder

    return ImageEmbedder(settings.retrieval.clip_model, settings.retrieval.clip_weights,
                         batch_size=settings.ingestion.embed_batch_size)


_LATE: dict[str, LateInteractionRetriever] = {}


def late_retriever(settings: Settings) -> LateInteractionRetriever | None:
    """The late-interaction page-image retriever (MMRAG_PAGE_RETRIEVER names its folder), or None. One per folder
    per process: the CLI, the server and its tenants share the loaded model."""
    folder = settings.retrieval.late_retriever
    if folder is None:
        return None
    from mmrag.adapters.late import LateInteractionRetriever

    key = str(folder.resolve())
    if key not in _LATE:
        _LATE[key] = LateInteractionRetriever(folder, batch_size=settings.ingestion.embed_batch_size)
    return _LATE[key]


def fusion(settings: Settings):
    from retrieval.search import Fusion

    return Fusion(settings.retrieval.fusion, settings.retrieval.fusion_weight_table)


# --- the index -------------------------------------------------------------------------------------------


def page_index(settings: Settings, text_dim: int, *, collection: str | None = None, client=None,
               late_dim: int = 0) -> PageIndex:
    """The index for writing (its collection created or checked against the embedders' sizes). ``collection``: a
    tenant's (TenantScope.collection; None: MMRAG_QDRANT_COLLECTION, the default tenant's). ``late_dim``: the
    late-interaction retriever's vector size, when MMRAG_PAGE_RETRIEVER names one."""
    from mmrag.adapters.embed import clip_embed_dim
    from mmrag.adapters.qdrant import PageIndex, open_qdrant

    index = PageIndex(client or open_qdrant(settings.storage.qdrant_url, settings.storage.qdrant_path),
                      collection or settings.storage.qdrant_collection, text_dim=text_dim,
                      image_dim=clip_embed_dim(settings.retrieval.clip_model), late_dim=late_dim)
    index.ensure_collection()
    return index


def read_index(settings: Settings, *, collection: str | None = None) -> PageIndex:
    """The index for reading only: no embedder is loaded and no vector sizes are needed. ``collection``: as
    page_index's."""
    from mmrag.adapters.qdrant import PageIndex, open_qdrant

    storage = settings.storage
    return PageIndex(open_qdrant(storage.qdrant_url, storage.qdrant_path), collection or storage.qdrant_collection,
                     text_dim=0, image_dim=0)


def ingestor(settings: Settings, *, collection: str | None = None, model: ModelSource | None = None,
             store: FeatureStore | None = None,
             index: PageIndex | None = None, text: TextEmbedder | None = None,
             image: ImageEmbedder | None = None, encoder: VisionEncoder | RemoteVisionEncoder | None = None,
             tiers: tuple[str, ...] = ()) -> Ingestor:
    """The ingest pipeline; parts already built (the server's store, index, embedders, tower) are reused.
    ``tiers``: a job's own tiers to encode, beside MMRAG_INGEST_TIERS (names of MMRAG_TIERS). ``collection``: the
    index's when none is given (page_index's)."""
    from ingestion.pipeline import Ingestor

    model = model or resolve_model(settings)
    text = text or text_embedder(settings)
    if image is None:
        image = image_embedder(settings)
    encoder = encoder or vision_encoder(settings, model)
    late = late_retriever(settings)
    policies = settings.vision.extra_tier_policies([*settings.ingestion.tiers, *tiers])
    if policies and settings.vision.url:
        raise ValueError("MMRAG_INGEST_TIERS beyond standard needs the vision tower in this process: the vision "
                         "service (MMRAG_VISION_URL) encodes its one policy; unset one of them")
    return Ingestor(
        settings.documents,
        vision_batch_size=settings.ingestion.vision_batch_size,
        encoder=encoder,
        store=store or feature_store(settings),
        index=index or page_index(settings, text.dim, collection=collection, late_dim=late.dim if late else 0),
        text_embedder=text,
        image_embedder=image,
        tier_encoders=[encoder.with_policy(p) for p in policies],
        late=late,
        late_pool_factor=settings.retrieval.page_pool_factor,
    )


def reencoder(settings: Settings, *, encoder: VisionEncoder, store: FeatureStore, index: PageIndex):
    """`mmrag reencode`'s worker: the stored pages re-encoded by ``encoder`` under the settings' reading of
    documents, tiers, batch size and image input."""
    from ingestion.reencode import Reencoder

    return Reencoder(settings.documents, tiers=settings.vision.tier_table,
                     pixels=settings.engine.image_input == "pixels",
                     vision_batch_size=settings.ingestion.vision_batch_size, encoder=encoder, store=store, index=index)


def searcher(settings: Settings, *, collection: str | None = None, client=None, encoder: EncoderScope | None = None,
             text: TextEmbedder | None = None, image: ImageEmbedder | None = None) -> PageSearcher:
    """``collection``: as page_index's. ``encoder``: retrieve only pages whose tokens it made (whoever feeds hits
    to the VLM must pass it).
    Embedders already built (another tenant's searcher) are reused."""
    from mmrag.adapters.qdrant import open_async_qdrant
    from retrieval.search import PageSearcher

    return PageSearcher(client or open_async_qdrant(settings.storage.qdrant_url, settings.storage.qdrant_path),
                        collection or settings.storage.qdrant_collection, text or text_embedder(settings),
                        image if image is not None else image_embedder(settings), late=late_retriever(settings),
                        fusion=fusion(settings), top_k=settings.retrieval.top_k,
                        candidate_k=settings.retrieval.candidate_k,
                        page_prefetch=settings.retrieval.page_prefetch, encoder=encoder)


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
    if settings.vision.url:
        return lambda policy: None
    return functools.cache(lambda policy: tower().with_policy(policy))
