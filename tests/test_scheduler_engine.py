"""The scheduler in front of the real vLLM engine: ordering + canonical layout turn a shared page into hits."""

from __future__ import annotations

import asyncio

from qdrant_client import QdrantClient

from mmrag.core.keys import ImageKey
from rag.order import canonical_order
from mmrag.core.engine import Layout, PromptPlan, SamplingSpec
from serving.scheduler import Policy, Scheduler, SchedulerConfig

SAMPLING = SamplingSpec(max_tokens=4)


def distinct_keys(settings, n: int) -> list[tuple[ImageKey, int]]:
    client = QdrantClient(path=str(settings.storage.qdrant_path))
    try:
        points, _ = client.scroll(settings.storage.qdrant_collection, limit=1000, with_payload=True)
    finally:
        client.close()
    tokens = {p.payload["image_key"]: p.payload["image_tokens"] for p in points}
    return [(ImageKey.parse(k), tokens[k]) for k in sorted(tokens)[-n:]]  # the end of the key order: unused elsewhere


async def run_batch(engine, policy: Policy, layout: Layout, pages_per_plan) -> int:
    await engine.reset_prefix_cache()
    tokens = {k: n for plan in pages_per_plan for k, n in plan}
    keyed = [[k for k, _ in plan] for plan in pages_per_plan]
    orders = canonical_order(keyed) if layout is Layout.CANONICAL else keyed  # naive: retrieval-score order
    plans = [PromptPlan(images=tuple(o), text=f"sub-question {i}: what does it show?", sampling=SAMPLING,
                        layout=layout) for i, o in enumerate(orders)]
    sched = Scheduler(engine, SchedulerConfig(policy=policy, max_concurrency=4),
                      image_tokens=lambda p: sum(tokens[k] for k in p.images))
    done = await asyncio.gather(*(sched.submit(p) for p in plans))
    return sum(c.usage.cached_image_tokens for c in done)


async def test_a_shared_page_hits_under_dfs_weight_and_canonical_layout_but_not_fcfs_and_naive(
    inprocess_engine, engine_settings, ingested
):
    (shared, n_shared), b, c, d = distinct_keys(engine_settings, 4)
    # Retrieval ranked the shared page second for each sub-question: score order puts it after another page.
    batch = [[b, (shared, n_shared)], [c, (shared, n_shared)], [d, (shared, n_shared)]]
    naive = await run_batch(inprocess_engine, Policy.FCFS, Layout.NAIVE, batch)
    ours = await run_batch(inprocess_engine, Policy.DFS_WEIGHT, Layout.CANONICAL, batch)
    assert naive == 0
    # Two of the three plans reuse the shared page's full blocks.
    assert ours >= 2 * (n_shared // 32 * 32 - 32) > 0
