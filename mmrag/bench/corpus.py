"""The benchmark corpus: synthetic figure pages that recur across documents, encoded once into a feature store.

Page ``i`` (0-based) is a 448x448 slide — a title, a chart drawn from its own seeded stream, a caption — so
every page is a distinct image. A mixed corpus (``CorpusSpec.mixed``) draws each page's size instead, as
figure-heavy documents have them: a small figure (224x224, 64 image tokens under the default 28-pixel merge),
a slide (448x448, 256) or a scanned A4 page (756x1064, 1026: a 16x spread); its resolution policy's max_pixels
must admit the A4 page (``MIXED_MAX_PIXELS``). Page popularity falls with ``i`` (the workload samples it from a Zipf law),
and so does its recurrence: page 0 is the standard slide that sits in most decks, the tail pages appear in
one document each. Two extra probe pages, never asked about, measure the machine's speed between configs.

Everything is written under ``root`` (PNG pages + ``manifest.json``) and reused when the same parameters
ask for it again; image tokens go into a DiskFeatureStore under every resolution policy the run needs.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from PIL import Image

from mmrag.core.keys import ImageKey, ResolutionPolicy, content_hash_of
from mmrag.adapters.store import FeatureStore

PAGE_PX = 448  # 448x448 = 200704 pixels: 1024 patches, 256 image tokens under the default policy
# A mixed corpus's page sizes (width, height) and their shares: sides are multiples of 28 (a merged token).
MIXED_SIZES = {"figure": ((224, 224), 0.4), "slide": ((PAGE_PX, PAGE_PX), 0.3), "a4": ((756, 1064), 0.3)}
MIXED_MAX_PIXELS = 1024 * 1024  # admits the A4 page (804,384 pixels) unscaled
PROBES = 2
_KINDS = ("bars", "line", "pie", "scatter")
_TOPICS = ("revenue", "latency", "headcount", "storage", "churn", "adoption", "margin", "backlog")


@dataclass(slots=True, frozen=True)
class CorpusSpec:
    pages: int
    seed: int = 0
    docs: int = 0  # 0: pages // 3, at least 3
    max_recurrence: int = 6  # documents holding page 0; page i is in about max_recurrence / (i + 1) of them
    mixed: bool = False  # page sizes drawn from MIXED_SIZES (probes stay 448x448 slides)

    @property
    def n_docs(self) -> int:
        return self.docs or max(3, self.pages // 3)

    @property
    def folder_name(self) -> str:
        return f"corpus-p{self.pages}-d{self.n_docs}-r{self.max_recurrence}-s{self.seed}" + ("-mixed" * self.mixed)

    def page_size(self, index: int) -> tuple[int, int]:
        """Page ``index``'s pixel size: every page a slide, or (mixed) a size drawn from its own seeded stream."""
        if not self.mixed or index >= self.pages:
            return PAGE_PX, PAGE_PX
        sizes, shares = zip(*MIXED_SIZES.values())
        rng = np.random.default_rng([self.seed, index, zlib.crc32(b"size")])
        return sizes[int(rng.choice(len(sizes), p=shares))]


@dataclass(slots=True, frozen=True)
class BenchPage:
    index: int  # popularity rank; probes come after the workload's pages
    title: str
    file: str  # PNG under the corpus folder
    content_hash: str
    docs: tuple[int, ...]  # documents that show this page (empty for probes)


@dataclass(slots=True)
class BenchCorpus:
    root: Path
    spec: CorpusSpec
    pages: list[BenchPage]  # workload pages, by popularity rank
    probes: list[BenchPage]

    def image(self, page: BenchPage) -> Image.Image:
        with Image.open(self.root / page.file) as im:
            return im.convert("RGB")

    def documents(self) -> list[list[int]]:
        """Page indices per document, in page order."""
        docs: list[list[int]] = [[] for _ in range(self.spec.n_docs)]
        for p in self.pages:
            for d in p.docs:
                docs[d].append(p.index)
        return docs

    def recurrence(self) -> list[int]:
        return [len(p.docs) for p in self.pages]

    def describe(self) -> dict:
        docs = self.documents()
        return {
            **asdict(self.spec), "documents": len(docs), "page_slots": sum(len(d) for d in docs),
            "distinct_pages": len(self.pages), "recurrence": self.recurrence(),
            "page_px": sorted({self.spec.page_size(p.index) for p in self.pages}),
        }


def build_corpus(root: Path, spec: CorpusSpec) -> BenchCorpus:
    """Render the pages into ``root/<spec folder>`` unless a manifest for the same spec is already there."""
    folder = Path(root) / spec.folder_name
    manifest = folder / "manifest.json"
    if manifest.is_file():
        data = json.loads(manifest.read_text(encoding="utf-8"))
        pages = [_page_from_json(p) for p in data["pages"]]
        return BenchCorpus(folder, spec, pages[: spec.pages], pages[spec.pages:])
    folder.mkdir(parents=True, exist_ok=True)
    placement = _place(spec)
    pages = []
    for i in range(spec.pages + PROBES):
        probe = i >= spec.pages
        title = f"Probe {i - spec.pages + 1}" if probe else f"Figure {i + 1}: {_TOPICS[i % len(_TOPICS)]} by quarter"
        image = _render(title, i, spec.seed, spec.page_size(i))
        name = f"page-{i:03d}.png"
        image.save(folder / name, format="PNG")
        h = content_hash_of(image.mode, image.size, image.tobytes())
        pages.append(BenchPage(i, title, name, h, () if probe else placement[i]))
    tmp = manifest.with_suffix(".tmp")
    tmp.write_text(json.dumps({"spec": asdict(spec), "pages": [asdict(p) for p in pages]}, indent=1), encoding="utf-8")
    tmp.replace(manifest)
    return BenchCorpus(folder, spec, pages[: spec.pages], pages[spec.pages:])


def encode_corpus(corpus: BenchCorpus, model_path: Path, policy: ResolutionPolicy, store: FeatureStore,
                  *, batch: int = 4) -> tuple[dict[int, ImageKey], dict[ImageKey, int], int]:
    """Image keys of every page (workload + probes) under ``policy``, their token counts, and the vision
    forwards this call ran (0 when the store already held every page: ingestion is done once)."""
    from mmrag.adapters.vision import VisionEncoder

    encoder = VisionEncoder(model_path, policy)
    everything = corpus.pages + corpus.probes
    keys = {p.index: encoder.key_for(p.content_hash) for p in everything}
    todo = [p for p in everything if not store.contains(keys[p.index])]
    for start in range(0, len(todo), batch):
        chunk = todo[start:start + batch]
        for page, encoded in zip(chunk, encoder.encode([corpus.image(p) for p in chunk]), strict=True):
            store.put(keys[page.index], encoded)
    tokens = {}
    for p in everything:
        # From the resize rule, checked against the stored entry once: both must agree or the spans are wrong.
        n = encoder.num_tokens_for(corpus.image(p))
        stored = store.get(keys[p.index])
        if stored is None or stored.num_tokens != n:
            raise RuntimeError(f"feature entry for bench page {p.index} has the wrong size; delete {corpus.root}")
        tokens[keys[p.index]] = n
    return keys, tokens, encoder.forwards


def _place(spec: CorpusSpec) -> dict[int, tuple[int, ...]]:
    """Which documents hold each page: popular pages recur in more documents (at least one each)."""
    rng = np.random.default_rng([spec.seed, zlib.crc32(b"placement")])
    out = {}
    for i in range(spec.pages):
        copies = min(spec.n_docs, max(1, round(spec.max_recurrence / (i + 1))))
        out[i] = tuple(sorted(int(d) for d in rng.choice(spec.n_docs, size=copies, replace=False)))
    return out


def _render(title: str, index: int, seed: int, size: tuple[int, int]) -> Image.Image:
    rng = np.random.default_rng([seed, index])
    fig = Figure(figsize=(size[0] / 100, size[1] / 100), dpi=100)
    fig.text(0.05, 0.93, title, fontsize=12, fontweight="bold", color="#1f2a44")
    ax = fig.add_axes((0.12, 0.18, 0.82, 0.68))
    kind = _KINDS[index % len(_KINDS)]
    colors = ["#2f6db5", "#f28e2b", "#59a14f", "#b07aa1", "#e15759"]
    if kind == "bars":
        values = rng.integers(5, 60, 6)
        ax.bar([f"Q{q}" for q in range(1, 7)], values, color=colors[index % 5])
    elif kind == "line":
        for c in range(3):
            ax.plot(np.cumsum(rng.normal(1, 2, 12)), color=colors[c], marker="o", markersize=3)
    elif kind == "pie":
        ax.pie(rng.integers(5, 40, 5), colors=colors, labels=[f"S{s}" for s in range(1, 6)])
    else:
        ax.scatter(rng.normal(0, 1, 60), rng.normal(0, 1, 60), s=12, c=colors[index % 5])
    fig.text(0.05, 0.06, f"Source: bench corpus, page {index + 1}; values in arbitrary units.", fontsize=8,
             color="#6b7280")
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    image = Image.fromarray(np.asarray(canvas.buffer_rgba())).convert("RGB")
    if image.size != size:
        raise RuntimeError(f"bench page rendered at {image.size}, expected {size[0]}x{size[1]}")
    return image


def _page_from_json(p: dict) -> BenchPage:
    return BenchPage(p["index"], p["title"], p["file"], p["content_hash"], tuple(p["docs"]))
