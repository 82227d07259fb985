"""Routing by KV events on real `vllm serve` replicas of the tiny model (fp32): each publishes its KV events, a
router over both subscribes, and plans go where the replicas say a page's KV is.

Replica A is the session's (``vllm_server``); replica B is this module's, its KV cache 129 blocks of 32 tokens (the
least that holds one 4,096-token prompt), so a few prompts evict older ones. Each test keeps to its own cache salt:
no other test's prompts share a prefix with it, on either replica.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Iterator

import pytest

from mmrag.core.engine import PromptPlan, SamplingSpec
from mmrag.core.keys import ImageKey
from mmrag.devkit.ports import free_port
from serving.kv_events import free_port_pair
from mmrag.wiring import engine_config, feature_store, resolve_model
from serving.engine.features import FeatureProvider
from serving.engine.images import multi_modal_uuid
from serving.engine.remote import RemoteEngine
from serving.kv_events import State
from serving.routing import rendezvous_order, route_key
from serving.vllm_launch import ServerHandle, start_dev_replica
from tests.conftest import KV_EVENTS

SHORT = SamplingSpec(max_tokens=4)
WAIT_S = 120.0  # a hang guard for events to cross from a replica's engine core, never a speed check
KV_BLOCKS = 129  # x 32 tokens: one 4,096-token prompt (MMRAG_MAX_MODEL_LEN) and a block to spare


@pytest.fixture(scope="module")
def pressed(engine_settings, ingested, tmp_path_factory) -> Iterator[tuple[str, str]]:
    """Replica B: (URL, KV events endpoint)."""
    events = f"tcp://*:{free_port_pair()}"
    config = dataclasses.replace(engine_config(engine_settings), kv_events=events, kv_blocks=KV_BLOCKS)
    handle: ServerHandle = start_dev_replica(resolve_model(engine_settings).path, config,
                                             tmp_path_factory.mktemp("kv-pressed") / "server.log", port=free_port())
    try:
        yield handle.url, events
    finally:
        handle.stop()


@pytest.fixture(scope="module")
def keys(engine_settings, ingested) -> list[ImageKey]:
    return sorted(feature_store(engine_settings).keys())


@pytest.fixture(scope="module")
def replicas(vllm_server, pressed) -> dict[str, str]:
    return {vllm_server: KV_EVENTS[vllm_server], pressed[0]: pressed[1]}


def engine(engine_settings, urls: list[str], events: dict[str, str] | None = None) -> RemoteEngine:
    return RemoteEngine(urls, resolve_model(engine_settings), FeatureProvider.unscoped(feature_store(engine_settings)),
                        kv_events={u: events[u] for u in urls} if events else None)


@pytest.fixture
async def router(engine_settings, replicas) -> RemoteEngine:
    """A router over both replicas that follows their KV events, synced with both before a test starts."""
    eng = engine(engine_settings, list(replicas), replicas)
    try:
        for url in replicas:
            await waiting(eng, lambda v, url=url: v.state(url) is State.SYNCED, f"{url}'s events synced")
        yield eng
    finally:
        await eng.close()


async def waiting(eng: RemoteEngine, predicate, what: str) -> None:
    """Until the router's index satisfies ``predicate``: woken by each batch of events, bounded by WAIT_S."""
    assert eng.kv_events is not None
    if not await asyncio.to_thread(eng.kv_events.index.wait, predicate, WAIT_S):
        raise AssertionError(f"not within {WAIT_S:.0f} s: {what}; index: {eng.kv_events.index.stats()}")


async def holds(eng: RemoteEngine, url: str, plan: PromptPlan, n: int) -> None:
    ids = [multi_modal_uuid(k, eng.image_input) for k in plan.images]
    await waiting(eng, lambda v: v.state(url) is State.SYNCED and v.match(url, plan.cache_salt, ids) == n,
                  f"{url} holds {n} leading images of the plan")


def homed(keys: list[ImageKey], salt: str, urls: list[str], home: str) -> ImageKey:
    """A page whose plans under ``salt`` rank ``home`` first by rendezvous (where a router with no word from the
    replicas sends them)."""
    return next(k for k in keys if rendezvous_order(salt + str(k), urls)[0] == home)


def plan(key: ImageKey, salt: str, text: str = "What does this page show?") -> PromptPlan:
    p = PromptPlan(images=(key,), text=text, sampling=SHORT, cache_salt=salt)
    assert route_key(p) == salt + str(key)
    return p


async def warm_elsewhere(engine_settings, router: RemoteEngine, key: ImageKey, salt: str, on: str) -> None:
    """``key``'s page prefilled on replica ``on`` by another router (an engine over ``on`` alone, as another API
    process would have sent it), and ``on``'s events say so to ``router``."""
    other = engine(engine_settings, [on])
    try:
        assert (await other.generate(plan(key, salt, "Warm this page."))).replica == on
    finally:
        await other.close()
    await holds(router, on, plan(key, salt), 1)


async def test_a_second_router_sends_a_page_the_first_one_warmed_to_the_replica_holding_it(
        engine_settings, replicas, router, keys):
    a, b = replicas
    key = homed(keys, "second-router", list(replicas), home=b)  # by rendezvous it would go to B
    await warm_elsewhere(engine_settings, router, key, "second-router", on=a)
    served = await router.generate(plan(key, "second-router"))
    assert served.replica == a and served.usage.cached_image_tokens > 0, served.usage
    assert router.routed["events"] == 1


async def test_a_reset_replica_no_longer_attracts_its_pages_plans(engine_settings, replicas, router, keys):
    a, b = replicas
    key = homed(keys, "reset", list(replicas), home=b)
    await warm_elsewhere(engine_settings, router, key, "reset", on=a)
    assert (await router.generate(plan(key, "reset"))).replica == a  # attracted; the router's table learned A too
    only_a = engine(engine_settings, [a])
    try:
        await only_a.reset_prefix_cache()  # behind the router's back
        # vLLM publishes the reset with the replica's next engine step: any prompt makes one.
        await only_a.generate(PromptPlan(images=(), text="Step once.", sampling=SHORT, cache_salt="reset-step"))
    finally:
        await only_a.close()
    await holds(router, a, plan(key, "reset"), 0)
    served = await router.generate(plan(key, "reset", "And now?"))
    assert served.replica == b, "the router's table still says A; the replica's word moved the plan home"


async def test_an_evicted_page_stops_attracting_its_plans(engine_settings, replicas, router, keys):
    a, b = replicas
    key = homed(keys, "evicted", list(replicas), home=a)
    await warm_elsewhere(engine_settings, router, key, "evicted", on=b)
    assert (await router.generate(plan(key, "evicted"))).replica == b  # attracted away from its home
    only_b = engine(engine_settings, [b])
    try:
        # Other pages fill B's 129 blocks twice over, three a prompt (each round over them under a salt of its
        # own: new blocks): the page's blocks go.
        store, others = feature_store(engine_settings), [k for k in keys if k != key]
        groups = ((r, others[i:i + 3]) for r in itertools.count() for i in range(0, len(others), 3))
        written = 0
        while written < 2 * KV_BLOCKS * 32:
            r, group = next(groups)
            await only_b.generate(PromptPlan(images=tuple(group), text="Fill.", sampling=SHORT,
                                             cache_salt=f"evicted-{r}"))
            written += sum(store.get(k).num_tokens for k in group)
    finally:
        await only_b.close()
    await holds(router, b, plan(key, "evicted"), 0)
    assert router.kv_events.index.stats()[b]["blocks"] <= KV_BLOCKS
    served = await router.generate(plan(key, "evicted", "And now?"))
    assert served.replica == a


async def test_a_tenants_salt_keeps_its_blocks_from_routing_another_tenants_plans(
        engine_settings, replicas, router, keys):
    a, b = replicas
    urls = list(replicas)
    key = next(k for k in keys if all(rendezvous_order(s + str(k), urls)[0] == b for s in ("tenant-1", "tenant-2")))
    await warm_elsewhere(engine_settings, router, key, "tenant-1", on=a)
    assert (await router.generate(plan(key, "tenant-2"))).replica == b  # tenant-1's blocks are not tenant-2's
    assert (await router.generate(plan(key, "tenant-1"))).replica == a


async def test_the_routes_and_the_index_are_in_the_metrics(engine_settings, replicas, router, keys):
    from prometheus_client import CollectorRegistry, generate_latest

    from serving.metrics import Metrics

    a, _ = replicas
    key = keys[0]
    await router.generate(plan(key, "metrics"))
    metrics = Metrics(CollectorRegistry())
    metrics.register_kv_events(router.kv_events.index.stats, router.routed)
    text = generate_latest(metrics.registry).decode()
    assert f'mmrag_kv_events_synced{{replica="{a}",state="synced"}} 1.0' in text
    assert 'mmrag_routes_total{source="events"} 1.0' in text
    assert f'mmrag_kv_events_total{{replica="{a}"}}' in text
