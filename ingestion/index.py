"""The page index in Qdrant: one point per page with named vectors ``text`` and ``image``.

The collection is created explicitly with sizes from the embedders' configs, and checked on every open:
a mismatch stops with a message that names the fix instead of writing vectors of the wrong shape.
"""

from __future__ import annotations

import fcntl
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qdrant_client import QdrantClient, models

from core.keys import ImageKey, page_point_id
from ingestion.embed import IMAGE_VECTOR, TEXT_VECTOR

# Payload fields that retrieval filters on get an index (keyword or integer).
PAYLOAD_INDEXES: dict[str, models.PayloadSchemaType] = {
    "doc_id": models.PayloadSchemaType.KEYWORD,
    "doc": models.PayloadSchemaType.KEYWORD,
    "page": models.PayloadSchemaType.INTEGER,
    "content_hash": models.PayloadSchemaType.KEYWORD,
}


class IndexConfigError(RuntimeError):
    """The index cannot be opened or does not match the configured embedders."""


class IndexLockedError(IndexConfigError):
    pass


@dataclass(slots=True, frozen=True)
class IndexedPage:
    """What the index already holds for one page (enough to decide whether to re-ingest)."""

    page: int
    file_sha256: str
    fingerprint: str
    image_key: str


def open_qdrant(url: str, path: Path) -> QdrantClient:
    """A Qdrant server when ``url`` is set, otherwise embedded local mode in ``path``."""
    if url:
        return QdrantClient(url=url)
    probe_local_lock(path)
    return QdrantClient(path=str(path))


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
    def __init__(self, client: QdrantClient, collection: str, *, text_dim: int, image_dim: int) -> None:
        self.client = client
        self.collection = collection
        self.dims = {TEXT_VECTOR: text_dim, IMAGE_VECTOR: image_dim}

    def ensure_collection(self) -> None:
        if not self.client.collection_exists(self.collection):
            self.client.create_collection(
                self.collection,
                vectors_config={
                    name: models.VectorParams(size=dim, distance=models.Distance.COSINE)
                    for name, dim in self.dims.items()
                },
            )
            with warnings.catch_warnings():
                # Local mode ignores payload indexes (and says so); a Qdrant server uses them for filters.
                warnings.filterwarnings("ignore", message="Payload indexes have no effect in the local Qdrant")
                for field, schema in PAYLOAD_INDEXES.items():
                    self.client.create_payload_index(self.collection, field, field_schema=schema)
            return
        self._check_vectors()

    def _check_vectors(self) -> None:
        params = self.client.get_collection(self.collection).config.params.vectors
        have = {name: p.size for name, p in params.items()} if isinstance(params, dict) else {"": params.size}
        if have != self.dims:
            raise IndexConfigError(
                f"Qdrant collection {self.collection!r} has vectors {have}, but the configured embedders "
                f"need {self.dims}. Re-create it with `mmrag index reset`, or set MMRAG_QDRANT_COLLECTION to "
                "a new name."
            )

    def reset(self) -> None:
        self.client.delete_collection(self.collection)
        self.ensure_collection()

    def count(self) -> int:
        return self.client.count(self.collection, exact=True).count

    def doc_pages(self, doc_id: str) -> list[IndexedPage]:
        points = self._scroll(_match("doc_id", doc_id), with_vectors=False)
        return sorted(
            (
                IndexedPage(p.payload["page"], p.payload["file_sha256"], p.payload["fingerprint"],
                            p.payload["image_key"])
                for p in points
            ),
            key=lambda p: p.page,
        )

    def replace_document(self, doc_id: str, points: list[models.PointStruct]) -> None:
        """Write a document's pages, then drop pages it no longer has (a shorter new version)."""
        if points:
            self.client.upsert(self.collection, points=points, wait=True)
        keep = [p.id for p in points]
        stale = models.Filter(
            must=[_match("doc_id", doc_id)],
            must_not=[models.HasIdCondition(has_id=keep)] if keep else [],
        )
        self.client.delete(self.collection, points_selector=models.FilterSelector(filter=stale), wait=True)

    def find_page(self, doc: str, page: int) -> dict[str, Any] | None:
        """The payload of page ``page`` of the document named ``doc`` (file name or doc id), if indexed."""
        for field in ("doc", "doc_id"):
            found = self._scroll(
                models.Filter(must=[_match(field, doc), _match("page", page)]), with_vectors=False, limit=2
            )
            if found:
                return found[0].payload
        return None

    def image_pages(self) -> list[tuple[ImageKey, int]]:
        """(image key, image tokens) of every indexed page: what warm-up ranks by recurrence."""
        return [
            (ImageKey.parse(p.payload["image_key"]), p.payload["image_tokens"])
            for p in self._scroll(None, with_vectors=False)
        ]

    def all_points(self, *, with_vectors: bool = False) -> list[models.Record]:
        return self._scroll(None, with_vectors=with_vectors)

    def _scroll(self, condition: models.Condition | models.Filter | None, *, with_vectors: bool,
                limit: int | None = None) -> list[models.Record]:
        flt = condition if isinstance(condition, models.Filter) or condition is None else models.Filter(must=[condition])
        out: list[models.Record] = []
        offset = None
        while True:
            batch, offset = self.client.scroll(
                self.collection, scroll_filter=flt, limit=limit or 256, offset=offset,
                with_payload=True, with_vectors=with_vectors,
            )
            out.extend(batch)
            if offset is None or (limit is not None and len(out) >= limit):
                return out


def make_point(doc_id: str, page: int, vectors: dict[str, list[float]], payload: dict[str, Any]) -> models.PointStruct:
    return models.PointStruct(id=page_point_id(doc_id, page), vector=vectors, payload=payload)


def _match(field: str, value: str | int) -> models.FieldCondition:
    return models.FieldCondition(key=field, match=models.MatchValue(value=value))
