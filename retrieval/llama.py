"""A llama-index retriever over PageSearcher, async for real.

llama-index's default ``_aretrieve`` calls the sync ``_retrieve``, which would block the event loop for
the whole search. Here it is the other way round: ``_aretrieve`` awaits the searcher, and the sync
``_retrieve`` runs that coroutine with ``asyncio.run`` only where no loop is running (a script, a REPL).
Inside a running loop it refuses, since blocking the loop (or nesting it) is exactly what this avoids.
"""

from __future__ import annotations

import asyncio

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.callbacks import CallbackManager
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

from mmrag.core.keys import page_point_id
from retrieval.search import Channel, Hit, PageSearcher

# Identifiers for citations and the engine, not words for the LLM or an embedding model.
_MACHINE_KEYS = ["doc_id", "image_key", "image_tokens", "path", "snippet", "channels"]


class SyncRetrieveInLoopError(RuntimeError):
    pass


class MMRAGRetriever(BaseRetriever):
    def __init__(
        self,
        searcher: PageSearcher,
        *,
        top_k: int | None = None,
        channels: Channel = Channel.HYBRID,
        doc_filter: list[str] | None = None,
        callback_manager: CallbackManager | None = None,
    ) -> None:
        super().__init__(callback_manager=callback_manager)
        self.searcher = searcher
        self.top_k = top_k
        self.channels = Channel(channels)
        self.doc_filter = doc_filter

    async def _aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return (await self.aretrieve_many([query_bundle.query_str]))[0]

    async def aretrieve_many(self, queries: list[str]) -> list[list[NodeWithScore]]:
        """Nodes for several sub-questions from one Qdrant round trip (``retrieve`` asks one at a time).

        Skips llama-index's retrieval events and callbacks; use ``aretrieve`` where those matter.
        """
        hits = await self.searcher.search_many(
            queries, doc_filter=self.doc_filter, top_k=self.top_k, channels=self.channels
        )
        return [[self._node(h) for h in per_query] for per_query in hits]

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            # No loop here: a private one for this call. A client bound to a server connection pool
            # lives on the loop that opened it, so sync use is for local mode and scripts.
            return asyncio.run(self._aretrieve(query_bundle))
        raise SyncRetrieveInLoopError(
            "MMRAGRetriever.retrieve() was called inside a running event loop, where it would block the "
            "loop; use `await retriever.aretrieve(query)` (or a query engine with use_async=True) instead"
        )

    def _node(self, hit: Hit) -> NodeWithScore:
        node = TextNode(
            id_=page_point_id(hit.doc_id, hit.page),
            text=hit.text or hit.snippet,
            metadata={
                "doc": hit.doc,
                "page": hit.page,
                "doc_id": hit.doc_id,
                "image_key": str(hit.image_key),
                "image_tokens": hit.image_tokens,
                "path": hit.path,
                "snippet": hit.snippet,
                "channels": self.channels.value,
            },
            excluded_llm_metadata_keys=_MACHINE_KEYS,
            excluded_embed_metadata_keys=_MACHINE_KEYS,
        )
        return NodeWithScore(node=node, score=hit.score)
