"""The mmrag pipeline as a llama-index query engine (async end to end)."""

from __future__ import annotations

import asyncio
from typing import Any

from llama_index.core.base.response.schema import Response
from llama_index.core.query_engine import CustomQueryEngine
from llama_index.core.schema import NodeWithScore, TextNode
from pydantic import ConfigDict

from rag.pipeline import Pipeline


class MMRAGQueryEngine(CustomQueryEngine):
    """``await engine.aquery(question)`` → a Response whose source nodes are the cited pages."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    pipeline: Any  # rag.pipeline.Pipeline (pydantic cannot validate it)
    docs: list[str] | None = None

    async def acustom_query(self, query_str: str) -> Response:
        answer = await self.pipeline.ask(query_str, docs=self.docs)
        nodes = [
            NodeWithScore(node=TextNode(text=f"{c.doc}, page {c.page}",
                                        metadata={"doc": c.doc, "page": c.page, "image_key": c.image_key}),
                          score=c.score)
            for c in answer.citations
        ]
        return Response(response=answer.answer, source_nodes=nodes, metadata=answer.to_json())

    def custom_query(self, query_str: str) -> Response:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.acustom_query(query_str))
        raise RuntimeError("MMRAGQueryEngine.query() was called inside a running event loop: use `await aquery()`")


def as_query_engine(pipeline: Pipeline, *, docs: list[str] | None = None) -> MMRAGQueryEngine:
    return MMRAGQueryEngine(pipeline=pipeline, docs=docs)
