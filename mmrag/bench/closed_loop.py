"""Prompt plans in a closed loop through one engine or several routers over the same replicas: what the routing
benchmarks (mmrag/bench/replicas.py, mmrag/bench/kv_events.py) measure each routing by. No Ray here: the `vllm
serve` transport runs without it."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

from mmrag.bench.workload import Workload
from mmrag.core.engine import PromptPlan, SamplingSpec
from mmrag.core.keys import ImageKey


def workload_plans(workload: Workload, by_page: dict[int, ImageKey]) -> list[PromptPlan]:
    sampling = SamplingSpec(max_tokens=workload.spec.max_tokens)
    return [PromptPlan(images=tuple(by_page[p] for p in sub.pages), text=sub.text, sampling=sampling)
            for q in workload.questions for sub in q.subs]


async def run_plans(engines: list[Any], plans: list[PromptPlan], concurrency: int,
                    between: Callable[[], Awaitable[Any]] | None = None) -> dict[str, Any]:
    """The plans in a closed loop, ``concurrency`` in flight, dealt alternately to ``engines`` (one engine, or
    several routers over the same replicas); ``between``: awaited once half of them are done, before the rest
    start. Their image-prefix hit rate, throughput and client-side TTFT."""
    gate = asyncio.Semaphore(concurrency)
    ttfts: list[float] = []
    usages = []

    async def one(i: int, plan: PromptPlan) -> None:
        async with gate:
            sent = time.perf_counter()
            completion = await engines[i % len(engines)].generate(
                plan, on_first_token=lambda: ttfts.append(time.perf_counter() - sent))
            usages.append(completion.usage)

    started = time.perf_counter()
    half = len(plans) // 2 if between else len(plans)
    await asyncio.gather(*(one(i, p) for i, p in enumerate(plans[:half])))
    if between:
        await between()
        await asyncio.gather(*(one(i, p) for i, p in enumerate(plans[half:], start=half)))
    seconds = time.perf_counter() - started
    image = sum(u.image_tokens for u in usages)
    ttfts.sort()
    return {
        "image_prefix_hit_rate": round(sum(u.cached_image_tokens for u in usages) / max(1, image), 4),
        "plans_per_s": round(len(plans) / seconds, 3),
        "ttft_p50_s": round(statistics.median(ttfts), 4),
        "ttft_p99_s": round(ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 4),
        "seconds": round(seconds, 1),
        "plans": len(plans),
    }
