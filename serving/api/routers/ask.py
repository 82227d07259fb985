from __future__ import annotations

import time

from fastapi import APIRouter
from pydantic import BaseModel, Field

from serving.api.deps import AuthDep, ServicesDep

router = APIRouter(prefix="/v1", tags=["ask"], dependencies=[AuthDep])


class AskRequest(BaseModel):
    question: str = Field(description="The question; it is split into sub-questions.")
    docs: list[str] | None = Field(default=None, description="Only search these documents (file names or ids).")


@router.post("/ask", summary="Answer a question with page citations and cache accounting")
async def ask(body: AskRequest, services: ServicesDep) -> dict:
    started = time.perf_counter()
    ok = False
    try:
        answer = await services.pipeline.ask(body.question, docs=body.docs)
        ok = True
        return answer.to_json()
    finally:
        services.metrics.record_answer(time.perf_counter() - started, ok)
