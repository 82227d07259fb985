"""`mmrag retrieval eval` and `mmrag retrieval latency`: retrieval quality and speed (parts from mmrag/wiring.py).

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

    from core.keys import ImageKey
    from core.settings import Settings
    from devkit.corpus import CorpusManifest
    from retrieval.evaluate import LabelledQuestion
    from retrieval.search import Channel, PageSearcher

retrieval_app = typer.Typer(help="Measure page retrieval: recall on a labelled corpus, latency at scale.",
                            no_args_is_help=True)
err = Console(stderr=True)


# --- eval ------------------------------------------------------------------------------------------------


@retrieval_app.command("eval")
def eval_command(
    corpus: Annotated[Path, typer.Option(help="Corpus folder with manifest.json (from `mmrag corpus sample`), "
                                         "or the manifest file.")] = Path("corpus"),
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of the table.")] = False,
) -> None:
    """Recall@1, recall@5 and MRR of the labelled questions, per channel: text, image (if on), hybrid."""
    from core.settings import Settings

    settings = Settings()
    manifest = load_manifest(corpus)
    report = asyncio.run(run_eval(settings, manifest))
    if as_json:
        typer.echo(json.dumps(report))
    else:
        print_eval(report, err)


def load_manifest(corpus: Path) -> CorpusManifest:
    from devkit.corpus import CorpusManifest

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


async def run_eval(settings: Settings, manifest: CorpusManifest) -> dict[str, Any]:
    from qdrant_client import models

    from core.pages import TextSource
    from core.payload import PageField
    from mmrag import wiring
    from retrieval.evaluate import chance_recall, evaluate
    from retrieval.search import Channel

    searcher = wiring.searcher(settings)
    labelled = labelled_questions(manifest)
    try:
        channels = [Channel.TEXT, *([Channel.IMAGE] if searcher.image_channel else []), Channel.HYBRID]
        scores = await evaluate(searcher, labelled, channels)
        client, collection = searcher.client, searcher.collection
        pages = (await client.count(collection, exact=True)).count
        no_text = models.Filter(must=[models.FieldCondition(key=PageField.TEXT_SOURCE.value,
                                                            match=models.MatchValue(value=TextSource.NONE.value))])
        without_text = (await client.count(collection, count_filter=no_text, exact=True)).count
    finally:
        await searcher.client.close()
    image = searcher.image_embedder
    return {
        "channels": scores,
        "pages": pages,
        "pages_without_text": without_text,
        "image_channel": image.name if image else "off",
        "image_random_init": bool(image and settings.clip_weights is None),
        "chance_recall@5": round(chance_recall(labelled, pages), 4),
    }


def print_eval(report: dict[str, Any], console: Console) -> None:
    table = Table(title=f"retrieval eval ({report['pages']} indexed pages)")
    for col in ("channel", "recall@1", "recall@5", "MRR@5", "questions"):
        table.add_column(col, justify="left" if col == "channel" else "right")
    for channel, s in report["channels"].items():
        name = channel if channel != "hybrid" or report["image_channel"] != "off" else "hybrid (= text: image off)"
        table.add_row(name, f"{s['recall@1']:.3f}", f"{s['recall@5']:.3f}", f"{s['mrr']:.3f}", str(s["n"]))
    console.print(table)
    if report["image_channel"] == "off":
        console.print("image channel: off (set MMRAG_CLIP_WEIGHTS to a local open_clip file to score it)")
    elif report["image_random_init"]:
        console.print(f"[yellow]image channel: {report['image_channel']} has RANDOM weights[/]: image-only recall "
                      f"is expected near chance (recall@5 ≈ {report['chance_recall@5']:.3f}), and it adds noise "
                      "to hybrid. Only tests should run this way.")
    if report["pages_without_text"]:
        console.print(f"{report['pages_without_text']} indexed pages have no text (no text layer and OCR off or "
                      "empty): the text channel cannot find them. Ingest with MMRAG_OCR=true to read them.")


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
    """Search latency on N synthetic pages in an in-memory local Qdrant: text-only vs. hybrid (RRF).

    Pages get random unit vectors (text 384-d, image from the CLIP config), so only timing means anything;
    the queries are embedded by the configured models (CLIP with random weights when none are set).
    """
    if pages < 1 or queries < 1 or batch < 1:
        raise typer.BadParameter("--pages, --queries and --batch must be at least 1")
    from core.settings import Settings

    settings = Settings()
    result = asyncio.run(run_latency(settings, pages=pages, queries=queries, batch=batch, seed=seed))
    if as_json:
        typer.echo(json.dumps(result))
    else:
        print_latency(result, err)


async def run_latency(settings: Settings, *, pages: int, queries: int, batch: int, seed: int = 0) -> dict[str, Any]:
    import numpy as np
    from qdrant_client import AsyncQdrantClient

    from adapters.embed import ImageEmbedder
    from core.keys import ContentHash, EncoderVersion, ImageKey
    from mmrag import wiring
    from retrieval.search import Channel, PageSearcher

    text = wiring.text_embedder(settings)
    # Timing only: a random-weight CLIP when no weights are configured (random weights change no timing).
    image = wiring.image_embedder(settings) or ImageEmbedder(settings.clip_model, None,
                                                             batch_size=settings.embed_batch_size)
    client = AsyncQdrantClient(location=":memory:")
    try:
        t0 = time.perf_counter()
        key = ImageKey(ContentHash("0" * 64), EncoderVersion("0" * 16), settings.resolution_policy)
        await fill_synthetic(client, "latency", pages, text.dim, image.dim, key, np.random.default_rng(seed))
        build_s = time.perf_counter() - t0
        searcher = PageSearcher(client, "latency", text, image, top_k=settings.top_k)
        questions = [f"How did metric {i} of region {i % 7} change in quarter {i % 4 + 1}?" for i in range(queries)]
        rows = [await _time_channel(searcher, questions, batch, ch) for ch in (Channel.TEXT, Channel.HYBRID)]
    finally:
        await client.close()
    return {"pages": pages, "queries": queries, "batch": batch, "build_s": round(build_s, 2),
            "image_channel": image.name, "rows": [asdict(r) for r in rows]}


async def _time_channel(searcher: PageSearcher, questions: list[str], batch: int, channel: Channel) -> LatencyRow:
    import numpy as np

    batches = [questions[i:i + batch] for i in range(0, len(questions), batch)]
    embed, qdrant = [], []
    for i, qs in enumerate([batches[0], *batches]):  # the first pass warms both models and Qdrant
        t0 = time.perf_counter()
        text_vecs, image_vecs = await asyncio.to_thread(searcher.embed_queries, qs, channel)
        t1 = time.perf_counter()
        await searcher.search_vectors(qs, text_vecs, image_vecs)
        t2 = time.perf_counter()
        if i:
            embed.append((t1 - t0) * 1e3)
            qdrant.append((t2 - t1) * 1e3)
    sizes = np.array([len(b) for b in batches], dtype=float)
    total = np.array(embed) + np.array(qdrant)
    pct = lambda xs, q: round(float(np.percentile(xs, q)), 2)  # noqa: E731
    return LatencyRow(channel.value, pct(embed, 50), pct(embed, 99), pct(qdrant, 50), pct(qdrant, 99),
                      pct(total / sizes, 50), pct(total / sizes, 99), pct(total, 50), pct(total, 99))


async def fill_synthetic(client: AsyncQdrantClient, collection: str, pages: int, text_dim: int, image_dim: int,
                         image_key: ImageKey, rng: np.random.Generator, chunk: int = 1000) -> None:
    """A collection shaped like the page index (same vector names, sizes and payload) of random pages."""
    from qdrant_client import models

    from core.keys import doc_id_for
    from core.pages import TextSource
    from core.payload import IMAGE_VECTOR, TEXT_VECTOR, PagePayload

    await client.create_collection(collection, vectors_config={
        TEXT_VECTOR: models.VectorParams(size=text_dim, distance=models.Distance.COSINE),
        IMAGE_VECTOR: models.VectorParams(size=image_dim, distance=models.Distance.COSINE),
    })
    for start in range(0, pages, chunk):
        n = min(chunk, pages - start)
        tv, iv = _unit(rng, n, text_dim), _unit(rng, n, image_dim)
        points = []
        for j in range(n):
            doc = f"synthetic_{(start + j) // 20:05d}.pdf"
            payload = PagePayload(
                doc_id=doc_id_for(doc), doc=doc, path=f"/synthetic/{doc}", page=(start + j) % 20 + 1, num_pages=20,
                file_sha256="0" * 64, content_hash=image_key.content_hash, image_key=image_key, image_tokens=256,
                width=448, height=448, text=f"Synthetic page {(start + j) % 20 + 1} of {doc}. " + _FILLER,
                text_source=TextSource.TEXT_LAYER, fingerprint="synthetic",
            )
            points.append(models.PointStruct(
                id=payload.page_id, vector={TEXT_VECTOR: tv[j].tolist(), IMAGE_VECTOR: iv[j].tolist()},
                payload=payload.to_qdrant(),
            ))
        await client.upsert(collection, points=points, wait=True)


_FILLER = ("Quarterly revenue, regional headcount and platform latency figures are summarised in the chart "
           "beside this paragraph; the table below lists the numbers by month. ") * 4


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
