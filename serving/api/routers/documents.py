from __future__ import annotations

import asyncio
import io
import uuid
from collections.abc import Iterable
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import Response

from core.payload import PagePayload
from ingestion.loaders import IngestError, open_document
from serving.api.deps import AuthDep, ServicesDep
from serving.api.errors import ApiError
from serving.api.schemas import (
    INVALID_REQUEST,
    PNG_RESPONSE,
    UNAUTHORIZED,
    Document,
    DocumentList,
    DocumentPage,
    Page,
    error_responses,
)

router = APIRouter(prefix="/v1", tags=["documents"], dependencies=[AuthDep], responses=error_responses(UNAUTHORIZED))

PAGE_IDS_FIX = "page ids come from GET /v1/documents (each document's `pages`) and from answers' `citations`"
UNKNOWN_PAGE = {404: "No indexed page has this id (`unknown_page`)."}
INDEX_DOWN = {503: "Qdrant does not answer, or holds pages of another mmrag version (`index_incompatible`)."}
SOURCE_GONE = {410: "The page's source file is gone or changed (`source_gone`): re-ingest it."}
PAGE_ERRORS = {**UNKNOWN_PAGE, **INDEX_DOWN, **INVALID_REQUEST}


@router.get("/documents", summary="Ingested documents with their pages and page ids",
            response_model=DocumentList, responses=error_responses(INDEX_DOWN))
async def documents(services: ServicesDep) -> DocumentList:
    pages = await services.pages.pages()
    return DocumentList(documents=sorted(_by_document(pages), key=lambda d: (d.doc, d.doc_id)))


def _by_document(pages: Iterable[PagePayload]) -> list[Document]:
    grouped: dict[str, list[PagePayload]] = {}
    for p in pages:
        grouped.setdefault(p.doc_id, []).append(p)
    return [_document(sorted(ps, key=lambda p: p.page)) for ps in grouped.values()]


def _document(pages: list[PagePayload]) -> Document:
    first = pages[0]
    return Document(doc_id=first.doc_id, doc=first.doc, path=first.path, num_pages=first.num_pages,
                    indexed_pages=len(pages), pages=[DocumentPage(page=p.page, page_id=p.page_id) for p in pages])


async def _page(services, page_id: str) -> PagePayload:
    try:
        uuid.UUID(page_id)  # Qdrant refuses ids that are not UUIDs; that is a 404 for the client, not a 500
    except ValueError:
        raise ApiError(404, "unknown_page", f"{page_id!r} is not a page id", PAGE_IDS_FIX) from None
    found = await services.pages.get(page_id)
    if found is None:
        raise ApiError(404, "unknown_page", f"no page with id {page_id}", PAGE_IDS_FIX)
    return found


@router.get("/pages/{page_id}", summary="A page's metadata and text", response_model=Page,
            responses=error_responses(PAGE_ERRORS))
async def page(page_id: str, services: ServicesDep) -> Page:
    return Page.of(await _page(services, page_id))


@router.get("/pages/{page_id}/image", summary="The page image (PNG), rendered from its source file",
            response_class=Response, responses={**PNG_RESPONSE, **error_responses({**PAGE_ERRORS, **SOURCE_GONE})})
async def page_image(page_id: str, services: ServicesDep) -> Response:
    found = await _page(services, page_id)
    png = await asyncio.to_thread(_render_png, Path(found.path), found.page, services.settings)
    return Response(png, media_type="image/png")


def _render_png(path: Path, number: int, settings) -> bytes:
    try:
        with open_document(path, settings.model_copy(update={"ocr": False})) as doc:
            for rendered in doc.pages():
                if rendered.page == number:
                    buf = io.BytesIO()
                    rendered.image.save(buf, format="PNG")
                    return buf.getvalue()
    except IngestError as exc:  # named by file name: the folder is the server's business
        raise ApiError(410, "source_gone", f"cannot render {path.name}: {exc}", "re-ingest the document") from exc
    raise ApiError(410, "source_gone", f"{path.name} no longer has page {number}", "re-ingest the document")
