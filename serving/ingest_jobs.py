"""Ingest jobs inside the server: documents are added while it serves, through the server's own index client.

Qdrant local mode allows one client per folder, and the server already holds it (async). Ingestion is sync
code running in a worker thread, so it reaches the index through `adapters.qdrant.LoopBridge`, which runs
each call on the server's event loop. Jobs run one at a time: ingestion is CPU-bound and the machine has few cores.
Their state lives in SQLite under the data dir (JobStore), so they survive a restart, even a ``kill -9``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adapters.qdrant import PageIndex
from adapters.store import FeatureStore
from core.keys import ImageKey, Tiers, doc_id_for
from core.scope import TenantScope
from core.settings import DEFAULT_TENANT
from ingestion.pipeline import Ingestor

log = logging.getLogger(__name__)


class PathOutsideRootError(PermissionError):
    pass


class InvalidPathError(ValueError):
    """A requested path no file can have (a NUL byte) or that cannot be resolved (a symbolic link loop)."""


@dataclass(slots=True)
class Job:
    id: str
    paths: list[str]
    recursive: bool
    status: str = "queued"  # queued | running | cancelling | done | failed | cancelled
    report: dict[str, Any] | None = None
    error: str | None = None
    submitted_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    resumed: int = 0  # times a restarted server took the job up again
    files: list[str] = field(default_factory=list)  # the resolved paths: what a resumed job ingests (server-only)
    tenant: str = DEFAULT_TENANT  # whose collection it writes, who may see and cancel it (server-only)
    tiers: list[str] = field(default_factory=list)  # resolution tiers encoded beside MMRAG_INGEST_TIERS

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "paths": self.paths, "recursive": self.recursive, "status": self.status,
                "report": self.report, "error": self.error, "submitted_at": self.submitted_at,
                "finished_at": self.finished_at, "resumed": self.resumed, "tiers": self.tiers}


UNFINISHED = ("queued", "running")


class JobCancelled(Exception):
    """Raised from the ingest progress callback: a cancelled running job stops before its next batch."""


class JobStore:
    """Job state in one SQLite table under the data dir, written on every state change, so a server killed
    with ``kill -9`` finds its unfinished jobs at the next start. One connection, shared by the event loop
    (submit, cancel) and the ingest thread (progress), hence the lock."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("CREATE TABLE IF NOT EXISTS jobs (id TEXT PRIMARY KEY, submitted_at REAL NOT NULL, "
                             "state TEXT NOT NULL)")

    def save(self, job: Job) -> None:
        state = json.dumps({**job.to_json(), "files": job.files, "tenant": job.tenant})
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO jobs VALUES (?, ?, ?)", (job.id, job.submitted_at, state))

    def load(self) -> list[Job]:
        """Every job, oldest first."""
        with self._lock:
            rows = self._db.execute("SELECT state FROM jobs ORDER BY submitted_at, id").fetchall()
        return [Job(**json.loads(state)) for (state,) in rows]

    def close(self) -> None:
        with self._lock:
            self._db.close()


@dataclass(slots=True, frozen=True)
class DeletedDocument:
    doc_id: str
    doc: str
    pages: int
    entries_removed: int  # feature-store entries no other indexed page referenced
    entries_kept: int  # this document's entries another page still references (a shared figure)


class IngestJobs:
    """Ingest jobs, one at a time on one worker thread, their state persisted in ``state`` (a JobStore file).

    Jobs a killed server left queued or running are queued again at start-up: ingestion is idempotent (an
    unchanged, fully indexed file is skipped; a half-done one is redone), so a resumed job ends with the index
    an uninterrupted one makes. Document deletion runs on the same thread, so it never interleaves with an
    ingest that has stored a page's tokens but not yet indexed the page — any tenant's, since tenants share the
    feature store.

    Each job belongs to a tenant (``for_tenant`` gives a tenant's view): it writes the tenant's collection
    (``make_index(tenant)``), reads server-side paths under its scope's ``root`` and stores uploads under its
    scope's ``uploads`` (``scope_of(tenant)``, core/scope.py).
    ``referenced``: the feature keys any tenant's pages reference (what a deletion must keep, with those pages'
    entries in the other ``tiers``)."""

    def __init__(self, scope_of: Callable[[str], TenantScope], make_ingestor: Callable[[str, tuple[str, ...]], Ingestor],
                 *, state: Path,
                 make_index: Callable[[str], PageIndex], store: FeatureStore,
                 referenced: Callable[[PageIndex], set[ImageKey]], tiers: Tiers) -> None:
        self._scope_of = scope_of
        self.uploads = scope_of(DEFAULT_TENANT).uploads  # the default tenant's; the others' are under it
        self._make_ingestor = make_ingestor
        self._make_index = make_index
        self._referenced = referenced
        self._tiers = tiers
        self._store = store
        self._ingestors: dict[tuple[str, tuple[str, ...]], Ingestor] = {}  # by tenant and a job's own tiers
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mmrag-ingest")
        self._db = JobStore(state)
        # A cancel (event loop) and the worker's own steps change a job's status from two threads: each
        # change and its write happen together, so the stored state is never an older one than the last.
        self._transition = threading.RLock()
        self._jobs: dict[str, Job] = {job.id: job for job in self._db.load()}
        for job in self._jobs.values():
            if job.status == "cancelling":  # killed before the worker saw the cancel
                self._finish(job, "cancelled")
            elif job.status in UNFINISHED:
                self._resume(job)

    def for_tenant(self, tenant: str) -> TenantJobs:
        return TenantJobs(self, tenant)

    def root_of(self, tenant: str) -> Path | None:
        return self._scope_of(tenant).root

    def uploads_of(self, tenant: str) -> Path:
        return self._scope_of(tenant).uploads

    def allowed(self, raw: list[str], tenant: str = DEFAULT_TENANT) -> list[Path]:
        root = self.root_of(tenant)
        if root is None:
            raise PathOutsideRootError(
                "server-side ingest is off: set MMRAG_INGEST_ROOT to the folder clients may ingest from"
            )
        where = "MMRAG_INGEST_ROOT" if tenant == DEFAULT_TENANT else f"MMRAG_INGEST_ROOT/{tenant}"
        paths = []
        for p in raw:
            if "\0" in p:
                raise InvalidPathError(f"{p!r} holds a NUL byte, which no file name can: send the path without it")
            try:
                resolved = (root / p).resolve()  # an absolute p stays itself
            except RuntimeError:  # what Python 3.11's resolve() raises for a link loop (ELOOP)
                raise InvalidPathError(f"{p} is a symbolic link loop: fix the link, or ingest its target") from None
            if not resolved.is_relative_to(root):
                raise PathOutsideRootError(f"{p} is outside the ingest root: use a path under {where}")
            paths.append(resolved)
        return paths

    def shown(self, path: str | Path, tenant: str = DEFAULT_TENANT) -> str:
        """``path`` as clients see it: relative to the tenant's ingest root (never the server's folders)."""
        path, root = Path(path), self.root_of(tenant)
        if root is not None and path.is_relative_to(root):
            return path.relative_to(root).as_posix()  # the root itself is "."
        return path.name

    def submit(self, raw: list[str], *, recursive: bool, tenant: str = DEFAULT_TENANT,
               tiers: list[str] | None = None) -> Job:
        return self._start(self.allowed(raw, tenant), recursive=recursive, tenant=tenant, tiers=tiers or [])

    def submit_upload(self, path: Path, tenant: str = DEFAULT_TENANT, tiers: list[str] | None = None) -> Job:
        """Ingest a file POST /v1/documents stored under the uploads folder (not under the ingest root)."""
        return self._start([path.resolve()], recursive=False, tenant=tenant, tiers=tiers or [])

    def _start(self, paths: list[Path], *, recursive: bool, tenant: str, tiers: list[str]) -> Job:
        # Random ids: a counter would restart at job-1 after a restart, and an old id would name a new job.
        job = Job(id=f"job-{uuid.uuid4().hex[:16]}", paths=[self.shown(p, tenant) for p in paths],
                  recursive=recursive, files=[str(p) for p in paths], tenant=tenant, tiers=tiers)
        self._jobs[job.id] = job
        self._db.save(job)
        self._pool.submit(self._run, job)
        return job

    def _resume(self, job: Job) -> None:
        outside = [f for f in job.files if not self._may_read(Path(f), job.tenant)]
        if outside:  # the server restarted with another MMRAG_INGEST_ROOT: the job may no longer read them
            self._finish(job, "failed", error=f"interrupted by a server restart, and "
                         f"{self.shown(outside[0], job.tenant)} is no longer under MMRAG_INGEST_ROOT: submit the "
                         "job again")
            return
        job.status, job.resumed = "queued", job.resumed + 1
        self._db.save(job)
        log.info("ingest %s resumed after a restart: %s", job.id, ", ".join(job.paths))
        self._pool.submit(self._run, job)

    def _is_upload(self, path: Path, tenant: str) -> bool:
        """An upload of this tenant's (the default tenant's folder holds the others' under ``tenants/``)."""
        return path.is_relative_to(self.uploads_of(tenant)) and (
            tenant != DEFAULT_TENANT or not path.is_relative_to(self.uploads / "tenants"))

    def _may_read(self, path: Path, tenant: str) -> bool:
        root = self.root_of(tenant)
        return self._is_upload(path, tenant) or (root is not None and path.is_relative_to(root))

    def get(self, job_id: str, tenant: str = DEFAULT_TENANT) -> Job | None:
        """The tenant's job with this id: another tenant's is as unknown as one that never was."""
        job = self._jobs.get(job_id)
        return job if job is not None and job.tenant == tenant else None

    def list(self, *, limit: int, offset: int, tenant: str = DEFAULT_TENANT) -> tuple[list[Job], int]:
        """A page of the tenant's jobs, newest first, and how many it has."""
        jobs = sorted((j for j in self._jobs.values() if j.tenant == tenant), key=lambda j: (j.submitted_at, j.id),
                      reverse=True)
        return jobs[offset:offset + limit], len(jobs)

    def cancel(self, job_id: str, tenant: str = DEFAULT_TENANT) -> Job | None:
        """Cancel a queued job (it never runs) or a running one (it stops before its next page batch; what it
        indexed stays, and re-submitting it finishes the rest). A finished job stays as it is."""
        job = self.get(job_id, tenant)
        with self._transition:
            if job is not None and job.status == "queued":
                self._finish(job, "cancelled")
            elif job is not None and job.status == "running":
                job.status = "cancelling"  # the worker sees it at its next progress call
                self._db.save(job)
        return job

    def delete_document(self, doc_id: str, tenant: str = DEFAULT_TENANT) -> Future[DeletedDocument | None]:
        """Remove a document's pages from the tenant's collection, then the feature entries no other indexed
        page of any tenant references (a figure another document shares stays), then its uploaded file. None
        when no page of the tenant has this doc id."""
        return self._pool.submit(self._delete, doc_id, tenant)

    def _delete(self, doc_id: str, tenant: str) -> DeletedDocument | None:
        index = self._make_index(tenant)
        removed = index.delete_document(doc_id)
        if not removed:
            return None
        keys = {p.image_key for p in removed}
        in_use = self._tiers.in_use(self._referenced(index))
        tiered = keys | {k.in_policy(p) for k in keys for p in self._tiers.policies.values()}
        unreferenced = [k for k in tiered if not in_use(k) and self._store.delete(k)]
        source = Path(removed[0].path)
        if self._is_upload(source, tenant):
            _remove_upload(source)
        return DeletedDocument(doc_id, removed[0].doc, len(removed), len(unreferenced), sum(map(in_use, keys)))

    def _run(self, job: Job) -> None:
        with self._transition:
            if job.status != "queued":  # cancelled while it waited
                return
            job.status = "running"
            self._db.save(job)
        log.info("ingest %s started: %s%s", job.id, ", ".join(job.paths), " (recursive)" if job.recursive else "")

        def progress(files_done: int, files_total: int, pages_done: int) -> None:
            if job.status == "cancelling":
                raise JobCancelled

        try:
            which = (job.tenant, tuple(job.tiers))
            if which not in self._ingestors:
                self._ingestors[which] = self._make_ingestor(*which)
            uploaded = self._is_upload(Path(job.files[0]), job.tenant)
            report = self._ingestors[which].run([Path(f) for f in job.files], recursive=job.recursive,
                                                     root=None if uploaded else self.root_of(job.tenant),
                                        progress=progress)
        except JobCancelled:
            self._finish(job, "cancelled")
            log.info("ingest %s cancelled while running", job.id)
        except Exception as exc:  # the job records the cause; the server keeps serving
            self._finish(job, "failed", error=f"{type(exc).__name__}: {exc}")
            log.warning("ingest %s failed: %s", job.id, job.error, exc_info=True)
        else:
            if uploaded:
                self._drop_failed_uploads(job.tenant, [Path(f.path) for f in report.failed])
            out = report.to_json()
            for failure in out["failed"]:
                failure["path"] = self.shown(failure["path"], job.tenant)
            self._finish(job, "done", report=out)  # a cancel asked after its last batch came too late
            log.info("ingest %s done: %d files (%d failed), %d pages, %d encoded, %d cached in %.1f s", job.id,
                     report.files, len(report.failed), report.pages, report.encoded, report.cached, report.seconds)

    def _drop_failed_uploads(self, tenant: str, paths: list[Path]) -> None:
        """An uploaded file ingestion refused (not a readable PDF, a bomb, ...) and no page of which is indexed
        is of no use to anyone: it goes, so refused uploads do not pile up under the data dir."""
        if not paths:
            return
        index = self._make_index(tenant)
        for path in paths:
            if self._is_upload(path, tenant) and not index.doc_pages(doc_id_for(str(path))):
                _remove_upload(path)

    def _finish(self, job: Job, status: str, *, report: dict[str, Any] | None = None, error: str | None = None
                ) -> None:
        with self._transition:
            job.status, job.report, job.error, job.finished_at = status, report, error, time.time()
            self._db.save(job)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._db.close()


def _remove_upload(path: Path) -> None:
    path.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        path.parent.rmdir()  # the content-hash folder, once it holds no other name of these bytes


@dataclass(slots=True, frozen=True)
class TenantJobs:
    """One tenant's view of the jobs: what the REST routes use, so no route can name another tenant's."""

    jobs: IngestJobs
    tenant: str

    @property
    def uploads(self) -> Path:
        return self.jobs.uploads_of(self.tenant)

    def submit(self, raw: list[str], *, recursive: bool, tiers: list[str] | None = None) -> Job:
        return self.jobs.submit(raw, recursive=recursive, tenant=self.tenant, tiers=tiers)

    def submit_upload(self, path: Path, tiers: list[str] | None = None) -> Job:
        return self.jobs.submit_upload(path, self.tenant, tiers)

    def get(self, job_id: str) -> Job | None:
        return self.jobs.get(job_id, self.tenant)

    def list(self, *, limit: int, offset: int) -> tuple[list[Job], int]:
        return self.jobs.list(limit=limit, offset=offset, tenant=self.tenant)

    def cancel(self, job_id: str) -> Job | None:
        return self.jobs.cancel(job_id, self.tenant)

    def delete_document(self, doc_id: str) -> Future[DeletedDocument | None]:
        return self.jobs.delete_document(doc_id, self.tenant)

    def shutdown(self) -> None:
        self.jobs.shutdown()
