"""Page search over the Qdrant index: dense text, lexical (sparse BM25) and page-image channels, fused.

Async end to end: query embedding is CPU-bound torch work and runs in a worker thread
(``asyncio.to_thread``), and every channel of every sub-question of a request goes to Qdrant in ONE
``query_batch_points`` round trip: per sub-question a dense request on ``text``, a sparse one on ``lexical``
(Qdrant applies IDF to the stored BM25 term weights) and, where configured, a page-image one: ``image`` (CLIP)
or, for a late-interaction retriever, a two-stage query in which the mean-pooled ``page_mean`` vector
prefetches ``page_prefetch`` pages and MaxSim over their ``page`` multi-vectors re-ranks only those. Each
channel returns ``candidate_k`` pages; they are fused here (:class:`Fusion`: weighted reciprocal-rank fusion or
a weighted sum of scaled scores, MMRAG_FUSION / MMRAG_FUSION_WEIGHTS) and cut to ``top_k``. Fusing client-side
keeps each channel's own ranking visible to the evaluation (`mmrag retrieval eval` scores every channel from
the same round trip) and lets the weights be measured rather than assumed.

Questions and page text go through the one normaliser (mmrag/core/text.py) before either is embedded or tokenised.

Local mode (``AsyncQdrantClient(path=...)``) is qdrant-client's in-process engine behind async methods:
it computes on the calling thread, so a local-mode search holds the event loop for its duration (a few ms
at 10k pages, see ``mmrag retrieval latency``). A Qdrant server (``MMRAG_QDRANT_URL``) makes it real I/O.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import math
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
from qdrant_client import AsyncQdrantClient, models

from mmrag.adapters.embed import ImageEmbedder, TextEmbedder
from mmrag.adapters.late import LateInteractionRetriever, mean_pool
from mmrag.adapters.lexical import LexicalEncoder, caption_terms, special_token, token_index
from mmrag.adapters.qdrant import IS_FIGURE, IndexConfigError, check_vectors, scope_filter
from mmrag.core.figures import (FIGURE_NAMING_MIN_SIMILARITY, PageFigure, figure_refs, hit_figure, shows_crop,
                                 slide_title)
from mmrag.core.keys import ImageKey
from mmrag.core.payload import (
    FIGURE_INDEX,
    FIGURE_PARENT,
    IMAGE_VECTOR,
    LEXICAL_VECTOR,
    PAGE_MEAN_VECTOR,
    PAGE_VECTOR,
    STALE_PAGES_FIX,
    TEXT_VECTOR,
    EncoderScope,
    PageField,
    PagePayload,
)
from mmrag.core.settings import DEFAULT_FUSION, DEFAULT_FUSION_WEIGHTS, default_of
from mmrag.core.text import normalise

log = logging.getLogger(__name__)

SNIPPET_CHARS = 200
QUERY_MEMO = 4096  # query texts whose dense vectors a searcher remembers (1.5 KiB each at 384 floats)
KNOWN_DOCS_SHOWN = 10
T = TypeVar("T")
# How much a sub-question's ranking leans on the whole question's (PageSearcher.search_many ``context``).
CONTEXT_WEIGHT = 0.25
RRF_K = 60  # the constant of reciprocal-rank fusion (Cormack et al.; Qdrant's own RRF uses it too)


class Channel(str, enum.Enum):
    TEXT = "text"  # page text vs. the question, dense (MiniLM)
    LEXICAL = "lexical"  # page text vs. the question, sparse BM25 with Qdrant's IDF
    IMAGE = "image"  # page image vs. the question: CLIP's text tower, or a late-interaction retriever (MaxSim)
    # The pages whose caption carries a figure, table or listing the question names ("Figure 12"): the lexical
    # vector's figure#N tokens alone. Asked only for such questions, and only as part of HYBRID: a question that
    # names a figure by number means that figure's page, not the pages that merely mention it.
    CAPTION = "caption"
    # Figure points (issue 26: one per figure with a caption or sentences naming it), dense text, each found point
    # counted as a hit on its page with that figure named. Like CAPTION, only a part of HYBRID.
    FIGURE = "figure"
    HYBRID = "hybrid"  # every channel that is on, fused (class Fusion)


FUSED = (Channel.TEXT, Channel.LEXICAL, Channel.IMAGE, Channel.CAPTION, Channel.FIGURE)


@dataclass(frozen=True, slots=True)
class Fusion:
    """How the channels' rankings of one query become one. ``rrf``: sum over channels of weight / (RRF_K + rank);
    ``score``: each channel's scores scaled to [0, 1] over its candidates for the query (max 1, min 0), then a
    weighted sum. A channel with weight 0 is not queried at all."""

    method: str = DEFAULT_FUSION
    weights: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_FUSION_WEIGHTS))

    def __post_init__(self) -> None:
        if self.method not in ("rrf", "score"):
            raise ValueError(f"unknown fusion {self.method!r}: use rrf or score (MMRAG_FUSION)")

    def weight(self, channel: Channel) -> float:
        return float(self.weights.get(channel.value, DEFAULT_FUSION_WEIGHTS.get(channel.value, 1.0)))

    def fuse(self, ranked: Mapping[Channel, Sequence[T]], key: Callable[[T], Any] = lambda p: p.id
             ) -> list[tuple[float, T]]:
        """(fused score, item) best first, from each channel's items best first (Qdrant points, or hits with
        ``key=lambda h: h.page_id``); ties broken by the key, so the order is stable."""
        total: dict[Any, float] = {}
        item: dict[Any, T] = {}
        for channel, items in ranked.items():
            w = self.weight(channel)
            if not items or w == 0:
                continue
            if self.method == "rrf":
                parts = [w / (RRF_K + rank) for rank in range(1, len(items) + 1)]
            else:
                hi, lo = items[0].score, items[-1].score
                parts = [w * ((p.score - lo) / (hi - lo) if hi > lo else 1.0) for p in items]
            for p, part in zip(items, parts):
                k = key(p)
                total[k] = total.get(k, 0.0) + part
                item.setdefault(k, p)
        return sorted(((score, item[k]) for k, score in total.items()), key=lambda sk: (-sk[0], str(key(sk[1]))))


@dataclass(slots=True)
class QueryVectors:
    """One row per query for each channel asked (None: not asked, or the channel is off)."""

    text: np.ndarray | None = None
    lexical: list[tuple[list[int], list[float]]] | None = None
    caption: list[tuple[list[int], list[float]]] | None = None  # the figure#N tokens alone (empty: none named)
    image: np.ndarray | None = None  # CLIP text-tower vectors
    late: list[np.ndarray] | None = None  # late-interaction query multi-vectors (rows: query tokens)
    figure: np.ndarray | None = None  # the figure points' query: the dense text vectors

    def channels(self) -> list[Channel]:
        return [c for c, v in ((Channel.TEXT, self.text), (Channel.LEXICAL, self.lexical),
                               (Channel.IMAGE, self.image if self.image is not None else self.late),
                               (Channel.CAPTION, self.caption), (Channel.FIGURE, self.figure)) if v is not None]


class RetrievalError(LookupError):
    """A search that cannot be answered as asked; the message names the fix."""


class NoDocumentsError(RetrievalError):
    pass


class UnknownDocumentError(RetrievalError):
    pass


class ImageChannelOffError(RetrievalError):
    pass


class StaleIndexError(RetrievalError):
    """Every indexed page was encoded by another encoder than the configured one: nothing can be served."""


@dataclass(frozen=True, slots=True)
class Hit:
    page_id: str  # the page's point id (citations and GET /v1/pages/{id})
    doc_id: str
    doc: str  # file name, for citations and filters
    page: int  # 1-based
    score: float  # cosine similarity for one channel, RRF score for hybrid
    snippet: str  # ~200 chars of page text around the words that match the question best
    image_key: ImageKey
    image_tokens: int
    path: str
    text: str = ""  # the whole page text (empty for a page without text layer and OCR off)
    # How far ``score`` stands above the median score of its query's candidates (the whole fused pool, or the
    # channel's): comparable across sub-questions where raw scores are not (a vague sub-question's candidates all
    # score alike, and high), so one prompt's page budget is spent on the pages that stand out (rag/plans.py).
    margin: float = 0.0
    # The page's figure this hit is on (mmrag/core/figures.py hit_figure): the one the query names by number, else
    # the one whose caption the query matches, else the one a channel found the page by; None when the page as a
    # whole answered.
    figure: PageFigure | None = None

    @property
    def shows_crop(self) -> bool:
        """Whether the image this hit shows is its figure's crop (rag/plans.shown_as_figures), in any tier."""
        return shows_crop(self.image_key, self.figure)

    @classmethod
    def of(cls, page: PagePayload, score: float, query: str, margin: float = 0.0, found: int | None = None
           ) -> Hit:
        """``found``: the index of the page's figure whose figure point the query found (the figure channel)."""
        figure = hit_figure(page.figures, query, title=slide_title(page.captions), found=found,
                            terms=caption_terms)
        return cls(page_id=page.page_id, doc_id=page.doc_id, doc=page.doc, page=page.page, score=score,
                   snippet=make_snippet(page.text, query), image_key=page.image_key,
                   image_tokens=page.image_tokens, path=page.path, text=page.text, margin=margin, figure=figure)


class PageSearcher:
    def __init__(
        self,
        client: AsyncQdrantClient,
        collection: str,
        text_embedder: TextEmbedder,
        image_embedder: ImageEmbedder | None,
        *,
        lexical: LexicalEncoder | None = None,
        late: LateInteractionRetriever | None = None,
        fusion: Fusion | None = None,
        top_k: int = default_of("top_k"),
        candidate_k: int = default_of("candidate_k"),
        page_prefetch: int = default_of("page_prefetch"),
        encoder: EncoderScope | None = None,
    ) -> None:
        """``encoder``: the encoder whose image tokens the caller will feed to the VLM. Pages outside it are
        never returned (a payload filter in every query), so stale tokens cannot reach a prompt after an
        upgrade; None returns every page (the retrieval evaluations, which feed no VLM). ``image_embedder``
        (CLIP) and ``late`` (a late-interaction retriever) are the page-image channel: at most one of them."""
        if not 0 < top_k <= candidate_k:
            raise ValueError(f"need 0 < top_k <= candidate_k, got top_k={top_k}, candidate_k={candidate_k}")
        if image_embedder is not None and late is not None:
            raise ValueError("the page-image channel is CLIP or a late-interaction retriever, not both")
        self.client = client
        self.collection = collection
        self.text_embedder = text_embedder
        self._memo: OrderedDict[str, np.ndarray] = OrderedDict()  # _dense's remembered query vectors
        self._memo_lock = threading.Lock()
        self.image_embedder = image_embedder
        self.lexical = lexical or LexicalEncoder()
        self.late = late
        self.fusion = fusion or Fusion()
        self.top_k = top_k
        self.candidate_k = candidate_k
        self.page_prefetch = max(page_prefetch, candidate_k)
        self.encoder = encoder
        self._scope = None if encoder is None else scope_filter(encoder)
        self._warned = (0, 0)  # the stale/total counts last warned about
        self._checked = False  # the collection exists, has pages and matches the embedders

    @property
    def image_channel(self) -> bool:
        return self.image_embedder is not None or self.late is not None

    @property
    def image_channel_name(self) -> str:
        part = self.image_embedder or self.late
        return part.name if part is not None else "off"

    async def search_many(
        self,
        queries: list[str],
        *,
        doc_filter: list[str] | None = None,
        top_k: int | None = None,
        channels: Channel = Channel.HYBRID,
        context: str | None = None,
    ) -> list[list[Hit]]:
        """The best pages for each query, best first, in one Qdrant round trip for all of them.

        ``context``: the question the queries were split from. Searched in the same round trip, its fused
        ranking is added to each query's at CONTEXT_WEIGHT (HYBRID only): a sub-question such as "and the one
        with a command?" then prefers the pages of the question's own subject over look-alikes elsewhere."""
        return (await self._search(queries, doc_filter=doc_filter, top_k=top_k, channels=channels, context=context,
                                   every=False))[Channel(channels)]

    async def search_channels(
        self,
        queries: list[str],
        *,
        doc_filter: list[str] | None = None,
        top_k: int | None = None,
        channels: Channel = Channel.HYBRID,
        context: str | None = None,
    ) -> dict[Channel, list[list[Hit]]]:
        """Like :meth:`search_many`, with each channel's own ranking beside the fused one (under HYBRID), all from
        the same round trip: what the evaluation scores."""
        return await self._search(queries, doc_filter=doc_filter, top_k=top_k, channels=channels, context=context,
                                  every=True)

    async def _search(self, queries: list[str], *, doc_filter: list[str] | None, top_k: int | None, channels: Channel,
                      context: str | None, every: bool) -> dict[Channel, list[list[Hit]]]:
        """``every``: hits of each channel searched, besides the fused ones (else those asked for only)."""
        channels = Channel(channels)
        with_context = context is not None and channels is Channel.HYBRID and context not in queries
        if not queries:
            return {channels: []}
        if channels in (Channel.CAPTION, Channel.FIGURE):
            raise ValueError(f"the {channels.value} channel is a part of hybrid search, not a channel to search alone")
        if channels is Channel.IMAGE and not self.image_channel:
            raise ImageChannelOffError(
                "image-only search was asked for, but the page-image channel is off: set MMRAG_PAGE_RETRIEVER to a "
                "local ColQwen2/ColPali checkpoint folder (or MMRAG_CLIP_WEIGHTS to local open_clip weights) and "
                "re-ingest, or search the text channels"
            )
        prepared = await self._prepare(doc_filter)  # before embedding: a bad filter fails fast
        asked = [*queries, context] if with_context else queries
        vectors = await asyncio.to_thread(self.embed_queries, asked, channels)
        return await self._query(asked, vectors, prepared, top_k or self.top_k, context=with_context, every=every)

    async def search_vectors(self, queries: list[str], vectors: QueryVectors, *, doc_filter: list[str] | None = None,
                             top_k: int | None = None) -> list[list[Hit]]:
        """``search_many`` for queries embedded already (``embed_queries``; the channels are those in ``vectors``:
        more than one means fused). ``queries`` only shape the snippets. One Qdrant round trip."""
        asked = vectors.channels()
        if not asked:
            raise ValueError("search_vectors needs the vectors of at least one channel")
        prepared = await self._prepare(doc_filter)
        found = await self._query(queries, vectors, prepared, top_k or self.top_k, every=False)
        return found[Channel.HYBRID if len(asked) > 1 else asked[0]]

    async def search(self, query: str, **kwargs: Any) -> list[Hit]:
        return (await self.search_many([query], **kwargs))[0]

    async def _prepare(self, doc_filter: list[str] | None) -> tuple[models.Filter, bool]:
        """The pages' filter (encoder scope, documents, no figure points), and whether documents were named."""
        await self._check_collection()
        must = [self._scope] if self._scope is not None else []
        if doc_filter:
            must.append(await self._doc_filter(doc_filter))
        return models.Filter(must=must, must_not=[IS_FIGURE]), bool(doc_filter)  # pages; figure points: _request

    async def _query(self, queries: list[str], vectors: QueryVectors, prepared: tuple[models.Filter, bool],
                     limit: int, *, context: bool = False, every: bool = True) -> dict[Channel, list[list[Hit]]]:
        """Every channel's request for every query in one batch; with more than one channel, the fused hits under
        HYBRID and, with ``every``, each channel's own (a hit is a parsed payload and a snippet: an answer needs
        the fused ones only); with one channel, its hits. ``context``: the last query is the question the others
        came from (see :meth:`search_many`); it is not answered itself."""
        flt, by_doc = prepared
        channels = vectors.channels()
        depth = self.candidate_k if len(channels) > 1 else limit
        requests: list[models.QueryRequest] = []
        slots: list[tuple[int, Channel, bool]] = []  # (query, channel, on figure points)
        for i in range(len(queries)):
            for channel in channels:
                request = self._request(channel, vectors, i, flt, depth)
                if request is not None:  # a question with no lexical term (only stop words) has no lexical query
                    slots.append((i, channel, channel is Channel.FIGURE))
                    requests.append(request)
                if channel is Channel.IMAGE:  # the same query on the figure crops' image vectors
                    slots.append((i, channel, True))
                    requests.append(self._request(channel, vectors, i, _on_figures(flt), depth))
        responses = await self.client.query_batch_points(self.collection, requests=requests) if requests else []
        ranked: list[dict[Channel, list[models.ScoredPoint]]] = [{} for _ in queries]
        found: list[dict[Any, int]] = [{} for _ in queries]  # per query: page id -> the figure a channel found on it
        by_image: list[dict[Any, int]] = [{} for _ in queries]
        for (i, channel, figures), response in zip(slots, responses):
            if channel is Channel.FIGURE:
                ranked[i][channel], found[i] = _as_pages(response.points)
            elif figures:  # after the pages' request of the same channel and query
                ranked[i][channel], by_image[i] = _with_figures(ranked[i][channel], response.points)
            else:
                ranked[i][channel] = response.points
        for f, image in zip(found, by_image):
            for page_id, figure in image.items():
                f.setdefault(page_id, figure)  # the figure channel's (text) naming first
        if not any(p for r in ranked for ps in r.values() for p in ps) and not by_doc:
            await self._check_not_empty()  # emptied since the first check (e.g. `mmrag index reset`)
        around: list[tuple[float, models.ScoredPoint]] = []
        if context:
            around = self.fusion.fuse(ranked.pop())
            queries, found = queries[:-1], found[:-1]
        own = channels if every or len(channels) == 1 else []
        out = {c: [_hits([(p.score, p) for p in r.get(c, [])], q, limit, depth, f)
                   for q, r, f in zip(queries, ranked, found)] for c in own}
        out.pop(Channel.CAPTION, None)  # parts of the fusion, not channels to search alone
        out.pop(Channel.FIGURE, None)
        if len(channels) > 1:
            out[Channel.HYBRID] = [_hits(_with_context(self.fusion.fuse(r), around), q, limit, depth, f)
                                   for q, r, f in zip(queries, ranked, found)]
        else:  # HYBRID with every other channel weighted 0: the one channel left is the fusion
            out[Channel.HYBRID] = out[channels[0]]
        return out

    def embed_queries(self, queries: list[str], channels: Channel = Channel.HYBRID) -> QueryVectors:
        """Query vectors per channel (those not asked, or off, left None; a channel weighted 0 in the fusion is
        not asked under HYBRID). Blocking torch work: call it via asyncio.to_thread."""
        channels = Channel(channels)
        texts = [normalise(q) for q in queries]

        def asked(channel: Channel) -> bool:
            return channels is channel or (channels is Channel.HYBRID and self.fusion.weight(channel) > 0)

        out = QueryVectors()
        if asked(Channel.TEXT):
            out.text = self._dense(texts)
        if asked(Channel.LEXICAL):
            out.lexical = [self.lexical.query(t) for t in texts]
        if channels is Channel.HYBRID and self.fusion.weight(Channel.CAPTION) > 0:
            out.caption = [figure_query(t) for t in texts]
        if channels is Channel.HYBRID and self.fusion.weight(Channel.FIGURE) > 0:
            out.figure = out.text if out.text is not None else self._dense(texts)
        if asked(Channel.IMAGE) and self.image_embedder is not None:
            out.image = self.image_embedder.embed_text(texts)
        if asked(Channel.IMAGE) and self.late is not None:
            out.late = self.late.embed_queries(texts)
        if not out.channels():  # HYBRID with every channel weighted 0: still answer, by dense text
            out.text = self._dense(texts)
        return out

    def _dense(self, texts: list[str]) -> np.ndarray:
        """The dense vectors of ``texts``, those of the last QUERY_MEMO texts remembered: a repeated question
        (a FAQ, a polling dashboard, the answer cache's hits) is searched without a text-encoder forward, and with
        the very vectors it had, so it finds the very pages again (a text embedded in another batch can differ in
        its last float bits). Thread-safe: embed_queries runs in worker threads."""
        with self._memo_lock:
            known = {t: self._memo[t] for t in dict.fromkeys(texts) if t in self._memo}
            for t in known:
                self._memo.move_to_end(t)
        missing = [t for t in dict.fromkeys(texts) if t not in known]
        if missing:
            fresh = dict(zip(missing, self.text_embedder.embed(missing)))
            with self._memo_lock:
                for t, v in fresh.items():
                    self._memo[t] = v
                    self._memo.move_to_end(t)
                while len(self._memo) > QUERY_MEMO:
                    self._memo.popitem(last=False)
            known.update(fresh)
        if not texts:
            return self.text_embedder.embed([])
        return np.stack([known[t] for t in texts])

    def _request(self, channel: Channel, vectors: QueryVectors, i: int, flt: models.Filter, limit: int
                 ) -> models.QueryRequest | None:
        common: dict[str, Any] = {"filter": flt, "limit": limit, "with_payload": True}
        if channel is Channel.TEXT:
            return models.QueryRequest(query=vectors.text[i].tolist(), using=TEXT_VECTOR, **common)
        if channel is Channel.FIGURE:  # the pages' conditions (_prepare), on figure points instead of pages
            return models.QueryRequest(query=vectors.figure[i].tolist(), using=TEXT_VECTOR,
                                       **{**common, "filter": _on_figures(flt)})
        if channel in (Channel.LEXICAL, Channel.CAPTION):
            indices, values = (vectors.lexical if channel is Channel.LEXICAL else vectors.caption)[i]
            if not indices:
                return None
            return models.QueryRequest(query=models.SparseVector(indices=indices, values=values), using=LEXICAL_VECTOR,
                                       **common)
        if vectors.image is not None:
            return models.QueryRequest(query=vectors.image[i].tolist(), using=IMAGE_VECTOR, **common)
        multi = vectors.late[i]
        # Two stages, as Qdrant documents for multi-vectors: the pooled single vector prefetches, MaxSim re-ranks
        # only the prefetched pages (the multi-vectors have no HNSW graph of their own).
        return models.QueryRequest(
            prefetch=[models.Prefetch(query=mean_pool(multi).tolist(), using=PAGE_MEAN_VECTOR, filter=flt,
                                      limit=max(self.page_prefetch, limit))],
            query=multi.tolist(), using=PAGE_VECTOR, **common,
        )

    async def _check_collection(self) -> None:
        """Once per searcher: fail loudly on a missing or empty collection or on embedder sizes it lacks."""
        if self._checked:
            return
        if not await self.client.collection_exists(self.collection):
            raise NoDocumentsError(
                f"no documents are indexed (Qdrant collection {self.collection!r} does not exist): "
                "run `mmrag ingest PATH...` first"
            )
        await self._check_not_empty()
        config = (await self.client.get_collection(self.collection)).config.params
        want = {TEXT_VECTOR: self.text_embedder.dim}
        if self.image_embedder is not None:
            want[IMAGE_VECTOR] = self.image_embedder.dim
        if self.late is not None:
            want |= {PAGE_VECTOR: self.late.dim, PAGE_MEAN_VECTOR: self.late.dim}
        try:
            check_vectors(self.collection, config.vectors, want, exact=False)
        except IndexConfigError as exc:
            raise RetrievalError(str(exc)) from exc
        if LEXICAL_VECTOR not in (config.sparse_vectors or {}):
            raise RetrievalError(
                f"Qdrant collection {self.collection!r} was built before the lexical channel (no sparse vector "
                f"{LEXICAL_VECTOR!r}): re-create it with `mmrag index reset --yes` and ingest again"
            )
        channel_vector = IMAGE_VECTOR if self.image_embedder is not None else PAGE_VECTOR
        if self.image_channel and not await self._count(
            models.Filter(must=[models.HasVectorCondition(has_vector=channel_vector)])
        ):
            raise ImageChannelOffError(
                f"the page-image channel is on ({self.image_channel_name}), but no indexed page has its vector "
                f"{channel_vector!r}: re-ingest with the same MMRAG_PAGE_RETRIEVER / MMRAG_CLIP_* settings "
                "(`mmrag ingest PATH...`), or turn the channel off"
            )
        stale, total = await self.stale_pages()
        if stale and stale == total:
            raise StaleIndexError(
                f"all {total} indexed pages were encoded by another vision encoder than the configured one "
                f"({self.encoder}), so none can be served: {STALE_PAGES_FIX}"
            )
        self._checked = True

    async def stale_pages(self) -> tuple[int, int]:
        """(pages another encoder than ``encoder`` made, all pages): the former are never retrieved. Logs a
        warning with the count and the fix when there are any (again only when the counts change)."""
        if self._scope is None or not await self.client.collection_exists(self.collection):
            return 0, 0
        counts = tuple(await asyncio.gather(self._count(models.Filter(must_not=[self._scope, IS_FIGURE])),
                                            self._count(models.Filter(must_not=[IS_FIGURE]))))
        if counts[0] and counts != self._warned:
            log.warning("%d of %d indexed pages were encoded by another vision encoder than the configured one "
                        "(%s): they are excluded from retrieval and their tokens are never fed to the model. "
                        "Fix: %s", *counts, self.encoder, STALE_PAGES_FIX)
        self._warned = counts
        return counts

    async def _check_not_empty(self) -> None:
        if not await self._count(None):
            self._checked = False
            raise NoDocumentsError(
                f"no documents are indexed (Qdrant collection {self.collection!r} is empty): "
                "run `mmrag ingest PATH...` first"
            )

    async def _count(self, flt: models.Filter | None) -> int:
        return (await self.client.count(self.collection, count_filter=flt, exact=True)).count

    async def _doc_filter(self, names: Sequence[str]) -> models.Filter:
        """Pages of the named documents (file name or doc id); every name must be indexed."""
        wanted = list(dict.fromkeys(names))
        by_name, by_id = await asyncio.gather(
            self._facet(PageField.DOC, wanted, len(wanted)), self._facet(PageField.DOC_ID, wanted, len(wanted))
        )
        unknown = [n for n in wanted if n not in by_name and n not in by_id]
        if unknown:
            known = sorted(await self._facet(PageField.DOC, None, KNOWN_DOCS_SHOWN))
            raise UnknownDocumentError(
                f"no indexed document is named {', '.join(map(repr, unknown))} (by file name or doc id). "
                f"Indexed documents include: {', '.join(known) or 'none'}. "
                "Check `mmrag index stats`, or ingest the file first"
            )
        return models.Filter(should=[
            models.FieldCondition(key=PageField.DOC.value, match=models.MatchAny(any=wanted)),
            models.FieldCondition(key=PageField.DOC_ID.value, match=models.MatchAny(any=wanted)),
        ])

    async def _facet(self, field: PageField, values: list[str] | None, limit: int) -> set[str]:
        flt = None if values is None else models.Filter(
            must=[models.FieldCondition(key=field.value, match=models.MatchAny(any=values))]
        )
        found = await self.client.facet(self.collection, key=field.value, facet_filter=flt, limit=limit, exact=True)
        return {str(h.value) for h in found.hits}


def _with_context(fused: list[tuple[float, models.ScoredPoint]], around: list[tuple[float, models.ScoredPoint]]
                  ) -> list[tuple[float, models.ScoredPoint]]:
    """A query's fused ranking plus CONTEXT_WEIGHT x its question's, best first (ties by point id)."""
    if not around:
        return fused
    total = {p.id: (score, p) for score, p in fused}
    for score, p in around:
        mine, point = total.get(p.id, (0.0, p))
        total[p.id] = (mine + CONTEXT_WEIGHT * score, point)
    return sorted(total.values(), key=lambda sp: (-sp[0], str(sp[1].id)))


def figure_query(text: str) -> tuple[list[int], list[float]]:
    """The caption channel's sparse query: the figure#N / table#N tokens (mmrag/adapters/lexical.py) of every figure,
    table or listing the question names, weight 1 each; empty when it names none."""
    indices = sorted({token_index(special_token(kind, number)) for kind, number in figure_refs(text)})
    return indices, [1.0] * len(indices)


def _hits(scored: list[tuple[float, models.ScoredPoint]], query: str, limit: int, depth: int,
          found: Mapping[Any, int] | None = None) -> list[Hit]:
    """The first ``limit`` of a query's candidates (best first) as hits, each with its margin over the median
    score of the first ``depth`` (Hit.margin; for fused hits, as deep as each channel was asked) and the figure
    the figure channel ``found`` on its page."""
    median = float(np.median([s for s, _ in scored[:depth]])) if scored else 0.0
    found = found or {}
    return [Hit.of(PagePayload.from_qdrant(p.payload), float(s), query, margin=float(s) - median,
                   found=found.get(p.id)) for s, p in scored[:limit]]


def _as_pages(points: list[models.ScoredPoint], named_from: float = FIGURE_NAMING_MIN_SIMILARITY
              ) -> tuple[list[models.ScoredPoint], dict[Any, int]]:
    """Figure points (best first) as their pages: each page once, at its best figure's score (the payload is
    the page's own, mmrag/core/payload.py figure_payload), and which figure that was where it is close enough to the
    query to be named (score >= ``named_from``)."""
    pages: list[models.ScoredPoint] = []
    seen: set[Any] = set()
    found: dict[Any, int] = {}
    for p in points:
        parent = (p.payload or {}).get(FIGURE_PARENT)
        if parent is None or parent in seen:
            continue
        seen.add(parent)
        if p.score >= named_from:
            found[parent] = int(p.payload[FIGURE_INDEX])
        pages.append(p.model_copy(update={"id": parent}))
    return pages, found


def _on_figures(flt: models.Filter) -> models.Filter:
    """The pages' conditions (_prepare: encoder scope, documents), on figure points instead of pages."""
    return models.Filter(must=[*(flt.must or []), IS_FIGURE])


def _with_figures(pages: list[models.ScoredPoint], figures: list[models.ScoredPoint]
                  ) -> tuple[list[models.ScoredPoint], dict[Any, int]]:
    """The page-image channel over pages and their figure crops (issue 26): each page at the better of its own
    score and its best crop's, best first, as deep as the two requests were; a page is found by its figure (the
    figure named) where the crop scores at least the whole page. No absolute threshold, unlike the figure
    channel's: CLIP's and the late retriever's scores have no fixed scale, but a crop that matches the query
    better than its page is what the page was found for."""
    by_page = {p.id: p for p in pages}
    crops, best = _as_pages(figures, named_from=-math.inf)  # each page once, at its best crop
    named: dict[Any, int] = {}
    for crop in crops:
        page = by_page.get(crop.id)
        if page is None or crop.score >= page.score:
            by_page[crop.id] = crop
            named[crop.id] = best[crop.id]
    merged = sorted(by_page.values(), key=lambda p: -p.score)
    return merged[:max(len(pages), len(figures))], named


_WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9'\-]*")
_STOPWORDS = frozenset(
    "a an and are as at be by did do does for from has have how in is it its of on or the this to was "
    "were what when where which who whom why will with".split()
)


def make_snippet(text: str, query: str, width: int = SNIPPET_CHARS) -> str:
    """About ``width`` chars of ``text``: the window holding most distinct query words, else the start."""
    flat = " ".join(text.split())
    if len(flat) <= width:
        return flat
    terms = {_stem(w) for w in _WORD.findall(query) if len(w) > 2 and w.lower() not in _STOPWORDS}
    found = [(m.start(), stem) for m in _WORD.finditer(flat) if (stem := _stem(m.group())) in terms]
    lead = width // 5  # begin a little before the first matching word, so the phrase reads in context
    start, best = 0, (0, 0)
    for i, (pos, _) in enumerate(found):
        inside = list(itertools.takewhile(lambda f: f[0] + len(f[1]) < pos + width - lead, found[i:]))
        # Most distinct query words; among equals the tightest cluster (it sits mid-window, not cut at the end).
        score = (len({w for _, w in inside}), pos - inside[-1][0])
        if score > best:
            start, best = max(pos - lead, 0), score
    start = min(start, len(flat) - width)  # near the end: shift back to fill the window
    start = flat.rfind(" ", 0, start + 1) + 1  # on a word boundary (0 stays 0)
    end = flat.rfind(" ", start, start + width + 1)
    end = start + width if end <= start else end
    return ("…" if start else "") + flat[start:end] + ("…" if end < len(flat) else "")


def _stem(word: str) -> str:
    """Crude, but enough to match "shortened" to "shorten" and "revenues" to "revenue" in a snippet."""
    return word.lower()[:6]
