from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request, Response

from serving.api.deps import ServicesDep
from serving.api.schemas import Readiness
from serving.http.errors import hide_paths
from serving.http.schemas import Check, Health

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="Liveness: the process answers", response_model=Health)
async def healthz() -> Health:
    return Health(status="ok")


# exclude_unset: a check carries `detail` or `error`, never both as nulls (the shape probes already parse).
@router.get("/readyz", summary="Readiness: engine, Qdrant and Redis answer", response_model=Readiness,
            response_model_exclude_unset=True,
            responses={503: {"model": Readiness, "description": "Not ready: at least one check failed; "
                                                                "its `error` says why."}})
async def readyz(services: ServicesDep, request: Request, response: Response) -> Readiness:
    checks = {"engine": _engine(services), "qdrant": _qdrant(services), "redis": _redis(services)}
    results = dict(zip(checks, await asyncio.gather(*checks.values())))
    for check in results.values():  # causes are for the operator, server folders are not for the caller
        if check.error is not None:
            check.error = hide_paths(request, check.error)
    ready = all(r.ok for r in results.values())
    response.status_code = 200 if ready else 503  # orchestrators read the status, not the body
    return Readiness(ready=ready, checks=results)


async def _check(coro) -> Check:
    try:
        detail = await asyncio.wait_for(coro, timeout=5)
    except Exception as exc:  # readiness reports any failure as not ready, with its cause
        return Check(ok=False, error=f"{type(exc).__name__}: {exc}")
    return Check(ok=True, detail=detail)


async def _engine(services) -> Check:
    async def probe():
        cap = await services.engine.kv_capacity()
        return f"{cap.blocks} KV blocks of {cap.block_size} tokens"
    return await _check(probe())


async def _qdrant(services) -> Check:
    async def probe():  # answered, but not with what it holds: the count of collections would count the tenants
        await services.qdrant.get_collections()
        return "answers"
    return await _check(probe())


async def _redis(services) -> Check:
    if services.store.backend != "redis":
        return Check(ok=True, detail="not configured (disk feature store)")
    return await _check(asyncio.to_thread(lambda: services.store.client.ping() and "PONG"))
