from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, Field

from serving.api.deps import AuthDep, ServicesDep
from serving.api.errors import ApiError
from serving.ingest_jobs import PathOutsideRootError

router = APIRouter(prefix="/v1", tags=["ingest"], dependencies=[AuthDep])


class IngestRequest(BaseModel):
    paths: list[str] = Field(min_length=1, description="Server-side files or folders under MMRAG_INGEST_ROOT.")
    recursive: bool = False


@router.post("/ingest", status_code=202, summary="Start an ingest job for server-side paths")
async def start(body: IngestRequest, services: ServicesDep) -> dict:
    try:
        job = services.jobs.submit(body.paths, recursive=body.recursive)
    except PathOutsideRootError as exc:
        raise ApiError(403, "path_not_allowed", str(exc), "ingest paths under MMRAG_INGEST_ROOT") from exc
    return job.to_json()


@router.get("/ingest/{job_id}", summary="An ingest job's status and report")
async def status(job_id: str, services: ServicesDep) -> dict:
    job = services.jobs.get(job_id)
    if job is None:
        raise ApiError(404, "unknown_job", f"no ingest job {job_id}", "use the id POST /v1/ingest returned")
    return job.to_json()
