from __future__ import annotations

import asyncio
import io
import uuid
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import Response

from ingestion.loaders import IngestError, open_document
from serving.api.deps import AuthDep, ServicesDep
from serving.api.errors import ApiError

router = APIRouter(prefix="/v1", tags=["documents"], dependencies=[AuthDep])


@router.get("/documents", summary="Ingested documents with their page counts")
async def documents(services: ServicesDep) -> dict:
    client, collection = services.qdrant, services.settings.qdrant_collection
    if not await client.collection_exists(collection):
        return {"documents": []}
    docs: dict[str, dict] = {}
    offset = None
    while True:
        points, offset = await client.scroll(collection, limit=512, offset=offset, with_payload=[
            "doc_id", "doc", "path", "num_pages"])
        for p in points:
            d = docs.setdefault(p.payload["doc_id"], {k: p.payload[k] for k in ("doc_id", "doc", "path", "num_pages")})
            d["indexed_pages"] = d.get("indexed_pages", 0) + 1
        if offset is None:
            break
    return {"documents": sorted(docs.values(), key=lambda d: (d["doc"], d["doc_id"]))}


async def _page(services, page_id: str) -> dict:
    try:
        uuid.UUID(page_id)
    except ValueError:
        raise ApiError(404, "unknown_page", f"{page_id!r} is not a page id", "page ids come from GET /v1/documents "
                       "and from answers' citations") from None
    found = await services.qdrant.retrieve(services.settings.qdrant_collection, ids=[page_id], with_payload=True)
    if not found:
        raise ApiError(404, "unknown_page", f"no page with id {page_id}", "list pages with GET /v1/documents")
    return {"id": page_id, **found[0].payload}


@router.get("/pages/{page_id}", summary="A page's metadata and text")
async def page(page_id: str, services: ServicesDep) -> dict:
    payload = await _page(services, page_id)
    return {k: payload[k] for k in ("id", "doc_id", "doc", "path", "page", "num_pages", "image_key", "image_tokens",
                                     "text", "text_source", "width", "height")}


@router.get("/pages/{page_id}/image", summary="The page image (PNG), rendered from its source file",
            response_class=Response)
async def page_image(page_id: str, services: ServicesDep) -> Response:
    payload = await _page(services, page_id)
    png = await asyncio.to_thread(_render_png, Path(payload["path"]), payload["page"], services.settings)
    return Response(png, media_type="image/png")


def _render_png(path: Path, number: int, settings) -> bytes:
    try:
        with open_document(path, settings.model_copy(update={"ocr": False})) as doc:
            for rendered in doc.pages():
                if rendered.page == number:
                    buf = io.BytesIO()
                    rendered.image.save(buf, format="PNG")
                    return buf.getvalue()
    except (IngestError, FileNotFoundError) as exc:
        raise ApiError(410, "source_gone", f"cannot render {path}: {exc}", "re-ingest the document") from exc
    raise ApiError(410, "source_gone", f"{path} no longer has page {number}", "re-ingest the document")
