"""`mmrag bench --image-input`: what each deployment form (MMRAG_IMAGE_INPUT, serving/engine/images.py) costs, at
ingest and at serving, in one run on one workload.

Ingest: every page of the bench corpus is encoded three ways, each by a fresh :class:`VisionEncoder` into its own
DiskFeatureStore (under ``root``, rebuilt every run so it is timed): ``tokens`` (the embeds form, as ingestion
does today), ``tokens_and_pixels`` (the tokens and the page's lossless PNG: either form can serve it) and
``pixels_only`` (``tokens=False``: the PNG and the grid, no tower forward; only the pixels form serves it). The
kinds take turns batch by batch, so background load falls on the three alike. Reported per kind: seconds per
page (the encoder's call and the store write; the page PNGs are decoded before the clock starts, and each
encoder is loaded and run once on a batch of a probe page before it), tower forwards per page and stored bytes
per page (``encode_entry``), and ``ingest_time_saved`` = 1 - pixels_only / tokens seconds per page.

Serving: the ``tokens_and_pixels`` store, the workload's questions planned once (one prompt per question: the joint
strategy, rag/plans.py, planned as `mmrag serve` plans it, through mmrag/bench/runner.workload_plans) and every plan decoding
exactly ``max_tokens`` (min_tokens: both forms decode the same amount), driven through the prefix-aware scheduler
at the same concurrency (mmrag/bench/runner.run_config) by four engines:

- ``inprocess_embeds`` / ``inprocess_pixels``: one InProcessEngine, ``with_image_input`` either form;
- ``remote_embeds`` / ``remote_pixels``: one `vllm serve` replica started here with the same EngineConfig (its
  processor bounded by the standard policy, ``image_pixels``), a RemoteEngine over it; stopped at the end.

The in-process engine is closed before the replica starts: one engine on the cores at a time. Every
configuration starts cold (prefix, multimodal-processor and encoder caches reset). Before the timed runs each
engine answers the first ``check_plans`` plans one at a time, cold, in both forms: their greedy tokens must be
equal in fp32 (``same_tokens``, recorded, not enforced; it also warms each engine up for both forms).

Per configuration: questions/s, TTFT p50/p95 (submit to first token, the scheduler's queue included; and the
engine's own p50), vision forwards per question (pixels: images not wholly served from the prefix cache, an
upper bound on vLLM's encoder forwards; embeds: 0, the tower ran at ingest: ``ingest_forwards_per_page``), the
image-token prefix-cache hit rate and the bytes moved per image sent: in process the token tensor handed to
vLLM (embeds) or the stored PNG and its decoded RGB (pixels); remote the base64 payload of the request
(``RemoteEngine.bytes_sent``). Ratios pixels / embeds per engine kind come from this run alone.
"""

from __future__ import annotations

import asyncio
import copy
import io
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from PIL import Image

from mmrag.adapters.checkpoint import ModelSource
from mmrag.adapters.store import DiskFeatureStore, encode_entry
from mmrag.adapters.vision import VisionEncoder
from mmrag.bench.corpus import BenchCorpus
from mmrag.devkit.ports import free_port
from mmrag.bench.runner import (BenchInputs, ConfigResult, ConfigSpec, ImageInput as BenchImages, Keys, cpu_snapshot,
                          machine_info, run_config, workload_plans)
from mmrag.bench.workload import Workload
from mmrag.core.engine import Completion, EngineWrapper, ImageInput, OnText, PromptPlan
from mmrag.core.keys import ImageKey, ResolutionPolicy
from mmrag.core.pages import EncodedImage
from rag.plans import AnswerMode
from serving.engine.config import EngineConfig
from serving.engine.features import FeatureProvider
from serving.engine.inprocess import InProcessEngine
from serving.engine.remote import RemoteEngine
from serving.scheduler import Policy
from serving.vllm_launch import DEV_MODE, start_dev_replica as start_replica

# (name, keep_pixels, tokens): the three entry kinds ingestion can write.
INGEST_KINDS = (("tokens", False, True), ("tokens_and_pixels", True, True), ("pixels_only", True, False))
SERVING_STORE = "tokens_and_pixels"  # serves both forms
FORMS = (ImageInput.EMBEDS, ImageInput.PIXELS)
CHECK_PLANS = 3  # plans answered one at a time in both forms before the timed runs (the same-tokens check)
# The plans: the joint strategy as one prompt per question over its sub-questions' pages (at most 4, in their stable
# order; not decoded in parts), and mmrag's scheduler policy; built by the runner. Joint rather than the default,
# auto, on purpose: one plan shape per question at the whole answer length, so the same-tokens check compares
# whole answers, whatever auto would choose; the forms' costs are per image either way.
PLAN_SPEC = ConfigSpec("image_input", BenchImages.TOKENS, caching=True, policy=Policy.DFS_WEIGHT,
                       answer_mode=AnswerMode.JOINT, joint_in_parts=False)
REPLICA_RESETS = ("reset_prefix_cache", "reset_mm_cache", "reset_encoder_cache")


@dataclass(slots=True)
class ImageInputBenchInputs:
    model: ModelSource
    corpus: BenchCorpus
    workload: Workload
    policy: ResolutionPolicy  # the standard tier's: the keys' and the engines' processor bounds
    engine_config: EngineConfig
    root: Path  # this run's stores and logs (rebuilt each run)
    remote: bool = True  # also the `vllm serve` half (the bench always; a smoke test may leave it out)
    check_plans: int = CHECK_PLANS
    batch: int = 4  # pages per encoder call at ingest (as mmrag/bench/corpus.encode_corpus)
    log: Callable[[str], None] = print
    # An in-process engine already running (a test session's, of the same model) to run on instead of starting
    # one: it serves this run's store under ``engine_config`` and is left running. vLLM allows one per process.
    engine: InProcessEngine | None = None


# --- ingest ------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Ingested:
    stores: dict[str, DiskFeatureStore]
    keys: Keys  # the same keys in every store (one encoder version and policy)
    report: dict[str, Any]


def ingest(inputs: ImageInputBenchInputs) -> Ingested:
    """Every corpus page encoded the three ways, each by its own fresh encoder into its own fresh store, timed
    (see the module docstring). The kinds take turns batch by batch, in a rotating order, so a change in the
    machine's background load falls on the three alike."""
    corpus, pages = inputs.corpus, inputs.corpus.pages
    images = [corpus.image(p) for p in pages]  # decoded once, outside every clock
    warm = [corpus.image(corpus.probes[0])] * min(inputs.batch, len(images))
    n = len(pages)
    stores: dict[str, DiskFeatureStore] = {}
    encoders: dict[str, VisionEncoder] = {}
    load_s: dict[str, float] = {}
    for name, keep_pixels, tokens in INGEST_KINDS:
        folder = inputs.root / "stores" / name
        shutil.rmtree(folder, ignore_errors=True)  # timed every run: nothing may be served from a last one
        stores[name] = DiskFeatureStore(folder)
        t = time.perf_counter()
        encoders[name] = VisionEncoder(inputs.model.path, inputs.policy, keep_pixels=keep_pixels, tokens=tokens)
        load_s[name] = time.perf_counter() - t
        # First-call allocations, thread pools and kernels for the batch's shapes: outside the clock.
        encoders[name].encode(warm)
        encoders[name].forwards = 0
    key_lists = {name: [e.key_for(p.content_hash) for p in pages] for name, e in encoders.items()}
    keys = key_lists["tokens"]
    if any(k != keys for k in key_lists.values()):
        raise RuntimeError("the three encoders disagree on the pages' keys: they must share one version and policy")
    encode_s = dict.fromkeys(encoders, 0.0)
    write_s = dict.fromkeys(encoders, 0.0)
    values: dict[str, list[EncodedImage]] = {name: [] for name in encoders}
    names = list(encoders)
    cpu_before = cpu_snapshot()
    t_ingest = time.perf_counter()
    for turn, start in enumerate(range(0, n, inputs.batch)):
        for name in names[turn % 3:] + names[:turn % 3]:
            t = time.perf_counter()
            chunk = encoders[name].encode(images[start:start + inputs.batch])
            encode_s[name] += time.perf_counter() - t
            t = time.perf_counter()
            for key, value in zip(keys[start:start + inputs.batch], chunk, strict=True):
                stores[name].put(key, value)
            write_s[name] += time.perf_counter() - t
            values[name] += chunk
    wall = time.perf_counter() - t_ingest
    (busy0, _, own0), (busy1, _, own1) = cpu_before, cpu_snapshot()
    report: dict[str, Any] = {"pages": n, "batch": inputs.batch,
                              "other_cpu_cores": round(max(0.0, (busy1 - busy0) - (own1 - own0)) / wall, 2)}
    for name, keep_pixels, tokens in INGEST_KINDS:
        out, forwards = values[name], encoders[name].forwards
        sizes = [len(encode_entry(k, v)) for k, v in zip(keys, out, strict=True)]
        report[name] = {
            "keep_pixels": keep_pixels, "tokens": tokens,
            "load_s": round(load_s[name], 2), "encode_s": round(encode_s[name], 3), "write_s": round(write_s[name], 3),
            "s_per_page": round((encode_s[name] + write_s[name]) / n, 5),
            "encode_s_per_page": round(encode_s[name] / n, 5), "write_s_per_page": round(write_s[name] / n, 5),
            "tower_forwards": forwards, "tower_forwards_per_page": round(forwards / n, 3),
            "stored_bytes_per_page": round(statistics.fmean(sizes)),
            "png_bytes_per_page": round(statistics.fmean(len(v.pixels_png) for v in out)) if keep_pixels else 0,
        }
        inputs.log(f"ingest {name}: {n} pages, {report[name]['s_per_page'] * 1000:.1f} ms/page, "
                   f"{forwards} tower forwards, {report[name]['stored_bytes_per_page']:,} bytes/page")
    # The pixels-only entries must expand to the same tokens as the encoded ones (the resize rule's grid).
    for ref, bare in zip(values["tokens"], values["pixels_only"], strict=True):
        if bare.has_tokens or bare.num_tokens != ref.num_tokens or not bool((bare.grid_thw == ref.grid_thw).all()):
            raise RuntimeError("a pixels-only entry's grid differs from the encoded entry's: see mmrag/adapters/vision.py")
    tokens_s, pixels_s = report["tokens"]["s_per_page"], report["pixels_only"]["s_per_page"]
    both_s = report["tokens_and_pixels"]["s_per_page"]
    report["ingest_time_saved"] = round(1 - pixels_s / tokens_s, 4) if tokens_s else 0.0
    report["pixels_kept_overhead"] = round(both_s / tokens_s - 1, 4) if tokens_s else 0.0
    report["ingest_forwards_per_page"] = report["tokens"]["tower_forwards_per_page"]
    token_counts = {k: v.num_tokens for k, v in zip(keys, values["tokens"], strict=True)}
    report["image_tokens_per_page"] = sorted(set(token_counts.values()))
    by_page = {p.index: k for p, k in zip(pages, keys, strict=True)}
    return Ingested(stores, Keys(by_page, token_counts), report)


# --- serving -----------------------------------------------------------------------------------------------


class _TokenLog(EngineWrapper):
    """Keeps each plan's generated token ids (the same-tokens comparison of the timed runs)."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.tokens: dict[PromptPlan, list[int]] = {}

    async def generate(self, plan: PromptPlan, *, on_first_token: Callable[[], None] | None = None,
                       on_text: OnText | None = None) -> Completion:
        done = await self.inner.generate(plan, on_first_token=on_first_token, on_text=on_text)
        self.tokens[plan] = list(done.token_ids)
        return done


def _pct(values: list[float], q: float) -> float:
    return round(float(np.percentile(values, q)), 4) if values else 0.0


class _Bytes:
    """Per image key, what the in-process engine hands vLLM: token tensor bytes, PNG bytes, decoded RGB bytes."""

    def __init__(self, store: DiskFeatureStore) -> None:
        self.store = store
        self.cache: dict[ImageKey, tuple[int, int, int]] = {}

    def of(self, key: ImageKey) -> tuple[int, int, int]:
        if key not in self.cache:
            entry = self.store.get(key)
            if entry is None:
                raise RuntimeError(f"{key} is not in the serving store")
            with Image.open(io.BytesIO(entry.pixels_png or b"")) as im:
                rgb = im.width * im.height * 3
            self.cache[key] = (int(entry.image_tokens.nbytes), len(entry.pixels_png or b""), rgb)
        return self.cache[key]


def summarize(result: ConfigResult, kind: str, form: ImageInput, *, sizes: _Bytes, remote_bytes: int = 0
              ) -> dict[str, Any]:
    """One configuration's figures (see the module docstring)."""
    records = result.records
    usages = [r.usage for r in records]
    forms = sorted({u.image_input for u in usages})
    images = [k for r in records for k in r.plan.images]
    image_tokens = sum(u.image_tokens for u in usages)
    cached = sum(u.cached_image_tokens for u in usages)
    forwards = sum(u.vision_encodes for u in usages)
    q = result.questions
    out: dict[str, Any] = {
        "engine": kind, "form": form.value, "forms_reported": forms,
        "questions": q, "plans": len(records), "images_sent": len(images), "wall_s": round(result.wall_s, 2),
        "questions_per_s": round(q / result.wall_s, 4) if result.wall_s else 0.0,
        "ttft_p50_s": _pct([r.ttft_s for r in records], 50), "ttft_p95_s": _pct([r.ttft_s for r in records], 95),
        "engine_ttft_p50_s": _pct([u.ttft_s for u in usages], 50),
        "question_latency_p50_s": _pct(result.question_latencies_s, 50),
        "completion_tokens_per_plan": round(sum(u.completion_tokens for u in usages) / max(1, len(records)), 2),
        "vision_forwards": forwards, "vision_forwards_per_question": round(forwards / q, 3) if q else 0.0,
        "image_tokens": image_tokens, "cached_image_tokens": cached,
        "image_hit_rate": round(cached / image_tokens, 4) if image_tokens else 0.0,
        "other_cpu_cores": round(result.other_cpu_cores, 2),
    }
    n = max(1, len(images))
    if kind == "remote":  # the base64 payload the requests carried (what crosses the network per image)
        out["bytes_per_page"] = round(remote_bytes / n)
        out["bytes_what"] = "base64 image_embeds (torch.save)" if form is ImageInput.EMBEDS else "base64 PNG data URL"
    elif form is ImageInput.EMBEDS:
        out["bytes_per_page"] = round(sum(sizes.of(k)[0] for k in images) / n)
        out["bytes_what"] = "image token tensor (image_embeds)"
    else:
        out["bytes_per_page"] = round(sum(sizes.of(k)[1] for k in images) / n)
        out["decoded_rgb_bytes_per_page"] = round(sum(sizes.of(k)[2] for k in images) / n)
        out["bytes_what"] = "stored PNG (decoded to RGB for vLLM's processor)"
    return out


async def _reset_inprocess(engine: InProcessEngine) -> None:
    """The in-process engine back to cold: no cached prefix, processed image or encoder output."""
    await engine.reset_prefix_cache()
    await engine.llm.reset_mm_cache()
    await engine.llm.reset_encoder_cache()


async def _reset_replica(client: httpx.AsyncClient, url: str, *, attempts: int = 20) -> None:
    """The replica back to cold: no cached prefix, processed image or encoder output (as mmrag/bench/e2e.py does).
    vLLM refuses a prefix reset while blocks are held (``success: false``): retried."""
    for route in REPLICA_RESETS:
        for _ in range(attempts):
            resp = await client.post(f"{url}/{route}")
            if resp.status_code == 404:
                raise RuntimeError(f"{url} has no POST /{route}: the replica must run with {DEV_MODE}=1")
            resp.raise_for_status()
            if route != "reset_prefix_cache" or resp.json().get("success", True):
                break
            await asyncio.sleep(0.25)
        else:
            raise RuntimeError(f"{url}/reset_prefix_cache kept answering success=false: requests still running")


async def _check(engine: Any, plans: list[PromptPlan], cold: Callable[[], Any]) -> dict[str, list[list[int]]]:
    """The plans one at a time, cold, in each form: their token ids per form."""
    out: dict[str, list[list[int]]] = {}
    for form in FORMS:
        one = engine.with_image_input(form)
        await cold()
        out[form.value] = [list((await one.generate(p)).token_ids) for p in plans]
    await cold()
    return out


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


async def _serve(kind: str, engine: Any, inputs: ImageInputBenchInputs, plans: dict[int, list[PromptPlan]],
                 keys: Keys, bench: BenchInputs, cold: Callable[[], Any], sizes: _Bytes) -> dict[str, Any]:
    """The check, then both forms timed on ``engine`` (in-process or remote)."""
    ordered = [p for q in inputs.workload.questions for p in plans[q.qid]]
    t = time.perf_counter()
    check = await _check(engine, ordered[: inputs.check_plans], cold)
    inputs.log(f"{kind}: same-tokens check on {len(check['embeds'])} plans in {time.perf_counter() - t:.1f} s")
    configs, logs = {}, {}
    for form in FORMS:
        await cold()
        logged = _TokenLog(engine.with_image_input(form))
        before = engine.bytes_sent[form.value] if kind == "remote" else 0
        result = await run_config(logged, PLAN_SPEC, bench, keys, inputs.workload.questions, plans)
        sent = engine.bytes_sent[form.value] - before if kind == "remote" else 0
        configs[f"{kind}_{form.value}"] = summary = summarize(result, kind, form, sizes=sizes, remote_bytes=sent)
        logs[form.value] = logged.tokens
        inputs.log(f"  {kind}_{form.value}: {summary['questions_per_s']} q/s, TTFT p50 {summary['ttft_p50_s']} s, "
                   f"{summary['vision_forwards_per_question']} vision forwards/question, "
                   f"{summary['bytes_per_page']:,} bytes/page")
    embeds, pixels = logs["embeds"], logs["pixels"]
    equal = sum(embeds.get(p) == pixels.get(p) for p in ordered)
    return {"configs": configs, "check": check,
            "tokens_equal_in_run": round(equal / len(ordered), 4) if ordered else 1.0}


RATIO_FIELDS = ("questions_per_s", "ttft_p50_s", "ttft_p95_s", "engine_ttft_p50_s", "bytes_per_page")


async def run_image_input(inputs: ImageInputBenchInputs) -> dict[str, Any]:
    """Ingest three ways, then the four serving configurations; the result dict (see the module docstring)."""
    t_start = time.perf_counter()
    ingested = ingest(inputs)
    store = ingested.stores[SERVING_STORE]
    keys = ingested.keys
    features = FeatureProvider.unscoped(store)
    bench = BenchInputs(model=inputs.model, corpus=inputs.corpus, workload=inputs.workload, store=store, full=keys,
                        budget=keys, engine_config=inputs.engine_config, log=inputs.log)
    plans = workload_plans(PLAN_SPEC, bench, keys, inputs.workload.questions)
    ordered = [p for q in inputs.workload.questions for p in plans[q.qid]]
    sizes = _Bytes(store)
    served: dict[str, dict[str, Any]] = {}
    starts: dict[str, float] = {}
    dtype = inputs.engine_config.dtype

    t = time.perf_counter()
    if inputs.engine is None:
        inputs.log("starting the in-process engine ...")
        engine = InProcessEngine.start(inputs.model, features, inputs.engine_config)
    else:
        engine = copy.copy(inputs.engine)  # the same vLLM, serving this run's store
        engine.features, engine.config = features, inputs.engine_config
    starts["inprocess"] = round(time.perf_counter() - t, 1)
    try:
        dtype = str(engine.llm.vllm_config.model_config.dtype).removeprefix("torch.")
        served["inprocess"] = await _serve("inprocess", engine, inputs, plans, keys, bench,
                                           lambda: _reset_inprocess(engine), sizes)
    finally:
        if inputs.engine is None:
            await engine.close()
        del engine

    if inputs.remote:
        inputs.log("starting a `vllm serve` replica ...")
        t = time.perf_counter()
        handle = await asyncio.to_thread(start_replica, inputs.model.path, inputs.engine_config,
                                         inputs.root / "logs" / "vllm-serve.log", port=free_port())
        starts["remote"] = round(time.perf_counter() - t, 1)
        try:
            remote = RemoteEngine.connect([handle.url], inputs.model, features,
                                          image_pixels=inputs.engine_config.image_pixels)
            try:
                served["remote"] = await _serve("remote", remote, inputs, plans, keys, bench,
                                                lambda: _reset_replica(remote.client, handle.url), sizes)
            finally:
                await remote.close()
        finally:
            await asyncio.to_thread(handle.stop)

    configs = {name: c for s in served.values() for name, c in s["configs"].items()}
    ratios = {}
    for kind in served:
        e, p = configs[f"{kind}_embeds"], configs[f"{kind}_pixels"]
        ratios[kind] = {f: round(p[f] / e[f], 4) if e[f] else None for f in RATIO_FIELDS}
    # The check: per engine, each plan's tokens in the pixels form are those of the embeds form.
    same = {kind: [c == d for c, d in zip(s["check"]["embeds"], s["check"]["pixels"], strict=True)]
            for kind, s in served.items()}
    check = {
        "plans": min(inputs.check_plans, len(ordered)),
        "tokens_per_plan": ordered[0].sampling.max_tokens if ordered else 0,
        "equal_by_engine": {k: all(v) for k, v in same.items()},
        "first_difference": {k: [_first_difference(a, b) for a, b in zip(s["check"]["embeds"], s["check"]["pixels"])]
                             for k, s in served.items()},
        "tokens_equal_in_run": {k: s["tokens_equal_in_run"] for k, s in served.items()},
    }
    if "remote" in served:
        check["same_across_engines"] = served["inprocess"]["check"]["embeds"] == served["remote"]["check"]["embeds"]
    machine = machine_info()
    return {
        "machine": {"cpu": machine["cpu_model"], "cpus": machine["cpus"], "dtype": dtype,
                    "cpu_flags": sorted(f for f, on in machine["cpu_flags"].items() if on),
                    "emulated_isa": machine["emulated_isa"]},
        "ingest": ingested.report,
        "serving": configs,
        "ratios_pixels_over_embeds": ratios,
        "same_tokens": all(all(v) for v in same.values()),
        "same_tokens_check": check,
        "engine_start_s": starts,
        "plans": len(ordered),
        "answer_mode": PLAN_SPEC.answer_mode.value,
        "scheduler_concurrency": bench.scheduler_concurrency,
        "engine": {"block_size": inputs.engine_config.block_size, "kv_cache_gib": inputs.engine_config.kv_cache_gib,
                   "max_model_len": inputs.engine_config.max_model_len, "dtype": inputs.engine_config.dtype,
                   "image_pixels": list(inputs.engine_config.image_pixels or ()),
                   "enforce_eager": inputs.engine_config.enforce_eager},
        "workload": inputs.workload.describe(),
        "corpus": inputs.corpus.describe(),
        "total_s": round(time.perf_counter() - t_start, 1),
    }


def engine_config_for(base: EngineConfig, policy: ResolutionPolicy) -> EngineConfig:
    """``base`` with vLLM's processor bounded by the standard policy (what `mmrag engine serve` starts with)."""
    return replace(base, image_pixels=(policy.min_pixels, policy.max_pixels), image_input=ImageInput.EMBEDS)


# --- the table ---------------------------------------------------------------------------------------------


def image_input_table(result: dict[str, Any]) -> str:
    """The serving table, the ratios, the ingest table and the check, as markdown."""
    cols = ("questions_per_s", "ttft_p50_s", "ttft_p95_s", "vision_forwards_per_question", "image_hit_rate",
            "bytes_per_page", "other_cpu_cores")
    rows = ["| configuration | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, c in result["serving"].items():
        cells = [f"{c[col]:,}" if col == "bytes_per_page" else str(c[col]) for col in cols]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    rows.append("")
    for kind, r in result["ratios_pixels_over_embeds"].items():
        rows.append(f"pixels / embeds, {kind}: " + ", ".join(f"{f} {v}" for f, v in r.items()))
    ing = result["ingest"]
    rows += ["", "| ingest entry | s per page | tower forwards per page | stored bytes per page |", "|---|---|---|---|"]
    for name, _, _ in INGEST_KINDS:
        r = ing[name]
        rows.append(f"| {name} | {r['s_per_page']} | {r['tower_forwards_per_page']} | {r['stored_bytes_per_page']:,} |")
    rows.append(f"\ningest_time_saved (pixels only vs tokens): {ing['ingest_time_saved']}; keeping the pixels "
                f"beside the tokens costs {ing['pixels_kept_overhead']:+.1%} ingest time; embeds ran "
                f"{ing['ingest_forwards_per_page']} tower forwards per page at ingest, 0 at serving (other "
                f"processes' load during the ingest: {ing['other_cpu_cores']} cores)")
    check = result["same_tokens_check"]
    rows.append(f"same_tokens: {str(result['same_tokens']).lower()} (first {check['plans']} plans, "
                f"{check['tokens_per_plan']} greedy tokens each, per engine: {check['equal_by_engine']}); "
                f"tokens equal in the timed runs: {check['tokens_equal_in_run']}")
    m = result["machine"]
    rows.append(f"on {m['cpu']} ({m['cpus']} cores, {', '.join(m['cpu_flags']) or 'no AVX'}), {m['dtype']}")
    return "\n".join(rows)
