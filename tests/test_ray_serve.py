"""Ray Serve scale-out (serving/ray/): a real local Ray cluster, 2 engine replicas of the tiny model (fp32).

One cluster for this module (started by ``ray_cluster``, shut down at its end), on 127.0.0.1, without the
dashboard. The replicas read the session's ingested corpus from the local-disk feature store (every replica
runs on this machine; across machines it is MMRAG_REDIS_URL). What the cluster costs in start-up time and
memory is printed (`pytest -s`) and stated in the issue's report.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time

import pytest

ray = pytest.importorskip("ray", reason="ray[serve] is not installed: .venv/bin/pip install 'ray[serve]==2.60.0' "
                          "-c constraints.txt (scripts/setup.sh does it)")

from mmrag.bench.runner import machine_info  # noqa: E402
from mmrag.core.engine import Completion, PromptPlan, SamplingSpec  # noqa: E402
from mmrag.core.keys import ImageKey  # noqa: E402
from mmrag import wiring  # noqa: E402
from serving.ray.router import DEFAULT, PINNED  # noqa: E402
from serving.routing import rendezvous_order  # noqa: E402
from tests.conftest import free_port  # noqa: E402
from tests.waiting import eventually  # noqa: E402

SHORT = SamplingSpec(max_tokens=2)
# The tiny model's greedy answers hit EOS early; a grammar for many integers keeps each going to max_tokens,
# long enough that a replica is killed with requests in flight.
LONG = SamplingSpec(max_tokens=600, json_schema=json.dumps({"type": "array", "items": {"type": "integer"},
                                                            "minItems": 400}))
HANG_GUARD_S = 600.0  # a bound on waiting, not a timing assertion


def ray_rss_mib() -> dict[str, float]:
    """Resident memory of this test's Ray processes (children of this process), by kind, in MiB."""
    import psutil

    out: dict[str, float] = {}
    for proc in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(proc.cmdline())
            rss = proc.memory_info().rss / 2**20
        except psutil.Error:
            continue
        kind = ("replica" if "ServeReplica:mmrag-engine" in cmd or "EngineCore" in cmd or "VLLM" in cmd
                else "ray")
        out[kind] = out.get(kind, 0.0) + rss
    return out


@pytest.fixture(scope="module")
def keys(engine_settings, ingested) -> list[ImageKey]:
    # The corpus's pages as ingested (the store may hold a test's entries of another encoder or tier).
    found = sorted(k for k in wiring.feature_store(engine_settings).keys()
                   if k.policy == engine_settings.vision.resolution_policy)
    assert len(found) >= 8, "the sample corpus should give at least 8 distinct pages"
    return found


@pytest.fixture(scope="module")
def ray_cluster(engine_settings, ingested):
    """A local Ray cluster with Serve, and the engine deployment of 2 replicas on it."""
    # The replicas publish their KV events and the router follows them (MMRAG_RAY_KV_EVENTS).
    settings = engine_settings.replace(**{"ray_replicas": 2, "ray_replica_cpus": 1.0,
                                                  "ray_http_port": free_port(), "max_num_seqs": 8,
                                                  "ray_kv_events": True})
    started = time.perf_counter()
    # The cluster's processes take this environment: vLLM's default binding, which the replicas replace with a
    # share of the node's cores each (serving/ray/deployments.bind_cpu_engine), not an xdist worker's core.
    bound = os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    try:
        ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1",
                 object_store_memory=256 * 2**20, log_to_driver=False)
    finally:
        if bound is not None:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bound
    cluster_s = time.perf_counter() - started
    base = ray_rss_mib()
    engine = wiring.ray_engine(settings)
    cost = {"cluster_start_s": round(cluster_s, 1), "deploy_2_replicas_s": round(time.perf_counter() - started -
            cluster_s, 1), "rss_mib_cluster_alone": round(sum(base.values())),
            "rss_mib_with_replicas": {k: round(v) for k, v in ray_rss_mib().items()}}
    print(f"\nRay cost: {cost}")
    try:
        yield {"engine": engine, "settings": settings, "cost": cost}
    finally:
        from ray import serve

        serve.shutdown()
        ray.shutdown()


async def run_all(engine, plans: list[PromptPlan], concurrency: int = 2) -> list[Completion]:
    gate = asyncio.Semaphore(concurrency)

    async def one(plan: PromptPlan) -> Completion:
        async with gate:
            return await engine.generate(plan)

    return list(await asyncio.wait_for(asyncio.gather(*(one(p) for p in plans)), HANG_GUARD_S))


def image_hit_rate(done: list[Completion]) -> float:
    return sum(c.usage.cached_image_tokens for c in done) / max(1, sum(c.usage.image_tokens for c in done))


def test_the_rayservice_manifest_names_the_builders_and_applications_of_the_code():
    # No cluster: the KubeRay manifest's Serve applications are the ones `mmrag serve --ray` takes handles of.
    from pathlib import Path

    import yaml

    from serving.ray.app import ENGINE_APP, VISION_APP, VISION_ROUTE

    docs = list(yaml.safe_load_all((Path(__file__).parent.parent / "deploy/ray/rayservice.yaml").read_text()))
    service = next(d for d in docs if d["kind"] == "RayService")
    apps = {a["name"]: a for a in yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]}
    assert set(apps) == {ENGINE_APP, VISION_APP} and apps[VISION_APP]["route_prefix"] == VISION_ROUTE
    for app in apps.values():
        module, _, name = app["import_path"].partition(":")
        assert module == "mmrag.wiring" and callable(getattr(wiring, name))
    built = wiring.ray_engine_application(apps[ENGINE_APP]["args"])  # builds the Application, deploys nothing
    assert type(built).__name__ == "Application"


async def test_two_replicas_serve_and_plans_sharing_a_leading_figure_land_on_the_same_replica(ray_cluster, keys):
    engine = ray_cluster["engine"]
    replicas = await engine.replica_ids()
    assert len(replicas) == 2
    assert await engine.batch_capacity() == 2 * 8  # the replicas' sum: the plans a scheduler lets in at once
    # One node: each replica's vLLM worker bound to its own share of the CPUs (serving/ray/deployments.py).
    bound = await engine.handle.broadcast("cpu_binding").results_async()
    assert all(bound) and len(set(bound)) == min(2, len(os.sched_getaffinity(0))), bound
    await engine.reset_prefix_cache()
    plans = [PromptPlan(images=(keys[i], keys[(i + j + 1) % len(keys)]), text=f"What is shown ({j})?",
                        sampling=SHORT) for i in range(4) for j in range(3)]
    done = await run_all(engine, plans)
    served: dict[ImageKey, set[str]] = {}
    for plan, completion in zip(plans, done):
        assert completion.token_ids and completion.replica in replicas
        served.setdefault(plan.images[0], set()).add(completion.replica)
    # Each figure on one replica: its rendezvous home among the live replicas (no replica held it before).
    assert served == {k: {rendezvous_order(str(k), replicas)[0]} for k in served}, served


async def test_the_router_goes_by_the_replicas_kv_events_where_its_own_table_is_stale(ray_cluster, keys):
    from serving.kv_events import State

    engine = ray_cluster["engine"]
    events = engine.kv_events
    replicas = await engine.replica_ids()
    assert set(await engine.follow_kv_events()) == set(replicas)

    def index(predicate, what: str) -> None:
        assert events.index.wait(predicate, HANG_GUARD_S), f"{what}: {events.index.stats()}"

    await asyncio.to_thread(index, lambda v: all(v.state(r) is State.SYNCED for r in replicas), "both synced")
    key, salt = keys[5], "kv-events"  # a salt of its own: no other test's prompts share its prefix
    home = rendezvous_order(salt + str(key), replicas)[0]
    other = next(r for r in replicas if r != home)
    page = [str(key)]  # its uuid in the events (MMRAG_IMAGE_INPUT=embeds)

    def plan(text: str) -> PromptPlan:
        return PromptPlan(images=(key,), text=text, cache_salt=salt, sampling=SHORT)

    warmed = await engine.with_routing(PINNED + other).generate(plan("Warm this page."))
    assert warmed.replica == other
    await asyncio.to_thread(index, lambda v: v.match(other, salt, page) == 1, "the other replica holds the page")
    assert (await engine.generate(plan("What is shown?"))).replica == other  # drawn there, away from its home
    # Reset behind the router's back (Serve's broadcast bypasses it), so its table still says `other`; the replica
    # publishes the reset with its next step.
    await engine.handle.broadcast("reset_prefix_cache").results_async()
    await engine.with_routing(PINNED + other).generate(PromptPlan(images=(), text="Step once.", sampling=SHORT))
    await asyncio.to_thread(index, lambda v: v.match(other, salt, page) == 0, "the reset reached the index")
    before = events.routed["events"]
    assert (await engine.generate(plan("And now?"))).replica == home
    assert events.routed["events"] == before + 1


async def test_affinity_keeps_the_single_replica_hit_rate_on_a_shared_figure_workload(ray_cluster, keys):
    engine = ray_cluster["engine"]
    replicas = await engine.replica_ids()
    rng = random.Random(0)
    # 6 figures, 3 whose rendezvous home is each replica (replica ids are random per run: figures taken in
    # key order would all have one home once in 32 runs), each leading 4 questions (with a second page after
    # it), in a shuffled order. The system prompt of this test keeps its prefixes apart from the other tests'.
    home = {k: rendezvous_order(str(k), replicas)[0] for k in keys}
    figures = [k for r in replicas for k in [k for k in keys if home[k] == r][:3]]
    assert len(figures) == 6, f"the corpus's pages should give each replica 3 figures: {list(home.values())}"
    plans = [PromptPlan(images=(fig, keys[(keys.index(fig) + q + 1) % len(keys)]), text=f"Question {q} on {f}.",
                        system_prompt_id="synthesize", sampling=SHORT) for f, fig in enumerate(figures)
             for q in range(4)]
    rng.shuffle(plans)
    rates = {}
    for name, routing in (("single", PINNED + replicas[0]), ("affinity", "affinity"), ("ray_default", DEFAULT)):
        await engine.reset_prefix_cache()
        done = await run_all(engine.with_routing(routing), plans)
        rates[name] = image_hit_rate(done)
        # One replica for the baseline; both under Ray's default and under affinity, where each plan lands on
        # its figure's home (the reset emptied the router's table: what the pinned run sent to replicas[0] no
        # longer draws every figure there; 2 in flight never pass the queue bound).
        assert {c.replica for c in done} == ({replicas[0]} if name == "single" else set(replicas)), name
        if name == "affinity":
            assert [c.replica for c in done] == [home[p.images[0]] for p in plans]
    machine = machine_info()
    print(f"\nimage-prefix hit rate ({machine['cpu_model']}, {machine['cpus']} cores, fp32, tiny model, 24 plans): "
          f"{rates}")
    assert rates["single"] > 0.25  # the workload shares figures: one replica reuses them
    assert rates["affinity"] >= 0.95 * rates["single"], rates


async def test_the_replicas_bench_reports_three_routings_in_one_run(ray_cluster, keys):
    # `mmrag bench --replicas`'s measurement (mmrag/bench/replicas.py) on this module's cluster, not a cluster of its
    # own: Ray starts once per test session. Smoke size; its timings mean nothing and are not asserted.
    from mmrag.bench.replicas import ROUTINGS, measure_routings, replicas_table, workload_plans
    from mmrag.bench.workload import WorkloadSpec, make_workload

    workload = make_workload(WorkloadSpec(questions=6, pages=8, max_tokens=2))
    plans = workload_plans(workload, dict(enumerate(keys[:8])))
    routings = await measure_routings(ray_cluster["engine"], plans, concurrency=4, log=print)
    assert list(routings) == list(ROUTINGS)
    for name, r in routings.items():
        assert r["plans"] == len(plans), name
        assert 0 <= r["image_prefix_hit_rate"] <= 1 and r["plans_per_s"] > 0 and r["ttft_p99_s"] >= r["ttft_p50_s"] > 0
    assert routings["single"]["image_prefix_hit_rate"] > 0  # the Zipf workload repeats pages
    table = replicas_table({"routings": routings, "replicas": 2})
    assert "| affinity |" in table and "affinity / single hit rate" in table


async def test_the_rest_app_answers_through_the_ray_replicas(ray_cluster, tmp_path_factory):
    # `mmrag serve --ray`'s composition (wiring.ray_app) on the running cluster: MMRAG_RAY_DEPLOY=false takes
    # the deployed engine's handle, as under a RayService. Its own copy of the corpus (Qdrant local mode).
    import httpx

    from tests.conftest import API_KEY, copy_corpus, serving

    data = tmp_path_factory.mktemp("ray-api")
    copy_corpus(ray_cluster["settings"], data)
    settings = ray_cluster["settings"].replace(**{
        "data_dir": data, "api_key": API_KEY, "ray_deploy": False, "answer_max_tokens": 8, "warm_top": 2})
    app = wiring.ray_app(settings)
    async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=300) as http:
        r = await http.post("/v1/ask", json={"question": "What is the retry limit of the ingest service?"},
                            headers={"Authorization": f"Bearer {API_KEY}"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["citations"] and body["usage"]["prompt_tokens"] > 0
        assert (await http.get("/readyz")).status_code == 200


@pytest.fixture(scope="module")
async def killed_mid_load(ray_cluster, keys) -> dict:
    """One engine replica killed with requests in flight on both: what the two tests after it check."""
    engine = ray_cluster["engine"]
    replicas = await engine.replica_ids()
    victim = replicas[0]
    # Plans homed on each replica (fresh prefixes: the "decompose" system prompt is used by no other test here).
    homed = {r: [k for k in keys if rendezvous_order(str(k), replicas)[0] == r] for r in replicas}
    assert all(homed.values()), homed
    plans = [PromptPlan(images=(homed[r][i % len(homed[r])],), text=f"List the numbers of part {i}.",
                        system_prompt_id="decompose", sampling=LONG) for r in replicas for i in range(3)]
    streamed: list[list[str]] = [[] for _ in plans]
    first = asyncio.Event()
    started = 0

    def on_first() -> None:
        nonlocal started
        started += 1
        if started >= 2:
            first.set()

    tasks = [asyncio.ensure_future(engine.generate(p, on_first_token=on_first, on_text=streamed[i].append))
             for i, p in enumerate(plans)]
    await asyncio.wait_for(first.wait(), HANG_GUARD_S)
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    done = await asyncio.wait_for(asyncio.gather(*tasks), HANG_GUARD_S)
    return {"victim": victim, "plans": plans, "streamed": streamed, "done": done}


async def test_a_replica_killed_mid_load_loses_no_request(ray_cluster, killed_mid_load):
    victim, plans, streamed, done = (killed_mid_load[k] for k in ("victim", "plans", "streamed", "done"))
    assert len(done) == len(plans) and all(isinstance(c, Completion) and c.token_ids for c in done)
    assert ray_cluster["engine"].retries >= 1  # the victim had requests in flight: they were re-sent
    assert all(c.replica != victim for c in done if c.replica)  # none was answered by the dead replica
    # Answered exactly once: what each caller was told while streaming is its answer, no piece twice.
    assert all("".join(told) == c.text for told, c in zip(streamed, done))


def test_the_vision_service_runs_as_a_second_deployment_behind_serves_proxy(ray_cluster, tmp_path_factory):
    import io
    from functools import partial

    import httpx
    from PIL import Image
    from ray import serve

    from serving.ray.app import VISION_APP, deploy_vision

    # Between the kill and the replacement test (the fixture killed_mid_load is theirs): the vision replica starts
    # while Ray replaces the killed engine replica, whose start is one process after another, one core busy.
    # Its own data dir: the tokens it encodes go to a store the engine tests do not read.
    settings = ray_cluster["settings"].replace(**{"data_dir": tmp_path_factory.mktemp("ray-vision")})
    url = deploy_vision(wiring.ray_config(settings), partial(wiring.vision_app, settings))
    info = httpx.get(f"{url}/v1/info", timeout=60)
    assert info.status_code == 200 and info.json()["encoder_version"] == str(wiring.encoder_scope(
        settings, wiring.resolve_model(settings)).version)
    png = io.BytesIO()
    Image.new("RGB", (224, 168), (200, 30, 90)).save(png, format="PNG")
    answer = httpx.post(f"{url}/v1/encode", files=[("images", ("page.png", png.getvalue(), "image/png"))],
                        timeout=120)
    assert answer.status_code == 200, answer.text
    key = answer.json()["images"][0]["key"]
    assert wiring.feature_store(settings).contains(ImageKey.parse(key))  # written by the replica, read here
    serve.delete(VISION_APP, _blocking=False)  # Serve removes it while the next test waits for the replacement


async def test_the_killed_replica_is_replaced_and_later_plans_route_to_live_replicas(ray_cluster, keys,
                                                                                    killed_mid_load):
    engine, victim = ray_cluster["engine"], killed_mid_load["victim"]

    # Ray replaces the dead replica (seen at its next health check, 2 s apart); later plans route to live
    # replicas only.
    async def replaced() -> list[str]:
        now = await engine.replica_ids()
        assert len(now) == 2 and victim not in now, now
        return now

    now = await eventually(replaced, timeout=HANG_GUARD_S, what="the killed replica replaced")
    later = await run_all(engine, [PromptPlan(images=(k,), text="After the restart.", sampling=SHORT)
                                   for k in keys[:4]])
    assert {c.replica for c in later} <= set(now)


def test_a_local_cluster_announces_a_cpu_for_every_replica_on_a_small_host():
    # Found running `mmrag serve --ray` on this 2-core host: 2 engine replicas took both CPUs Ray announced and
    # the vision replica waited for a third forever. Ray's CPUs are scheduling tokens here (vLLM picks threads).
    from serving.ray.app import RayServeConfig, local_cpus

    config = RayServeConfig(address="", replicas=2, queue_bound=8, replica_cpus=1.0, replica_gpus=0.0,
                            max_ongoing_requests=16, http_host="127.0.0.1", http_port=8200, vision_max_replicas=2)
    assert local_cpus(config) >= 4


def test_each_replica_on_one_node_gets_its_own_share_of_the_cpus():
    from serving.ray.deployments import cpu_share

    assert [cpu_share([0, 1], r, 2) for r in range(2)] == [[0], [1]]  # this 2-core host: a core each
    assert [cpu_share(range(8), r, 2) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [cpu_share([3, 1], r, 3) for r in range(3)] == [[1], [3], [1]]  # more replicas than CPUs: shared
    assert cpu_share(range(6), 1, 4) == [1]
