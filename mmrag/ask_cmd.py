"""`mmrag ask` and `mmrag warm`: parts from mmrag/wiring/."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape

from mmrag.core.keys import UnknownTierError
from mmrag.core.settings import DEFAULT_TENANT, Settings
from mmrag import wiring
from rag.answer import Answer, answer_over_pages
from serving.api.schemas import FigureCitation
from serving.warmup import WarmCandidate, WarmReport, leading_images, rank_by_demand, warm

if TYPE_CHECKING:
    from mmrag.adapters.qdrant import PageIndex
    from mmrag.core.figures import PageFigure
    from mmrag.core.payload import PagePayload
    from mmrag.core.scope import TenantScope


class PageNotFoundError(LookupError):
    pass


class ArgumentError(ValueError):
    """A command-line argument in the wrong form; the message shows the right one."""


def parse_page_refs(spec: str) -> list[tuple[str, int]]:
    """``report.pdf:2,slides.png:1`` → [("report.pdf", 2), ("slides.png", 1)]."""
    refs = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        doc, sep, page = item.rpartition(":")
        if not sep or not doc or not page.isdigit() or int(page) < 1:
            raise ArgumentError(f"--pages takes DOC:PAGE items (e.g. report.pdf:2), got {item!r}")
        refs.append((doc, int(page)))
    if not refs:
        raise ArgumentError("--pages is empty; give DOC:PAGE items, e.g. report.pdf:2,slides.png:1")
    return refs


def open_page_index(settings: Settings, collection: str | None = None) -> PageIndex:
    # Read-only use: no embedder is loaded and no sizes are needed; writers check them (ensure_collection).
    # ``collection``: a tenant's (None: the default tenant's).
    index = wiring.read_index(settings, collection=collection)
    if not index.client.collection_exists(index.collection):
        raise PageNotFoundError("no documents ingested yet: run `mmrag ingest PATH...` first")
    return index


def lookup_pages(index: PageIndex, refs: list[tuple[str, int]]) -> list[PagePayload]:
    pages = []
    for doc, page in refs:
        payload = index.find_page(doc, page)
        if payload is None:
            raise PageNotFoundError(
                f"page {page} of {doc!r} is not in the index: check `mmrag index stats`, or ingest the file first"
            )
        pages.append(payload)
    return pages


def check_tier(settings: Settings, tier: str) -> str:
    """``--tier``: a configured tier, or an ArgumentError naming them."""
    try:
        settings.vision.tier_table.policy(tier)
    except UnknownTierError as exc:
        raise ArgumentError(f"--tier: {exc}") from None
    return tier


def ask(question: str, pages_spec: str | None, *, docs: list[str] | None, max_tokens: int | None,
        console: Console, tier: str | None = None, tenant: str = DEFAULT_TENANT, answer_mode: str | None = None
        ) -> Answer:
    """Over given pages (``--pages``), or through the whole pipeline: sub-questions, retrieval, cited answer
    (its pages in ``tier``; ``--pages`` shows them as indexed)."""
    if not question.strip():
        raise ArgumentError("the question is empty: ask something, e.g. mmrag ask \"What does the chart show?\"")
    refs = parse_page_refs(pages_spec) if pages_spec else None
    settings, scope = wiring.for_tenant(tenant)
    if tier is not None:
        if refs is not None:
            raise ArgumentError("--tier applies to retrieved pages; leave it out with --pages")
        check_tier(settings, tier)
    if max_tokens:
        settings = settings.replace(**{"answer_max_tokens": max_tokens})
    if answer_mode is not None:
        if refs is not None:
            raise ArgumentError("--answer-mode applies to retrieved pages; leave it out with --pages (one prompt "
                                "over the pages given)")
        settings = settings.replace(**{"answer_mode": answer_mode})
    pages = None
    if refs is not None:
        index = open_page_index(settings, scope.collection)
        try:
            pages = lookup_pages(index, refs)
        finally:
            index.client.close()
    model = wiring.resolve_model(settings)
    console.print(f"model: {model.describe()}")
    return asyncio.run(_ask(settings, scope, model, question, pages, docs, tier))


async def _ask(settings: Settings, scope: TenantScope, model, question: str, pages, docs, tier: str | None
               ) -> Answer:
    engine = wiring.engine(settings, model)
    try:
        if pages is not None:
            return await answer_over_pages(engine, question, pages, max_tokens=settings.answer.max_tokens,
                                           cache_salt=scope.cache_salt)
        pipeline, _ = wiring.pipeline(settings, engine, scope=scope)
        try:
            return await pipeline.ask(question, docs=docs, tier=tier)
        finally:
            await pipeline.searcher.client.close()
    finally:
        await engine.close()


def warm_pages(*, top: int | None, pages_spec: str | None, share: float, tenant: str = DEFAULT_TENANT
               ) -> WarmReport:
    """Warm the running engine replicas (MMRAG_ENGINE_URLS) with the tenant's pages, under its cache salt (only
    its questions can hit them): never a throwaway engine in this process."""
    settings, scope = wiring.for_tenant(tenant)
    model = wiring.resolve_model(settings)
    engine = wiring.engine(settings, model, allow_inprocess=False)
    index = open_page_index(settings, scope.collection)
    try:
        if pages_spec:
            payloads = lookup_pages(index, parse_page_refs(pages_spec))
        else:
            payloads = index.pages()
        encoder = wiring.encoder_scope(settings, model)  # another encoder's pages are never served, so never warmed
        candidates = rank_by_demand((key, tokens) for key, tokens in
                                    leading_images(payloads, figure_crops=settings.answer.figure_crops,
                                                   by_pixels=settings.page_image_channel)
                                    if encoder.covers(key))
        if not pages_spec:
            candidates = candidates[:top] if top else candidates
    finally:
        index.client.close()
    return asyncio.run(_warm(engine, candidates, share, scope.cache_salt))


async def _warm(engine, candidates: list[WarmCandidate], share: float, cache_salt: str) -> WarmReport:
    try:
        return await warm(engine, candidates, share=share, cache_salt=cache_salt)
    finally:
        await engine.close()


def figure_note(figure: PageFigure | None) -> str:
    """A citation's figure as `mmrag ask` prints it: ``, Figure 3: Revenue by quarter (box 72,90,540,400 pt)``,
    the box in points, top-left origin (GET /v1/pages/{id}/image?figure=3 outlines it); empty for a whole page."""
    if figure is None:
        return ""
    cited = FigureCitation.model_validate(figure.citation())
    return f", {cited.reference()} (box {','.join(f'{v:g}' for v in cited.bbox)} pt)"


def print_answer(answer: Answer, console: Console) -> None:
    data = answer.to_json()
    if answer.random_weights:
        console.print(f"[yellow]note:[/] {data['model']['note']}")
    if len(answer.sub_questions) > 1 or answer.sub_question_source != "none":
        console.print(f"sub-questions ({answer.sub_question_source}):")
        for q in answer.sub_questions:
            console.print(escape(f"  - {q}"))
    if "answer_mode" in data:
        why = f" ({data['answer_mode_reason']})" if "answer_mode_reason" in data else ""
        console.print(escape(f"answer mode: {data['answer_mode']}{why}"))
    console.print(f"[bold]answer[/] ({escape(answer.model)}): {escape(answer.answer)}")
    for c in answer.citations:
        console.print(escape(f"  cited: [{c.doc}, page {c.page}] score {c.score:.3f}{figure_note(c.figure)}"))
    u = data["usage"]
    console.print(
        f"usage: {u['prompt_tokens']} prompt tokens, {u['cached_tokens']} cached; {u['image_tokens']} image tokens, "
        f"{u['cached_image_tokens']} from cache ({u['image_input'] or 'no images'}); vision encodes "
        f"{u['vision_encodes']}; TTFT {u['ttft_s']:.3f}s"
    )
