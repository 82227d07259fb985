from __future__ import annotations

from fastapi import APIRouter, Query, Request
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from serving.api.deps import AuthDep, TenantDep
from serving.api.documents_schemas import MAX_PAGE, Job as IngestJob, JobsPage, Paged
from serving.api.limits import check_tier
from serving.api.schemas import IngestRequest
from serving.http.errors import ApiError, hide_paths
from serving.http.schemas import INVALID_REQUEST, TOO_LARGE, UNAUTHORIZED, error_responses
from serving.ingest_jobs import InvalidPathError, Job, PathOutsideRootError



class SharedPathRoute(APIRoute):
    """Starlette answers a 405 from the first route whose path matches, so its ``Allow`` names only that route's
    methods; on a path several routes share (GET and POST /v1/documents) this one names all of them."""

    async def handle(self, scope, receive, send) -> None:
        if self.methods and scope["method"] not in self.methods:
            methods = {m for r in scope["app"].routes if isinstance(r, APIRoute) and r.path == self.path
                       for m in r.methods}
            raise HTTPException(405, headers={"Allow": ", ".join(sorted(methods))})
        await super().handle(scope, receive, send)


router = APIRouter(prefix="/v1", tags=["ingest"], dependencies=[AuthDep], responses=error_responses(UNAUTHORIZED),
                   route_class=SharedPathRoute)

START_ERRORS = error_responses({
    400: "A path holds a NUL byte or is a symbolic link loop (`invalid_path`), text that is not Unicode "
         "(`invalid_text`), or a tier is not configured (`unknown_tier`).",
    403: "A path is outside MMRAG_INGEST_ROOT, or server-side ingest is off (`path_not_allowed`).",
    **TOO_LARGE,
    **INVALID_REQUEST,
})
STATUS_ERRORS = error_responses({404: "No ingest job has this id (`unknown_job`).", **INVALID_REQUEST})


@router.post("/ingest", status_code=202, summary="Start an ingest job for server-side paths",
             response_model=IngestJob, responses=START_ERRORS)
async def start(body: IngestRequest, request: Request, services: TenantDep) -> dict:
    for tier in body.tiers:
        check_tier(tier, services.settings.tiers)
    try:
        job = services.jobs.submit(body.paths, recursive=body.recursive, tiers=body.tiers)
    except PathOutsideRootError as exc:
        raise ApiError(403, "path_not_allowed", str(exc), "ingest paths under MMRAG_INGEST_ROOT") from exc
    except InvalidPathError as exc:
        raise ApiError(400, "invalid_path", str(exc), "send the path of a file or folder under MMRAG_INGEST_ROOT"
                       ) from exc
    return public_job(request, job)


@router.get("/ingest", summary="Ingest jobs, newest first (paginated: limit/offset, then next_offset)",
            response_model=JobsPage, responses=error_responses(INVALID_REQUEST))
async def jobs(request: Request, services: TenantDep, limit: int = Query(100, ge=1, le=MAX_PAGE),
               offset: int = Query(0, ge=0)) -> dict:
    page, total = services.jobs.list(limit=limit, offset=offset)
    return {"jobs": [public_job(request, j) for j in page], "total": total, "limit": limit, "offset": offset,
            "next_offset": Paged.next_of(offset, len(page), total)}


@router.get("/ingest/{job_id}", summary="An ingest job's status and report", response_model=IngestJob,
            responses=STATUS_ERRORS)
async def status(job_id: str, request: Request, services: TenantDep) -> dict:
    return public_job(request, _job(services.jobs.get(job_id), job_id))


@router.post("/ingest/{job_id}/cancel", summary="Cancel an ingest job: a queued one never runs, a running one "
             "stops before its next page batch (`cancelling` until then); a finished one is returned as it is",
             response_model=IngestJob, responses=STATUS_ERRORS)
async def cancel(job_id: str, request: Request, services: TenantDep) -> dict:
    return public_job(request, _job(services.jobs.cancel(job_id), job_id))


def _job(job: Job | None, job_id: str) -> Job:
    if job is None:
        raise ApiError(404, "unknown_job", f"no ingest job {job_id}", "use an id POST /v1/ingest, POST "
                       "/v1/documents or GET /v1/ingest returned")
    return job


def public_job(request: Request, job: Job) -> dict:
    # A failed job's cause comes from a dependency (Qdrant, the feature store) and may name server folders.
    out = job.to_json()
    if out["error"]:
        out["error"] = hide_paths(request, out["error"])
    return out
