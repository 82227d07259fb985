"""Runs the six configurations on one model, back to back in one process, and records every engine request.

Two engines, started one after the other with the same settings except caching (one in-process AsyncLLM
at a time): engine A has prefix caching and the processor cache off (no_cache, vision_cache); engine B has
prefix caching on (apc_naive, mmrag, mmrag_warm, mmrag_budget), its prefix cache reset between configs.
Before each configuration two cold single-page probe prompts time the machine, and during it the CPU time of
other processes is measured, so a reader can tell a ratio from a change in background load.
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from PIL import Image
from prometheus_client import REGISTRY

from core.keys import ImageKey
from adapters.checkpoint import ModelSource
from adapters.store import FeatureStore
from rag.pipeline import build_plans
from retrieval.search import Hit
from core.engine import Completion, KVCapacity, Layout, PromptPlan, SamplingSpec, Usage
from serving.engine.config import EngineConfig
from serving.engine.features import FeatureProvider
from serving.engine.inprocess import InProcessEngine
from serving.scheduler import Policy, Scheduler, SchedulerConfig
from serving.warmup import rank_by_demand, warm

from bench.corpus import BenchCorpus
from bench.workload import PromptImages, Question, Workload, fits_in_kv, oracle_bound, prefix_bound

KV_USAGE = "vllm:kv_cache_usage_perc"


@dataclass(slots=True, frozen=True)
class ConfigSpec:
    name: str
    pixels: bool  # send page pixels (vision encoder per request) instead of stored image tokens
    caching: bool  # engine B (prefix caching on) or engine A (off)
    layout: Layout
    policy: Policy
    warm: bool = False
    budget: bool = False  # the smaller resolution policy's keys


CONFIGS = (
    ConfigSpec("no_cache", pixels=True, caching=False, layout=Layout.NAIVE, policy=Policy.FCFS),
    ConfigSpec("vision_cache", pixels=False, caching=False, layout=Layout.NAIVE, policy=Policy.FCFS),
    ConfigSpec("apc_naive", pixels=False, caching=True, layout=Layout.NAIVE, policy=Policy.FCFS),
    ConfigSpec("mmrag", pixels=False, caching=True, layout=Layout.CANONICAL, policy=Policy.DFS_WEIGHT),
    ConfigSpec("mmrag_warm", pixels=False, caching=True, layout=Layout.CANONICAL, policy=Policy.DFS_WEIGHT,
               warm=True),
    ConfigSpec("mmrag_budget", pixels=False, caching=True, layout=Layout.CANONICAL, policy=Policy.DFS_WEIGHT,
               warm=True, budget=True),
)


@dataclass(slots=True)
class Keys:
    """One resolution policy's image keys for the corpus."""

    by_page: dict[int, ImageKey]
    tokens: dict[ImageKey, int]


@dataclass(slots=True)
class BenchInputs:
    model: ModelSource
    corpus: BenchCorpus
    workload: Workload
    store: FeatureStore
    full: Keys
    budget: Keys
    engine_config: EngineConfig  # caching on; engine A is the same with caching=False
    scheduler_concurrency: int = 4
    warm_share: float = 0.5
    log: Callable[[str], None] = print


@dataclass(slots=True)
class PlanRecord:
    question: int
    plan: PromptPlan
    ttft_s: float  # submit to the scheduler -> first token (queue wait included)
    latency_s: float
    usage: Usage


@dataclass(slots=True)
class ConfigResult:
    spec: ConfigSpec
    records: list[PlanRecord] = field(default_factory=list)
    question_latencies_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    kv_usage_peak: float = 0.0
    vision_forwards: int = 0
    oracle_hit_rate: float = 0.0
    prefix_bound_hit_rate: float = 0.0
    probe: list[Usage] = field(default_factory=list)
    warm: dict[str, Any] | None = None
    # (cached, total) image tokens of the first image of each prompt, and of the images after it
    other_cpu_cores: float = 0.0
    steal_cores: float = 0.0
    own_cpu_cores: float = 0.0
    first_image_tokens: tuple[int, int] = (0, 0)
    later_image_tokens: tuple[int, int] = (0, 0)
    scheduler: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class BenchRun:
    results: dict[str, ConfigResult]
    capacity: KVCapacity
    dtype: str
    engine_start_s: list[float]
    vit_probe_s: float  # a cold single-page prompt as pixels minus the same as image tokens, engine A


# --- engines the scheduler can drive --------------------------------------------------------------------


class PixelEngine:
    """no_cache: the page pixels go to vLLM with a fresh uuid per request, so no vLLM cache can serve them
    (its encoder cache is keyed by the uuid; the processor cache and prefix caching are off in engine A).
    The request runs through the in-process engine's own loop (``InProcessEngine.run_request``)."""

    def __init__(self, inner: InProcessEngine, images: dict[ImageKey, Image.Image], tokens: dict[ImageKey, int]):
        self.inner = inner
        self.images = images
        self.tokens = tokens
        self.model_name = inner.model_name
        self.random_weights = inner.random_weights
        self.forwards = 0

    async def generate(self, plan: PromptPlan, *, on_first_token: Callable[[], None] | None = None) -> Completion:
        started = time.perf_counter()
        request = {
            "prompt": self.inner.renderer.render(plan),
            "multi_modal_data": {"image": [self.images[k] for k in plan.images]},
            "multi_modal_uuids": {"image": [f"pixels-{uuid.uuid4().hex}" for _ in plan.images]},
        }
        self.forwards += len(plan.images)
        return await self.inner.run_request(plan, request, [self.tokens[k] for k in plan.images], started=started,
                                            vision_encodes=len(plan.images), on_first_token=on_first_token)

    async def kv_capacity(self) -> KVCapacity:
        return await self.inner.kv_capacity()

    async def close(self) -> None:
        pass


class _FirstTokens:
    """Wraps an engine to timestamp each plan's first token (the scheduler owns the callback slot)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.model_name = inner.model_name
        self.random_weights = inner.random_weights
        self.first: dict[PromptPlan, float] = {}

    async def generate(self, plan: PromptPlan, *, on_first_token: Callable[[], None] | None = None) -> Completion:
        def stamp() -> None:
            self.first.setdefault(plan, time.perf_counter())
            if on_first_token is not None:
                on_first_token()

        return await self.inner.generate(plan, on_first_token=stamp)

    async def kv_capacity(self) -> KVCapacity:
        return await self.inner.kv_capacity()

    async def close(self) -> None:
        pass


# --- one configuration ----------------------------------------------------------------------------------


def question_plans(q: Question, spec: ConfigSpec, keys: Keys, corpus: BenchCorpus, max_tokens: int
                   ) -> list[PromptPlan]:
    """The plans rag/pipeline.build_plans makes from this question's simulated retrieval."""
    hits = [[_hit(p, rank, keys, corpus) for rank, p in enumerate(s.pages)] for s in q.subs]
    return build_plans([s.text for s in q.subs], hits, max_tokens=max_tokens, layout=spec.layout)


def _hit(page: int, rank: int, keys: Keys, corpus: BenchCorpus) -> Hit:
    p = corpus.pages[page]
    key = keys.by_page[page]
    doc = p.docs[0] if p.docs else 0
    return Hit(page_id=f"bench-page-{page}", doc_id=f"bench-doc-{doc}", doc=f"doc-{doc}.pdf", page=page + 1,
               score=1.0 - 0.1 * rank, snippet=p.title, image_key=key, image_tokens=keys.tokens[key],
               path=str(corpus.root / p.file))


def prompt_images(plans: list[PromptPlan], keys: Keys, renderer: Any) -> list[PromptImages]:
    out = []
    for plan in plans:
        spans = renderer.tokens(renderer.render(plan), [keys.tokens[k] for k in plan.images]).image_spans
        # The naive layout puts the (unique) sub-question before the images: it is part of every prefix.
        lead = (plan.text,) if plan.layout is Layout.NAIVE else ()
        out.append(PromptImages(plan.images, spans, lead))
    return out


def cpu_snapshot() -> tuple[float, float, float]:
    """(CPU seconds the machine spent busy, of those stolen by the hypervisor, of those spent by this process
    and its children — the engine core and its worker), since boot."""
    import psutil  # comes with vLLM

    t = psutil.cpu_times()
    busy = t.user + t.nice + t.system + t.irq + t.softirq
    own = 0.0
    me = psutil.Process()
    for proc in [me, *me.children(recursive=True)]:
        try:
            c = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        own += c.user + c.system
    return busy, t.steal, own


def kv_usage() -> float:
    """vLLM's own KV usage gauge (0..1) from the in-process Prometheus registry."""
    values = [s.value for m in REGISTRY.collect() if m.name == KV_USAGE for s in m.samples]
    return max(values, default=0.0)


async def _sample_kv(peak: list[float], stop: asyncio.Event, period_s: float = 0.1) -> None:
    while not stop.is_set():
        peak[0] = max(peak[0], kv_usage())
        try:
            await asyncio.wait_for(stop.wait(), period_s)
        except TimeoutError:
            pass


async def run_config(engine: Any, spec: ConfigSpec, inputs: BenchInputs, keys: Keys) -> ConfigResult:
    wl = inputs.workload
    result = ConfigResult(spec)
    recorder = _FirstTokens(engine)
    sched = Scheduler(recorder, SchedulerConfig(policy=spec.policy, max_concurrency=inputs.scheduler_concurrency),
                      image_tokens=lambda p: sum(keys.tokens[k] for k in p.images))
    plans = {q.qid: question_plans(q, spec, keys, inputs.corpus, wl.spec.max_tokens) for q in wl.questions}

    async def ask(q: Question) -> None:
        started = time.perf_counter()

        async def one(plan: PromptPlan) -> None:
            submitted = time.perf_counter()
            completion = await sched.submit(plan)
            done = time.perf_counter()
            first = recorder.first.get(plan, done)
            result.records.append(PlanRecord(q.qid, plan, first - submitted, done - submitted, completion.usage))

        await asyncio.gather(*(one(p) for p in plans[q.qid]))
        result.question_latencies_s.append(time.perf_counter() - started)

    peak, stop = [0.0], asyncio.Event()
    sampler = asyncio.get_running_loop().create_task(_sample_kv(peak, stop))
    cpu_before = cpu_snapshot()
    started = time.perf_counter()
    if wl.spec.rate_qps:
        async def arrive(q: Question) -> None:
            await asyncio.sleep(max(0.0, started + q.arrival_s - time.perf_counter()))
            await ask(q)

        await asyncio.gather(*(arrive(q) for q in wl.questions))
    else:
        queue = iter(wl.questions)

        async def worker() -> None:
            for q in queue:  # one shared iterator: each worker takes the next question when it is free
                await ask(q)

        await asyncio.gather(*(worker() for _ in range(wl.spec.concurrency)))
    result.wall_s = time.perf_counter() - started
    (busy0, steal0, own0), (busy1, steal1, own1) = cpu_before, cpu_snapshot()
    # Other tenants' load while this config ran, in cores: the noise its timings carry.
    result.other_cpu_cores = max(0.0, (busy1 - busy0) - (own1 - own0)) / result.wall_s
    result.steal_cores = (steal1 - steal0) / result.wall_s
    result.own_cpu_cores = (own1 - own0) / result.wall_s
    stop.set()
    await sampler
    result.kv_usage_peak = peak[0]
    result.vision_forwards = sum(r.usage.vision_encodes for r in result.records)
    s = sched.stats
    result.scheduler = {"dispatched": s.dispatched, "gated": s.gated, "fairness_overrides": s.fairness_overrides,
                        "fcfs_fallbacks": s.fcfs_fallbacks}
    return result


async def probe(engine: InProcessEngine, inputs: BenchInputs, *, reset: bool) -> list[Usage]:
    """Two cold single-page prompts on pages no question asks about: the machine's speed right now."""
    out = []
    sampling = SamplingSpec(max_tokens=inputs.workload.spec.max_tokens)
    for p in inputs.corpus.probes:
        if reset:
            await engine.reset_prefix_cache()
        plan = PromptPlan(images=(inputs.full.by_page[p.index],), text=f"{p.title}: what does it show?",
                          sampling=sampling)
        out.append((await engine.generate(plan)).usage)
    if reset:
        await engine.reset_prefix_cache()
    return out


async def _warm_up(engine: InProcessEngine, inputs: BenchInputs, keys: Keys) -> tuple[dict[str, Any], set[ImageKey]]:
    """The production warm-up: pages ranked by how many documents show them, as many as fit the share."""
    pages = [(keys.by_page[p.index], keys.tokens[keys.by_page[p.index]]) for p in inputs.corpus.pages for _ in p.docs]
    report = await warm(engine, rank_by_demand(pages), share=inputs.warm_share)
    info = {"pages": len(report.warmed), "did_not_fit": len(report.did_not_fit), "seconds": round(report.seconds, 3),
            "tokens": report.warmed_tokens}
    return info, set(report.warmed)


def _oracles(result: ConfigResult, inputs: BenchInputs, keys: Keys, renderer: Any, capacity: KVCapacity,
             warmed: set[ImageKey] | None) -> None:
    spec, wl = result.spec, inputs.workload

    def prompts(layout_spec: ConfigSpec) -> list[PromptImages]:
        plans = [p for q in wl.questions
                 for p in question_plans(q, layout_spec, keys, inputs.corpus, wl.spec.max_tokens)]
        return prompt_images(plans, keys, renderer)

    # The workload's bound, over its canonical rendering: the same number for every config on these keys.
    canonical = prompts(replace(spec, layout=Layout.CANONICAL))
    warm_set = fits_in_kv(canonical, capacity.tokens, capacity.block_size) if spec.warm else None
    result.oracle_hit_rate = oracle_bound(canonical, capacity.block_size, warm_set)
    # What a prefix cache could reach with this config's own layout and the warm-up it really did.
    result.prefix_bound_hit_rate = prefix_bound(prompts(spec), capacity.block_size, warmed) if spec.caching else 0.0


def _hits_by_position(result: ConfigResult, keys: Keys, renderer: Any) -> None:
    """Where the hits were: the first image of each prompt, or the images behind it."""
    first, later = [0, 0], [0, 0]
    for rec in result.records:
        spans = renderer.tokens(renderer.render(rec.plan), [keys.tokens[k] for k in rec.plan.images]).image_spans
        for pos, (start, n) in enumerate(spans):
            bucket = first if pos == 0 else later
            bucket[0] += max(0, min(start + n, rec.usage.cached_tokens) - start)
            bucket[1] += n
    result.first_image_tokens, result.later_image_tokens = (first[0], first[1]), (later[0], later[1])


async def run_all(inputs: BenchInputs, names: list[str] | None = None) -> BenchRun:
    wanted = [c for c in CONFIGS if names is None or c.name in names]
    images = {inputs.full.by_page[p.index]: inputs.corpus.image(p) for p in inputs.corpus.pages}
    features = FeatureProvider(inputs.store)
    results: dict[str, ConfigResult] = {}
    starts: list[float] = []
    capacity, dtype, vit_probe = KVCapacity(0, 1), "", 0.0
    for caching in (False, True):
        group = [c for c in wanted if c.caching is caching]
        if not group:
            continue
        config = replace(inputs.engine_config, caching=caching)
        inputs.log(f"starting engine ({'prefix caching on' if caching else 'all caches off'}) ...")
        t = time.perf_counter()
        engine = InProcessEngine.start(inputs.model, features, config)
        starts.append(round(time.perf_counter() - t, 1))
        try:
            capacity = await engine.kv_capacity()
            dtype = str(engine.llm.vllm_config.model_config.dtype).removeprefix("torch.")
            if not caching:
                vit_probe = await _vit_probe(engine, inputs, images)
            for spec in group:
                keys = inputs.budget if spec.budget else inputs.full
                warm_info, warmed = None, None
                probes = await probe(engine, inputs, reset=caching)
                if spec.warm:
                    warm_info, warmed = await _warm_up(engine, inputs, keys)
                target = PixelEngine(engine, images, keys.tokens) if spec.pixels else engine
                inputs.log(f"  {spec.name}: {len(inputs.workload.questions)} questions ...")
                result = await run_config(target, spec, inputs, keys)
                result.probe, result.warm = probes, warm_info
                _oracles(result, inputs, keys, engine.renderer, capacity, warmed)
                _hits_by_position(result, keys, engine.renderer)
                results[spec.name] = result
                inputs.log(f"  {spec.name}: {result.wall_s:.1f} s, "
                           f"{len(inputs.workload.questions) / result.wall_s:.2f} questions/s")
        finally:
            await engine.close()
    return BenchRun({c.name: results[c.name] for c in wanted}, capacity, dtype, starts, vit_probe)


async def _vit_probe(engine: InProcessEngine, inputs: BenchInputs, images: dict[ImageKey, Image.Image]) -> float:
    """Seconds the vision encoder adds to a cold single-page prompt: pixels minus image tokens, same page."""
    page = inputs.corpus.pages[-1]  # engine A caches nothing: the probe leaves no trace for the configs
    key = inputs.full.by_page[page.index]
    plan = PromptPlan(images=(key,), text="vision probe", sampling=SamplingSpec(max_tokens=1))
    pixels = PixelEngine(engine, images, inputs.full.tokens)
    diffs = []
    for _ in range(2):
        px = (await pixels.generate(plan)).usage.ttft_s
        tok = (await engine.generate(plan)).usage.ttft_s
        diffs.append(px - tok)
    return statistics.median(diffs)


def default_engine_config(max_model_len: int = 4096) -> EngineConfig:
    """The same for every configuration: 32-token blocks (CPU attention wants multiples of 32), 1 GiB of KV,
    eager mode (20 s start-up), vLLM's dtype choice for the checkpoint on this CPU."""
    return EngineConfig(block_size=32, kv_cache_gib=1, max_model_len=max_model_len, max_images_per_prompt=4,
                        enforce_eager=True, dtype="auto", max_num_seqs=16)
