"""`mmrag bench --figures`: page-level keys against figure-level keys (issue 26), on one engine, in one run.

The corpus (:func:`build_figure_corpus`, seeded): a dozen charts, each drawn once with PIL and saved as ONE JPEG,
then pasted into up to six pages of different documents, in this order: a report page (portrait, its own body text,
the chart at a varying place and size, "Figure N: <title>" below it, N the figure's number in that report), a slide
(landscape, a title, bullets, the chart elsewhere, no caption), an appendix page, then next quarter's report, the
all-hands deck and next quarter's appendix (the same layouts, other text, places and sizes). So the same figure
recurs inside different pages: each page is a key of its own, the figure is one key wherever it is pasted
(ingestion keys an embedded picture by its own bitmap).

The real Ingestor (figures on) ingests it; the questions ask about 1-2 charts each, drawn by a Zipf law over the
charts, each chart reached through one of the pages that show it, at random. How many pages a chart is asked
through decides how much page keys can reuse at all: a chart re-asked through the page it was asked through
before is a page-level hit too. So the run sweeps it (``placements``: 2, 3, 4 and 6 pages a chart): the same
questions, the same charts asked in the same order, each ask reaching its chart through one of the chart's first
``placements`` pages (one uniform draw per ask, shared by every point of the sweep). Each question becomes the
prompts mmrag serves in each strategy (rag/plans.py), planned as Pipeline.ask plans them (mmrag/bench/runner.answer_plans),
from hits built on the indexed payloads (retrieval.search.Hit.of, whose ``figure`` must be the page's chart):

- ``page_level``: joint (MMRAG_ANSWER_MODE=joint: one prompt over the question's images in their stable order,
  joint_plan), every hit showing its page (the page's key);
- ``figure_level``: the same hits through ``shown_as_figures`` (MMRAG_FIGURE_CROPS): the chart's crop key;
- ``page_level_split``, ``figure_level_split``: the same, answered split (MMRAG_ANSWER_MODE=split, split_plans: each
  image leads a prompt of its own, the answer's length shared among them), so an image after the first one of a
  question hits too. These questions relate nothing across their charts, so split is what the default, auto,
  answers them with (a one-chart question: its one prompt, the same in both).

Runs before the strategies were renamed call the split ones ``*_per_image`` and order a joint prompt's pages by
popularity instead of by key.

All four run back to back on ONE in-process engine, prefix caching on, every cache reset before each
(runner._cold), through the scheduler at the same concurrency (runner.run_config), at each point of the sweep and
each answer length.
"""

from __future__ import annotations

import copy
import io
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from mmrag.adapters.checkpoint import ModelSource
from mmrag.adapters.store import FeatureStore
from mmrag.core.engine import PromptPlan
from mmrag.core.figures import PageFigure, area
from mmrag.core.keys import ImageKey
from mmrag.core.payload import PagePayload
from mmrag.devkit.pdfbuild import PageBuilder, join_pages
from rag.pipeline import PipelineConfig
from rag.plans import AnswerMode, shown_as_figures
from retrieval.search import Hit
from serving.engine.config import EngineConfig
from serving.engine.features import FeatureProvider
from serving.engine.inprocess import InProcessEngine
from serving.scheduler import Policy

from mmrag.bench.report import config_summary
from mmrag.bench.runner import (BenchInputs, ConfigSpec, ImageInput, Keys, Prompts, _cold, _hits_by_position, answer_plans,
                          fixed_length, machine_info, prompt_images, run_config)
from mmrag.bench.workload import (Question, SubQuestion, Workload, WorkloadSpec, oracle_bound, prefix_bound,
                            zipf_probabilities)

PAGE_LEVEL, FIGURE_LEVEL = "page_level", "figure_level"
SPLIT = "_split"
# name -> (which level's keys, the strategy): joint first (the names the runs before split had), then split.
CONFIGS = {PAGE_LEVEL: (PAGE_LEVEL, AnswerMode.JOINT), FIGURE_LEVEL: (FIGURE_LEVEL, AnswerMode.JOINT),
           PAGE_LEVEL + SPLIT: (PAGE_LEVEL, AnswerMode.SPLIT), FIGURE_LEVEL + SPLIT: (FIGURE_LEVEL, AnswerMode.SPLIT)}
LENGTHS = (4, 128)
CHART_PX = (400, 260)  # each chart's JPEG: a quarter of a page's pixels, about half its image tokens
SLIDE = (792.0, 612.0)  # landscape, points
LETTER = (612.0, 792.0)
REPORT_PAGES, DECK_SLIDES, APPENDIX_PAGES = 3, 4, 3  # chart occurrences per document of each kind
# Where each chart recurs, in the order the corpus adds its pages: (layout, document family). A chart's first
# ``placements`` pages are the ones questions reach it through.
ROUNDS = (("report", "report"), ("slide", "deck"), ("appendix", "appendix"), ("report", "report-q2"),
          ("slide", "allhands"), ("appendix", "appendix-q2"))
# The sweep: pages a chart is asked through (the issue's own example, a report, a slide and an appendix, is 3).
PLACEMENTS = (2, 3, 4, 6)

_SUBJECTS = ("revenue", "API latency", "headcount", "storage use", "customer churn", "feature adoption",
             "gross margin", "ticket backlog", "cloud spend", "deploy frequency", "energy use", "cache hit rate",
             "page views", "error budget", "hiring pipeline", "build time")
_BREAKDOWNS = ("by region", "by quarter", "by month", "by team", "by product line", "by data centre")
_SENTENCES = ("The numbers below come from the finance team's quarterly close.",
              "Each series is normalised to the first period so that the shapes compare.",
              "We revised the methodology in the spring; earlier periods were restated.",
              "The sharp change mid-year follows the migration to the new platform.",
              "Targets for next year assume the same growth as the last two quarters.",
              "Regional differences are mostly explained by the rollout schedule.",
              "Outliers were kept: removing them does not change the conclusion.",
              "See the appendix for the raw data and the definitions used throughout.",
              "This section summarises what changed and why it matters for planning.",
              "The operations review discussed these results with every team lead.")


@dataclass(slots=True, frozen=True)
class FigureCorpusSpec:
    charts: int = 12
    seed: int = 0
    placements: int = max(PLACEMENTS)  # pages each chart is pasted into (ROUNDS' first ones)

    def __post_init__(self) -> None:
        if not 1 <= self.placements <= len(ROUNDS):
            raise ValueError(f"a chart is pasted into 1 to {len(ROUNDS)} pages, not {self.placements}")

    @property
    def folder_name(self) -> str:
        return f"figures-c{self.charts}-p{self.placements}-s{self.seed}"


@dataclass(slots=True, frozen=True)
class Placement:
    """One occurrence of a chart: which document, which page of it, in which layout."""

    chart: int
    layout: str  # "report", "slide", "appendix"
    doc: str  # file name
    page: int  # 1-based
    round: int  # its index in ROUNDS: the chart's (round + 1)-th page


@dataclass(slots=True)
class FigureCorpus:
    spec: FigureCorpusSpec
    root: Path
    titles: list[str]
    placements: list[Placement]

    @property
    def files(self) -> list[Path]:
        return [self.root / "pdf" / d for d in dict.fromkeys(p.doc for p in self.placements)]

    def describe(self) -> dict[str, Any]:
        layouts = {k: sum(p.layout == k for p in self.placements) for k in ("report", "slide", "appendix")}
        return {**asdict(self.spec), "documents": len(self.files), "pages": len(self.placements),
                "layouts": layouts, "rounds": [f"{layout} ({family})" for layout, family in
                                               ROUNDS[:self.spec.placements]], "titles": self.titles}

    def places(self, chart: int, placements: int) -> list[Placement]:
        """The pages questions reach ``chart`` through when it is asked through ``placements`` of them."""
        where = sorted((p for p in self.placements if p.chart == chart), key=lambda p: p.round)
        if placements > len(where):
            raise ValueError(f"chart {chart} is on {len(where)} pages, fewer than {placements}: build the corpus "
                             f"with placements >= {placements}")
        return where[:placements]


# --- the corpus ----------------------------------------------------------------------------------------------


def chart_titles(n: int, rng: np.random.Generator) -> list[str]:
    if n > len(_SUBJECTS):
        raise ValueError(f"at most {len(_SUBJECTS)} charts (distinct subjects), not {n}")
    subjects = rng.permutation(len(_SUBJECTS))[:n]
    return [f"{_SUBJECTS[s].capitalize()} {_BREAKDOWNS[int(rng.integers(len(_BREAKDOWNS)))]}" for s in subjects]


def chart_jpeg(title: str, rng: np.random.Generator, *, line: bool) -> bytes:
    """A bar or line chart with its title, as the one JPEG every page that shows it pastes."""
    w, h = CHART_PX
    im = Image.new("RGB", (w, h), "white")
    draw = ImageDraw.Draw(im)
    font = ImageFont.load_default(size=16)
    draw.text((12, 8), title, fill="black", font=font)
    left, top, right, bottom = 36, 40, w - 14, h - 26
    draw.line((left, bottom, right, bottom), fill="black", width=2)
    draw.line((left, top, left, bottom), fill="black", width=2)
    n = int(rng.integers(5, 10))
    values = rng.uniform(0.15, 1.0, n)
    step = (right - left) / n
    colour = tuple(int(c) for c in rng.integers(30, 200, 3))
    points = []
    for k, v in enumerate(values):
        x = left + step * (k + 0.5)
        y = bottom - v * (bottom - top)
        if line:
            points.append((x, y))
        else:
            draw.rectangle((x - step * 0.35, y, x + step * 0.35, bottom - 1), fill=colour)
        draw.text((x - 6, bottom + 6), f"{k + 1}", fill="black", font=ImageFont.load_default(size=11))
    if line:
        draw.line(points, fill=colour, width=3)
        for x, y in points:
            draw.ellipse((x - 4, y - 4, x + 4, y + 4), fill=colour)
    out = io.BytesIO()
    im.save(out, "JPEG", quality=88)
    return out.getvalue()


def _paragraph(b: PageBuilder, x: float, y: float, lines: int, rng: np.random.Generator, tag: str) -> float:
    for k in range(lines):
        b.text(x, y + 14 * k, f"{_SENTENCES[int(rng.integers(len(_SENTENCES)))]} ({tag}.{k + 1})")
    return y + 14 * lines


def _place_chart(b: PageBuilder, jpeg: bytes, x: float, y: float, width: float, caption: str = "") -> float:
    """The chart at (x, y), ``width`` wide at its own aspect ratio, its caption 10 pt below; its bottom edge."""
    bottom = y + width * CHART_PX[1] / CHART_PX[0]
    b.image((x, y, x + width, bottom), jpeg)
    if caption:
        b.text(x, bottom + 10, caption)
    return bottom


def report_page(jpeg: bytes, title: str, number: int, doc: str, rng: np.random.Generator) -> bytes:
    b = PageBuilder(*LETTER)
    b.text(72, 48, f"{doc.removesuffix('.pdf').replace('-', ' ').title()}: section {number}", size=16)
    y = _paragraph(b, 72, 84, int(rng.integers(2, 7)), rng, f"{doc} {number}a") + 24
    width = float(rng.uniform(260, 440))
    x = float(rng.uniform(72, LETTER[0] - 72 - width))
    bottom = _place_chart(b, jpeg, x, y, width, f"Figure {number}: {title}.")
    _paragraph(b, 72, bottom + 50, int(rng.integers(3, 9)), rng, f"{doc} {number}b")
    return b.bytes()


def slide_page(jpeg: bytes, title: str, doc: str, rng: np.random.Generator) -> bytes:
    b = PageBuilder(*SLIDE)
    b.text(60, 40, f"{title}: where we stand", size=24)
    width = float(rng.uniform(300, 420))
    height = width * CHART_PX[1] / CHART_PX[0]
    x = float(rng.uniform(330, SLIDE[0] - 40 - width))
    y = float(rng.uniform(130, SLIDE[1] - 50 - height))
    _place_chart(b, jpeg, x, y, width)
    for k in range(int(rng.integers(3, 6))):
        b.text(60, 150 + 34 * k, f"- {_SENTENCES[int(rng.integers(len(_SENTENCES)))][:38]}", size=12)
    b.text(60, SLIDE[1] - 40, f"{doc} - confidential", size=9)
    return b.bytes()


def appendix_page(jpeg: bytes, title: str, number: int, doc: str, rng: np.random.Generator) -> bytes:
    b = PageBuilder(*LETTER)
    b.text(72, 48, f"Appendix {number}: data behind the charts", size=14)
    y = _paragraph(b, 72, 80, int(rng.integers(1, 4)), rng, f"{doc} {number}") + 24
    width = float(rng.uniform(200, 300))
    bottom = _place_chart(b, jpeg, 72, y, width, f"Figure {number}: {title} (raw data).")
    for k in range(int(rng.integers(4, 12))):  # a table of figures, as text rows
        row = f"row {k + 1}    {rng.uniform(0, 1000):8.1f}    {rng.uniform(0, 100):5.1f} %"
        b.text(72, bottom + 50 + 14 * k, row)
    return b.bytes()


def build_figure_corpus(root: Path, spec: FigureCorpusSpec) -> FigureCorpus:
    """The PDFs under ``root/pdf`` (written once; the same seed gives the same pages) and where each chart is."""
    rng = np.random.default_rng(spec.seed)
    titles = chart_titles(spec.charts, rng)
    jpegs = [chart_jpeg(t, rng, line=bool(i % 2)) for i, t in enumerate(titles)]
    per_doc = {"report": REPORT_PAGES, "slide": DECK_SLIDES, "appendix": APPENDIX_PAGES}
    placements: list[Placement] = []
    pages: dict[str, list[bytes]] = {}
    for r, (layout, family) in enumerate(ROUNDS[:spec.placements]):
        order = [int(c) for c in rng.permutation(spec.charts)]
        for i, chart in enumerate(order):
            doc = f"{family}-{i // per_doc[layout] + 1}.pdf"
            page = i % per_doc[layout] + 1
            number = page + int(rng.integers(0, 9))  # the figure's number differs per document
            if layout == "report":
                data = report_page(jpegs[chart], titles[chart], number, doc, rng)
            elif layout == "slide":
                data = slide_page(jpegs[chart], titles[chart], doc, rng)
            else:
                data = appendix_page(jpegs[chart], titles[chart], number, doc, rng)
            pages.setdefault(doc, []).append(data)
            placements.append(Placement(chart, layout, doc, page, r))
    folder = root / "pdf"
    folder.mkdir(parents=True, exist_ok=True)
    for doc, datas in pages.items():
        path = folder / doc
        if not path.exists():  # rewritten bytes would make the ingestor re-read an unchanged document
            path.write_bytes(join_pages(datas))
    return FigureCorpus(spec, root, titles, placements)


# --- ingest --------------------------------------------------------------------------------------------------

# files -> (IngestReport.to_json(), every indexed page): mmrag/bench_cmd.py builds it from the wiring.
IngestFn = Callable[[Sequence[Path]], tuple[dict[str, Any], list[PagePayload]]]


@dataclass(slots=True)
class Ingested:
    report: dict[str, Any]  # the ingest that encoded the corpus (kept in ingest.json: a rerun encodes nothing)
    reused: bool
    seconds: float
    by_place: dict[tuple[str, int], PagePayload]
    chart_figure: dict[tuple[str, int], PageFigure]  # each page's chart


def ingest(corpus: FigureCorpus, run: IngestFn) -> Ingested:
    """The corpus through ``run`` (the real Ingestor), each page's chart found among its figures. A rerun finds
    every file unchanged and encodes nothing: the forwards reported are then the first ingest's (ingest.json)."""
    t = time.perf_counter()
    report, pages = run(corpus.files)
    seconds = time.perf_counter() - t
    saved = corpus.root / "ingest.json"
    reused = not (report["encoded"] or report["figures_encoded"]) and saved.exists()
    if reused:
        report = json.loads(saved.read_text())
    else:
        saved.write_text(json.dumps(report, indent=2) + "\n")
    if report["failed"]:
        raise RuntimeError(f"ingesting the figure corpus failed: {report['failed']}")
    by_place = {(p.doc, p.page): p for p in pages}
    chart_figure = {}
    for pl in corpus.placements:
        page = by_place[(pl.doc, pl.page)]
        if not page.figures:
            raise RuntimeError(f"{pl.doc} page {pl.page}: no figure detected on a page that shows chart {pl.chart} "
                               "(ingestion/figures.py): the corpus layout no longer suits the detector")
        # The chart is the page's largest figure (each layout places one; the detector finds nothing else here).
        chart_figure[(pl.doc, pl.page)] = max(page.figures, key=lambda f: area(f.region.bbox_pt))
    return Ingested(report, reused, seconds, by_place, chart_figure)


# --- questions and plans -------------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class FigureQuestion:
    qid: int
    charts: tuple[int, ...]
    places: tuple[Placement, ...]  # the page each chart is asked about through

    def sub_texts(self, titles: Sequence[str]) -> list[str]:
        return [f"What does the chart of {titles[c].lower()} show?" for c in self.charts]


def make_questions(corpus: FigureCorpus, n: int, zipf_s: float, seed: int, placements: int
                   ) -> list[FigureQuestion]:
    """``n`` questions of 1-2 distinct charts each, drawn by a Zipf law over the charts (a seeded shuffle decides
    which chart is most asked), each chart reached through one of its first ``placements`` pages, at random. The
    charts do not depend on ``placements``, and neither does each ask's uniform draw of its page (a stream of its
    own): a sweep over ``placements`` asks the same charts in the same order, only through more pages."""
    rng = np.random.default_rng(seed + 1)
    where_rng = np.random.default_rng(seed + 2)
    charts = corpus.spec.charts
    rank = rng.permutation(charts)
    probs = zipf_probabilities(charts, zipf_s)
    where = {c: corpus.places(c, placements) for c in range(charts)}
    out = []
    for qid in range(n):
        k = int(rng.integers(1, 3))
        picked = tuple(int(rank[i]) for i in rng.choice(charts, size=k, replace=False, p=probs))
        places = tuple(where[c][int(u * placements)] for c, u in zip(picked, where_rng.random(k)))
        out.append(FigureQuestion(qid, picked, places))
    return out


def question_hits(q: FigureQuestion, titles: Sequence[str], ingested: Ingested) -> list[list[Hit]]:
    """One hit per sub-question: the page it reaches its chart through, its figure named as retrieval names it
    (Hit.of: mmrag/core/figures.py hit_figure, by the caption, on a slide by its title), which must be that chart."""
    out = []
    for text, place in zip(q.sub_texts(titles), q.places):
        page = ingested.by_place[(place.doc, place.page)]
        hit = Hit.of(page, 1.0, text)
        if hit.figure != ingested.chart_figure[(place.doc, place.page)]:
            raise RuntimeError(f"{text!r} names {hit.figure} on {place.doc} page {place.page}, not its chart: "
                               "the figure corpus no longer matches retrieval's hit_figure")
        out.append([hit])
    return out


def level_plans(questions: Sequence[FigureQuestion], titles: Sequence[str], ingested: Ingested,
                config: PipelineConfig, *, figures: bool, mode: AnswerMode = AnswerMode.JOINT
                ) -> dict[int, list[PromptPlan]]:
    """Each question's prompts as Pipeline.ask builds them under ``config`` (mmrag/bench/runner.answer_plans): its hits
    (as figures: shown_as_figures), choose_answer's pages, then joint_plan over them in their stable order (one
    prompt: what is measured here is how often each shown image recurs, which a joint answer's parts would count
    once per part), or split_plans (a prompt per image, the answer's length shared); each decoding exactly its
    length."""
    plans = {}
    for q in questions:
        hits = question_hits(q, titles, ingested)
        subs = q.sub_texts(titles)
        question = " ".join(subs)
        if figures:
            hits = shown_as_figures(hits, subs, whole=question)
        shown = answer_plans(question, subs, hits, mode, config, joint_in_parts=False)[1]
        plans[q.qid] = [replace(plan, sampling=fixed_length(plan.sampling.max_tokens)) for plan in shown]
    return plans


# --- the run -------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class FigureBenchInputs:
    model: ModelSource
    corpus: FigureCorpus
    ingested: Ingested
    store: FeatureStore
    engine_config: EngineConfig
    questions: int = 32
    zipf_s: float = 1.0
    concurrency: int = 4
    lengths: tuple[int, ...] = LENGTHS
    placements: tuple[int, ...] = PLACEMENTS
    seed: int = 0
    log: Callable[[str], None] = print
    # An engine already running (a test session's, of the same model) to run on instead of starting one: it serves
    # this bench's store and is left running. vLLM allows one in-process engine per process.
    engine: InProcessEngine | None = None


def _tokens(ingested: Ingested) -> dict[ImageKey, int]:
    tokens = {p.image_key: p.image_tokens for p in ingested.by_place.values()}
    tokens |= {f.image_key: f.image_tokens for p in ingested.by_place.values() for f in p.figures}
    return tokens


def ingest_summary(corpus: FigureCorpus, ingested: Ingested) -> dict[str, Any]:
    r = ingested.report
    figures = list(ingested.chart_figure.values())
    all_figures = [f for p in ingested.by_place.values() for f in p.figures]
    return {
        "report": r, "reused": ingested.reused, "seconds": round(ingested.seconds, 1),
        "pages": len(ingested.by_place),
        "distinct_page_keys": len({p.image_key for p in ingested.by_place.values()}),
        "figure_occurrences": len(all_figures),
        "distinct_figure_keys": len({f.image_key for f in all_figures}),
        "chart_occurrences": len(figures),
        "distinct_chart_keys": len({f.image_key for f in figures}),
        "charts": corpus.spec.charts,
        "image_tokens_per_page": sorted({p.image_tokens for p in ingested.by_place.values()}),
        "image_tokens_per_figure": sorted({f.image_tokens for f in all_figures}),
        "vision_forwards": {PAGE_LEVEL: r["encoded"], FIGURE_LEVEL: r["encoded"] + r["figures_encoded"]},
    }


def _summary(result: Any, plans: Sequence[PromptPlan], forwards: int) -> dict[str, Any]:
    s = config_summary(result)
    n = len(plans)
    return {
        "questions": s["questions"], "prompts": n, "wall_s": s["wall_s"],
        "questions_per_s": s["throughput_qps"], "ttft_p50_s": s["ttft_p50_s"], "ttft_p99_s": s["ttft_p99_s"],
        "image_hit_rate": s["image_hit_rate"], "position_oracle_hit_rate": s["position_oracle_hit_rate"],
        "position_oracle_ratio": s["position_oracle_ratio"],
        # Why a rate falls short of its oracle: what a prefix cache can reach with these prompts (an image after
        # the first hits only behind the same images before it), and the hits of first and later images.
        "prefix_bound_hit_rate": s["prefix_bound_hit_rate"],
        "image_hit_rate_first_image": s["image_hit_rate_first_image"],
        "image_hit_rate_later_images": s["image_hit_rate_later_images"],
        "later_image_token_share": s["later_image_token_share"],
        "image_tokens": s["image_tokens"], "cached_image_tokens": s["cached_image_tokens"],
        "image_tokens_per_prompt": round(s["image_tokens"] / n, 2) if n else 0.0,
        "images_per_prompt": round(sum(len(p.images) for p in plans) / n, 3) if n else 0.0,
        "distinct_image_keys": len({k for p in plans for k in p.images}),
        "prompt_tokens": s["prompt_tokens"], "cached_tokens": s["cached_tokens"],
        "completion_tokens_per_question": s["completion_tokens_per_question"],
        "vision_forwards_at_ingest": forwards, "vision_forwards_at_serve": result.vision_forwards,
        "other_cpu_cores": s["other_cpu_cores"],
    }


def _workload(questions: Sequence[FigureQuestion], corpus: FigureCorpus, inputs: FigureBenchInputs,
              length: int) -> Workload:
    """The questions as runner.run_config takes them (a sub-question per chart; its "page" is the chart)."""
    asked = [Question(q.qid, tuple(SubQuestion(t, (c,)) for t, c in zip(q.sub_texts(corpus.titles), q.charts)),
                      0.0) for q in questions]
    return Workload(WorkloadSpec(questions=len(asked), pages=corpus.spec.charts, zipf_s=inputs.zipf_s,
                                 concurrency=inputs.concurrency, max_tokens=length, seed=inputs.seed), asked)


async def _run_level(engine: InProcessEngine, name: str, length: int, questions: Sequence[FigureQuestion],
                     inputs: FigureBenchInputs, keys: Keys, forwards: int, placements: int) -> dict[str, Any]:
    """One level at one length, from cold caches, through the scheduler as run_config drives every bench config;
    the oracle and the prefix bound over its own prompts."""
    level, mode = CONFIGS[name]
    spec = ConfigSpec(name, ImageInput.TOKENS, caching=True, policy=Policy.DFS_WEIGHT, answer_mode=mode,
                      max_tokens=length)
    # run_config reads the workload, the engine config and the scheduler's concurrency; the plans are given.
    bench = BenchInputs(model=inputs.model, corpus=None, workload=_workload(  # type: ignore[arg-type]
        questions, inputs.corpus, inputs, length), store=inputs.store, full=keys, budget=keys,
        engine_config=inputs.engine_config, scheduler_concurrency=inputs.concurrency, log=inputs.log)
    plans = level_plans(questions, inputs.corpus.titles, inputs.ingested, bench.pipeline_config(spec),
                        figures=level == FIGURE_LEVEL, mode=mode)
    await _cold(engine)
    inputs.log(f"  {placements} pages a chart, {name} at {length} tokens: {len(questions)} questions ...")
    result = await run_config(engine, spec, bench, keys, bench.workload.questions, plans)
    flat = [p for q in questions for p in plans[q.qid]]
    prompts = Prompts(engine.renderer)
    shown = prompt_images(flat, keys, prompts)
    block = (await engine.kv_capacity()).block_size
    # The position oracle to the token: every use of an image after its first hits, all its tokens. The
    # block-rounded one (runner's, which leaves out each run's last partial block) is no bound here: a prompt
    # that recurs whole (the same page, label and sub-question) hits its image's last block too.
    result.position_oracle_hit_rate = oracle_bound(shown, 1)
    result.prefix_bound_hit_rate = prefix_bound(shown, block)
    _hits_by_position(result, keys, prompts)
    out = _summary(result, flat, forwards)
    out["position_oracle_full_blocks_hit_rate"] = round(oracle_bound(shown, block), 4)
    inputs.log(f"  {placements} pages a chart, {name} at {length} tokens: {result.wall_s:.1f} s, "
               f"image hit rate {out['image_hit_rate']:.3f} "
               f"(oracle {out['position_oracle_hit_rate']:.3f}, prefix bound {out['prefix_bound_hit_rate']:.3f})")
    return out


async def run_figure_bench(inputs: FigureBenchInputs) -> dict[str, Any]:
    """Both levels, in both answer modes, at each point of the sweep and each length, on one engine; the JSON
    section ``figures``."""
    corpus, ingested = inputs.corpus, inputs.ingested
    asked = {k: make_questions(corpus, inputs.questions, inputs.zipf_s, inputs.seed, k) for k in inputs.placements}
    keys = Keys({}, _tokens(ingested))
    summary = ingest_summary(corpus, ingested)
    features = FeatureProvider.unscoped(inputs.store)
    t = time.perf_counter()
    if inputs.engine is None:
        inputs.log(f"figures: starting the engine ({inputs.engine_config.dtype}) ...")
        engine = InProcessEngine.start(inputs.model, features, inputs.engine_config)
    else:
        engine = copy.copy(inputs.engine)  # the same vLLM, serving this corpus' store
        engine.features = features
    start_s = time.perf_counter() - t
    by_placements: dict[str, dict[str, Any]] = {}
    try:
        capacity = await engine.kv_capacity()
        dtype = str(engine.llm.vllm_config.model_config.dtype).removeprefix("torch.")
        for k, questions in asked.items():
            by_length = {str(length): {
                name: await _run_level(engine, name, length, questions, inputs, keys,
                                       summary["vision_forwards"][level], k)
                for name, (level, _) in CONFIGS.items()} for length in inputs.lengths}
            by_placements[str(k)] = {"pages_asked": _pages_asked(questions), "by_length": by_length}
    finally:
        if inputs.engine is None:
            await engine.close()
    machine = machine_info()
    return {
        "corpus": corpus.describe(), "ingest": summary,
        "questions": _describe_questions(next(iter(asked.values())), inputs),
        "engine": {**{k: v for k, v in asdict(inputs.engine_config).items() if k != "caching"},
                   "dtype": dtype, "start_s": round(start_s, 1), "block_size": capacity.block_size,
                   "kv_tokens": capacity.tokens, "concurrency": inputs.concurrency},
        "machine": {"cpu": machine["cpu_model"], "cpus": machine["cpus"],
                    "cpu_flags": sorted(f for f, on in machine["cpu_flags"].items() if on), "dtype": dtype},
        "by_placements": by_placements,
        "targets": targets(by_placements),
    }


def _describe_questions(questions: Sequence[FigureQuestion], inputs: FigureBenchInputs) -> dict[str, Any]:
    """What every point of the sweep asks (the same charts; only the pages they are reached through differ)."""
    titles, charts = inputs.corpus.titles, inputs.corpus.spec.charts
    return {"n": len(questions), "zipf_s": inputs.zipf_s, "seed": inputs.seed,
            "charts_per_question": [len(q.charts) for q in questions],
            "chart_uses": [int(n) for n in np.bincount([c for q in questions for c in q.charts], minlength=charts)],
            "texts": [" ".join(q.sub_texts(titles)) for q in questions]}


def _pages_asked(questions: Sequence[FigureQuestion]) -> dict[str, int]:
    """Chart asks and the distinct pages and charts they went through: the two position oracles follow from them
    (an image's first use misses, every later one can hit)."""
    places = [p for q in questions for p in q.places]
    return {"asks": len(places), "distinct_pages": len({(p.doc, p.page) for p in places}),
            "distinct_charts": len({p.chart for p in places})}


# --- targets and the table -----------------------------------------------------------------------------------


def _target(name: str, measured: float | None, wanted: str, met: bool) -> dict[str, Any]:
    return {"name": name, "measured": measured, "wanted": wanted, "met": bool(met)}


def targets(by_placements: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 26's checks at each point of the sweep and each length: figure-level keys reach 0.9 of their own
    oracle (answered split, and joint) and twice page-level's hit rate (page-level answered joint, and split as
    they are), with fewer image tokens per prompt."""
    return [t for k, point in by_placements.items() for t in _targets_at(point["by_length"], f"{k} pages a chart")]


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def _targets_at(by_length: dict[str, dict[str, dict]], where: str) -> list[dict[str, Any]]:
    out = []
    for length, r in by_length.items():
        at = f"at {length} tokens, {where}"
        for name in (FIGURE_LEVEL + SPLIT, FIGURE_LEVEL):
            x = _ratio(r[name]["image_hit_rate"], r[name]["position_oracle_hit_rate"])
            out.append(_target(f"{name} hit rate / its position oracle {at}", x, ">= 0.9", x is not None and x >= 0.9))
        fig = r[FIGURE_LEVEL + SPLIT]
        for name in (PAGE_LEVEL, PAGE_LEVEL + SPLIT):
            x = _ratio(fig["image_hit_rate"], r[name]["image_hit_rate"])
            out.append(_target(f"{FIGURE_LEVEL + SPLIT} hit rate / {name} hit rate {at}", x, ">= 2.0",
                               x is None and fig["image_hit_rate"] > 0 or x is not None and x >= 2.0))
        x = _ratio(r[FIGURE_LEVEL]["image_tokens_per_prompt"], r[PAGE_LEVEL]["image_tokens_per_prompt"])
        out.append(_target(f"image tokens per prompt, figure-level / page-level {at}", x, "< 1.0",
                           x is not None and x < 1.0))
    return out


COLUMNS = ("image_hit_rate", "position_oracle_hit_rate", "prefix_bound_hit_rate", "image_hit_rate_first_image",
           "image_hit_rate_later_images", "image_tokens_per_prompt", "questions_per_s", "ttft_p50_s",
           "vision_forwards_at_ingest", "distinct_image_keys")


def figures_table(data: dict[str, Any]) -> str:
    ing = data["ingest"]
    rows = [f"on {data['machine']['cpu']} ({data['machine']['cpus']} cores), dtype {data['machine']['dtype']}; "
            f"{ing['pages']} pages in {data['corpus']['documents']} PDFs, {ing['chart_occurrences']} chart "
            f"occurrences -> {ing['distinct_chart_keys']} distinct figure keys ({ing['figure_occurrences']} figures "
            f"detected, {ing['distinct_figure_keys']} keys); {data['questions']['n']} questions"]
    lengths = next(iter(data["by_placements"].values()))["by_length"]
    for length in lengths:
        rows += [f"\n### {length} answer tokens\n", "| pages a chart | keys | " + " | ".join(COLUMNS) + " |",
                 "|---" * (len(COLUMNS) + 2) + "|"]
        for k, point in data["by_placements"].items():
            rows += [f"| {k} | {name} | " + " | ".join(str(v[c]) for c in COLUMNS) + " |"
                     for name, v in point["by_length"][length].items()]
    rows.append("")
    rows += [f"{t['name']}: {t['measured']} (wanted {t['wanted']}): {'met' if t['met'] else 'MISSED'}"
             for t in data["targets"]]
    return "\n".join(rows)
