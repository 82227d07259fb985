from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import io
import math
import re
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import BinaryIO, Literal

from fastapi import APIRouter, File, Form, Query, Request, UploadFile
from fastapi.responses import Response
from PIL import Image, ImageDraw

from mmrag.adapters.files import atomic_file
from mmrag.core.figures import Box, FigureRegion
from mmrag.core.keys import doc_id_for
from mmrag.core.payload import PagePayload
from mmrag.core.settings import DocumentSettings
from ingestion.loaders import SUPPORTED_FORMATS, IngestError, render_page, sniff_format
from serving.api.deps import AuthDep, TenantDep
from serving.api.documents_schemas import MAX_PAGE, DeletedDocument, DocumentsPage, Paged, Upload
from serving.api.limits import check_tier
from serving.api.routers.ingest import SharedPathRoute, public_job
from serving.api.schemas import PNG_RESPONSE, Document, DocumentPage, Page
from serving.http.errors import ApiError
from serving.http.schemas import INVALID_REQUEST, UNAUTHORIZED, error_responses

router = APIRouter(prefix="/v1", tags=["documents"], dependencies=[AuthDep], responses=error_responses(UNAUTHORIZED),
                   route_class=SharedPathRoute)

PAGE_IDS_FIX = "page ids come from GET /v1/documents (each document's `pages`) and from answers' `citations`"
UNKNOWN_PAGE = {404: "No indexed page has this id (`unknown_page`)."}
INDEX_DOWN = {503: "Qdrant does not answer, or holds pages of another mmrag version (`index_incompatible`)."}
SOURCE_GONE = {410: "The page's source file is gone or changed (`source_gone`): re-ingest it."}
PAGE_ERRORS = {**UNKNOWN_PAGE, **INDEX_DOWN, **INVALID_REQUEST}


UPLOAD_ERRORS = {
    413: "The file is over MMRAG_MAX_UPLOAD_BYTES, or the body over that plus MMRAG_MAX_REQUEST_BYTES "
         "(`request_too_large`), or over what the tenant's `bytes` quota leaves (`quota_exceeded`).",
    403: "The tenant holds as many documents or pages as its quota allows (`quota_exceeded`).",
    415: "The file's bytes are not a PDF, PNG, JPEG, WebP or TIFF (`unsupported_type`).",
    400: "The body is not valid multipart/form-data (`bad_request`), or a tier is not configured "
         "(`unknown_tier`).",
    **INVALID_REQUEST,
}
UNKNOWN_DOCUMENT = {404: "No indexed page belongs to a document with this id (`unknown_document`)."}
DELETE_ORDER = (
    "Never waits for another tenant's ingest jobs. It waits for this tenant's own jobs, queued or running when it "
    "arrives, that ingest this document's file (its upload, the file, or a folder holding it), so none of them "
    "adds the pages back after it; a job submitted after it ingests the file anew. The response says what left "
    "this tenant's index, never what happened to the shared image-token entries (that would tell whether another "
    "tenant holds the same page): an entry no indexed page of any tenant references is removed at once, or, while "
    "a lease holds it (a running answer, a conversation, an ingest in progress), once the lease ends.")
_COPY_CHUNK = 1 << 20


@router.get("/documents", summary="Ingested documents with their pages and page ids (paginated: limit/offset, "
            "then next_offset)", response_model=DocumentsPage, responses=error_responses({**INDEX_DOWN,
                                                                                          **INVALID_REQUEST}))
async def documents(services: TenantDep, limit: int = Query(100, ge=1, le=MAX_PAGE),
                    offset: int = Query(0, ge=0)) -> DocumentsPage:
    docs = sorted(_by_document(await services.pages.pages(), services.jobs.shown), key=lambda d: (d.doc, d.doc_id))
    page = docs[offset:offset + limit]
    return DocumentsPage(documents=page, total=len(docs), limit=limit, offset=offset,
                         next_offset=Paged.next_of(offset, len(page), len(docs)))


@router.post("/documents", status_code=202, summary="Upload a document (multipart field `file`) and ingest it "
             "as a job", response_model=Upload, responses=error_responses(UPLOAD_ERRORS))
async def upload(request: Request, services: TenantDep,
                 file: UploadFile = File(description="A PDF, PNG, JPEG, WebP or TIFF file."),
                 tiers: list[str] = Form(default=[], max_length=8, description="Resolution tiers (MMRAG_TIERS) "
                                         "to encode its pages in too, beside MMRAG_INGEST_TIERS.")) -> dict:
    for tier in tiers:
        check_tier(tier, services.settings.tiers)
    quota = services.keys.quota(services.tenant)
    await check_documents_quota(services, quota)
    uploads, limit = services.jobs.uploads, services.settings.max_upload_bytes
    if quota.bytes is not None:
        used = await asyncio.to_thread(stored_bytes, uploads)
        if used >= quota.bytes:
            raise _over_bytes(services.tenant, quota.bytes, used)
        limit = min(limit, quota.bytes - used)
    try:
        path, size, sha, renamed = await asyncio.to_thread(_store_upload, file.file, file.filename or "", uploads,
                                                           limit)
    except ApiError as exc:
        if exc.status == 413 and limit < services.settings.max_upload_bytes:  # the quota's room, not the file bound
            raise _over_bytes(services.tenant, quota.bytes, quota.bytes - limit) from None
        raise
    job = services.jobs.submit_upload(path, tiers)
    return {"doc_id": doc_id_for(str(path)), "doc": path.name, "bytes": size, "sha256": sha,
            "renamed_from": renamed, "job": public_job(request, job)}


async def check_documents_quota(services, quota) -> None:
    """403 when the tenant already holds its quota's documents or pages (a new file would add more)."""
    if quota.documents is None and quota.pages is None:
        return
    pages = await services.pages.pages()
    documents = len({p.doc_id for p in pages})
    for what, held, bound in (("documents", documents, quota.documents), ("pages", len(pages), quota.pages)):
        if bound is not None and held >= bound:
            raise ApiError(403, "quota_exceeded", f"tenant {services.tenant!r} holds {held} {what}, its quota "
                           f"({what} in the tenants file)", "delete documents it no longer needs (DELETE "
                           f"/v1/documents/{{doc_id}}); operators: `mmrag tenant quota {services.tenant} "
                           f"--{what} N`")


def _over_bytes(tenant: str, quota: int, used: int) -> ApiError:
    return ApiError(413, "quota_exceeded", f"the file is over what tenant {tenant!r}'s quota of {quota} bytes "
                    f"stored leaves ({max(0, quota - used)} bytes; {used} stored)",
                    "delete documents it no longer needs (DELETE /v1/documents/{doc_id}), or upload a smaller "
                    f"file; operators: `mmrag tenant quota {tenant} --bytes N`")


def stored_bytes(uploads: Path) -> int:
    """Bytes of the uploads a tenant keeps (:func:`_stored`)."""
    return sum(f.stat().st_size for f in _stored(uploads))


def _stored(uploads: Path) -> list[Path]:
    """The tenant's stored uploads, ``<sha>/<name>`` (another tenant's, under the default's ``tenants/``, not)."""
    return [f for f in uploads.glob("*/*")
            if f.is_file() and f.parent.name != "tenants" and not f.name.startswith(".")]


@router.delete("/documents/{doc_id}", summary="Delete a document: its pages, and the feature entries no other "
               "indexed page references", description=DELETE_ORDER,
               response_model=DeletedDocument, responses=error_responses({**UNKNOWN_DOCUMENT, **INDEX_DOWN, **INVALID_REQUEST}))
async def delete(doc_id: str, services: TenantDep) -> DeletedDocument:
    deleted = await asyncio.wrap_future(services.jobs.delete_document(doc_id))
    if deleted is None:
        raise ApiError(404, "unknown_document", f"no indexed document with id {doc_id}",
                       "document ids are the `doc_id` of GET /v1/documents and POST /v1/documents")
    return DeletedDocument(**dataclasses.asdict(deleted))


def _store_upload(src: BinaryIO, client_name: str, uploads: Path,
                  max_bytes: int) -> tuple[Path, int, str, str | None]:
    """Copy the upload to ``uploads/<sha256 prefix>/<safe name>``: at most ``max_bytes``, of a format ingestion
    reads (sniffed from its bytes, not its name). The client's name only names the file, never a folder. A name
    another of the tenant's documents (other bytes) has already gets ``-2``, ``-3``, ... before its suffix, so
    citations tell them apart; the name it was asked for is returned then (else None)."""
    digest, size = hashlib.sha256(), 0
    # Its name comes from its bytes: written under a temp name first, removed if it is refused half-way.
    with atomic_file(uploads, prefix=".upload-") as tmp:
        head = src.read(1024)
        fmt = sniff_format(head)
        if fmt is None:
            raise ApiError(415, "unsupported_type", "the file is not a PDF, PNG, JPEG, WebP or TIFF (by its "
                           "first bytes)", "convert it to PDF or an image of one of these formats")
        chunk = head
        while chunk:
            size += len(chunk)
            if size > max_bytes:
                raise ApiError(413, "request_too_large", f"the file is over {max_bytes} bytes",
                               "upload a smaller file (or raise MMRAG_MAX_UPLOAD_BYTES)")
            digest.update(chunk)
            tmp.write(chunk)
            chunk = src.read(_COPY_CHUNK)
        sha = digest.hexdigest()
        folder = uploads / sha[:16]
        folder.mkdir(exist_ok=True)
        asked = _safe_name(client_name, fmt)
        name = _unique_name(uploads, folder, asked)
        path = folder / name
        tmp.commit(path)  # the same bytes under the same name: the same file, so the same document
    return path, size, sha, (asked if name != asked else None)


def _unique_name(uploads: Path, folder: Path, name: str) -> str:
    """``name``, or with the first ``-N`` no other document of the tenant has (the same bytes keep theirs)."""
    taken = {f.name for f in _stored(uploads) if f.parent != folder}
    if (folder / name).exists() or name not in taken:
        return name
    stem, suffix = Path(name).stem, Path(name).suffix
    return next(n for i in range(2, len(taken) + 3) if (n := f"{stem}-{i}{suffix}") not in taken)


def _safe_name(client_name: str, fmt: str) -> str:
    """A file name from the client's (in letters, digits, ``._-``; every other run of characters, separators
    included, one ``_``), with a suffix that matches the sniffed format, so that ingestion's name-vs-content
    check holds. Never a folder: no separator survives. A browser sends the base name only (RFC 7578 §4.2), so
    keeping every part costs nothing there, and a name with markup in it stays recognisable
    (``<img src=x><script>alert(1)</script>.pdf`` is ``img_src_x_script_alert_1_script.pdf``, not ``script.pdf``)."""
    suffix = Path(client_name.replace("\\", "/")).suffix
    stem = client_name[:len(client_name) - len(suffix)]
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", stem).strip("._-")[:100]
    suffix = suffix.lower()
    if SUPPORTED_FORMATS.get(suffix) != fmt:
        suffix = next(s for s, f in SUPPORTED_FORMATS.items() if f == fmt)
    return f"{stem or 'upload'}{suffix}"


def _by_document(pages: Iterable[PagePayload], shown: Callable[[str], str]) -> list[Document]:
    grouped: dict[str, list[PagePayload]] = {}
    for p in pages:
        grouped.setdefault(p.doc_id, []).append(p)
    return [_document(sorted(ps, key=lambda p: p.page), shown) for ps in grouped.values()]


def _document(pages: list[PagePayload], shown: Callable[[str], str]) -> Document:
    """One document of the listing; ``shown`` writes its source path as the tenant sees it (TenantJobs.shown):
    relative to its ingest root, else the file name — the server's folders are its own business."""
    first = pages[0]
    return Document(doc_id=first.doc_id, doc=first.doc, path=shown(first.path), num_pages=first.num_pages,
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
async def page(page_id: str, services: TenantDep) -> Page:
    found = await _page(services, page_id)
    return Page.of(found, path=services.jobs.shown(found.path))


IMAGE_ERRORS = {
    **PAGE_ERRORS, **SOURCE_GONE,
    404: "No indexed page has this id (`unknown_page`), or the page has no figure (of `kind`) numbered `figure` "
         "(`unknown_figure`; the message names the numbers it has).",
    400: "`bbox` is not four numbers x0,y0,x1,y1 (points, top-left origin) with x0 < x1 and y0 < y1 inside the page "
         "(`invalid_bbox`), or `figure` and `bbox` are both given, or `kind` without `figure` "
         "(`conflicting_parameters`).",
}
BBOX_FIX = ("give bbox=x0,y0,x1,y1 in PDF points (1/72 inch), top-left origin, y down, inside the page: a "
            "citation's `figure.bbox` is one")
# The outline drawn for `figure`/`bbox`: red, 3 px, inside the box so that a box at the page's edge shows whole.
OUTLINE_RGB = (255, 0, 0)
OUTLINE_PX = 3


@router.get("/pages/{page_id}/image", summary="The page image (PNG), rendered from its source file; with "
            "`figure` or `bbox`, that box outlined", response_class=Response,
            responses={**PNG_RESPONSE, **error_responses(IMAGE_ERRORS)})
async def page_image(
    page_id: str, services: TenantDep,
    figure: int | None = Query(None, ge=1, description="Outline this figure (or table) of the page: the `number` of "
                               "a citation's `figure`. The page's figures without a number: use their `bbox`."),
    kind: Literal["figure", "table"] | None = Query(None, description="With `figure`: a figure's or a table's "
                                                    "number (a citation's `figure.kind`; an `image` is a "
                                                    "figure). Unset: the one so numbered, the figure where a "
                                                    "figure and a table share the number."),
    bbox: str | None = Query(None, max_length=200, description="Outline this box: `x0,y0,x1,y1` in PDF points "
                             "(1/72 inch), top-left origin, y down (a citation's `figure.bbox`); drawn at the "
                             "render's MMRAG_PDF_DPI/72 pixels per point (an image document: its pixels)."),
) -> Response:
    if kind is not None and figure is None:
        raise ApiError(400, "conflicting_parameters", "`kind` says which of a figure and a table `figure` names, "
                       "and no `figure` is given", "give figure=N with kind, or leave kind out", param="kind")
    if figure is not None and bbox is not None:
        raise ApiError(400, "conflicting_parameters", "`figure` and `bbox` both name a box to outline",
                       "give one of them: figure=N for a numbered figure of the page, bbox=x0,y0,x1,y1 for any box",
                       param="bbox")
    box = _parse_bbox(bbox) if bbox is not None else None
    found = await _page(services, page_id)
    if figure is not None:
        box = _figure_box(found, figure, kind)
    path, renders = Path(found.path), services.renders
    key = renders.key(services.tenant, path, found.page, box, figure is None)
    if box is None:  # the page as is: the bytes it always was
        png = await renders.png(services.tenant, key,
                                lambda: _render_png(path, found.page, services.settings.documents))
    else:  # a figure's box is the page's own (clamped to it when drawn); the client's must lie on the page
        png = await renders.png(services.tenant, key, lambda: _render_outlined_png(
            path, found.page, services.settings.documents, box, on_page=figure is None))
    return Response(png, media_type="image/png")


def _parse_bbox(text: str) -> Box:
    """``x0,y0,x1,y1`` as four finite numbers with x0 < x1 and y0 < y1; whether it lies on the page is known
    once the page is rendered."""
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 4 or not all(math.isfinite(v) for v in values):
        raise ApiError(400, "invalid_bbox", f"bbox={text!r} is not four numbers x0,y0,x1,y1", BBOX_FIX, param="bbox")
    x0, y0, x1, y1 = values
    if not (x0 < x1 and y0 < y1):
        raise ApiError(400, "invalid_bbox", f"bbox={text!r} is empty or inverted: it needs x0 < x1 and y0 < y1",
                       BBOX_FIX, param="bbox")
    return x0, y0, x1, y1


def _figure_box(page: PagePayload, number: int, kind: str | None = None) -> Box:
    """The box of the page's figure (or table: ``kind``) ``number``, the figure where both share it and ``kind``
    is None; 404 naming the numbers it has, or saying it has none."""
    kinds = ("figure", "table") if kind is None else (kind,)
    named = next((f for k in kinds for f in page.figures if f.region.named_by((k, str(number)))), None)
    if named is not None:
        return named.region.bbox_pt
    if kind is not None and any(f.region.number == number for f in page.figures):
        other = "figure" if kind == "table" else "table"
        raise ApiError(404, "unknown_figure", f"page {page.page} of {page.doc} has no {kind} {number}, only a "
                       f"{other} {number}", f"ask for kind={other}, or leave kind out", param="kind")
    where = f"page {page.page} of {page.doc}"
    numbers = sorted({f.region.number for f in page.figures if f.region.number is not None})
    if numbers:
        listed = ", ".join(map(str, numbers))
        raise ApiError(404, "unknown_figure", f"{where} has no figure {number}; its figures are numbered {listed}",
                       f"ask for one of figure={listed}, or outline any box with bbox=x0,y0,x1,y1", param="figure")
    if page.figures:
        raise ApiError(404, "unknown_figure", f"{where} has no figure {number}: none of its {len(page.figures)} "
                       "figures has a number", "outline one with bbox=x0,y0,x1,y1: a citation's `figure.bbox`",
                       param="figure")
    raise ApiError(404, "unknown_figure", f"{where} has no figure {number}: no figures were found on it",
                   "outline any box with bbox=x0,y0,x1,y1 (PDF points, top-left origin, y down)", param="figure")


def _points_scale(path: Path, documents: DocumentSettings) -> float:
    """Pixels per point of the page as rendered: MMRAG_PDF_DPI/72 for a PDF; an image document is its pixels."""
    return documents.pdf_dpi / 72 if SUPPORTED_FORMATS.get(path.suffix.lower()) == "PDF" else 1.0


def _render_png(path: Path, number: int, documents: DocumentSettings) -> bytes:
    return _png(_render(path, number, documents))


def _render_outlined_png(path: Path, number: int, documents: DocumentSettings, box: Box, *, on_page: bool) -> bytes:
    """The page with ``box`` (points) outlined; with ``on_page``, 400 when the box is not inside the page (half a
    pixel of slack: a figure's box, rounded in its citation, may reach that far past the page's edge)."""
    image = _render(path, number, documents)
    scale = _points_scale(path, documents)
    width_pt, height_pt = image.width / scale, image.height / scale
    x0, y0, x1, y1 = box
    slack = 0.5 / scale
    if on_page and (x0 < -slack or y0 < -slack or x1 > width_pt + slack or y1 > height_pt + slack):
        raise ApiError(400, "invalid_bbox", f"bbox {x0:g},{y0:g},{x1:g},{y1:g} is not inside the page "
                       f"({width_pt:g} x {height_pt:g} points)", BBOX_FIX, param="bbox")
    region = FigureRegion(None, "figure", "", box, "page")  # bbox_px: the one points-to-pixels rule
    px0, py0, px1, py1 = region.bbox_px(scale, image.size)
    ImageDraw.Draw(image).rectangle((px0, py0, max(px0, px1 - 1), max(py0, py1 - 1)), outline=OUTLINE_RGB,
                                    width=OUTLINE_PX)
    return _png(image)


def _render(path: Path, number: int, documents: DocumentSettings) -> Image.Image:
    try:
        rendered = render_page(path, number, documents)  # pdfium calls take turns (ingestion/loaders.py)
    except IngestError as exc:  # named by file name: the folder is the server's business
        raise ApiError(410, "source_gone", f"cannot render {path.name}: {exc}", "re-ingest the document") from exc
    if rendered is None:
        raise ApiError(410, "source_gone", f"{path.name} no longer has page {number}", "re-ingest the document")
    return rendered.image


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()
