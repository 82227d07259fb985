"""`mmrag retrieval eval` and `mmrag retrieval latency`: retrieval quality and speed (parts from mmrag/wiring/).

Imported by mmrag/cli.py at start-up (for the sub-commands' --help): numpy, Qdrant, the embedders and the
sample corpus' plotting are imported inside the functions that use them.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    import numpy as np
    from qdrant_client import AsyncQdrantClient

    from mmrag.adapters.lexical import LexicalEncoder
    from mmrag.core.keys import ImageKey
    from mmrag.core.settings import Settings
    from mmrag.devkit.manifest import CorpusManifest
    from retrieval.evaluate import LabelledQuestion
    from retrieval.search import Channel, Hit, PageSearcher

retrieval_app = typer.Typer(help="Measure page retrieval: recall on a labelled corpus, latency at scale.",
                            no_args_is_help=True)
err = Console(stderr=True)


# --- eval ------------------------------------------------------------------------------------------------


@retrieval_app.command("eval")
def eval_command(
    docs: Annotated[Path | None, typer.Argument(help="Folder of the labelled documents: ingested first (files "
                                                "already indexed unchanged are skipped), then searched.")] = None,
    labels: Annotated[Path | None, typer.Option(help="Labelled questions, JSON lines: {\"question\", \"pages\": "
                                                "[{\"doc\", \"page\"}], \"needs\": \"any\"|\"all\", "
                                                "\"kind\": \"text\"|\"figure\"} (mmrag/bench/realdocs/labels.jsonl "
                                                "is one).")] = None,
    corpus: Annotated[Path, typer.Option(help="Without --labels: the sample corpus folder with manifest.json "
                                         "(from `mmrag corpus sample`), or the manifest file.")] = Path("corpus"),
    sweep: Annotated[bool, typer.Option(help="Also score the fused ranking under a grid of fusion methods and "
                                        "weights (MMRAG_FUSION, MMRAG_FUSION_WEIGHTS), from the same searches.")
                     ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of the tables.")] = False,
    held_out: Annotated[Path | None, typer.Option(
        "--held-out", help="Also score the held-out set (mmrag/bench/heldout/labels.jsonl over the PDFs in this "
        "folder: `python -m mmrag.bench.realdocs.fetch --set heldout --out DIR`), ingested into a collection of "
        "its own (MMRAG_QDRANT_COLLECTION + '-heldout': neither set's pages are the other's distractors), and "
        "print both side by side. Reported only: nothing is tuned on it.")] = None,
) -> None:
    """Recall@1, recall@5, MRR and (multi-page questions) every-page@5, per channel: text (dense), lexical (BM25),
    image (if on), hybrid (fused), and `cited`: the pages an answer to the question cites (sub-questions, their
    pages, one prompt's page budget), as POST /v1/ask would. Per question kind too (text, figure).

    On your own documents: `mmrag retrieval eval --labels my_labels.jsonl my_docs/`. The project's own sets:
    `mmrag retrieval eval --labels mmrag/bench/realdocs/labels.jsonl realdocs/ --held-out heldout/`."""
    from mmrag.core.settings import Settings
    from retrieval.evaluate import load_labels

    settings = Settings()
    if labels is None:
        if docs is not None:
            raise typer.BadParameter("a DOCS folder needs --labels FILE.jsonl (its labelled questions)")
        manifest = load_manifest(corpus)
        report = asyncio.run(run_eval(settings, labelled_questions(manifest)))
    else:
        if docs is None or not docs.is_dir():
            raise typer.BadParameter(f"give the folder of the labelled documents after --labels (got {docs}); "
                                     "e.g. `python -m mmrag.bench.realdocs.fetch --out realdocs` fetches ours")
        ingest_for_eval(settings, docs, err)
        report = asyncio.run(run_eval(settings, load_labels(labels), sweep=sweep))
    if held_out is not None:
        from mmrag.bench.heldout import LABELS

        if not held_out.is_dir():
            raise typer.BadParameter(f"--held-out {held_out} is not a folder: fetch the held-out PDFs with "
                                     f"`python -m mmrag.bench.realdocs.fetch --set heldout --out {held_out}`")
        collection = f"{settings.storage.qdrant_collection}{HELD_OUT_SUFFIX}"
        ingest_for_eval(settings, held_out, err, collection=collection)
        report = {"tuned": report, "held_out": asyncio.run(run_eval(settings, load_labels(LABELS),
                                                                    collection=collection))}
    if as_json:
        typer.echo(json.dumps(report))
    elif held_out is not None:
        print_eval(report["tuned"], err, title="the labelled set")
        print_eval(report["held_out"], err, title="the held-out set")
        print_side_by_side(report["tuned"], report["held_out"], err)
    else:
        print_eval(report, err)


HELD_OUT_SUFFIX = "-heldout"  # the held-out set's collection: MMRAG_QDRANT_COLLECTION and this


def ingest_for_eval(settings: Settings, docs: Path, console: Console, *, collection: str | None = None) -> None:
    """Ingest ``docs`` as `mmrag ingest` would (unchanged files are skipped), with progress; a failed file stops
    the evaluation, since its questions could not be answered. ``collection``: None, the configured one."""
    from mmrag import wiring

    ingestor = wiring.ingestor(settings, collection=collection)
    try:
        report = ingestor.run([docs], progress=lambda done, total, pages: console.print(
            f"ingesting {docs}: {done}/{total} files, {pages} pages", end="\r"))
    finally:
        ingestor.index.client.close()
    console.print(f"ingested {docs}: {report.files} files, {report.pages} pages ({report.unchanged_files} "
                  f"unchanged) in {report.seconds:.1f}s")
    if report.failed:
        raise typer.BadParameter("; ".join(f"{f.path}: {f.error}" for f in report.failed))


def load_manifest(corpus: Path) -> CorpusManifest:
    from mmrag.devkit.manifest import CorpusManifest

    path = corpus / "manifest.json" if corpus.is_dir() else corpus
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist: point --corpus at a folder written by `mmrag corpus sample --out DIR` "
            "(it holds manifest.json with the labelled questions)"
        )
    return CorpusManifest.load(path)


def labelled_questions(manifest: CorpusManifest) -> list[LabelledQuestion]:
    from retrieval.evaluate import LabelledQuestion

    return [LabelledQuestion(q.question, frozenset((a.file, a.page) for a in q.answers)) for q in manifest.questions]


async def run_eval(settings: Settings, labelled: list[LabelledQuestion], *, sweep: bool = False,
                   collection: str | None = None) -> dict[str, Any]:
    from qdrant_client import models

    from mmrag.core.pages import TextSource
    from mmrag.adapters.qdrant import PAGES_ONLY, AsyncPageReader
    from mmrag.core.payload import PageField
    from mmrag import wiring
    from retrieval.evaluate import DEPTH, by_kind, chance_recall, misses, score, unknown_docs
    from retrieval.search import Channel

    searcher = wiring.searcher(settings, collection=collection)
    try:
        client, collection = searcher.client, searcher.collection
        # Pages only: figure points (issue 26) carry their page's payload, and are not pages to count.
        pages = (await client.count(collection, count_filter=PAGES_ONLY, exact=True)).count \
            if await client.collection_exists(collection) else 0
        if pages:
            facet = await client.facet(collection, key=PageField.DOC.value, facet_filter=PAGES_ONLY, limit=100_000,
                                       exact=True)
            missing = unknown_docs(labelled, {str(h.value): h.count for h in facet.hits})
            if missing:
                raise typer.BadParameter(
                    f"{len(missing)} labelled pages are not indexed (e.g. {', '.join(missing[:5])}): ingest the "
                    "labelled documents (pass their folder), or fix the labels' doc names and page numbers")
        questions = [q.question for q in labelled]
        t0 = time.perf_counter()
        found = await searcher.search_channels(questions, top_k=settings.retrieval.candidate_k, channels=Channel.HYBRID)
        search_ms = (time.perf_counter() - t0) * 1e3 / len(questions)
        cited = await cited_pages(settings, searcher, questions)
        no_text = models.Filter(must=[models.FieldCondition(key=PageField.TEXT_SOURCE.value,
                                                            match=models.MatchValue(value=TextSource.NONE.value))],
                                must_not=PAGES_ONLY.must_not)
        without_text = (await client.count(collection, count_filter=no_text, exact=True)).count
        # What each needed page of a missed question holds: the indexed pages' payloads, read once.
        by_page = {(p.doc, p.page): p for p in await AsyncPageReader(client, collection).pages()} if pages else {}
        missed = misses(cited, found[Channel.HYBRID], labelled, by_page)
    finally:
        await searcher.client.close()
    channels = {c.value: score([h[:DEPTH] for h in found[c]], labelled) for c in found}
    channels["cited"] = score(cited, labelled)
    kinds = {c: by_kind([h[:DEPTH] for h in found[Channel(c)]] if c != "cited" else cited, labelled)
             for c in ("hybrid", "cited")}
    report: dict[str, Any] = {
        "channels": channels,
        "by_kind": kinds,
        "questions": len(labelled),
        "pages": pages,
        "pages_without_text": without_text,
        "image_channel": searcher.image_channel_name,
        "image_random_init": bool((searcher.image_embedder and settings.retrieval.clip_weights is None)
                                  or (searcher.late and searcher.late.random_weights)),
        "chance_recall@5": round(chance_recall(labelled, pages), 4),
        "fusion": {"method": searcher.fusion.method, "weights": dict(searcher.fusion.weights)},
        "search_ms_per_question": round(search_ms, 2),
        # Why a question's answer missed: its pages' fused ranks, figures and text, and what it cited instead.
        "misses": missed,
    }
    if sweep:
        report["sweep"] = fusion_sweep(found, labelled)
    return report


async def cited_pages(settings: Settings, searcher: PageSearcher, questions: list[str]) -> list[list[tuple[str, int]]]:
    """Per question, the pages its answer cites, best first, chosen by rag/plans.py's own functions as
    rag/pipeline.py calls them: the rule decomposer's sub-questions, MMRAG_TOP_K fused pages each, cut to one
    prompt's room and to the answer's page budget (MMRAG_ONE_PROMPT_PAGES), shown as MMRAG_ANSWER_MODE chooses
    (split or joint show the same pages; every prompt taken to fit the engine's context, and a split at most
    MMRAG_ANSWER_MAX_TOKENS parts). A real model's decomposer (MMRAG_DECOMPOSER=model) may split a question
    otherwise."""
    from mmrag.core.engine import Layout
    from rag.decompose import RuleDecomposer
    from rag.plans import AnswerMode, choose_answer, cite, fit_pages, shown_as_figures

    rules = RuleDecomposer(max_n=settings.answer.max_sub_questions)
    out = []
    for question in questions:  # one round trip per question, as an answer makes
        subs = rules.split(question)
        hits = await searcher.search_many(subs, top_k=settings.retrieval.top_k,
                                          context=question if len(subs) > 1 else None)
        if settings.answer.figure_crops:  # a figure's crop is an image of its own: one key wherever it recurs
            hits = shown_as_figures(hits, subs, whole=question)
        shown, _ = fit_pages(hits, room=settings.engine.max_images_per_prompt, layout=Layout.CANONICAL)
        choice = choose_answer(AnswerMode(settings.answer.mode), shown, misfit=lambda pages: None,
                               question=question, max_pages=settings.answer.one_prompt_pages,
                               max_parts=settings.answer.max_tokens)
        dropped = {p.image_key for p in choice.left_out}
        out.append([(c.doc, c.page) for c in cite([[h for h in hs if h.image_key not in dropped] for hs in shown])])
    return out


# The grid `--sweep` scores: each method with the channels weighted alike, and with one channel leading.
SWEEP_WEIGHTS = tuple({"text": t, "lexical": lx, "image": 1, "caption": c}
                      for t, lx, c in ((1, 1, 1), (1, 1.5, 1), (1, 2, 1), (1, 3, 1), (2, 1, 1), (1, 2, 0), (1, 2, 2),
                                       (0, 1, 0), (1, 0, 0))) + ({"text": 1, "lexical": 2, "image": 0.5, "caption": 1},
                                                                 {"text": 1, "lexical": 2, "image": 2, "caption": 1})


def fusion_sweep(found: dict[Channel, list[list[Hit]]], labelled: list[LabelledQuestion]) -> list[dict[str, Any]]:
    """The fused ranking's scores under each method and weights of SWEEP_WEIGHTS, re-fused from the same
    per-channel candidates (Fusion is client-side, so no search is repeated)."""
    from retrieval.evaluate import DEPTH, score
    from retrieval.search import FUSED, Fusion

    rows = []
    for method in ("rrf", "score"):
        for weights in SWEEP_WEIGHTS:
            fusion = Fusion(method, {k: float(v) for k, v in weights.items()})
            fused = [[h for _, h in fusion.fuse({c: found[c][i] for c in FUSED if c in found},
                                                key=lambda h: h.page_id)[:DEPTH]] for i in range(len(labelled))]
            rows.append({"method": method, "weights": weights, **score(fused, labelled)})
    return rows


def print_side_by_side(tuned: dict[str, Any], held: dict[str, Any], console: Console) -> None:
    """Recall@5 and every-page@5 of the labelled set beside the held-out set's, per channel and per kind."""
    table = Table(title="the labelled set (tuned on) beside the held-out set (reported only)")
    for col in ("", "recall@5", "held out", "every page@5", "held out"):
        table.add_column(col, justify="left" if not col else "right")

    def row(name: str, a: dict[str, Any] | None, b: dict[str, Any] | None) -> None:
        def cells(s: dict[str, Any] | None) -> tuple[str, str]:
            if s is None:
                return "-", "-"
            multi = f"{s['all@5']:.3f} of {s['n_multi']}" if s.get("n_multi") else "-"
            return f"{s['recall@5']:.3f} of {s['n']}", multi
        (r5a, alla), (r5b, allb) = cells(a), cells(b)
        table.add_row(name, r5a, r5b, alla, allb)

    for channel in tuned["channels"]:
        row(channel, tuned["channels"][channel], held["channels"].get(channel))
    for channel, kinds in tuned.get("by_kind", {}).items():
        for kind in sorted({*kinds, *held.get("by_kind", {}).get(channel, {})}):
            row(f"{channel}, {kind} questions", kinds.get(kind), held["by_kind"].get(channel, {}).get(kind))
    console.print(table)


def print_eval(report: dict[str, Any], console: Console, *, title: str = "retrieval eval") -> None:
    table = Table(title=f"{title}: {report['questions']} questions, {report['pages']} indexed pages")
    for col in ("channel", "recall@1", "recall@5", "MRR@5", "every page@5", "questions"):
        table.add_column(col, justify="left" if col == "channel" else "right")
    for channel, s in report["channels"].items():
        multi = f"{s['all@5']:.3f} of {s['n_multi']}" if s.get("n_multi") else "-"
        table.add_row(channel, f"{s['recall@1']:.3f}", f"{s['recall@5']:.3f}", f"{s['mrr']:.3f}", multi, str(s["n"]))
    for channel, kinds in report.get("by_kind", {}).items():
        for kind, s in kinds.items():
            table.add_row(f"{channel}, {kind} questions", f"{s['recall@1']:.3f}", f"{s['recall@5']:.3f}",
                          f"{s['mrr']:.3f}", f"{s['all@5']:.3f} of {s['n_multi']}" if s.get("n_multi") else "-",
                          str(s["n"]))
    console.print(table)
    fusion = report["fusion"]
    console.print(f"fusion: {fusion['method']} {fusion['weights']}; search {report['search_ms_per_question']} ms per "
                  "question (every channel, one round trip)")
    if report.get("sweep"):
        sweep = Table(title="fusion sweep (hybrid, from the same candidates)")
        for col in ("method", "weights", "recall@1", "recall@5", "MRR@5", "every page@5"):
            sweep.add_column(col)
        for r in report["sweep"]:
            sweep.add_row(r["method"], ",".join(f"{k}={v}" for k, v in r["weights"].items()), f"{r['recall@1']:.3f}",
                          f"{r['recall@5']:.3f}", f"{r['mrr']:.3f}", f"{r['all@5']:.3f}")
        console.print(sweep)
    if report.get("misses"):
        missed = Table(title=f"{title}: questions whose answer cites no needed page (every one, for multi-page)")
        for col in ("id", "kind", "needs", "fused rank of each needed page [its figures]", "cited instead"):
            missed.add_column(col)
        for m in report["misses"]:
            needed = m.get("needed", {})
            missed.add_row(m["id"], m["kind"], m["needs"], "; ".join(
                f"{p}: {r if r is not None else '-'}" + (f" [{' | '.join(needed[p]['figures'])}]"
                                                         if needed.get(p, {}).get("figures") else "")
                for p, r in m["hybrid_rank"].items()), ", ".join(m["cited"]))
        console.print(missed)
        console.print("(--json adds each needed page's text; a rank '-': not among the fused candidates)")
    if report["image_channel"] == "off":
        console.print("page-image channel: off (set MMRAG_PAGE_RETRIEVER to a local ColQwen2/ColPali folder, or "
                      "MMRAG_CLIP_WEIGHTS to a local open_clip file, to score it)")
    elif report["image_random_init"]:
        console.print(f"[yellow]page-image channel: {report['image_channel']} has RANDOM weights[/]: image-only "
                      f"recall is expected near chance (recall@5 ≈ {report['chance_recall@5']:.3f}), and it adds "
                      "noise to hybrid. Only tests should run this way.")
    if report["pages_without_text"]:
        console.print(f"{report['pages_without_text']} indexed pages have no text (no text layer and OCR off or "
                      "empty): the text channels cannot find them. Ingest with MMRAG_OCR=true to read them.")


# --- latency ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class LatencyRow:
    """Milliseconds, p50 and p99 over batches; per-question figures are batch time / batch size."""

    channel: str
    embed_p50: float
    embed_p99: float
    qdrant_p50: float
    qdrant_p99: float
    per_question_p50: float
    per_question_p99: float
    batch_p50: float
    batch_p99: float


@retrieval_app.command("latency")
def latency_command(
    pages: Annotated[int, typer.Option(help="Synthetic pages in the temporary collection.")] = 10_000,
    queries: Annotated[int, typer.Option(help="Sub-questions to search per channel.")] = 200,
    batch: Annotated[int, typer.Option(help="Sub-questions per search_many call (one Qdrant round trip).")] = 4,
    seed: Annotated[int, typer.Option(help="Seed of the synthetic vectors.")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of the table.")] = False,
) -> None:
    """Search latency on N synthetic pages in an in-memory local Qdrant: dense text, lexical (BM25), both fused,
    and all channels fused with the page-image channel (the configured one; CLIP with random weights if none).

    Pages get random unit vectors (text 384-d, image from the CLIP config) and synthetic text drawn from a
    Zipf-distributed vocabulary (for the lexical postings), so only timing means anything; the queries are embedded
    by the configured models. The late-interaction channel's cost at scale: `mmrag retrieval cost`.
    """
    if pages < 1 or queries < 1 or batch < 1:
        raise typer.BadParameter("--pages, --queries and --batch must be at least 1")
    from mmrag.core.settings import Settings

    settings = Settings()
    result = asyncio.run(run_latency(settings, pages=pages, queries=queries, batch=batch, seed=seed))
    if as_json:
        typer.echo(json.dumps(result))
    else:
        print_latency(result, err)


async def run_latency(settings: Settings, *, pages: int, queries: int, batch: int, seed: int = 0) -> dict[str, Any]:
    import numpy as np
    from qdrant_client import AsyncQdrantClient

    from mmrag.adapters.embed import ImageEmbedder
    from mmrag.adapters.lexical import LexicalEncoder
    from mmrag.core.keys import ContentHash, EncoderVersion, ImageKey
    from mmrag.core.payload import EncoderScope
    from mmrag import wiring
    from retrieval.search import Channel, Fusion, PageSearcher

    text = wiring.text_embedder(settings)
    lexical = LexicalEncoder()
    # Timing only: a random-weight CLIP when no weights are configured (random weights change no timing).
    image = wiring.image_embedder(settings) or ImageEmbedder(settings.retrieval.clip_model, None,
                                                             batch_size=settings.ingestion.embed_batch_size)
    rng = np.random.default_rng(seed)
    vocabulary = [f"{_SYLLABLES[i % 37]}{_SYLLABLES[(i // 37) % 37]}{i // 1369}" for i in range(30_000)]
    client = AsyncQdrantClient(location=":memory:")
    try:
        t0 = time.perf_counter()
        key = ImageKey(ContentHash("0" * 64), EncoderVersion("0" * 16), settings.vision.resolution_policy)
        await fill_synthetic(client, "latency", pages, text.dim, image.dim, key, rng, lexical, vocabulary)
        build_s = time.perf_counter() - t0
        weights = settings.retrieval.fusion_weight_table
        words = _zipf_words(rng, vocabulary, queries * 6)
        questions = [f"How does {' '.join(words[6 * i:6 * i + 6])} change in part {i % 4 + 1}?"
                     for i in range(queries)]
        # As served: every request filtered to the encoder's pages (and no figure points), as wiring.searcher does.
        scope = EncoderScope.of(key)
        texts = PageSearcher(client, "latency", text, None, lexical=lexical, top_k=settings.retrieval.top_k,
                             candidate_k=settings.retrieval.candidate_k,
                             fusion=Fusion(settings.retrieval.fusion, weights | {"image": 0}),
                             encoder=scope)
        every = PageSearcher(client, "latency", text, image, lexical=lexical, top_k=settings.retrieval.top_k,
                             candidate_k=settings.retrieval.candidate_k,
                             fusion=Fusion(settings.retrieval.fusion, weights), encoder=scope)
        rows = [await _time_channel(s, questions, batch, ch, name) for s, ch, name in (
            (texts, Channel.TEXT, "text (dense)"), (texts, Channel.LEXICAL, "lexical (BM25)"),
            (texts, Channel.HYBRID, "text + lexical, fused"), (every, Channel.HYBRID, "text + lexical + image, fused"))]
    finally:
        await client.close()
    return {"pages": pages, "queries": queries, "batch": batch, "build_s": round(build_s, 2),
            "image_channel": image.name, "fusion": settings.retrieval.fusion, "rows": [asdict(r) for r in rows]}


async def _time_channel(searcher: PageSearcher, questions: list[str], batch: int, channel: Channel, name: str
                        ) -> LatencyRow:
    import numpy as np

    batches = [questions[i:i + batch] for i in range(0, len(questions), batch)]
    embed, qdrant = [], []
    for i, qs in enumerate([batches[0], *batches]):  # the first pass warms both models and Qdrant
        t0 = time.perf_counter()
        vectors = await asyncio.to_thread(searcher.embed_queries, qs, channel)
        t1 = time.perf_counter()
        await searcher.search_vectors(qs, vectors)
        t2 = time.perf_counter()
        if i:
            embed.append((t1 - t0) * 1e3)
            qdrant.append((t2 - t1) * 1e3)
    sizes = np.array([len(b) for b in batches], dtype=float)
    total = np.array(embed) + np.array(qdrant)
    pct = lambda xs, q: round(float(np.percentile(xs, q)), 2)  # noqa: E731
    return LatencyRow(name, pct(embed, 50), pct(embed, 99), pct(qdrant, 50), pct(qdrant, 99),
                      pct(total / sizes, 50), pct(total / sizes, 99), pct(total, 50), pct(total, 99))


async def fill_synthetic(client: AsyncQdrantClient, collection: str, pages: int, text_dim: int, image_dim: int,
                         image_key: ImageKey, rng: np.random.Generator, lexical: LexicalEncoder,
                         vocabulary: list[str], chunk: int = 1000, words_per_page: int = 300) -> None:
    """A collection shaped like the page index (same vectors, sizes and payload) of random pages: unit dense
    vectors, and BM25 vectors of ``words_per_page`` words drawn from ``vocabulary`` by a Zipf law (as words are)."""
    from qdrant_client import models

    from mmrag.adapters.qdrant import make_point, vector_params
    from mmrag.core.keys import doc_id_for
    from mmrag.core.pages import TextSource
    from mmrag.core.payload import IMAGE_VECTOR, LEXICAL_VECTOR, TEXT_VECTOR, PagePayload

    await client.create_collection(
        collection, vectors_config={n: vector_params(n, d) for n, d in ((TEXT_VECTOR, text_dim),
                                                                          (IMAGE_VECTOR, image_dim))},
        sparse_vectors_config={LEXICAL_VECTOR: models.SparseVectorParams(modifier=models.Modifier.IDF)})
    for start in range(0, pages, chunk):
        n = min(chunk, pages - start)
        tv, iv = _unit(rng, n, text_dim), _unit(rng, n, image_dim)
        words = _zipf_words(rng, vocabulary, n * words_per_page)
        points = []
        for j in range(n):
            doc = f"synthetic_{(start + j) // 20:05d}.pdf"
            text = " ".join(words[j * words_per_page:(j + 1) * words_per_page])
            payload = PagePayload(
                doc_id=doc_id_for(doc), doc=doc, path=f"synthetic/{doc}", page=(start + j) % 20 + 1, num_pages=20,
                file_sha256="0" * 64, content_hash=image_key.content_hash, image_key=image_key, image_tokens=256,
                width=448, height=448, text=text, text_source=TextSource.TEXT_LAYER, fingerprint="synthetic",
            )
            vectors = {TEXT_VECTOR: tv[j].tolist(), IMAGE_VECTOR: iv[j].tolist(),
                       LEXICAL_VECTOR: lexical.document(text, [])}
            points.append(make_point(vectors, payload))
        await client.upsert(collection, points=points, wait=True)


_SYLLABLES = ["ka", "lo", "mi", "nu", "pe", "ra", "si", "to", "vu", "ze", "ba", "de", "fi", "go", "hu", "ja", "ke",
              "li", "mo", "ne", "po", "qu", "ri", "so", "tu", "va", "we", "xi", "yo", "zu", "ab", "ec", "id", "ok",
              "ul", "ym", "ar"]


def _zipf_words(rng: np.random.Generator, vocabulary: list[str], n: int) -> list[str]:
    import numpy as np

    ranks = np.minimum(rng.zipf(1.2, size=n), len(vocabulary)) - 1
    return [vocabulary[r] for r in ranks]


def _unit(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    import numpy as np

    x = rng.standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def print_latency(result: dict[str, Any], console: Console) -> None:
    table = Table(title=f"search latency in ms, p50 / p99: {result['pages']} synthetic pages, {result['queries']} "
                        f"sub-questions in batches of {result['batch']}, in-memory local Qdrant")
    for col in ("channel", "per sub-question", "per batch", "embed (batch)", "qdrant (batch)"):
        table.add_column(col, justify="left" if col == "channel" else "right")
    for r in result["rows"]:
        table.add_row(r["channel"], *(f"{r[k + '_p50']:.1f} / {r[k + '_p99']:.1f}"
                                      for k in ("per_question", "batch", "embed", "qdrant")))
    console.print(table)
    console.print(f"collection built in {result['build_s']:.1f}s; image queries through {result['image_channel']} "
                  "(random weights change nothing in timing). Local mode searches on the event-loop thread, so the "
                  "qdrant column is also how long each batch holds the loop; a Qdrant server takes that off it.")


# --- cost of the late-interaction channel ------------------------------------------------------------------


@retrieval_app.command("cost")
def cost_command(
    pages: Annotated[int, typer.Option(help="Pages of ColQwen2-shaped multi-vectors.")] = 10_000,
    tokens_per_page: Annotated[int, typer.Option(help="Rows per page (a real ColQwen2 page: ~740-770).")] = 760,
    local_pages: Annotated[int, typer.Option(help="Pages built in real Qdrant local mode (more: extrapolated).")
                           ] = 1_000,
    variants: Annotated[str, typer.Option(help="float32, pooledN (token pooling by N), int8, binary; comma-separated.")
                        ] = "float32,pooled2,pooled3,pooled4,int8,binary",
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of the tables.")] = False,
) -> None:
    """What the late-interaction page-image channel (MMRAG_PAGE_RETRIEVER) costs: index bytes per page per storage
    option (float32, token pooling, int8 / binary quantisation on a Qdrant server) and two-stage query latency
    (pooled prefetch, MaxSim re-rank) against single-stage MaxSim. Random vectors: shapes decide the cost."""
    from mmrag.bench.late_cost import print_late_cost, run_late_cost

    result = run_late_cost(pages=pages, tokens_per_page=tokens_per_page, local_pages=local_pages,
                           variants=tuple(v.strip() for v in variants.split(",") if v.strip()))
    if as_json:
        typer.echo(json.dumps(result))
    else:
        print_late_cost(result, err)
