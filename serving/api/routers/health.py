from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from serving.api.deps import ServicesDep

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="Liveness: the process answers")
async def healthz() -> dict:
    return {"status": "ok"}


@router.get("/readyz", summary="Readiness: engine, Qdrant and Redis answer")
async def readyz(services: ServicesDep) -> JSONResponse:
    checks = {"engine": _engine(services), "qdrant": _qdrant(services), "redis": _redis(services)}
    results = dict(zip(checks, await asyncio.gather(*checks.values())))
    ready = all(r["ok"] for r in results.values())
    return JSONResponse({"ready": ready, "checks": results}, status_code=200 if ready else 503)


async def _check(coro) -> dict:
    try:
        detail = await asyncio.wait_for(coro, timeout=5)
    except Exception as exc:  # readiness reports any failure as not ready, with its cause
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    return {"ok": True, "detail": detail}


async def _engine(services) -> dict:
    async def probe():
        cap = await services.engine.kv_capacity()
        return f"{cap.blocks} KV blocks of {cap.block_size} tokens"
    return await _check(probe())


async def _qdrant(services) -> dict:
    async def probe():
        return f"{len((await services.qdrant.get_collections()).collections)} collections"
    return await _check(probe())


async def _redis(services) -> dict:
    if services.store.backend != "redis":
        return {"ok": True, "detail": "not configured (disk feature store)"}
    return await _check(asyncio.to_thread(lambda: services.store.client.ping() and "PONG"))
