"""Models of the document upload/delete and ingest-job routes (serving/api/routers/documents.py, ingest.py).

Listings paginate by ``limit``/``offset``: a response carries ``total`` and ``next_offset`` (null on the last
page), so a client pages with ``?offset=<next_offset>`` until it is null.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from serving.api.schemas import Document, IngestJob
from serving.http.schemas import ResponseBody

MAX_PAGE = 1000  # the most items one listing page returns


class Paged(ResponseBody):
    total: int = Field(description="Items in all pages together.")
    limit: int = Field(description="The most items this page holds (the request's `limit`).")
    offset: int = Field(description="Items before this page (the request's `offset`).")
    next_offset: int | None = Field(description="`offset` of the next page; null on the last one.")

    @staticmethod
    def next_of(offset: int, shown: int, total: int) -> int | None:
        return offset + shown if offset + shown < total else None


class DocumentsPage(Paged):
    documents: list[Document] = Field(description="Ingested documents, by file name then id.")


class JobProgress(ResponseBody):
    files_done: int = Field(description="Files of the job finished (ingested, unchanged or failed).")
    files_total: int = Field(description="Files the job ingests (a folder's, once listed).")
    pages_done: int = Field(description="Pages indexed so far, the file being ingested included, batch by batch "
                                        "(MMRAG_VISION_BATCH_SIZE pages at a time).")


class Job(IngestJob):
    status: Literal["queued", "running", "cancelling", "done", "failed", "cancelled"] = Field(
        description="Where the job is: `cancelling` is a running job asked to stop (it does before its next "
        "page batch); a job a restarted server took up again is `queued` or `running` with `resumed` > 0.")
    resumed: int = Field(description="How many restarts of the server the job was resumed after.")
    tiers: list[str] = Field(default=[], description="Resolution tiers it encodes beside MMRAG_INGEST_TIERS.")
    progress: JobProgress | None = Field(default=None, description="How far it got: files finished and pages "
                                         "indexed, updated after each page batch; null until it starts.")


class JobsPage(Paged):
    jobs: list[Job] = Field(description="Ingest jobs, newest first.")


class Upload(ResponseBody):
    doc_id: str = Field(description="The document's id once ingested: DELETE /v1/documents/{doc_id}.")
    doc: str = Field(description="Its file name on the server (sanitised from the upload's), as citations name it.")
    bytes: int = Field(description="Size of the stored file.")
    sha256: str = Field(description="SHA-256 of the file's bytes.")
    renamed_from: str | None = Field(None, description="The name asked for, when another of the tenant's "
                                     "documents (other bytes) had it: `doc` then carries a `-N` before its suffix.")
    job: Job = Field(description="The ingest job: poll GET /v1/ingest/{job.id}.")


class DeletedDocument(ResponseBody):
    doc_id: str = Field(description="Id of the deleted document.")
    doc: str = Field(description="Its file name.")
    pages: int = Field(description="Pages removed from the tenant's index. What happened to their image-token "
                       "entries is not said: the feature store is shared, so that would tell whether another tenant "
                       "holds the same page (the server logs it).")
