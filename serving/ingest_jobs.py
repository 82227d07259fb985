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

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "paths": self.paths, "recursive": self.recursive, "status": self.status,
                "report": self.report, "error": self.error, "submitted_at": self.submitted_at,
                "finished_at": self.finished_at, "resumed": self.resumed}


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
        state = json.dumps({**job.to_json(), "files": job.files})
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
    ingest that has stored a page's tokens but not yet indexed the page."""

    def __init__(self, root: Path | None, make_ingestor: Callable[[], Ingestor], *, state: Path, uploads: Path,
                 make_index: Callable[[], PageIndex], store: FeatureStore) -> None:
        self.root = root.resolve() if root else None
        self.uploads = uploads.resolve()
        self._make_ingestor = make_ingestor
        self._make_index = make_index
        self._store = store
        self._ingestor: Ingestor | None = None
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

    def allowed(self, raw: list[str]) -> list[Path]:
        if self.root is None:
            raise PathOutsideRootError(
                "server-side ingest is off: set MMRAG_INGEST_ROOT to the folder clients may ingest from"
            )
        paths = []
        for p in raw:
            if "\0" in p:
                raise InvalidPathError(f"{p!r} holds a NUL byte, which no file name can: send the path without it")
            try:
                resolved = (self.root / p).resolve()  # an absolute p stays itself
            except RuntimeError:  # what Python 3.11's resolve() raises for a link loop (ELOOP)
                raise InvalidPathError(f"{p} is a symbolic link loop: fix the link, or ingest its target") from None
            if not resolved.is_relative_to(self.root):
                raise PathOutsideRootError(f"{p} is outside the ingest root: use a path under MMRAG_INGEST_ROOT")
            paths.append(resolved)
        return paths

    def shown(self, path: str | Path) -> str:
        """``path`` as clients see it: relative to the ingest root (never the server's absolute folders)."""
        path = Path(path)
        if self.root is not None and path.is_relative_to(self.root):
            return path.relative_to(self.root).as_posix()  # the root itself is "."
        return path.name

    def submit(self, raw: list[str], *, recursive: bool) -> Job:
        return self._start(self.allowed(raw), recursive=recursive)

    def submit_upload(self, path: Path) -> Job:
        """Ingest a file POST /v1/documents stored under the uploads folder (not under the ingest root)."""
        return self._start([path.resolve()], recursive=False)

    def _start(self, paths: list[Path], *, recursive: bool) -> Job:
        # Random ids: a counter would restart at job-1 after a restart, and an old id would name a new job.
        job = Job(id=f"job-{uuid.uuid4().hex[:16]}", paths=[self.shown(p) for p in paths], recursive=recursive,
                  files=[str(p) for p in paths])
        self._jobs[job.id] = job
        self._db.save(job)
        self._pool.submit(self._run, job)
        return job

    def _resume(self, job: Job) -> None:
        outside = [f for f in job.files if not self._may_read(Path(f))]
        if outside:  # the server restarted with another MMRAG_INGEST_ROOT: the job may no longer read them
            self._finish(job, "failed", error=f"interrupted by a server restart, and {self.shown(outside[0])} is "
                         "no longer under MMRAG_INGEST_ROOT: submit the job again")
            return
        job.status, job.resumed = "queued", job.resumed + 1
        self._db.save(job)
        log.info("ingest %s resumed after a restart: %s", job.id, ", ".join(job.paths))
        self._pool.submit(self._run, job)

    def _may_read(self, path: Path) -> bool:
        return path.is_relative_to(self.uploads) or (self.root is not None and path.is_relative_to(self.root))

    def get(self, job_id: str) -> Job | None:
        return self._jobs.get(job_id)

    def list(self, *, limit: int, offset: int) -> tuple[list[Job], int]:
        """A page of jobs, newest first, and how many there are."""
        jobs = sorted(self._jobs.values(), key=lambda j: (j.submitted_at, j.id), reverse=True)
        return jobs[offset:offset + limit], len(jobs)

    def cancel(self, job_id: str) -> Job | None:
        """Cancel a queued job (it never runs) or a running one (it stops before its next page batch; what it
        indexed stays, and re-submitting it finishes the rest). A finished job stays as it is."""
        job = self._jobs.get(job_id)
        with self._transition:
            if job is not None and job.status == "queued":
                self._finish(job, "cancelled")
            elif job is not None and job.status == "running":
                job.status = "cancelling"  # the worker sees it at its next progress call
                self._db.save(job)
        return job

    def delete_document(self, doc_id: str) -> Future[DeletedDocument | None]:
        """Remove a document's pages, then the feature entries no other indexed page references (a figure
        another document shares stays), then its uploaded file. None when no page has this doc id."""
        return self._pool.submit(self._delete, doc_id)

    def _delete(self, doc_id: str) -> DeletedDocument | None:
        index = self._make_index()
        removed = index.delete_document(doc_id)
        if not removed:
            return None
        keys = {p.image_key for p in removed}
        unreferenced = keys - index.referenced_keys()
        for key in unreferenced:
            self._store.delete(key)
        source = Path(removed[0].path)
        if source.is_relative_to(self.uploads):
            source.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                source.parent.rmdir()  # the content-hash folder, once it holds no other name of these bytes
        return DeletedDocument(doc_id, removed[0].doc, len(removed), len(unreferenced), len(keys - unreferenced))

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
            if self._ingestor is None:
                self._ingestor = self._make_ingestor()
            root = None if Path(job.files[0]).is_relative_to(self.uploads) else self.root
            report = self._ingestor.run([Path(f) for f in job.files], recursive=job.recursive, root=root,
                                        progress=progress)
        except JobCancelled:
            self._finish(job, "cancelled")
            log.info("ingest %s cancelled while running", job.id)
        except Exception as exc:  # the job records the cause; the server keeps serving
            self._finish(job, "failed", error=f"{type(exc).__name__}: {exc}")
            log.warning("ingest %s failed: %s", job.id, job.error, exc_info=True)
        else:
            out = report.to_json()
            for failure in out["failed"]:
                failure["path"] = self.shown(failure["path"])
            self._finish(job, "done", report=out)  # a cancel asked after its last batch came too late
            log.info("ingest %s done: %d files (%d failed), %d pages, %d encoded, %d cached in %.1f s", job.id,
                     report.files, len(report.failed), report.pages, report.encoded, report.cached, report.seconds)

    def _finish(self, job: Job, status: str, *, report: dict[str, Any] | None = None, error: str | None = None
                ) -> None:
        with self._transition:
            job.status, job.report, job.error, job.finished_at = status, report, error, time.time()
            self._db.save(job)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._db.close()
