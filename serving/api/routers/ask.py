from __future__ import annotations

import time

from fastapi import APIRouter

from serving.api.deps import AuthDep, ServicesDep
from serving.api.schemas import INVALID_REQUEST, TOO_LARGE, UNAUTHORIZED, AskRequest, AskResponse, error_responses

router = APIRouter(prefix="/v1", tags=["ask"], dependencies=[AuthDep], responses=error_responses(UNAUTHORIZED))

ASK_ERRORS = error_responses({
    400: "Empty or over-long question (`bad_question`), or an image-only search with the image channel off "
         "(`image_channel_off`).",
    404: "A document named in `docs` is not ingested (`unknown_document`), or nothing is (`no_documents`).",
    409: "A retrieved page's image tokens are not stored (`missing_image_tokens`): re-ingest it.",
    **TOO_LARGE,
    **INVALID_REQUEST,
    502: "The engine rejected the prompt (`engine_rejected`).",
    503: "The engine, Qdrant or the feature store does not answer (`engine_unavailable`, "
         "`retrieval_unavailable`, `feature_store_unavailable`, `index_unavailable`, ...).",
})


# exclude_unset: `sub_answers` stays absent (not null) on an answer that found no pages, as before.
@router.post("/ask", summary="Answer a question with page citations and cache accounting",
             response_model=AskResponse, response_model_exclude_unset=True, responses=ASK_ERRORS)
async def ask(body: AskRequest, services: ServicesDep) -> dict:
    started = time.perf_counter()
    ok = False
    try:
        answer = await services.pipeline.ask(body.question, docs=body.docs)
        ok = True
        return answer.to_json()
    finally:
        services.metrics.record_answer(time.perf_counter() - started, ok)
