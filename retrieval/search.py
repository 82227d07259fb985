"""Page search over the Qdrant index: text, image or both channels fused with reciprocal-rank fusion.

Async end to end: query embedding is CPU-bound torch work and runs in a worker thread
(``asyncio.to_thread``), and all sub-questions of a request go to Qdrant in ONE ``query_batch_points``
round trip. A hybrid query is one request per sub-question: a prefetch on ``text`` and one on ``image``
(each ``candidate_k`` deep), fused server-side with RRF and cut to ``top_k``.

Local mode (``AsyncQdrantClient(path=...)``) is qdrant-client's in-process engine behind async methods:
it computes on the calling thread, so a local-mode search holds the event loop for its duration (a few ms
at 10k pages, see ``mmrag retrieval latency``). A Qdrant server (``MMRAG_QDRANT_URL``) makes it real I/O.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from qdrant_client import AsyncQdrantClient, models

from adapters.embed import ImageEmbedder, TextEmbedder
from adapters.qdrant import IndexConfigError, check_vectors, scope_filter
from core.keys import ImageKey
from core.payload import IMAGE_VECTOR, STALE_PAGES_FIX, TEXT_VECTOR, EncoderScope, PageField, PagePayload

log = logging.getLogger(__name__)

SNIPPET_CHARS = 200
KNOWN_DOCS_SHOWN = 10


class Channel(str, enum.Enum):
    TEXT = "text"  # page text vs. the question (MiniLM)
    IMAGE = "image"  # page image vs. the question through CLIP's text tower
    HYBRID = "hybrid"  # both, fused with RRF; text only when the image channel is off


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

    @classmethod
    def of(cls, page: PagePayload, score: float, query: str) -> Hit:
        return cls(page_id=page.page_id, doc_id=page.doc_id, doc=page.doc, page=page.page, score=score,
                   snippet=make_snippet(page.text, query), image_key=page.image_key,
                   image_tokens=page.image_tokens, path=page.path, text=page.text)


class PageSearcher:
    def __init__(
        self,
        client: AsyncQdrantClient,
        collection: str,
        text_embedder: TextEmbedder,
        image_embedder: ImageEmbedder | None,
        *,
        top_k: int = 3,
        candidate_k: int = 20,
        encoder: EncoderScope | None = None,
    ) -> None:
        """``encoder``: the encoder whose image tokens the caller will feed to the VLM. Pages outside it are
        never returned (a payload filter in every query), so stale tokens cannot reach a prompt after an
        upgrade; None returns every page (the retrieval evaluations, which feed no VLM)."""
        if not 0 < top_k <= candidate_k:
            raise ValueError(f"need 0 < top_k <= candidate_k, got top_k={top_k}, candidate_k={candidate_k}")
        self.client = client
        self.collection = collection
        self.text_embedder = text_embedder
        self.image_embedder = image_embedder
        self.top_k = top_k
        self.candidate_k = candidate_k
        self.encoder = encoder
        self._scope = None if encoder is None else scope_filter(encoder)
        self._warned = (0, 0)  # the stale/total counts last warned about
        self._checked = False  # the collection exists, has pages and matches the embedders

    @property
    def image_channel(self) -> bool:
        return self.image_embedder is not None

    async def search_many(
        self,
        queries: list[str],
        *,
        doc_filter: list[str] | None = None,
        top_k: int | None = None,
        channels: Channel = Channel.HYBRID,
    ) -> list[list[Hit]]:
        """The best pages for each query, best first, in one Qdrant round trip for all of them."""
        if not queries:
            return []
        channels = Channel(channels)
        if channels is Channel.IMAGE and not self.image_channel:
            raise ImageChannelOffError(
                "image-only search was asked for, but the image channel is off: set MMRAG_CLIP_WEIGHTS to a "
                "local open_clip weights file and re-ingest, or search the text channel"
            )
        prepared = await self._prepare(doc_filter)  # before embedding: a bad filter fails fast
        text_vecs, image_vecs = await asyncio.to_thread(self.embed_queries, queries, channels)
        return await self._query(queries, text_vecs, image_vecs, prepared, top_k or self.top_k)

    async def search_vectors(
        self,
        queries: list[str],
        text_vecs: np.ndarray | None,
        image_vecs: np.ndarray | None,
        *,
        doc_filter: list[str] | None = None,
        top_k: int | None = None,
    ) -> list[list[Hit]]:
        """``search_many`` for queries embedded already (one row per query; the channels are the vectors
        given: both means hybrid). ``queries`` only shape the snippets. One Qdrant round trip."""
        if text_vecs is None and image_vecs is None:
            raise ValueError("search_vectors needs text vectors, image vectors or both")
        prepared = await self._prepare(doc_filter)
        return await self._query(queries, text_vecs, image_vecs, prepared, top_k or self.top_k)

    async def search(self, query: str, **kwargs: Any) -> list[Hit]:
        return (await self.search_many([query], **kwargs))[0]

    async def _prepare(self, doc_filter: list[str] | None) -> tuple[models.Filter | None, bool]:
        """The query filter (encoder scope and documents), and whether documents were named."""
        await self._check_collection()
        must = [self._scope] if self._scope is not None else []
        if doc_filter:
            must.append(await self._doc_filter(doc_filter))
        return (models.Filter(must=must) if must else None), bool(doc_filter)

    async def _query(self, queries: list[str], text_vecs: np.ndarray | None, image_vecs: np.ndarray | None,
                     prepared: tuple[models.Filter | None, bool], limit: int) -> list[list[Hit]]:
        flt, by_doc = prepared
        requests = [
            self._request(t, i, flt, limit)
            for t, i in zip(_rows(text_vecs, len(queries)), _rows(image_vecs, len(queries)))
        ]
        responses = await self.client.query_batch_points(self.collection, requests=requests)
        if not any(r.points for r in responses) and not by_doc:
            await self._check_not_empty()  # emptied since the first check (e.g. `mmrag index reset`)
        return [
            sorted((_hit(p, q) for p in r.points), key=lambda h: h.score, reverse=True)
            for q, r in zip(queries, responses)
        ]

    def embed_queries(self, queries: list[str], channels: Channel) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Query vectors per channel (None where unused). Blocking torch work: call it via asyncio.to_thread."""
        text = self.text_embedder.embed(queries) if channels is not Channel.IMAGE else None
        image = None
        if channels is not Channel.TEXT and self.image_embedder is not None:
            image = self.image_embedder.embed_text(queries)
        return text, image

    def _request(self, text_vec: np.ndarray | None, image_vec: np.ndarray | None, flt: models.Filter | None,
                 limit: int) -> models.QueryRequest:
        common: dict[str, Any] = {"filter": flt, "limit": limit, "with_payload": True}
        if text_vec is not None and image_vec is not None:
            return models.QueryRequest(
                prefetch=[
                    models.Prefetch(query=text_vec.tolist(), using=TEXT_VECTOR, limit=self.candidate_k),
                    models.Prefetch(query=image_vec.tolist(), using=IMAGE_VECTOR, limit=self.candidate_k),
                ],
                query=models.FusionQuery(fusion=models.Fusion.RRF),
                **common,
            )
        # One channel: TEXT, IMAGE, or HYBRID with the image channel off (which is plain text search).
        vec, using = (text_vec, TEXT_VECTOR) if text_vec is not None else (image_vec, IMAGE_VECTOR)
        return models.QueryRequest(query=vec.tolist(), using=using, **common)

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
        params = (await self.client.get_collection(self.collection)).config.params.vectors
        want = {TEXT_VECTOR: self.text_embedder.dim}
        if self.image_embedder is not None:
            want[IMAGE_VECTOR] = self.image_embedder.dim
        try:
            check_vectors(self.collection, params, want, exact=False)
        except IndexConfigError as exc:
            raise RetrievalError(str(exc)) from exc
        if self.image_embedder is not None and not await self._count(
            models.Filter(must=[models.HasVectorCondition(has_vector=IMAGE_VECTOR)])
        ):
            raise ImageChannelOffError(
                f"the image channel is on ({self.image_embedder.name}), but no indexed page has an image "
                "vector: re-ingest with the same MMRAG_CLIP_* settings (`mmrag ingest PATH...`), or turn "
                "the image channel off"
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
        counts = tuple(await asyncio.gather(self._count(models.Filter(must_not=[self._scope])), self._count(None)))
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


def _rows(vecs: np.ndarray | None, n: int) -> list[np.ndarray | None]:
    return [None] * n if vecs is None else list(vecs)


def _hit(point: models.ScoredPoint, query: str) -> Hit:
    return Hit.of(PagePayload.from_qdrant(point.payload), float(point.score), query)


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
