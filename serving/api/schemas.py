"""Every request and response body of the REST API: the contract /openapi.json publishes.

Routes only route; the shapes live here. Response models forbid unknown keys, so a field added to
``Answer.to_json()`` (or a job's report) without being documented here fails the API tests loudly instead of
being silently dropped from the answer or missing from the OpenAPI document.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from mmrag.core.figures import FigureKind, figure_reference
from mmrag.core.pages import TextSource
from mmrag.core.payload import PagePayload
from serving.http.schemas import Check, ErrorDetail, ResponseBody


class Readiness(ResponseBody):
    ready: bool = Field(description="True when every check is ok; the status is then 200, else 503.")
    checks: dict[Literal["engine", "qdrant", "redis"], Check] = Field(
        description="One check per dependency: the engine's KV cache, Qdrant, and Redis (ok when not configured)."
    )


# --- ask -------------------------------------------------------------------------------------------------


CONVERSATION_ID = r"^[A-Za-z0-9_-]{1,64}$"
CONVERSATION_ID_DESCRIPTION = (
    "Names the images of this conversation. With images: they are kept under it (a new id is made when absent) "
    "and replace what it held. Without images: the images it holds are shown again, none resent; an unknown or "
    "expired id is a 404 (`unknown_conversation`), and images whose tokens went meanwhile a 409 "
    "(`image_expired`): send them again. /v1/chat/completions keeps no conversation."
)


class QuestionImageData(BaseModel):
    data: str = Field(description="The image file's bytes in base64 (standard alphabet, padded), or a data URL "
                                  "(`data:image/png;base64,...`). PNG, JPEG, WebP or TIFF, read from the bytes; "
                                  "at most MMRAG_MAX_IMAGE_BYTES decoded, MMRAG_MAX_IMAGE_PIXELS pixels.")


STREAM_DESCRIPTION = (
    "Answer with server-sent events (`text/event-stream`) instead of one JSON body: the sub-questions, the "
    "citations, each sub-answer as it finishes (per sub-question), the answer's tokens as they are generated, then `done` with the "
    "whole answer (the non-streamed body). Errors found before the stream starts are the usual JSON error.")
TIER_DESCRIPTION = (
    "Resolution tier to show the pages in (MMRAG_TIERS, e.g. `low`: 2x2-pooled, a quarter of the image tokens; "
    "`high`: more pixels). A page not stored in it is encoded on demand from its source (counted in "
    "`usage.vision_encodes`), or when its source is gone served in the nearest stored tier (`tier.fell_back`). "
    "Absent: `standard`, as ingested. The question's own images stay in `standard`.")


# The old names (one_prompt, per_image, per_sub_question) are accepted one more release, with a deprecation line
# in the server's log: mmrag/core/settings.DEPRECATED_ANSWER_MODES says what each is now.
AnswerModeName = Literal["auto", "split", "joint", "one_prompt", "per_image", "per_sub_question"]
ANSWER_MODE_DESCRIPTION = (
    "How the retrieved pages become the answer: `split` (each shown page, or figure crop, leads a prompt of its "
    "own with the parts of the question that found it; the parts, each under a heading naming its page, are one "
    "answer of the answer's length: every recurring page reuses its cached prefix), `joint` (one prompt over the "
    "pages, for questions that need them seen together; when they do not fit one prompt, a prompt per "
    "sub-question and a synthesis), or `auto` (per question: joint when the question relates items across pages, "
    "e.g. compare, difference, both; else split). Absent: MMRAG_ANSWER_MODE. "
    "The answer's `answer_mode` and `answer_mode_reason` say which one served and why. Deprecated, one release: "
    "`one_prompt` (joint), `per_image` (split), `per_sub_question` (joint).")
MAX_TOKENS_DESCRIPTION = ("Most tokens the answer generates; at most MMRAG_ANSWER_MAX_TOKENS, which is the default "
                          "(a larger value is served at that).")


class AskRequest(BaseModel):
    question: str = Field(description="The question; it is split into sub-questions.")
    docs: list[str] | None = Field(default=None, description="Only search these documents (file names or ids).")
    images: list[QuestionImageData] = Field(
        default_factory=list, description="Images the question is about (at most MMRAG_MAX_QUESTION_IMAGES): shown "
        "first in every prompt of the question, before the retrieved pages. Retrieval uses the text only. "
        "POST /v1/ask/upload takes them as files instead.")
    conversation_id: str | None = Field(default=None, pattern=CONVERSATION_ID, description=CONVERSATION_ID_DESCRIPTION)
    stream: bool = Field(default=False, description=STREAM_DESCRIPTION)
    tier: str | None = Field(default=None, max_length=64, description=TIER_DESCRIPTION)
    answer_mode: AnswerModeName | None = Field(default=None, description=ANSWER_MODE_DESCRIPTION)
    max_tokens: int | None = Field(default=None, ge=1, description=MAX_TOKENS_DESCRIPTION)


BBOX_DESCRIPTION = (
    "x0, y0, x1, y1 in PDF points (1/72 inch) with a top-left origin, y growing down: the box on the page as GET "
    "/v1/pages/{page_id}/image renders it, at scale MMRAG_PDF_DPI/72 pixels per point (an image document: its "
    "pixels, scale 1). GET /v1/pages/{page_id}/image?figure=N draws it.")


class FigureCitation(ResponseBody):
    """The figure (or table) of the cited page that the answer drew on."""

    number: int | None = Field(description="N of its caption (\"Figure 3\", \"Table 2\"); null when it has no "
                               "whole number (uncaptioned, or numbered like 3.2: the caption still says so).")
    kind: FigureKind = Field(description="`figure`, `table`, `image` (an uncaptioned picture) or `slide`.")
    caption: str = Field(description="Its caption line as printed on the page; empty when it has none.")
    bbox: list[float] = Field(min_length=4, max_length=4, description=BBOX_DESCRIPTION)

    def reference(self) -> str:
        """How a footnote or `mmrag ask` names it (mmrag/core/figures.py figure_reference): "Figure 3: Revenue by
        quarter"."""
        return figure_reference(self.kind, self.number, self.caption)


class Citation(ResponseBody):
    page_id: str = Field(description="The cited page's id: fetch it with GET /v1/pages/{page_id}.")
    doc: str = Field(description="File name of the cited document.")
    page: int = Field(description="1-based page number in that document.")
    score: float = Field(description="Retrieval score, rounded to 4 places: cosine similarity for one channel, "
                                     "reciprocal-rank-fusion score for hybrid search. Citations are best first.")
    figure: FigureCitation | None = Field(
        default=None, description="The figure of the page the hit was on (the question named its number, or its "
        "caption matched best); null when the hit was the page as a whole. GET "
        "/v1/pages/{page_id}/image?figure=N shows it outlined (N: its `number`, `&kind=table` for a table; `bbox=` "
        "for one without).")


class Usage(ResponseBody):
    prompt_tokens: int = Field(description="Prompt tokens over all completions of this answer, images included.")
    cached_tokens: int = Field(description="Of those, tokens whose KV came from the engine's prefix cache.")
    image_tokens: int = Field(description="Prompt tokens that are image tokens: the pages' and the question's.")
    cached_image_tokens: int = Field(description="Of those, image tokens served from the prefix cache.")
    vision_encodes: int = Field(description="Vision-encoder forwards done for this request: one per question image "
                                            "whose tokens were not stored yet (pages are encoded at ingest).")
    completion_tokens: int = Field(description="Generated tokens over all completions.")
    ttft_s: float = Field(description="Time to first token in seconds, summed over the completions.")
    latency_s: float = Field(description="Completion latency in seconds, summed over the completions.")
    image_input: str = Field(description="The form that sent the images to the engine (MMRAG_IMAGE_INPUT): "
                             "`embeds` (stored image tokens) or `pixels` (the engine's own encoder, under the "
                             "pages' image keys); `embeds` for a pooled tier in either; empty when no prompt ran.")
    answer_cache: Literal["hit", "miss", "off"] = Field(
        description="The answer cache (MMRAG_ANSWER_CACHE): `hit`, served from an earlier answer to the same "
        "question over the same pages, model and prompts, with no engine request (the token counts are then 0); "
        "`miss`, computed and kept; `off`, the cache is off or the answer was sampled (temperature > 0).")


class ModelInfo(ResponseBody):
    name: str = Field(description="The served model.")
    random_weights: bool = Field(description="True for the random-weight test model: its text is not meaningful.")
    note: str = Field(description="Why the answer text may be meaningless and how to fix it; empty for real weights.")


class SubAnswer(ResponseBody):
    sub_question: str = Field(description="One sub-question, as it was asked (its prompt also names the figure "
                              "crops it shows, with MMRAG_FIGURE_CROPS).")
    answer: str = Field(description="The model's answer to it, before synthesis.")
    page: str | None = Field(default=None, description="MMRAG_LAYOUT=per_page: the one page this answer saw, "
                             "as `[document, page N]`; absent when the sub-question's pages were seen together.")


class ImageAnswer(ResponseBody):
    page: str = Field(description="The page this part saw, as `[document, page N]`, and the figure's caption when "
                      "it saw the figure's crop alone (MMRAG_FIGURE_CROPS).")
    image: str = Field(description="The image key it saw: the page's, or its figure crop's.")
    answer: str = Field(description="The model's answer from that image alone (the answer joins these parts).")


class Timings(ResponseBody):
    """Where the answer's time went, in seconds of wall time, stage by stage (a stage that did not run is
    absent: no pages found; one prompt, so no sub-answers; or one sub-answer and so no synthesis)."""

    admission_s: float | None = Field(default=None, description="Waiting for a place among the questions in "
                                      "flight (MMRAG_MAX_QUESTIONS_IN_FLIGHT, the tenant's fair share of them): 0 "
                                      "when one was free.")
    decompose_s: float = Field(description="Splitting the question (a model request, or the rules).")
    retrieve_s: float = Field(description="The batched Qdrant search of every sub-question.")
    answer_s: float | None = Field(default=None, description="The joint prompt, or a split answer's parts side by "
                                   "side: scheduler queueing, prefill and decode included.")
    sub_answers_s: float | None = Field(default=None, description="Joint's overflow: every sub-question's prompt, "
                                        "scheduler queueing, prefill and decode included, all at once.")
    synthesis_s: float | None = Field(default=None, description="The final prompt over the sub-answers.")


class QuestionImageInfo(ResponseBody):
    image_key: str = Field(description="Key of the image's tokens (content hash, encoder, policy), as for pages.")
    image_tokens: int = Field(description="Image tokens it takes in each prompt.")


class TierInfo(ResponseBody):
    name: str = Field(description="The resolution tier the question asked for.")
    fell_back: list[str] = Field(description="Pages served in another tier, as `[document, page N]: <tier> "
                                             "(<why>)`: their source could not be rendered for an on-demand encode.")


class AskResponse(ResponseBody):
    answer: str = Field(description="The answer: a joint prompt's, a split answer's parts under their headings, or "
                        "joint's overflow synthesised from the sub-answers.")
    sub_questions: list[str] = Field(description="The sub-questions the question was split into.")
    sub_question_source: Literal["model", "rules", "none"] = Field(
        description="Who split the question: the model, the rule-based fallback, or `none`."
    )
    citations: list[Citation] = Field(description="Every retrieved page once, best score first.")
    usage: Usage = Field(description="Token and cache accounting over every completion of this answer.")
    model: ModelInfo = Field(description="The model that answered.")
    answer_mode: Literal["split", "joint"] | None = Field(
        default=None, description="The strategy that served (see the request's `answer_mode`); absent when no "
        "page was found.")
    answer_mode_reason: str | None = Field(
        default=None, description="Which rule chose the strategy (auto), or that it was asked for; a joint answer "
        "that did not fit one prompt says so here.")
    image_answers: list[ImageAnswer] | None = Field(
        default=None, description="`split`: each image's own part of the answer, in the answer's order.")
    sub_answers: list[SubAnswer] | None = Field(
        default=None, description="`joint` that did not fit one prompt: each sub-question's own answer; absent "
        "otherwise."
    )
    timings: Timings | None = Field(default=None, description="Seconds per stage of this answer.")
    conversation_id: str | None = Field(default=None, description="The conversation holding this question's images: "
                                        "send it with a follow-up to ask about them again without resending them. "
                                        "Absent when the question had no images.")
    tier: TierInfo | None = Field(default=None, description="The resolution tier asked for; absent when the "
                                  "question asked for none.")
    question_images: list[QuestionImageInfo] | None = Field(
        default=None, description="The question's images, as shown first in its prompts; absent when it had none.")
    pages_left_out: list[str] | None = Field(
        default=None, description="Retrieved pages no prompt showed, as `[document, page N]`, best first: the "
        "question's images took their places (a prompt holds MMRAG_MAX_IMAGES_PER_PROMPT images), the answer's "
        "page budget (MMRAG_ONE_PROMPT_PAGES) had no room for them, or another page stood out for a one-part "
        "question. Not cited.")
    pages_deleted: list[str] | None = Field(
        default=None, description="Retrieved pages whose document was deleted (their image tokens gone) before "
        "the answer could show them, as `[document, page N]`: left out as if not retrieved, not cited. Absent when "
        "none was.")


# --- documents and pages ---------------------------------------------------------------------------------


class DocumentPage(ResponseBody):
    page: int = Field(description="1-based page number.")
    page_id: str = Field(description="The page's id: GET /v1/pages/{page_id} and /v1/pages/{page_id}/image.")


SOURCE_PATH_DESCRIPTION = (
    "Where the source file is, as a client can name it: relative to the ingest root (MMRAG_INGEST_ROOT, a "
    "tenant's own folder under it) for a file ingested from there, else its file name (an upload, or a file "
    "`mmrag ingest` read from elsewhere). Never an absolute server path.")


class Document(ResponseBody):
    doc_id: str = Field(description="Stable id of the document (from its resolved source path).")
    doc: str = Field(description="File name; what citations and the `docs` filter of /v1/ask name.")
    path: str = Field(description=SOURCE_PATH_DESCRIPTION)
    num_pages: int = Field(description="Pages in the source file.")
    indexed_pages: int = Field(description="Pages of it in the index.")
    pages: list[DocumentPage] = Field(description="The indexed pages with their ids, by page number.")


class DocumentList(ResponseBody):
    documents: list[Document] = Field(description="Ingested documents, by file name.")


class Page(ResponseBody):
    id: str = Field(description="The page's id (as in citations and GET /v1/documents).")
    doc_id: str = Field(description="Id of the page's document.")
    doc: str = Field(description="File name of the page's document.")
    path: str = Field(description=SOURCE_PATH_DESCRIPTION + " The image is rendered from the file on request.")
    page: int = Field(description="1-based page number.")
    num_pages: int = Field(description="Pages in the source file.")
    image_key: str = Field(description="Key of the page's stored image tokens (content hash, encoder, policy).")
    image_tokens: int = Field(description="Image tokens the page takes in a prompt.")
    text: str = Field(description="The page's text (text layer or OCR; empty when it has none).")
    text_source: TextSource = Field(description="Where the text came from.")
    width: int = Field(description="Width in pixels of the page image the model sees.")
    height: int = Field(description="Height in pixels of the page image the model sees.")
    figures: list[FigureCitation] = Field(
        default=[], description="The page's figures and tables found at ingest (PDF pages, MMRAG_FIGURES), as "
        "found: what a citation's `figure` names. GET /v1/pages/{page_id}/image?figure=N outlines one (N: its "
        "`number`, `&kind=table` for a table; `bbox=` for one without a number). Empty for an image document, a page "
        "with none, or one indexed before figures were found.")

    @classmethod
    def of(cls, page: PagePayload, *, path: str) -> Page:
        """``path``: the page's source path as the client sees it (never ``page.path``, the server's own)."""
        return cls(id=page.page_id, doc_id=page.doc_id, doc=page.doc, path=path, page=page.page,
                   num_pages=page.num_pages, image_key=str(page.image_key), image_tokens=page.image_tokens,
                   text=page.text, text_source=page.text_source, width=page.width, height=page.height,
                   figures=[FigureCitation(**f.citation()) for f in page.figures])


PNG_RESPONSE: dict[int | str, dict[str, Any]] = {
    200: {"description": "The page image as PNG, rendered again from its source file; with `figure` or `bbox`, that "
                         "box outlined in red (3 px, inside the box).",
          "content": {"image/png": {"schema": {"type": "string", "format": "binary"}}}},
}


# --- ingest ----------------------------------------------------------------------------------------------


class IngestRequest(BaseModel):
    paths: list[str] = Field(min_length=1, description="Server-side files or folders under MMRAG_INGEST_ROOT.")
    # strict: JSON `true`/`false` only, as the schema says; lax pydantic would read 0, 1 or "yes" as a bool.
    recursive: bool = Field(default=False, strict=True,
                            description="Also ingest files in sub-folders of the given folders.")
    tiers: list[str] = Field(default=[], max_length=8, description="Resolution tiers (MMRAG_TIERS) to encode the "
                             "pages in too, beside MMRAG_INGEST_TIERS: questions in them need no on-demand encode.")


class FileFailure(ResponseBody):
    path: str = Field(description="A file that was not ingested.")
    error: str = Field(description="Why, and what to change.")


class IngestReport(ResponseBody):
    files: int = Field(description="Files ingested.")
    pages: int = Field(description="Pages indexed.")
    encoded: int = Field(description="Pages newly vision-encoded.")
    cached: int = Field(description="Pages whose image tokens were already stored.")
    figures: int = Field(default=0, description="Figures found on the PDF pages (MMRAG_FIGURES), each cropped as an "
                                                "image entry of its own.")
    figures_encoded: int = Field(default=0, description="Figure crops newly vision-encoded (a figure stored "
                                                        "already, from this or another document, needs none).")
    failed: list[FileFailure] = Field(description="Files that failed; the others were ingested.")
    seconds: float = Field(description="Wall time of the run.")
    unchanged_files: int = Field(description="Files skipped: same bytes and settings as already indexed.")
    ocr_pages: int = Field(description="Pages whose text came from OCR.")
    stage_seconds: dict[str, float] = Field(description="Seconds per stage (render, text, ocr, encode, embed, index).")
    figures_skipped: list[dict[str, Any]] = Field(default=[], description="Pages kept with their image and text "
                                                  "but no figures: over the figure step's object count or time "
                                                  "budget (`doc`, `page`, `why`).")


class IngestJob(ResponseBody):
    id: str = Field(description="Job id: poll GET /v1/ingest/{id}.")
    paths: list[str] = Field(description="The resolved paths being ingested.")
    recursive: bool = Field(description="Whether sub-folders are ingested.")
    status: Literal["queued", "running", "done", "failed"] = Field(description="Where the job is.")
    report: IngestReport | None = Field(description="The ingest report once `done`, else null.")
    error: str | None = Field(description="Why the job failed when `failed`, else null.")
    submitted_at: float = Field(description="Unix time the job was submitted.")
    finished_at: float | None = Field(description="Unix time it finished, null until then.")


class AskEvent(ResponseBody):
    """One server-sent event of a streamed answer (`"stream": true`): `event: <event>` and `data: <this, as
    JSON>`. Which fields an event carries depends on its `event`."""

    event: Literal["sub_questions", "citations", "sub_answer", "token", "done", "error"] = Field(
        description="`sub_questions` (after decomposition), `citations` (after retrieval), `sub_answer` "
        "(joint's overflow only: one per prompt, as each finishes), `token` (a piece of the final answer, as "
        "generated; a split answer's parts in order, each part's heading first; the pieces concatenate to "
        "`done.answer.answer`), `done` (last: the whole answer), or `error` (last: the answer failed after "
        "the stream had started).")
    sub_questions: list[str] | None = Field(default=None, description="`sub_questions`: the sub-questions.")
    sub_question_source: str | None = Field(default=None, description="`sub_questions`: who split the question.")
    citations: list[Citation] | None = Field(default=None, description="`citations`: every page shown.")
    answer_mode: str | None = Field(default=None, description="`citations`: the strategy that will answer "
                                    "(`split` or `joint`).")
    sub_question: str | None = Field(default=None, description="`sub_answer`: the sub-question answered.")
    page: str | None = Field(default=None, description="`sub_answer`: the page it is about, where it is one page's.")
    text: str | None = Field(default=None, description="`token`: the next piece of the answer's text.")
    answer: AskResponse | str | None = Field(
        default=None, description="`done`: the whole answer, as `stream: false` returns it; `sub_answer`: the "
        "sub-answer's text.")
    error: ErrorDetail | None = Field(default=None, description="`error`: what failed, as in an error body.")
