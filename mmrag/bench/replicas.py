"""`mmrag bench --replicas N`: engine replicas on Ray Serve, one workload under three routings, in one run.

One local Ray cluster, one engine deployment of N replicas (serving/ray/), the bench corpus's image tokens in
the local-disk feature store (all replicas run on this machine). The same plans — one per sub-question of
the bench workload, its pages in retrieval-score order after the system prompt — go through:

- ``single``: every plan to one replica (pinned by the router): what one engine does;
- ``affinity``: mmrag's router (serving/routing.py: the longest held image prefix, else the rendezvous home,
  unless past the queue bound);
- ``ray_default``: Ray Serve's PowerOfTwoChoices router, on the same replicas.

Each routing starts from cold prefix caches (a broadcast reset). Reported per routing: the image-prefix hit
rate (image tokens served from the prefix cache / image tokens sent), throughput (plans/s, closed loop) and
TTFT as the client sees it (from the call to the first streamed token, Ray's hop included), p50 and p99.
On a 2-core machine N replicas share the same cores: throughput does not scale with N here, the hit rate
is the figure that carries over to one replica per machine.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from mmrag.adapters.checkpoint import ModelSource
from mmrag.adapters.store import DiskFeatureStore
from mmrag.core.engine import PromptPlan
from mmrag.core.keys import ImageKey
from mmrag.devkit.ports import free_port
from serving.engine.config import EngineConfig
from serving.engine.features import FeatureProvider
from serving.engine.inprocess import InProcessEngine
from serving.ray.app import RayServeConfig, connect, deploy_engine
from serving.ray.engine import RayEngine
from serving.ray.router import AFFINITY, DEFAULT, PINNED
from mmrag.bench.closed_loop import run_plans, workload_plans
from mmrag.bench.workload import Workload

ROUTINGS = ("single", "affinity", "ray_default")


@dataclass(slots=True)
class ReplicaBenchInputs:
    model: ModelSource
    store_dir: Path  # the disk feature store holding every key of ``by_page``
    by_page: dict[int, ImageKey]
    workload: Workload
    engine_config: EngineConfig
    replicas: int
    queue_bound: int
    concurrency: int  # plans in flight (closed loop)
    log: Callable[[str], None] = print


def replica_engine(model: ModelSource, store_dir: Path, config: EngineConfig,
                   kv_events: str | None = None) -> InProcessEngine:
    """What each replica runs (module-level, so Ray can pickle it by reference); ``kv_events``: where it
    publishes its KV events (the replica picks it: serving/ray/deployments.py)."""
    if kv_events:
        config = replace(config, kv_events=kv_events)
    return InProcessEngine.start(model, FeatureProvider.unscoped(DiskFeatureStore(store_dir)), config)


async def measure_routings(engine: RayEngine, plans: list[PromptPlan], concurrency: int,
                    log: Callable[[str], None]) -> dict[str, dict[str, Any]]:
    """The plans under each routing, each from cold prefix caches, on the replicas of ``engine``."""
    replicas = await engine.replica_ids()
    routing = {"single": PINNED + replicas[0], "affinity": AFFINITY, "ray_default": DEFAULT}
    out = {}
    for name in ROUTINGS:
        await engine.reset_prefix_cache()
        out[name] = await run_plans([engine.with_routing(routing[name])], plans, concurrency)
        log(f"{name}: {out[name]}")
    return out


def run_replicas(inputs: ReplicaBenchInputs) -> dict[str, Any]:
    """Start Ray and the replicas, run the three routings, stop Ray; the results and what Ray cost."""
    import ray
    from ray import serve

    config = RayServeConfig(address="", replicas=inputs.replicas, queue_bound=inputs.queue_bound, replica_cpus=1.0,
                            replica_gpus=0.0,
                            max_ongoing_requests=inputs.engine_config.max_num_seqs + inputs.queue_bound,
                            # Serve's HTTP proxy, unused here, on a free port
                            http_host="127.0.0.1", http_port=free_port(), vision_max_replicas=1)
    t = time.perf_counter()
    cluster_s = connect(config, num_cpus=inputs.replicas + 2)
    handle = deploy_engine(config, partial(replica_engine, inputs.model, inputs.store_dir, inputs.engine_config))
    deploy_s = time.perf_counter() - t - cluster_s
    inputs.log(f"Ray cluster {cluster_s:.1f} s, {inputs.replicas} replicas deployed in {deploy_s:.1f} s")
    try:
        engine = RayEngine(handle, inputs.model)
        plans = workload_plans(inputs.workload, inputs.by_page)
        results = asyncio.run(measure_routings(engine, plans, inputs.concurrency, inputs.log))
    finally:
        serve.shutdown()
        ray.shutdown()
    return {"routings": results, "replicas": inputs.replicas, "queue_bound": inputs.queue_bound,
            "concurrency": inputs.concurrency, "ray_cluster_start_s": round(cluster_s, 1),
            "ray_deploy_s": round(deploy_s, 1)}


def replicas_table(result: dict[str, Any]) -> str:
    cols = ("image_prefix_hit_rate", "plans_per_s", "ttft_p50_s", "ttft_p99_s", "seconds")
    rows = ["| routing | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    rows += [f"| {name} | " + " | ".join(str(r[c]) for c in cols) + " |" for name, r in result["routings"].items()]
    single, affinity = result["routings"]["single"], result["routings"]["affinity"]
    ratio = affinity["image_prefix_hit_rate"] / single["image_prefix_hit_rate"] if single["image_prefix_hit_rate"] \
        else float("nan")
    rows.append(f"\naffinity / single hit rate: {ratio:.3f} (wanted ≥ 0.95) with {result['replicas']} replicas")
    return "\n".join(rows)
