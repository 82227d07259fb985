from __future__ import annotations

from fastapi import APIRouter, Request

from serving.api.deps import AuthDep, ServicesDep
from serving.api.schemas import INVALID_REQUEST, TOO_LARGE, UNAUTHORIZED, AskRequest, AskResponse, error_responses

router = APIRouter(prefix="/v1", tags=["ask"], dependencies=[AuthDep], responses=error_responses(UNAUTHORIZED))

ASK_ERRORS = error_responses({
    400: "Empty or over-long question (`bad_question`), or an image-only search with the image channel off "
         "(`image_channel_off`).",
    404: "A document named in `docs` is not ingested (`unknown_document`), or nothing is (`no_documents`).",
    409: "A retrieved page's image tokens are not stored (`missing_image_tokens`): re-ingest it; or every "
         "page is of another vision encoder than the configured one (`stale_index`): re-ingest or set it back.",
    **TOO_LARGE,
    **INVALID_REQUEST,
    429: "More questions are being answered than the server takes at once (`overloaded`): retry after the "
         "`Retry-After` seconds.",
    502: "The engine rejected the prompt (`engine_rejected`).",
    503: "The engine, Qdrant or the feature store does not answer (`engine_unavailable`, "
         "`retrieval_unavailable`, `feature_store_unavailable`, `index_unavailable`, ...).",
})


# exclude_unset: `sub_answers` stays absent (not null) on an answer that found no pages, as before.
@router.post("/ask", summary="Answer a question with page citations and cache accounting",
             response_model=AskResponse, response_model_exclude_unset=True, responses=ASK_ERRORS)
async def ask(body: AskRequest, request: Request, services: ServicesDep) -> dict:
    # Refused at once when full (429); cancelled, its plans and engine requests with it, when the client
    # leaves. Admission counts every outcome in the answers metric.
    async with services.admission.admit():
        answer = await services.admission.until_disconnect(
            request, services.pipeline.ask(body.question, docs=body.docs))
        return answer.to_json()
