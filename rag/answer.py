"""Answers with citations and cache accounting: the shape `mmrag ask --json` and `POST /v1/ask` return."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mmrag.core.engine import Engine, PromptPlan, SamplingSpec, Usage
from mmrag.core.figures import PageFigure
from mmrag.core.payload import PagePayload

RANDOM_MODEL_NOTE = (
    "random-weight test model: its text is not meaningful; set MMRAG_MODEL to a Qwen2-VL, Qwen2.5-VL or Qwen3-VL "
    "checkpoint for real answers"
)


@dataclass(slots=True, frozen=True)
class Citation:
    page_id: str  # GET /v1/pages/{page_id}
    doc: str
    page: int
    score: float
    image_key: str = ""
    # The figure of the page the hit was on (a question naming its number, or its caption matching best): the
    # citation's ``figure`` {number, kind, caption, bbox}. None: the page as a whole.
    figure: PageFigure | None = None

    def to_json(self) -> dict[str, Any]:
        return {"page_id": self.page_id, "doc": self.doc, "page": self.page, "score": round(self.score, 4),
                "figure": self.figure.citation() if self.figure is not None else None}


@dataclass(slots=True)
class Answer:
    answer: str
    sub_questions: list[str]
    citations: list[Citation]
    usage: Usage
    model: str
    random_weights: bool
    sub_question_source: str = "none"
    extra: dict[str, Any] = field(default_factory=dict)
    # The answer cache (rag/answer_cache.py): "hit" (served from it, no engine request), "miss" (computed, and
    # kept), or "off" (no cache, or a sampled answer, which is never looked up).
    answer_cache: str = "off"

    def to_json(self) -> dict[str, Any]:
        u = self.usage
        return {
            "answer": self.answer,
            "sub_questions": self.sub_questions,
            "sub_question_source": self.sub_question_source,
            "citations": [c.to_json() for c in self.citations],
            "usage": {
                "prompt_tokens": u.prompt_tokens,
                "cached_tokens": u.cached_tokens,
                "image_tokens": u.image_tokens,
                "cached_image_tokens": u.cached_image_tokens,
                "vision_encodes": u.vision_encodes,
                "completion_tokens": u.completion_tokens,
                "ttft_s": round(u.ttft_s, 4),
                "latency_s": round(u.latency_s, 4),
                "image_input": u.image_input,
                "answer_cache": self.answer_cache,
            },
            "model": {
                "name": self.model,
                "random_weights": self.random_weights,
                "note": RANDOM_MODEL_NOTE if self.random_weights else "",
            },
            **self.extra,
        }


async def answer_over_pages(engine: Engine, question: str, pages: list[PagePayload], *, max_tokens: int,
                            cache_salt: str = "") -> Answer:
    """One prompt over explicitly chosen pages, in the order given, under ``cache_salt`` (the tenant's)."""
    plan = PromptPlan(
        images=tuple(p.image_key for p in pages),
        text=question,
        sampling=SamplingSpec(max_tokens=max_tokens),
        cache_salt=cache_salt,
    )
    completion = await engine.generate(plan)
    return Answer(
        answer=completion.text,
        sub_questions=[question],
        citations=[Citation(p.page_id, p.doc, p.page, 1.0, str(p.image_key)) for p in pages],
        usage=completion.usage,
        model=completion.model,
        random_weights=engine.random_weights,
    )
