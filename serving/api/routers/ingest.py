from __future__ import annotations

from fastapi import APIRouter, Request

from serving.api.deps import AuthDep, ServicesDep
from serving.api.errors import ApiError, hide_paths
from serving.api.schemas import INVALID_REQUEST, TOO_LARGE, UNAUTHORIZED, IngestJob, IngestRequest, error_responses
from serving.ingest_jobs import InvalidPathError, Job, PathOutsideRootError

router = APIRouter(prefix="/v1", tags=["ingest"], dependencies=[AuthDep], responses=error_responses(UNAUTHORIZED))

START_ERRORS = error_responses({
    400: "A path holds a NUL byte or is a symbolic link loop (`invalid_path`), or text that is not Unicode "
         "(`invalid_text`).",
    403: "A path is outside MMRAG_INGEST_ROOT, or server-side ingest is off (`path_not_allowed`).",
    **TOO_LARGE,
    **INVALID_REQUEST,
})
STATUS_ERRORS = error_responses({404: "No ingest job has this id (`unknown_job`).", **INVALID_REQUEST})


@router.post("/ingest", status_code=202, summary="Start an ingest job for server-side paths",
             response_model=IngestJob, responses=START_ERRORS)
async def start(body: IngestRequest, request: Request, services: ServicesDep) -> dict:
    try:
        job = services.jobs.submit(body.paths, recursive=body.recursive)
    except PathOutsideRootError as exc:
        raise ApiError(403, "path_not_allowed", str(exc), "ingest paths under MMRAG_INGEST_ROOT") from exc
    except InvalidPathError as exc:
        raise ApiError(400, "invalid_path", str(exc), "send the path of a file or folder under MMRAG_INGEST_ROOT"
                       ) from exc
    return _public(request, job)


@router.get("/ingest/{job_id}", summary="An ingest job's status and report", response_model=IngestJob,
            responses=STATUS_ERRORS)
async def status(job_id: str, request: Request, services: ServicesDep) -> dict:
    job = services.jobs.get(job_id)
    if job is None:
        raise ApiError(404, "unknown_job", f"no ingest job {job_id}", "use the id POST /v1/ingest returned")
    return _public(request, job)


def _public(request: Request, job: Job) -> dict:
    # A failed job's cause comes from a dependency (Qdrant, the feature store) and may name server folders.
    out = job.to_json()
    if out["error"]:
        out["error"] = hide_paths(request, out["error"])
    return out
