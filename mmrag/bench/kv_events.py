"""`mmrag bench --kv-events`: what routing by the replicas' own KV events buys over the table a router learns
from what it sent, with 2 replicas on each transport — `vllm serve` replicas and Ray Serve engine replicas —
in one run (issue 45).

The bench workload's plans (one per sub-question, its pages in retrieval-score order after the system prompt)
go through two sources of "who holds which prefix", each time from cold prefix caches, on the same replicas:

- ``events``: the remote engine following both replicas' KV events (serving/kv_events.py);
- ``table``: the remote engine's learned table (serving/routing.py AffinityTable), as before;
- ``single``: every plan on one replica: in the steady scenario, the hit rate no routing over two can pass; under
  KV pressure, one replica with both replicas' KV blocks (what a perfect split of the pages between the two could
  at best approach, their LRU caches then being one cache of twice the size).

Scenarios:

- ``a_steady``: the workload as today, one router;
- ``b_kv_pressure``: the same on replicas whose KV holds about a third of the workload's working set (its
  distinct pages' image tokens), so they evict;
- ``c_two_routers``: two routers (two engines, each its own table or subscriber, as two API processes have)
  sharing the replicas, the plans dealt alternately between them;
- ``d_reset``: half the plans, then one replica's prefix cache reset behind the routers' backs (an operator,
  another process), then the other half;
- ``e_replica_joins`` (beyond the issue's four, `vllm serve` only): the workload served once by a router over
  replica A alone (B down, or not yet added), then again by a router started over both (a new API process): what
  is measured is the second pass. Where pages sit away from their rendezvous homes, the table of a router that
  did not place them is wrong and the replicas' word is not.

On Ray Serve (serving/ray/, one local cluster) the sources are the same router's, chosen per request: ``events``
(its affinity rule on the replicas' events), ``table`` (the rule on its learned table) and ``ray_default``
(Ray Serve's PowerOfTwoChoices); the scenarios a to d, where c's second router is a second deployment handle's (each
handle has a router of its own, with its own table; in one process they share the one KV events subscriber) and d
resets one replica through another handle's router, pinned to it, so the routers under test see only its events.

Reported per scenario and source: the image-prefix hit rate (image tokens served from the prefix cache / image
tokens sent), TTFT p50 and p99 as the client sees it, and the routes the events decided. A replica steps, and
publishes, only while it serves: a reset reaches the events with the replica's next step.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from mmrag.adapters.checkpoint import ModelSource
from mmrag.adapters.store import DiskFeatureStore
from mmrag.bench.closed_loop import run_plans
from mmrag.core.engine import PromptPlan
from mmrag.devkit.ports import free_port
from serving.engine.config import EngineConfig
from serving.engine.features import FeatureProvider
from serving.engine.remote import RemoteEngine
from serving.kv_events import State, free_port_pair
from serving.vllm_launch import ServerHandle, start_dev_replica

SOURCES = ("events", "table")
SCENARIOS = ("a_steady", "b_kv_pressure", "c_two_routers", "d_reset", "e_replica_joins")
SYNC_TIMEOUT_S = 120.0  # a hang guard for the subscriber's first replay


@dataclass(slots=True)
class KvEventsBenchInputs:
    model: ModelSource
    store_dir: Path  # the disk feature store holding every key of the plans (the Ray replicas open it themselves)
    plans: list[PromptPlan]
    engine_config: EngineConfig
    concurrency: int  # plans in flight (closed loop), over all routers
    working_set_tokens: int  # the distinct pages' image tokens the plans show
    longest_prompt_tokens: int  # the most image tokens one plan shows, with room for its text and answer
    root: Path  # a folder for the replicas' logs
    log: Callable[[str], None] = print

    @property
    def features(self) -> FeatureProvider:
        return FeatureProvider.unscoped(DiskFeatureStore(self.store_dir))  # the bench's keys, one encoder


def pressure_config(config: EngineConfig, working_set_tokens: int, longest_prompt_tokens: int,
                    fraction: float = 1 / 3) -> EngineConfig:
    """The replicas' engine with KV blocks for ``fraction`` of the working set, and a model length of the
    workload's longest prompt (vLLM starts only with blocks for one prompt of its model length)."""
    block = config.block_size or 32
    max_model_len = min(config.max_model_len, math.ceil(longest_prompt_tokens / block) * block)
    blocks = max(math.ceil(max_model_len / block) + 1, math.ceil(working_set_tokens * fraction / block))
    return replace(config, max_model_len=max_model_len, kv_blocks=blocks)


async def _start_pair(inputs: KvEventsBenchInputs, config: EngineConfig, tag: str,
                      n: int = 2) -> list[tuple[ServerHandle, str]]:
    pair = []
    for i in range(n):
        events = f"tcp://*:{free_port_pair()}"
        handle = await asyncio.to_thread(start_dev_replica, inputs.model.path, replace(config, kv_events=events),
                                         inputs.root / f"{tag}-{i}.log", port=free_port())
        pair.append((handle, events))
    return pair


async def _reset(urls: list[str]) -> None:
    """Every replica's prefix cache emptied, behind any router's back (vLLM's dev-mode route)."""
    async with httpx.AsyncClient(timeout=60) as client:
        for url in urls:
            (await client.post(f"{url}/reset_prefix_cache")).raise_for_status()


def _router(inputs: KvEventsBenchInputs, pair: list[tuple[ServerHandle, str]], source: str) -> RemoteEngine:
    urls = [h.url for h, _ in pair][:1 if source == "single" else None]
    events = {h.url: e for h, e in pair} if source == "events" else None
    return RemoteEngine(urls, inputs.model, inputs.features, kv_events=events,
                        max_num_seqs=inputs.engine_config.max_num_seqs)


async def _synced(router: RemoteEngine) -> None:
    if router.kv_events is None:
        return
    ok = await asyncio.to_thread(router.kv_events.index.wait,
                                 lambda v: all(v.state(u) is State.SYNCED for u in router.urls), SYNC_TIMEOUT_S)
    if not ok:
        raise RuntimeError(f"the replicas' KV events did not sync within {SYNC_TIMEOUT_S:.0f} s: "
                           f"{router.kv_events.index.stats()}")


async def _run(routers: list[Any], plans: list[PromptPlan], concurrency: int,
               between: Callable[[], Any] | None = None) -> dict[str, Any]:
    """mmrag/bench/closed_loop.run_plans over ``routers``, with the routes each source decided."""
    result = await run_plans(routers, plans, concurrency, between)
    routed = {k: sum(getattr(r, "routed", {}).get(k, 0) for r in routers) for k in ("events", "table")}
    return {**result, "routes_by_events": routed["events"], "routes_by_table": routed["table"]}


async def _scenario(inputs: KvEventsBenchInputs, pair: list[tuple[ServerHandle, str]], name: str,
                    source: str) -> dict[str, Any]:
    urls = [h.url for h, _ in pair]
    await _reset(urls)
    if name == "e_replica_joins":
        first = _router(inputs, pair[:1], "table")
        try:
            await _run([first], inputs.plans, inputs.concurrency)  # every page placed on A
        finally:
            await first.close()
    routers = [_router(inputs, pair, source) for _ in range(2 if name == "c_two_routers" else 1)]
    try:
        for router in routers:
            await _synced(router)
        between = (lambda: _reset(urls[:1])) if name == "d_reset" else None
        return await _run(routers, inputs.plans, inputs.concurrency, between)
    finally:
        for router in routers:
            await router.close()


async def run_kv_events(inputs: KvEventsBenchInputs) -> dict[str, Any]:
    """Every scenario under each source; the replicas started here and stopped at the end."""
    out: dict[str, dict[str, Any]] = {}
    pressed = pressure_config(inputs.engine_config, inputs.working_set_tokens, inputs.longest_prompt_tokens)
    blocks, block = pressed.kv_blocks or 0, pressed.block_size or 32
    for tag, config, names in (("steady", inputs.engine_config,
                                ("a_steady", "c_two_routers", "d_reset", "e_replica_joins")),
                               ("pressed", pressed, ("b_kv_pressure",)),
                               ("pressed-one", replace(pressed, kv_blocks=2 * blocks), ("b_kv_pressure",))):
        t = time.perf_counter()
        one = tag == "pressed-one"  # the reference for b: one replica with both replicas' blocks
        pair = await _start_pair(inputs, config, tag, n=1 if one else 2)
        inputs.log(f"{len(pair)} {tag} replicas ready in {time.perf_counter() - t:.0f} s"
                   + (f" (KV {config.kv_blocks} blocks of {block} tokens)" if config.kv_blocks else ""))
        try:
            for name in names:
                out.setdefault(name, {})
                for source in ("single",) if one else SOURCES + (("single",) if name == "a_steady" else ()):
                    out[name][source] = await _scenario(inputs, pair, name, source)
                    inputs.log(f"{name} {source}: {out[name][source]}")
        finally:
            for handle, _ in pair:
                await asyncio.to_thread(handle.stop)
    scenarios = {name: out[name] for name in SCENARIOS}
    return {"transport": "vllm_serve", "replicas": 2, "scenarios": scenarios, "concurrency": inputs.concurrency,
            "working_set_tokens": inputs.working_set_tokens, "pressure_kv_blocks": blocks,
            "pressure_kv_fraction": round(blocks * block / max(1, inputs.working_set_tokens), 3),
            "targets": targets(scenarios)}


async def run_kv_events_ray(inputs: KvEventsBenchInputs, queue_bound: int) -> dict[str, Any]:
    """Scenarios a, b and d on 2 Ray Serve engine replicas, under events, table and Ray's default routing."""
    import ray
    from ray import serve

    from mmrag.bench.replicas import replica_engine
    from serving.ray.app import RayServeConfig, connect, deploy_engine, engine_handle
    from serving.ray.engine import RayEngine
    from serving.ray.router import AFFINITY, DEFAULT, PINNED, TABLE

    routings = {"events": AFFINITY, "table": TABLE, "ray_default": DEFAULT}
    config = RayServeConfig(address="", replicas=2, queue_bound=queue_bound, replica_cpus=1.0, replica_gpus=0.0,
                            max_ongoing_requests=inputs.engine_config.max_num_seqs + queue_bound,
                            http_host="127.0.0.1", http_port=free_port(), vision_max_replicas=1, kv_events=True,
                            image_input=inputs.engine_config.image_input.value)
    pressed = pressure_config(inputs.engine_config, inputs.working_set_tokens, inputs.longest_prompt_tokens)
    out: dict[str, dict[str, Any]] = {}
    await asyncio.to_thread(connect, config, num_cpus=4)
    try:
        for tag, engine_config, names in (("steady", inputs.engine_config, ("a_steady", "c_two_routers", "d_reset")),
                                          ("pressed", pressed, ("b_kv_pressure",))):
            t = time.perf_counter()
            build = partial(replica_engine, inputs.model, inputs.store_dir, engine_config)
            handle = await asyncio.to_thread(deploy_engine, config, build)
            engine = RayEngine(handle, inputs.model, kv_events=True)
            inputs.log(f"2 {tag} Ray replicas deployed in {time.perf_counter() - t:.0f} s")
            for name in names:
                out[name] = {}
                for source, routing in routings.items():
                    await engine.reset_prefix_cache()
                    await engine.follow_kv_events()
                    assert engine.kv_events is not None
                    replicas = await engine.replica_ids()
                    synced = await asyncio.to_thread(
                        engine.kv_events.index.wait,
                        lambda v: all(v.state(r) is State.SYNCED for r in replicas), SYNC_TIMEOUT_S)
                    if not synced:
                        raise RuntimeError(f"the Ray replicas' KV events did not sync: {engine.kv_events.index.stats()}")
                    before = dict(engine.kv_events.routed)

                    async def reset_behind_the_router() -> None:
                        # One replica, through a second handle's router (an operator's, another process's): the
                        # routers under test see neither the call nor its answer, only the replica's own events.
                        await engine_handle().reset_prefix_cache.remote(routing=PINNED + replicas[0])

                    routers = [engine.with_routing(routing)]
                    if name == "c_two_routers":
                        # A second handle has a router of its own (its own table, as a second API process's;
                        # in this process it shares the one subscriber, whose events are the same either way).
                        second = RayEngine(engine_handle(), inputs.model, kv_events=True)
                        routers.append(second.with_routing(routing))
                    result = await _run(routers, inputs.plans, inputs.concurrency,
                                        reset_behind_the_router if name == "d_reset" else None)
                    result["routes_by_events"] = engine.kv_events.routed["events"] - before.get("events", 0)
                    result["routes_by_table"] = engine.kv_events.routed["table"] - before.get("table", 0)
                    out[name][source] = result
                    inputs.log(f"ray {name} {source}: {result}")
    finally:
        await asyncio.to_thread(serve.shutdown)
        await asyncio.to_thread(ray.shutdown)
    scenarios = {n: out[n] for n in SCENARIOS if n in out}
    return {"transport": "ray_serve", "replicas": 2, "scenarios": scenarios, "pressure_kv_blocks": pressed.kv_blocks,
            "targets": targets(scenarios)}


def targets(scenarios: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets: with events, b-d within 0.9 of a's hit rate; 1.2x the table's hit rate in b or c."""
    rate = {n: {s: r["image_prefix_hit_rate"] for s, r in by.items()} for n, by in scenarios.items()}
    steady = rate["a_steady"]["events"]
    single = rate["a_steady"].get("single")
    pressed_one = rate.get("b_kv_pressure", {}).get("single")
    within = {n: round(rate[n]["events"] / steady, 3) if steady else None
              for n in ("b_kv_pressure", "c_two_routers", "d_reset") if n in rate}
    over_table = {n: round(rate[n]["events"] / rate[n]["table"], 3) if rate[n]["table"] else None
                  for n in ("b_kv_pressure", "c_two_routers") if n in rate}
    joins = rate.get("e_replica_joins")
    return {"events_vs_steady": within,
            "events_within_0_9_of_steady": all(v is not None and v >= 0.9 for v in within.values()),
            "events_over_table": over_table,
            "events_1_2x_table_in_b_or_c": any(v is not None and v >= 1.2 for v in over_table.values()),
            "a_events_over_table": round(steady / rate["a_steady"]["table"], 3) if rate["a_steady"]["table"] else None,
            # The same plans on one replica: the hit rate no routing over two replicas can pass (every page's KV
            # in one cache); the table's share of it bounds what any other source can add.
            "a_single_replica": single,
            "a_table_of_single": round(rate["a_steady"]["table"] / single, 3) if single else None,
            "e_events_over_table": round(joins["events"] / joins["table"], 3) if joins and joins["table"] else None,
            # Under pressure: one replica with both replicas' blocks, over the table's rate (what is left to win).
            "b_one_cache_over_table": round(pressed_one / rate["b_kv_pressure"]["table"], 3)
            if pressed_one and rate["b_kv_pressure"]["table"] else None}


def kv_events_table(result: dict[str, Any]) -> str:
    cols = ("image_prefix_hit_rate", "ttft_p50_s", "ttft_p99_s", "plans_per_s", "routes_by_events")
    rows = ["| transport | scenario | source | " + " | ".join(cols) + " |", "|---" * (len(cols) + 3) + "|"]
    for transport, run in result.items():
        for name, by in run["scenarios"].items():
            rows += [f"| {transport} | {name} | {source} | " + " | ".join(str(r[c]) for c in cols) + " |"
                     for source, r in by.items()]
    for transport, run in result.items():
        t = run["targets"]
        rows.append(f"\n{transport}: with events, b-d against a {t['events_vs_steady']} (wanted >= 0.9); events / "
                    f"table in b, c {t['events_over_table']} (wanted >= 1.2 in one); a: events / table "
                    f"{t['a_events_over_table']}, table / one replica {t['a_table_of_single']}; b: one replica "
                    f"with both KVs / table {t.get('b_one_cache_over_table')}"
                    + (f"; e (a replica joins): events / table {t['e_events_over_table']}"
                       if t.get("e_events_over_table") else ""))
    return "\n".join(rows)
