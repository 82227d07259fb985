"""Ingest jobs inside the server: documents are added while it serves, through the server's own index client.

Qdrant local mode allows one client per folder, and the server already holds it (async). Ingestion is sync
code running in a worker thread, so it reaches the index through `adapters.qdrant.LoopBridge`, which runs
each call on the server's event loop. Jobs run one at a time: ingestion is CPU-bound and the machine has few cores.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
    status: str = "queued"  # queued | running | done | failed
    report: dict[str, Any] | None = None
    error: str | None = None
    submitted_at: float = field(default_factory=time.time)
    finished_at: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "paths": self.paths, "recursive": self.recursive, "status": self.status,
                "report": self.report, "error": self.error, "submitted_at": self.submitted_at,
                "finished_at": self.finished_at}


class IngestJobs:
    def __init__(self, root: Path | None, make_ingestor: Callable[[], Ingestor]) -> None:
        self.root = root.resolve() if root else None
        self._make_ingestor = make_ingestor
        self._ingestor: Ingestor | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mmrag-ingest")
        self._jobs: dict[str, Job] = {}

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
        paths = self.allowed(raw)
        # Random ids: a counter would restart at job-1 after a restart, and an old id would name a new job.
        job = Job(id=f"job-{uuid.uuid4().hex[:16]}", paths=[self.shown(p) for p in paths], recursive=recursive)
        self._jobs[job.id] = job
        self._pool.submit(self._run, job, paths)
        return job

    def get(self, job_id: str) -> Job | None:
        return self._jobs.get(job_id)

    def _run(self, job: Job, paths: list[Path]) -> None:
        job.status = "running"
        log.info("ingest %s started: %s%s", job.id, ", ".join(job.paths), " (recursive)" if job.recursive else "")
        try:
            if self._ingestor is None:
                self._ingestor = self._make_ingestor()
            report = self._ingestor.run(paths, recursive=job.recursive, root=self.root)
        except Exception as exc:  # the job records the cause; the server keeps serving
            job.status, job.error = "failed", f"{type(exc).__name__}: {exc}"
            log.warning("ingest %s failed: %s", job.id, job.error, exc_info=True)
        else:
            job.status, job.report = "done", report.to_json()
            for failure in job.report["failed"]:
                failure["path"] = self.shown(failure["path"])
            log.info("ingest %s done: %d files (%d failed), %d pages, %d encoded, %d cached in %.1f s", job.id,
                     report.files, len(report.failed), report.pages, report.encoded, report.cached, report.seconds)
        job.finished_at = time.time()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
