"""Ingest jobs inside the server: documents are added while it serves, through the server's own index client.

Qdrant local mode allows one client per folder, and the server already holds it (async). Ingestion is sync
code running in worker threads, so it reaches the index through `mmrag.adapters.qdrant.LoopBridge`, which runs
each call on the server's event loop. Jobs wait in one FIFO queue per tenant and are served round-robin by
MMRAG_INGEST_WORKERS threads (default 1: ingestion is CPU-bound and the machine has few cores), so one
tenant's backlog delays another's job by at most one job of each tenant with work queued. Their state lives in
SQLite under the data dir (JobStore), so they survive a restart, even a ``kill -9``.

Deletions run on a thread of their own, never behind an ingest: the ingest pipeline leases a page's feature
keys from before it stores them until the page is indexed, and a deletion keeps leased entries (retrying them
later), so it cannot remove tokens an ingest is about to index, whichever tenant's.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmrag.adapters.qdrant import PageIndex
from mmrag.adapters.store import FeatureStore
from mmrag.core.keys import ImageKey, Tiers, doc_id_for
from mmrag.core.scope import TenantScope
from mmrag.core.settings import DEFAULT_TENANT, default_of
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
    progress: dict[str, int] | None = None  # files_done, files_total, pages_done: None until it runs

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "paths": self.paths, "recursive": self.recursive, "status": self.status,
                "report": self.report, "error": self.error, "submitted_at": self.submitted_at,
                "finished_at": self.finished_at, "resumed": self.resumed, "tiers": self.tiers,
                "progress": self.progress}


UNFINISHED = ("queued", "running")
FINISHED = ("done", "failed", "cancelled")


class JobCancelled(Exception):
    """Raised from the ingest progress callback: a cancelled running job stops before its next batch."""


class ShuttingDown(Exception):
    """Raised from the ingest progress callback at shutdown: the job stops, left running for the next start."""


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

    def delete(self, job_ids: list[str]) -> None:
        with self._lock:
            self._db.executemany("DELETE FROM jobs WHERE id = ?", [(i,) for i in job_ids])

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
    """What a deletion tells the tenant: what left its own index. What it did to the shared feature store
    (entries removed, kept for other pages, kept while leased) is logged, never returned: those figures depend
    on other tenants' pages."""

    doc_id: str
    doc: str
    pages: int


BUSY = ("queued", "running", "cancelling")  # a job that may still write pages


def next_tenant(heads: Mapping[str, float], last_served: Mapping[str, int]) -> str:
    """Round-robin over the tenants with a queued job (``heads``: each one's oldest job's submission time): the
    tenant served least recently goes (one never served first); between those, the one that has waited longer."""
    return min(heads, key=lambda t: (last_served.get(t, -1), heads[t], t))


class FairQueue:
    """Queued jobs, one FIFO per tenant, taken in :func:`next_tenant` order. Not locked: IngestJobs holds its
    lock around every call."""

    def __init__(self) -> None:
        self._queues: dict[str, deque[Job]] = {}
        self._served: dict[str, int] = {}  # tenant -> the turn it was last served in
        self._turns = 0

    def put(self, job: Job) -> None:
        self._queues.setdefault(job.tenant, deque()).append(job)

    def discard(self, job: Job) -> None:
        queue = self._queues.get(job.tenant)
        if queue is not None and job in queue:
            queue.remove(job)
            if not queue:
                del self._queues[job.tenant]

    def take(self, *, besides: Collection[str] = ()) -> Job | None:
        """The next job in round-robin order (of a tenant not in ``besides``), or None."""
        heads = {t: q[0].submitted_at for t, q in self._queues.items() if t not in besides}
        if not heads:
            return None
        tenant = next_tenant(heads, self._served)
        self._turns += 1
        self._served[tenant] = self._turns
        queue = self._queues[tenant]
        job = queue.popleft()
        if not queue:
            del self._queues[tenant]
        return job


@dataclass(slots=True, eq=False)
class _Deletion:
    """A document deletion asked for and not yet run. ``before``: the tenant's jobs still busy when it was asked;
    ``after``, once resolved (it reads the index): those of them that ingest the document's file, which it waits
    for, so that a job the tenant started earlier cannot add the pages back after the deletion."""

    doc_id: str
    tenant: str
    before: list[Job]
    future: Future[DeletedDocument | None]
    after: list[Job] | None = None

    def ready(self) -> bool:
        return self.after is None or not any(j.status in BUSY for j in self.after)


class IngestJobs:
    """Ingest jobs on ``workers`` threads, taken from per-tenant FIFO queues round-robin (:class:`FairQueue`),
    their state persisted in ``state`` (a JobStore file).

    Fair between pages, not only between jobs: between two page batches of a job, a worker first runs any job
    another tenant has queued (round-robin, one tenant at a time on the worker's stack, its own batches yielding
    likewise), then goes on with the paused job. A tenant's one-page upload so waits for at most one batch of
    another tenant's 500-page PDF, not for the whole PDF.

    Jobs a killed server left queued or running are queued again at start-up: ingestion is idempotent (an
    unchanged, fully indexed file is skipped; a half-done one is redone), so a resumed job ends with the index
    an uninterrupted one makes. A job still running at shutdown stops before its next page batch and is resumed
    likewise at the next start.

    Document deletions run on a thread of their own, never behind another tenant's ingest: ingestion leases each
    page's feature keys until the page is indexed (ingestion/pipeline.py), and the store keeps leased entries, so
    a deletion cannot remove tokens an ingest has stored but not yet indexed — any tenant's, since tenants share
    the feature store. Entries a deletion had to keep because a lease held them (an ingest in progress, a running
    answer's pages, a conversation's images) are tried again every ``retry_s`` seconds and after each deletion,
    each time only if no lease holds them and no indexed page of any tenant references them (`mmrag store gc`
    remains the backstop: the set is not kept across restarts).

    Each job belongs to a tenant (``for_tenant`` gives a tenant's view): it writes the tenant's collection
    (``make_index(tenant)``), reads server-side paths under its scope's ``root`` and stores uploads under its
    scope's ``uploads`` (``scope_of(tenant)``, mmrag/core/scope.py).
    ``referenced``: the feature keys any tenant's pages reference (what a deletion must keep, with those pages'
    entries in the other ``tiers``)."""

    def __init__(self, scope_of: Callable[[str], TenantScope], make_ingestor: Callable[[str, tuple[str, ...]], Ingestor],
                 *, state: Path,
                 make_index: Callable[[str], PageIndex], store: FeatureStore,
                 referenced: Callable[[PageIndex], set[ImageKey]], tiers: Tiers,
                 workers: int = default_of("ingest_workers"), retry_s: float = default_of("delete_retry_s"),
                 keep: int = default_of("ingest_jobs_kept")) -> None:
        if workers < 1:
            raise ValueError(f"ingest workers must be at least 1, got {workers}: set MMRAG_INGEST_WORKERS to 1 or more")
        self._scope_of = scope_of
        self.uploads = scope_of(DEFAULT_TENANT).uploads  # the default tenant's; the others' are under it
        self._make_ingestor = make_ingestor
        self._make_index = make_index
        self._referenced = referenced
        self._tiers = tiers
        self._store = store
        self._retry_s = retry_s
        self._keep = keep
        self._ingestors: dict[tuple[str, tuple[str, ...]], Ingestor] = {}  # by tenant and a job's own tiers
        self._building = threading.Lock()  # not ``_lock``: building one calls the index on the event loop
        self._db = JobStore(state)
        # One lock for every change of a job's status (a cancel on the event loop, a worker's own steps: each
        # change and its write happen together, so the stored state is never an older one than the last), the
        # queue, pending deletions and deferred entries; its condition wakes the workers and the deletion thread.
        # The event loop takes it, so no one holding it may wait for the loop (an index call through LoopBridge).
        self._lock = threading.Condition(threading.RLock())
        self._queue = FairQueue()
        self._paused = threading.local()  # per worker: the tenants whose jobs it holds paused (_serve_others)
        self._deletions: list[_Deletion] = []
        self._deferred: set[ImageKey] = set()  # entries a deletion kept because a lease held them
        self._retry_at = 0.0
        self._closed = False
        self._jobs: dict[str, Job] = {job.id: job for job in self._db.load()}
        for job in self._jobs.values():
            if job.status == "cancelling":  # killed before the worker saw the cancel
                self._finish(job, "cancelled")
            elif job.status in UNFINISHED:
                self._resume(job)
        for tenant in {job.tenant for job in self._jobs.values()}:
            self._forget_finished(tenant)
        # Daemon threads: a process that exits mid-job leaves the job running in the JobStore, resumed next start.
        self._threads = [threading.Thread(target=self._work, name=f"mmrag-ingest-{i}", daemon=True)
                         for i in range(workers)]
        self._threads.append(threading.Thread(target=self._delete_loop, name="mmrag-delete", daemon=True))
        for thread in self._threads:
            thread.start()

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
        with self._lock:
            self._jobs[job.id] = job
            self._db.save(job)
            self._queue.put(job)
            self._lock.notify_all()
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
        self._queue.put(job)  # before the workers start: no lock needed yet

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
        with self._lock:
            if job is not None and job.status == "queued":
                self._queue.discard(job)
                self._finish(job, "cancelled")
            elif job is not None and job.status == "running":
                job.status = "cancelling"  # the worker sees it at its next progress call
                self._db.save(job)
        return job

    # --- deletion ----------------------------------------------------------------------------------------------

    def delete_document(self, doc_id: str, tenant: str = DEFAULT_TENANT) -> Future[DeletedDocument | None]:
        """Remove a document's pages from the tenant's collection, then the feature entries no other indexed
        page of any tenant references and no lease holds (a figure another document shares stays; a leased one
        is tried again later), then its uploaded file. None when no page of the tenant has this doc id.

        It runs on the deletion thread, never behind another tenant's ingest. It waits only for the tenant's own
        jobs, queued or running when it is asked, that ingest this document's file (its upload, the file, or a
        folder holding it): they would add its pages back after it."""
        future: Future[DeletedDocument | None] = Future()
        with self._lock:
            before = [j for j in self._jobs.values() if j.tenant == tenant and j.status in BUSY]
            self._deletions.append(_Deletion(doc_id, tenant, before, future))
            self._lock.notify_all()
        return future

    def _delete_loop(self) -> None:
        while (deletion := self._next_deletion()) is not None:
            if deletion.after is None:  # first the jobs it waits for; it stays listed until they finish
                found = self._attempt(lambda: self._ingesting(deletion))
                if isinstance(found, Exception):  # the index did not answer: the route says so (503)
                    self._answer(deletion, found)
                else:
                    deletion.after = found
            elif deletion.future.set_running_or_notify_cancel():  # not if its client left meanwhile
                self._answer(deletion, self._attempt(lambda: self._delete(deletion.doc_id, deletion.tenant)))
                self._attempt(self._retry_deferred)

    def _attempt(self, step: Callable[[], Any]) -> Any:
        """``step()``, or the exception it raised: the deletion thread outlives a Qdrant or Redis outage."""
        try:
            return step()
        except Exception as exc:
            log.warning("deletion step failed: %s: %s", type(exc).__name__, exc)
            return exc

    def _answer(self, deletion: _Deletion, outcome: DeletedDocument | Exception | None) -> None:
        with self._lock:
            if deletion in self._deletions:
                self._deletions.remove(deletion)
        if not deletion.future.running() and not deletion.future.set_running_or_notify_cancel():
            return
        if isinstance(outcome, Exception):
            deletion.future.set_exception(outcome)
        else:
            deletion.future.set_result(outcome)

    def _next_deletion(self) -> _Deletion | None:
        """The next deletion that may run, or that must first find the jobs it waits for, waiting for one; the
        deferred entries are retried whenever ``retry_s`` passes meanwhile. None once shut down."""
        while True:
            with self._lock:
                while not self._closed:
                    ready = next((d for d in self._deletions if d.ready()), None)
                    if ready is not None:
                        if ready.after is not None:
                            self._deletions.remove(ready)
                        return ready
                    due = self._retry_at - time.monotonic() if self._deferred else None
                    if due is not None and due <= 0:
                        break  # retry, then look again
                    self._lock.wait(timeout=due)
                if self._closed:
                    for deletion in self._deletions:
                        deletion.future.cancel()
                    return None
            self._attempt(self._retry_deferred)

    def _ingesting(self, deletion: _Deletion) -> list[Job]:
        """Of the tenant's jobs busy when the deletion was asked, those that ingest the document's file."""
        if not deletion.before:
            return []
        pages = self._make_index(deletion.tenant).doc_pages(deletion.doc_id)
        source = Path(pages[0].path) if pages else None
        return [j for j in deletion.before if any(
            doc_id_for(f) == deletion.doc_id or (source is not None and source.is_relative_to(f)) for f in j.files)]

    def _delete(self, doc_id: str, tenant: str) -> DeletedDocument | None:
        index = self._make_index(tenant)
        removed = index.delete_document(doc_id)
        if not removed:
            return None
        keys = {k for p in removed for k in p.image_keys}  # its pages' and their figures'
        in_use = self._tiers.in_use(self._referenced(index))
        tiered = keys | {k.in_policy(p) for k in keys for p in self._tiers.policies.values()}
        shared = {k for k in tiered if in_use(k)}
        freed = [k for k in tiered - shared if self._store.delete(k)]
        leased = self._defer(tiered - shared - set(freed))
        source = Path(removed[0].path)
        if self._is_upload(source, tenant):
            _remove_upload(source)
        log.info("deleted document %s of tenant %s: %d pages; feature entries: %d removed, %d kept for other "
                 "indexed pages, %d kept while leased (tried again later)", doc_id, tenant, len(removed),
                 len(freed), len(shared & keys), len(leased))
        return DeletedDocument(doc_id, removed[0].doc, len(removed))

    def _defer(self, keys: set[ImageKey]) -> set[ImageKey]:
        """Of entries a deletion could not remove, those a lease holds (the rest were not stored): kept in the
        deferred set, to be removed once no lease holds them."""
        leased = {k for k in keys if self._store.leased(k)}
        with self._lock:
            if leased and not self._deferred:
                self._retry_at = time.monotonic() + self._retry_s
            self._deferred |= leased
            self._lock.notify_all()
        return leased

    def _retry_deferred(self) -> None:
        """Remove the deferred entries no lease holds any more and no indexed page of any tenant references;
        forget those now referenced or gone. Reads every collection only when some lease has ended."""
        with self._lock:
            deferred, self._retry_at = set(self._deferred), time.monotonic() + self._retry_s
        free = {k for k in deferred if not self._store.leased(k)}
        if not free:
            return
        in_use = self._tiers.in_use(self._referenced(self._make_index(DEFAULT_TENANT)))
        freed = [k for k in free if not in_use(k) and self._store.delete(k)]
        again = {k for k in free - set(freed) if not in_use(k) and self._store.leased(k)}  # leased meanwhile
        with self._lock:
            self._deferred -= free - again
        log.info("deferred feature entries: %d removed once their leases ended, %d still leased, %d referenced "
                 "again or gone", len(freed), len(deferred) - len(free) + len(again), len(free) - len(freed) - len(again))

    @property
    def deferred(self) -> int:
        """Entries deletions kept while leased, not yet removed (for tests and metrics)."""
        with self._lock:
            return len(self._deferred)

    # --- ingestion ---------------------------------------------------------------------------------------------

    def _work(self) -> None:
        while (job := self._next_job()) is not None:
            try:
                self._run(job)
            except Exception as exc:  # not the ingest's own failure (that is the job's report): its bookkeeping's
                if self._closed:  # the job store closed under it: the job resumes at the next start
                    log.info("ingest %s left running at shutdown", job.id)
                    return
                log.warning("ingest %s failed after ingesting: %s", job.id, exc, exc_info=True)
                self._finish(job, "failed", error=f"{type(exc).__name__}: {exc}")

    def _next_job(self) -> Job | None:
        with self._lock:
            while not self._closed:
                job = self._take()
                if job is not None:
                    return job
                self._lock.wait()
            return None

    def _take(self, besides: Collection[str] = ()) -> Job | None:
        """A queued job (of a tenant not in ``besides``) marked running, or None. Under the lock."""
        with self._lock:
            while not self._closed and (job := self._queue.take(besides=besides)) is not None:
                if job.status == "queued":  # a cancelled one was left in the queue: skip it
                    job.status = "running"  # taken and marked under the lock: a cancel sees one or the other
                    self._db.save(job)
                    return job
            return None

    def _serve_others(self, paused: Job) -> None:
        """Between two batches of ``paused`` (its progress callback): run every job other tenants have queued,
        those whose jobs this worker already holds paused excepted, before ``paused`` goes on."""
        stack = self._paused.stack = getattr(self._paused, "stack", [])
        stack.append(paused.tenant)
        try:
            while (other := self._take(besides=stack)) is not None:
                log.info("ingest %s (tenant %s) runs between two batches of %s", other.id, other.tenant, paused.id)
                self._run(other)
        finally:
            stack.pop()

    def _run(self, job: Job) -> None:
        log.info("ingest %s started: %s%s", job.id, ", ".join(job.paths), " (recursive)" if job.recursive else "")

        def progress(files_done: int, files_total: int, pages_done: int) -> None:
            # One new dict, not edited in place: GET /v1/ingest/{id} reads it from the event loop meanwhile.
            job.progress = {"files_done": files_done, "files_total": files_total, "pages_done": pages_done}
            if job.status == "cancelling":
                raise JobCancelled
            if self._closed:
                raise ShuttingDown
            self._serve_others(job)

        try:
            which = (job.tenant, tuple(job.tiers))
            with self._building:  # workers share one ingestor per tenant and tiers (it loads nothing new)
                if which not in self._ingestors:
                    self._ingestors[which] = self._make_ingestor(*which)
                ingestor = self._ingestors[which]
            uploaded = self._is_upload(Path(job.files[0]), job.tenant)
            report = ingestor.run([Path(f) for f in job.files], recursive=job.recursive,
                                  root=None if uploaded else self.root_of(job.tenant), progress=progress)
        except JobCancelled:
            self._finish(job, "cancelled")
            log.info("ingest %s cancelled while running", job.id)
        except ShuttingDown:
            log.info("ingest %s stopped by the shutdown: it resumes at the next start", job.id)
        except Exception as exc:  # the job records the cause; the server keeps serving
            if self._closed:
                raise
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
        with self._lock:
            job.status, job.report, job.error, job.finished_at = status, report, error, time.time()
            self._db.save(job)
            self._forget_finished(job.tenant)
            self._lock.notify_all()  # a deletion may be waiting for this job

    def _forget_finished(self, tenant: str) -> None:
        """The tenant's finished jobs past the newest ``keep`` forgotten (their reports with them): the job list
        of a server that ingests for months stays bounded. Unfinished jobs are never forgotten."""
        with self._lock:
            finished = sorted((j for j in self._jobs.values() if j.tenant == tenant and j.status in FINISHED),
                              key=lambda j: (j.finished_at or j.submitted_at, j.submitted_at, j.id))
            old = finished[:max(0, len(finished) - self._keep)]
            for job in old:
                del self._jobs[job.id]
            if old:
                self._db.delete([job.id for job in old])

    def shutdown(self) -> None:
        """Stop taking jobs; a running one stops before its next page batch (left running in the JobStore, so the
        next start resumes it); pending deletions are cancelled."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
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

    def shown(self, path: str | Path) -> str:
        return self.jobs.shown(path, self.tenant)

    def delete_document(self, doc_id: str) -> Future[DeletedDocument | None]:
        return self.jobs.delete_document(doc_id, self.tenant)

    def shutdown(self) -> None:
        self.jobs.shutdown()
