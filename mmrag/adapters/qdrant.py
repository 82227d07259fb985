"""Qdrant access: the page index, one point per page with named vectors ``text`` and ``image``.

The collection is created explicitly with sizes from the embedders' configs, and checked on every open:
a mismatch stops with a message that names the fix instead of writing vectors of the wrong shape. Points
carry a :class:`mmrag.core.payload.PagePayload`; this module is the only one that scrolls the collection, once
for the sync client (ingestion, CLI) and once for the async client (the server's readers).
"""

from __future__ import annotations

import asyncio
import fcntl
from collections import defaultdict
from collections.abc import Coroutine, Mapping
from pathlib import Path
from typing import Any, TypeVar

from qdrant_client import AsyncQdrantClient, QdrantClient, models

from mmrag.adapters import qdrant_local
from mmrag.core.keys import ImageKey, figure_point_id
from mmrag.core.payload import (
    FIGURE_KIND,
    FIGURE_PARENT,
    IMAGE_VECTOR,
    LEXICAL_VECTOR,
    PAGE_MEAN_VECTOR,
    PAGE_VECTOR,
    TEXT_VECTOR,
    EncoderScope,
    PageField,
    PagePayload,
    encoder_fields_of,
)

# Local mode's sparse scoring is pure Python per point; the lexical channel needs it as a matrix product.
qdrant_local.install()

# Payload fields that readers filter on get an index (keyword or integer) on a Qdrant server.
PAYLOAD_INDEXES: dict[PageField, models.PayloadSchemaType] = {
    PageField.DOC_ID: models.PayloadSchemaType.KEYWORD,
    PageField.DOC: models.PayloadSchemaType.KEYWORD,
    PageField.PAGE: models.PayloadSchemaType.INTEGER,
    PageField.CONTENT_HASH: models.PayloadSchemaType.KEYWORD,
    PageField.TEXT_SOURCE: models.PayloadSchemaType.KEYWORD,
    PageField.ENCODER_VERSION: models.PayloadSchemaType.KEYWORD,
    PageField.RESOLUTION_POLICY: models.PayloadSchemaType.KEYWORD,
    PageField.KIND: models.PayloadSchemaType.KEYWORD,
}
# Figure points (mmrag/core/payload.py PageField.KIND) beside the pages: every page reader and count leaves them out.
IS_FIGURE = models.FieldCondition(key=PageField.KIND.value, match=models.MatchValue(value=FIGURE_KIND))
PAGES_ONLY = models.Filter(must_not=[IS_FIGURE])
SCROLL_BATCH = 256
T = TypeVar("T")


class IndexConfigError(RuntimeError):
    """The index cannot be opened or does not match the configured embedders."""


class IndexLockedError(IndexConfigError):
    pass


def open_qdrant(url: str, path: Path) -> QdrantClient:
    """A Qdrant server when ``url`` is set, otherwise embedded local mode in ``path``."""
    if url:
        return QdrantClient(url=url)
    probe_local_lock(path)
    return QdrantClient(path=str(path))


def open_async_qdrant(url: str, path: Path) -> AsyncQdrantClient:
    """The async sibling of :func:`open_qdrant`, for the server and retrieval."""
    if url:
        return AsyncQdrantClient(url=url)
    probe_local_lock(path)
    return AsyncQdrantClient(path=str(path))


def probe_local_lock(path: Path) -> None:
    """Local mode allows one client per folder (per open file, so per process too). Probe its lock first so a
    second client gets a message that says what to do, instead of qdrant-client's RuntimeError."""
    path.mkdir(parents=True, exist_ok=True)
    with open(path / ".lock", "a+") as probe:
        try:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise IndexLockedError(
                f"the Qdrant folder {path} is in use by another mmrag process (probably `mmrag serve`). "
                "Stop that process, ingest through the server (POST /v1/ingest), or run a Qdrant server "
                "and set MMRAG_QDRANT_URL so several processes can share the index."
            ) from exc
        fcntl.flock(probe, fcntl.LOCK_UN)


class PageIndex:
    def __init__(self, client: QdrantClient, collection: str, *, text_dim: int, image_dim: int, late_dim: int = 0
                 ) -> None:
        """``late_dim``: the late-interaction retriever's token vector size (0: that channel is off)."""
        self.client = client
        self.collection = collection
        self.dims = {TEXT_VECTOR: text_dim, IMAGE_VECTOR: image_dim}
        if late_dim:
            self.dims |= {PAGE_VECTOR: late_dim, PAGE_MEAN_VECTOR: late_dim}

    def ensure_collection(self) -> None:
        if not self.client.collection_exists(self.collection):
            self.client.create_collection(
                self.collection,
                vectors_config={name: vector_params(name, dim) for name, dim in self.dims.items()},
                sparse_vectors_config={LEXICAL_VECTOR: models.SparseVectorParams(modifier=models.Modifier.IDF)},
            )
            self._index_payload(PAYLOAD_INDEXES)
            return
        info = self.client.get_collection(self.collection)
        check_vectors(self.collection, info.config.params.vectors, self.dims, exact=True)
        if LEXICAL_VECTOR not in (info.config.params.sparse_vectors or {}):
            raise IndexConfigError(
                f"Qdrant collection {self.collection!r} was built before the lexical channel (it has no sparse "
                f"vector {LEXICAL_VECTOR!r}): re-create it with `mmrag index reset --yes` and ingest again, or set "
                "MMRAG_QDRANT_COLLECTION to a new collection"
            )
        # A collection written by an older mmrag lacks the fields added since (the encoder fields) and their
        # indexes: added here, once, so its pages are served again without re-ingesting.
        self._index_payload({f: t for f, t in PAYLOAD_INDEXES.items() if f.value not in (info.payload_schema or {})})
        self.backfill_encoder_fields()

    def backfill_encoder_fields(self) -> int:
        """Give pages written before the encoder fields existed those fields, derived from their image key;
        one set_payload per encoder. Returns the pages changed."""
        lacking = models.Filter(should=[
            models.IsEmptyCondition(is_empty=models.PayloadField(key=f.value))
            for f in (PageField.ENCODER_VERSION, PageField.RESOLUTION_POLICY)
        ])
        by_fields: dict[tuple[tuple[str, str], ...], list[Any]] = defaultdict(list)
        for point in self._scroll(lacking, with_vectors=False):
            by_fields[tuple(sorted(encoder_fields_of(point.payload or {}).items()))].append(point.id)
        for fields, ids in by_fields.items():
            self.client.set_payload(self.collection, payload=dict(fields), points=ids, wait=True)
        return sum(map(len, by_fields.values()))

    def _index_payload(self, indexes: Mapping[PageField, models.PayloadSchemaType]) -> None:
        if is_local(self.client):
            # Local mode keeps no payload indexes (it warns that they have no effect), so its collection never
            # lists them and each request to make one rewrote its whole meta.json: every ingest job, deletion and
            # retry that opened the index rewrote that file once per field, while a copy of the folder (a backup,
            # `mmrag store gc` beside the server) could be reading it. A Qdrant server makes them, for its filters.
            return
        for field, schema in indexes.items():
            self.client.create_payload_index(self.collection, field.value, field_schema=schema)

    def reset(self) -> None:
        self.client.delete_collection(self.collection)
        self.ensure_collection()

    def count(self) -> int:
        """Indexed pages (figure points not counted)."""
        return self.client.count(self.collection, count_filter=PAGES_ONLY, exact=True).count

    def figure_points(self, *, with_vectors: bool = False) -> list[models.Record]:
        """Every figure point as stored."""
        return self._scroll(IS_FIGURE, with_vectors=with_vectors, pages_only=False)

    def doc_pages(self, doc_id: str) -> list[PagePayload]:
        points = self._scroll(_match(PageField.DOC_ID, doc_id), with_vectors=False)
        return sorted((PagePayload.from_qdrant(p.payload) for p in points), key=lambda p: p.page)

    def replace_document(self, doc_id: str, points: list[models.PointStruct]) -> None:
        """Write a document's pages, then drop pages it no longer has (a shorter new version)."""
        if points:
            self.client.upsert(self.collection, points=points, wait=True)
        keep = [p.id for p in points]
        stale = models.Filter(
            must=[_match(PageField.DOC_ID, doc_id)],
            must_not=[models.HasIdCondition(has_id=keep)] if keep else [],
        )
        self.client.delete(self.collection, points_selector=models.FilterSelector(filter=stale), wait=True)

    def delete_document(self, doc_id: str) -> list[PagePayload]:
        """Remove every page of the document; returns the pages removed (none: no such document)."""
        removed = self.doc_pages(doc_id)
        if removed:
            self.client.delete(self.collection, points_selector=models.FilterSelector(
                filter=models.Filter(must=[_match(PageField.DOC_ID, doc_id)])), wait=True)
        return removed

    def referenced_keys(self, base: str | None = None) -> set[ImageKey]:
        """The feature-store keys indexed pages reference (their images and their figure crops): any other entry is garbage (`mmrag store gc`,
        DELETE /v1/documents). With ``base`` (MMRAG_QDRANT_COLLECTION): the pages of every tenant's
        collection, which all share the one feature store."""
        names = [self.collection] if base is None else tenant_collections(self.client, base)
        return {key for name in names for p in self._scroll(None, with_vectors=False, collection=name)
                for key in PagePayload.from_qdrant(p.payload).image_keys}  # a page's, and its figures' (issue 26)

    def find_page(self, doc: str, page: int) -> PagePayload | None:
        """Page ``page`` of the document named ``doc`` (file name or doc id), if indexed."""
        for field in (PageField.DOC, PageField.DOC_ID):
            found = self._scroll(
                models.Filter(must=[_match(field, doc), _match(PageField.PAGE, page)]), with_vectors=False, limit=2
            )
            if found:
                return PagePayload.from_qdrant(found[0].payload)
        return None

    def pages(self) -> list[PagePayload]:
        """Every indexed page."""
        return [PagePayload.from_qdrant(p.payload) for p in self._scroll(None, with_vectors=False)]

    def pages_outside(self, scope: EncoderScope) -> list[PagePayload]:
        """Every page whose image tokens another encoder than ``scope`` made (what `mmrag reencode` redoes)."""
        points = self._scroll(models.Filter(must_not=[scope_filter(scope)]), with_vectors=False)
        return [PagePayload.from_qdrant(p.payload) for p in points]

    def set_page_fields(self, page_id: str, fields: Mapping[str, Any]) -> None:
        """Overwrite these payload fields of one page and of its figure points (which carry its payload), leaving
        their other fields and their vectors as they are."""
        self.client.set_payload(self.collection, payload=dict(fields), wait=True, points=models.FilterSelector(
            filter=models.Filter(should=[models.HasIdCondition(has_id=[page_id]), _match_parent(page_id)])))

    def points(self, *, with_vectors: bool = False) -> list[models.Record]:
        """Every page point as stored (tests and tools that look at vectors; figure points: figure_points)."""
        return self._scroll(None, with_vectors=with_vectors)

    def _scroll(self, condition: models.Condition | models.Filter | None, *, with_vectors: bool,
                limit: int | None = None, collection: str | None = None, pages_only: bool = True
                ) -> list[models.Record]:
        flt = _as_filter(condition)
        if pages_only:
            flt = PAGES_ONLY if flt is None else models.Filter(must=[flt, PAGES_ONLY])
        out: list[models.Record] = []
        offset = None
        while True:
            batch, offset = self.client.scroll(
                collection or self.collection, scroll_filter=flt, limit=limit or SCROLL_BATCH, offset=offset,
                with_payload=True, with_vectors=with_vectors,
            )
            out.extend(batch)
            if offset is None or (limit is not None and len(out) >= limit):
                return out


def tenant_collections(client: QdrantClient | LoopBridge, base: str) -> list[str]:
    """The collections of every tenant (mmrag.core.settings.Settings.tenant_collection): ``base``, ``base--<tenant>``."""
    names = [c.name for c in client.get_collections().collections]
    return sorted(n for n in names if n == base or n.startswith(f"{base}--"))


def is_local(client: Any) -> bool:
    """Whether ``client`` (a QdrantClient, an AsyncQdrantClient, or a :class:`LoopBridge` over one) is embedded
    local mode (a folder, or ``:memory:``) rather than a Qdrant server."""
    inner = client._client if isinstance(client, LoopBridge) else client
    options = getattr(inner, "init_options", None) or {}
    return bool(options.get("path")) or options.get("location") == ":memory:"


class LoopBridge:
    """The sync client calls :class:`PageIndex` makes, run on ``loop`` through an async client.

    Local mode allows one client per folder: the server's ingest jobs (a worker thread) write through the
    server's own async client this way. Only the calls PageIndex makes are here, so a new one is a choice.
    """

    def __init__(self, client: AsyncQdrantClient, loop: asyncio.AbstractEventLoop) -> None:
        self._client = client
        self._loop = loop

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def collection_exists(self, *a: Any, **kw: Any) -> bool:
        return self._run(self._client.collection_exists(*a, **kw))

    def create_collection(self, *a: Any, **kw: Any) -> bool:
        return self._run(self._client.create_collection(*a, **kw))

    def create_payload_index(self, *a: Any, **kw: Any) -> Any:
        return self._run(self._client.create_payload_index(*a, **kw))

    def get_collection(self, *a: Any, **kw: Any) -> models.CollectionInfo:
        return self._run(self._client.get_collection(*a, **kw))

    def get_collections(self) -> models.CollectionsResponse:
        return self._run(self._client.get_collections())

    def delete_collection(self, *a: Any, **kw: Any) -> bool:
        return self._run(self._client.delete_collection(*a, **kw))

    def count(self, *a: Any, **kw: Any) -> models.CountResult:
        return self._run(self._client.count(*a, **kw))

    def scroll(self, *a: Any, **kw: Any) -> tuple[list[models.Record], Any]:
        return self._run(self._client.scroll(*a, **kw))

    def upsert(self, *a: Any, **kw: Any) -> models.UpdateResult:
        return self._run(self._client.upsert(*a, **kw))

    def delete(self, *a: Any, **kw: Any) -> models.UpdateResult:
        return self._run(self._client.delete(*a, **kw))

    def set_payload(self, *a: Any, **kw: Any) -> models.UpdateResult:
        return self._run(self._client.set_payload(*a, **kw))


class AsyncPageReader:
    """Read-only page access over the async client (the REST service and warm-up at start-up)."""

    def __init__(self, client: AsyncQdrantClient, collection: str) -> None:
        self.client = client
        self.collection = collection

    async def pages(self) -> list[PagePayload]:
        """Every indexed page (none when nothing was ingested yet)."""
        if not await self.client.collection_exists(self.collection):
            return []
        out: list[PagePayload] = []
        offset = None
        while True:
            batch, offset = await self.client.scroll(self.collection, scroll_filter=PAGES_ONLY, limit=SCROLL_BATCH,
                                                     offset=offset, with_payload=True, with_vectors=False)
            out.extend(PagePayload.from_qdrant(p.payload) for p in batch)
            if offset is None:
                return out

    async def get(self, page_id: str) -> PagePayload | None:
        if not await self.client.collection_exists(self.collection):
            return None
        found = await self.client.retrieve(self.collection, ids=[page_id], with_payload=True)
        return PagePayload.from_qdrant(found[0].payload) if found else None


def check_vectors(collection: str, params: models.VectorParams | Mapping[str, models.VectorParams],
                  want: Mapping[str, int], *, exact: bool) -> None:
    """The collection's named vector sizes against what the configured embedders make.

    ``exact``: writers need exactly these vectors; readers only the ones they query with.
    """
    have = {name: p.size for name, p in params.items()} if isinstance(params, Mapping) else {"": params.size}
    wrong = have != dict(want) if exact else any(have.get(name) != dim for name, dim in want.items())
    if wrong:
        raise IndexConfigError(
            f"Qdrant collection {collection!r} has vectors {have}, but the configured embedders need "
            f"{dict(want)}. Re-create it with `mmrag index reset --yes` and ingest again, or set "
            "MMRAG_QDRANT_COLLECTION to the collection these embedders wrote."
        )


def vector_params(name: str, dim: int) -> models.VectorParams:
    """A named dense vector's parameters. The late-interaction ``page`` multi-vector is scored by MaxSim and only
    re-ranks what ``page_mean`` prefetched, so it gets no HNSW graph (m=0), as Qdrant advises for multi-vectors."""
    if name == PAGE_VECTOR:
        return models.VectorParams(
            size=dim, distance=models.Distance.COSINE, hnsw_config=models.HnswConfigDiff(m=0),
            multivector_config=models.MultiVectorConfig(comparator=models.MultiVectorComparator.MAX_SIM),
        )
    return models.VectorParams(size=dim, distance=models.Distance.COSINE)


def make_point(vectors: dict[str, Any], payload: PagePayload, figure: int | None = None) -> models.PointStruct:
    """A page point, or with ``figure`` the point of the page's figure of that index. ``vectors``: dense rows as
    lists, multi-vectors as lists of rows, and the sparse lexical vector as an ``(indices, values)`` pair."""
    named = {name: models.SparseVector(indices=v[0], values=v[1]) if name == LEXICAL_VECTOR else v
             for name, v in vectors.items()}
    if figure is None:
        return models.PointStruct(id=payload.page_id, vector=named, payload=payload.to_qdrant())
    return models.PointStruct(id=figure_point_id(payload.page_id, figure), vector=named,
                              payload=payload.figure_payload(figure))


def scope_filter(scope: EncoderScope) -> models.Filter:
    """Pages whose image tokens the encoder ``scope`` names made (indexed keyword fields on a server)."""
    return models.Filter(must=[
        models.FieldCondition(key=name, match=models.MatchValue(value=value))
        for name, value in scope.payload_match().items()
    ])


def _as_filter(condition: models.Condition | models.Filter | None) -> models.Filter | None:
    return condition if isinstance(condition, models.Filter) or condition is None else models.Filter(must=[condition])


def _match_parent(page_id: str) -> models.FieldCondition:
    return models.FieldCondition(key=FIGURE_PARENT, match=models.MatchValue(value=page_id))


def _match(field: PageField, value: str | int) -> models.FieldCondition:
    return models.FieldCondition(key=field.value, match=models.MatchValue(value=value))
